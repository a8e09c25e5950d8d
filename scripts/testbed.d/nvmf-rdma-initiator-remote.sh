# nacred's NVMe/RDMA initiator in one guest, the kernel's nvmet-rdma target in another (real RoCEv2)
# The nacred side of a two-guest test (nvmet-rdma-peer.sh is the other guest, 192.0.2.1): rxe on eth0
# (192.0.2.2); nacred (--pack nacred, nacre) attaches the peer over RDMA twice (remotes shelf on port
# 4420 and shelfb on 4422, the second one with no volume), serves a volume on shelf's namespace on its NVMe/TCP target
# to the kernel's nvme-tcp host in this guest: O_DIRECT write/read/compare across the wire. Then it
# prints `TB-WAIT frozen` and waits: the host SIGSTOPs the peer's QEMU (a target that goes silent
# without a word) and answers `frozen`. With the target silent: `nacre remote detach shelfb` (a live
# controller: shutdown notification unanswered) must be prompt, and keep-alive (KATO 4 s) must
# declare shelf's session lost.
# Params: mib (default 8). Facts: attached, verified, rx_mib, tx_mib, silent_detach_s, ka_lost_s,
# nacred_alive.
NQN=nqn.2014-08.io.nacre.testbed:rdma-peer
EXP=nqn.2014-08.io.nacre.testbed:rdma-export
MIB=$(param mib 8)
for b in nacred nacre; do
    command -v $b >/dev/null || fail "no $b in the guest (run with --pack target/debug/$b)"
done
modprobe virtio_pci; modprobe virtio_net; modprobe rdma_rxe; modprobe rdma_ucm; modprobe nvme-tcp
wait_until 20 test -e /sys/class/net/eth0 || fail "no eth0"
ip link set eth0 up; ip addr add 192.0.2.2/24 dev eth0
ip link set lo up
rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add"
start_nacred

step "attach the peer's nvmet-rdma over RoCEv2 (retried while the peer boots)"
attach() {  # attach NAME PORT
    nacre remote attach "$1" --transport rdma --address 192.0.2.1 --port "$2" --subnqn $NQN \
        --io-queues 2 --queue-depth 32 --keep-alive-timeout-ms 4000 --reconnect-delay-sec 1 \
        --ctrl-loss-timeout-sec 60 > /dev/null 2>/tmp/attach.err
}
wait_until 120 attach shelf 4420 || fail "attach over RDMA: $(cat /tmp/attach.err)"
attach shelfb 4422 || fail "attach shelfb: $(cat /tmp/attach.err)"
nacre remote list
fact attached "$(nacre --json remote list shelf | sed -n 's/.*"state": *"\([a-z]*\)".*/\1/p' | head -1)"
run nacre rpc volume_create '{"name": "v", "backend": "remote", "size": 0, "block_size": 512, "remote": {"extents": ["shelf:1"]}}'
run nacre rpc nvmf_subsystem_create "{\"nqn\": \"$EXP\", \"allow_any_host\": true}"
run nacre rpc nvmf_subsystem_add_ns "{\"nqn\": \"$EXP\", \"volume\": \"v\", \"nsid\": 1}"
run nacre rpc nvmf_subsystem_add_listener "{\"nqn\": \"$EXP\", \"address\": \"127.0.0.1\", \"port\": 4421}"
run nvme connect -t tcp -a 127.0.0.1 -s 4421 -n $EXP -i 1 || fail "nvme connect to nacred"
wait_until 30 nvme_ns_dev $EXP 1 || fail "nacred's namespace did not appear"
P=$(nvme_ns_dev $EXP 1)

step "write, read back, compare ($MIB MiB, O_DIRECT) across the wire"
verify_rw /dev/$P "$MIB" 1
fact verified "${MIB}MiB"
fact rx_mib $(($(cat /sys/class/net/eth0/statistics/rx_bytes) >> 20))
fact tx_mib $(($(cat /sys/class/net/eth0/statistics/tx_bytes) >> 20))
run nvme disconnect -n $EXP

step "the target goes silent (the host freezes the peer's QEMU)"
wait_host frozen 120
t=$(up)
run nacre remote detach shelfb || fail "detach shelfb"
fact silent_detach_s "$(elapsed "$t")"
wait_until 30 sh -c "nacre --json remote list shelf | grep -q '\"state\": \"connecting\"'" ||
    fail "keep-alive did not declare the silent target lost: $(nacre remote list)"
fact ka_lost_s "$(elapsed "$t")"
nacre remote list
kill -0 $NACRED && fact nacred_alive yes
kill $NACRED
wait $NACRED || true
