# kernel nvmet-rdma target on a guest's network card: the storage shelf for nvmf-rdma-initiator-remote
# The shelf side of a two-guest RoCEv2 test: the guests share a QEMU socket netdev, so the RDMA traffic
# is real RoCEv2 (UDP 4791) frames between two machines. rxe on eth0 (192.0.2.1); nvmet-rdma serves
# tb.nqn (default nqn.2014-08.io.nacre.testbed:rdma-peer) with one RAM disk of tb.ns_mib MiB (default
# 32) on 4420 and 4422. Prints `TB-FACT ready=yes`, then waits for the host's `done` on the control channel
# (--ctl). The host may SIGSTOP this guest's QEMU meanwhile (a target that goes silent).
# Facts: ready, rx_mib, tx_mib (eth0's byte counters: the data crossed the link).
NQN=$(param nqn nqn.2014-08.io.nacre.testbed:rdma-peer)
modprobe virtio_pci; modprobe virtio_net; modprobe rdma_rxe; modprobe rdma_ucm; modprobe nvmet-rdma
modprobe brd rd_nr=1 rd_size=$(($(param ns_mib 32) * 1024))
wait_until 20 test -e /sys/class/net/eth0 || fail "no eth0"
ip link set eth0 up; ip addr add 192.0.2.1/24 dev eth0   # no default route: the other guest only
rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add (crc32 module missing?)"
nvmet_subsys "$NQN" 1 /dev/ram0
nvmet_port 1 rdma 192.0.2.1 4420 "$NQN"
nvmet_port 2 rdma 192.0.2.1 4422 "$NQN"
fact ready yes
wait_host done 600
fact rx_mib $(($(cat /sys/class/net/eth0/statistics/rx_bytes) >> 20))
fact tx_mib $(($(cat /sys/class/net/eth0/statistics/tx_bytes) >> 20))
