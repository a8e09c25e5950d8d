# nacred's NVMe/RDMA target on a guest's network card, for a second guest (nvmf-rdma-remote.sh)
# The DPU side of a two-guest RoCEv2 test: the guests share a QEMU socket netdev, so the RDMA traffic
# is real RoCEv2 (UDP 4791) frames between two machines, not rxe loopback. rxe on eth0 (192.0.2.1);
# nacred (--pack nacred, --pack nacre) serves a 64 MiB RAM volume on an RDMA listener; prints
# `TB-FACT ready=yes`, then waits for the host's `done` on the control channel (--ctl).
# Facts: ready, nacred_alive, rx_mib, tx_mib (eth0's byte counters: the data crossed the link).
NQN=nqn.2014-08.io.nacre.testbed:rdma-dpu
for b in nacred nacre; do
    command -v $b >/dev/null || fail "no $b in the guest (run with --pack target/debug/$b)"
done
modprobe virtio_pci; modprobe virtio_net; modprobe rdma_rxe; modprobe rdma_ucm
wait_until 20 test -e /sys/class/net/eth0 || fail "no eth0"
ip link set eth0 up; ip addr add 192.0.2.1/24 dev eth0   # no default route: the host only
rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add (crc32 module missing?)"
start_nacred
run nacre volume create r0 --size 64M --backend ram
run nacre nvmf create $NQN --allow-any-host --serial NACRE-RDMA-2
run nacre nvmf add-ns $NQN --volume r0
run nacre nvmf add-listener $NQN --transport rdma --address 192.0.2.1 --port 4420
fact ready yes
wait_host done 600
kill -0 $NACRED && fact nacred_alive yes
fact rx_mib $(($(cat /sys/class/net/eth0/statistics/rx_bytes) >> 20))
fact tx_mib $(($(cat /sys/class/net/eth0/statistics/tx_bytes) >> 20))
kill $NACRED
