# the kernel's nvme-rdma host in one guest -> nacred's NVMe/RDMA target in another (RoCEv2)
# The host side of the two-guest test (nvmf-rdma-dpu.sh is the other guest): rxe on eth0
# (192.0.2.2); discovery over RDMA (retried while the DPU guest starts), connect, `nvme list` shows
# nacre, O_DIRECT write/read/compare. Params: addr (192.0.2.1), mib (16).
# Facts: discovered_trtype, model, serial, transport, verified, rx_mib, tx_mib.
A=$(param addr 192.0.2.1)
MIB=$(param mib 16)
NQN=nqn.2014-08.io.nacre.testbed:rdma-dpu
modprobe virtio_pci; modprobe virtio_net; modprobe rdma_rxe; modprobe rdma_ucm; modprobe nvme-rdma
wait_until 20 test -e /sys/class/net/eth0 || fail "no eth0"
ip link set eth0 up; ip addr add 192.0.2.2/24 dev eth0
rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add"

step "discover nacred over RoCEv2"
wait_until 120 sh -c "nvme discover -t rdma -a $A -s 4420 > /tmp/disc 2>/dev/null" ||
    fail "no NVMe/RDMA discovery answer from $A:4420"
cat /tmp/disc
grep -q "subnqn: *$NQN\$" /tmp/disc || fail "discovery log does not list $NQN"
fact discovered_trtype "$(awk '/^trtype:/ {print $2; exit}' /tmp/disc)"

step "connect, nvme list, verify"
run nvme connect -t rdma -a "$A" -s 4420 -n $NQN -i 2 || fail "nvme connect -t rdma"
wait_until 30 nvme_ns_dev $NQN 1 || fail "namespace 1 did not appear"
C=$(nvme_ctrl_for $NQN)
NS1=$(nvme_ns_dev $NQN 1)
nvme list
nvme list | grep -q "^/dev/$NS1 .* nacre " || fail "nvme list does not show /dev/$NS1 as nacre"
fact model "$(sed 's/ *$//' /sys/class/nvme/$C/model)"
fact serial "$(sed 's/ *$//' /sys/class/nvme/$C/serial)"
fact transport "$(cat /sys/class/nvme/"$C"/transport)"
verify_rw /dev/$NS1 "$MIB" 0
fact verified "${MIB}MiB"
run nvme disconnect -n $NQN
fact rx_mib $(($(cat /sys/class/net/eth0/statistics/rx_bytes) >> 20))
fact tx_mib $(($(cat /sys/class/net/eth0/statistics/tx_bytes) >> 20))
