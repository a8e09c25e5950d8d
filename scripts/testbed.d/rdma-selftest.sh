# soft-RoCE (rdma_rxe) in one guest: kernel nvmet-rdma target + nvme-rdma host over RoCEv2
# The RDMA counterpart of kernel-selftest, for the fabric's RDMA transport: an rxe device on a
# dummy netdev (192.0.2.1), `rdma link` and libibverbs see it, discovery and connect over RDMA,
# O_DIRECT write/read/compare. Facts: rdma_link, ibv_device, transport, io_queues, verified.
NQN=nqn.2014-08.io.nacre.testbed:rdma
modprobe rdma_rxe; modprobe rdma_ucm; modprobe nvmet-rdma; modprobe nvme-rdma
modprobe brd rd_nr=1 rd_size=65536
rxe_loopback
rdma link show
fact rdma_link "$(rdma link show | awk '{print $2}' | head -1)"
ibv_devices
fact ibv_device "$(ibv_devices | awk 'NR>2 {print $1; exit}')"
nvmet_subsys $NQN 1 /dev/ram0
nvmet_port 1 rdma 192.0.2.1 4420 $NQN
step "discover over RDMA"
nvme discover -t rdma -a 192.0.2.1 -s 4420 > /tmp/disc || fail "nvme discover -t rdma"
grep -q "subnqn: *$NQN\$" /tmp/disc || fail "discovery log does not list $NQN"
step "connect over RDMA"
run nvme connect -t rdma -a 192.0.2.1 -s 4420 -n $NQN -i 2 || fail "nvme connect -t rdma"
wait_until 20 nvme_ns_dev $NQN 1 || fail "namespace 1 did not appear"
C=$(nvme_ctrl_for $NQN)
fact transport "$(cat /sys/class/nvme/"$C"/transport)"
fact io_queues "$(nvme_io_queues "$C")"
verify_rw /dev/"$(nvme_ns_dev $NQN 1)" 16 0
fact verified 16MiB
run nvme disconnect -n $NQN
