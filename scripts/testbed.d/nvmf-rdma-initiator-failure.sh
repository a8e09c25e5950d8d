# nacred's NVMe/RDMA initiator when the kernel's nvmet-rdma target goes away, over soft-RoCE, in one guest
# Set up like nvmf-rdma-initiator.sh (rxe on dummy0 192.0.2.1, nacred packed in): the kernel target
# serves one RAM disk on two RDMA ports, 4420 and 4422; nacred attaches both (reconnect_delay 1 s,
# ctrl_loss_timeout 8 s; fast_io_fail_timeout 4 s on 4420), serves a volume on port 4420's namespace on its NVMe/TCP target, and the
# kernel's nvme-tcp host is the client.
# 1. Port 4420 removed mid-write (a 16 MiB O_DIRECT dd) and restored 0.5 s later: the write
#    completes (nacred held the I/O and resent it on the new session) and reads back identical.
# 1b. A round-robin multipath volume over both controllers (same namespace, two ports): port 4422
#    removed, a 4 MiB O_DIRECT verify through it passes on the remaining path.
# 1c. RoCE first, TCP as the fallback: the subsystem also on nvmet-tcp (127.0.0.1:4423); a failover
#    multipath volume over shelf (RDMA) and shelft (TCP) verifies 2 MiB with port 4420 removed.
# 2. Port 4422 removed: `nacre remote detach` of that controller takes well under a second.
# 3. Port 4420 removed for good: a read (NVMe passthrough on the controller, so the kernel host's
#    multipath does not retry it) is held, then fails with a path error once fast_io_fail_timeout
#    has passed; the remote goes on reconnecting (`connecting`) until ctrl_loss_timeout, then
#    shows `failed`; nacred keeps serving. While it reconnects the error leaves DNR clear (the
#    host may retry); once failed, it sets DNR, and a read through the kernel host's block
#    device fails at once. (Before nacred set DNR, native multipath requeued the Internal Path
#    Error on the only path forever: seen here blocking over 280 s.)
# Facts: flap_in_flight, flap_verified, flap_resets, mp_verified, mp_shelfb_resets, mpx_verified,
# mpx_rdma_state, detach_s, lost_error_s, lost_status, state_after_fast_fail, lost_state, lost_state_s,
# failed_status, failed_blk_read_s, nacred_alive.
NQN=nqn.2014-08.io.nacre.testbed:rdma-shelf
EXP=nqn.2014-08.io.nacre.testbed:rdma-export
for b in nacred nacre; do
    command -v $b >/dev/null || fail "no $b in the guest (run with --pack target/debug/$b)"
done
modprobe rdma_rxe; modprobe rdma_ucm; modprobe nvmet-rdma; modprobe nvmet-tcp; modprobe nvme-tcp
modprobe brd rd_nr=1 rd_size=32768
ip link set lo up
rxe_loopback
nvmet_subsys $NQN 1 /dev/ram0
nvmet_port 1 rdma 192.0.2.1 4420 $NQN
nvmet_port 2 rdma 192.0.2.1 4422 $NQN
nvmet_port 3 tcp 127.0.0.1 4423 $NQN
port_off() { rm "/sys/kernel/config/nvmet/ports/$1/subsystems/$NQN"; }
port_on() { ln -s "/sys/kernel/config/nvmet/subsystems/$NQN" "/sys/kernel/config/nvmet/ports/$1/subsystems/$NQN"; }
remote_field() {  # remote_field NAME FIELD: a string or number field of `nacre remote list NAME`
    nacre --json remote list "$1" | sed -n "s/^ *\"$2\": *\"\{0,1\}\([^\",]*\)\"\{0,1\},\{0,1\}$/\1/p" | head -1
}

start_nacred
# shelf also fails held I/O fast: after 4 s without a connection, while it goes on reconnecting
for r in "shelf 4420 4" "shelfb 4422 0"; do
    set -- $r
    run nacre remote attach "$1" --transport rdma --address 192.0.2.1 --port "$2" --subnqn $NQN \
        --io-queues 2 --queue-depth 32 --reconnect-delay-sec 1 --ctrl-loss-timeout-sec 8 \
        --fast-io-fail-timeout-sec "$3" || fail "attach $1"
done
run nacre rpc volume_create '{"name": "v", "backend": "remote", "size": 0, "block_size": 512, "remote": {"extents": ["shelf:1"]}}'
run nacre rpc nvmf_subsystem_create "{\"nqn\": \"$EXP\", \"allow_any_host\": true}"
run nacre rpc nvmf_subsystem_add_ns "{\"nqn\": \"$EXP\", \"volume\": \"v\", \"nsid\": 1}"
run nacre rpc nvmf_subsystem_add_listener "{\"nqn\": \"$EXP\", \"address\": \"127.0.0.1\", \"port\": 4421}"
run nvme connect -t tcp -a 127.0.0.1 -s 4421 -n $EXP -i 1 || fail "nvme connect to nacred"
wait_until 30 nvme_ns_dev $EXP 1 || fail "nacred's namespace did not appear"
P=$(nvme_ns_dev $EXP 1)
C=$(nvme_ctrl_for $EXP)

step "1. the target's port removed mid-write and restored within reconnect_delay"
dd if=/dev/urandom of=/tmp/pat bs=1M count=16 2>/dev/null
dd if=/tmp/pat of=/dev/$P bs=128k seek=32 count=128 oflag=direct conv=fsync 2>/tmp/dd.err &
DD=$!
sleep 0.3
# the test asserts the write really was in flight when the port went away
if kill -0 $DD 2>/dev/null; then fact flap_in_flight yes; else fact flap_in_flight no; fi
port_off 1
echo "port 4420 removed at $(up)"
sleep 0.5
port_on 1
echo "port 4420 restored at $(up)"
wait $DD || fail "the write failed across the flap: $(cat /tmp/dd.err)"
dd if=/dev/$P of=/tmp/back bs=1M skip=4 count=16 iflag=direct 2>/dev/null || fail "read after the flap"
cmp /tmp/pat /tmp/back || fail "data written across the flap reads back different"
fact flap_verified 16MiB
fact flap_resets "$(remote_field shelf resets)"
nacre remote list

step "1b. multipath over the two RDMA controllers (round-robin): one path's port removed, I/O goes on"
run nacre rpc volume_create '{"name": "mp", "backend": "remote", "size": 0, "block_size": 512, "remote": {"extents": ["shelf:1+shelfb:1"], "multipath": "round_robin"}}'
run nacre rpc nvmf_subsystem_add_ns "{\"nqn\": \"$EXP\", \"volume\": \"mp\", \"nsid\": 2}"
wait_until 30 nvme_ns_dev $EXP 2 || fail "the multipath namespace did not appear"
M=$(nvme_ns_dev $EXP 2)
port_off 2
verify_rw /dev/$M 4 24
port_on 2
fact mp_verified 4MiB
fact mp_shelfb_resets "$(remote_field shelfb resets)"
run nacre rpc nvmf_subsystem_remove_ns "{\"nqn\": \"$EXP\", \"nsid\": 2}"
run nacre rpc volume_delete '{"name": "mp"}'
wait_until 20 sh -c "nacre --json remote list shelfb | grep -q '\"state\": \"live\"'" || fail "shelfb did not come back"

step "1c. RoCE first, TCP as the fallback: a failover multipath volume over an RDMA and a TCP path"
run nacre remote attach shelft --transport tcp --address 127.0.0.1 --port 4423 --subnqn $NQN \
    --io-queues 1 --queue-depth 32 --reconnect-delay-sec 1 --ctrl-loss-timeout-sec 8 || fail "attach shelft"
run nacre rpc volume_create '{"name": "mpx", "backend": "remote", "size": 0, "block_size": 512, "remote": {"extents": ["shelf:1+shelft:1"], "multipath": "failover"}}'
run nacre rpc nvmf_subsystem_add_ns "{\"nqn\": \"$EXP\", \"volume\": \"mpx\", \"nsid\": 3}"
wait_until 30 nvme_ns_dev $EXP 3 || fail "the cross-transport multipath namespace did not appear"
X=$(nvme_ns_dev $EXP 3)
verify_rw /dev/$X 2 28
port_off 1
verify_rw /dev/$X 2 28
# the RDMA path could not have carried that: its controller is still reconnecting
fact mpx_rdma_state "$(remote_field shelf state)"
port_on 1
fact mpx_verified 2MiB
run nacre rpc nvmf_subsystem_remove_ns "{\"nqn\": \"$EXP\", \"nsid\": 3}"
run nacre rpc volume_delete '{"name": "mpx"}'
run nacre remote detach shelft
wait_until 20 sh -c "nacre --json remote list shelf | grep -q '\"state\": \"live\"'" || fail "shelf did not come back"

step "2. teardown of a controller whose target went away"
port_off 2
t=$(up)
run nacre remote detach shelfb || fail "detach shelfb"
fact detach_s "$(elapsed "$t")"

step "3. the target's port removed for good: clean errors within ctrl_loss_timeout"
port_off 1
t=$(up)
if nvme io-passthru /dev/$C --namespace-id=1 --opcode=0x02 --data-len=4096 --read --cdw10=0 --cdw12=7 \
    > /tmp/pt.out 2>&1; then
    cat /tmp/pt.out
    fail "a read with the target gone for good succeeded"
fi
fact lost_error_s "$(elapsed "$t")"
cat /tmp/pt.out
# nvme-cli prints the status field (SCT << 8 | SC) in parentheses
fact lost_status "$(grep -o 'NVMe status: .*(0x[0-9a-f]*)' /tmp/pt.out | grep -o '0x[0-9a-f]*' | tail -1)"
fact state_after_fast_fail "$(remote_field shelf state)"
wait_until 20 sh -c "[ \"\$(nacre --json remote list shelf | grep -c '\"state\": \"failed\"')\" = 1 ]" ||
    fail "the remote is not failed: $(nacre remote list)"
fact lost_state failed
fact lost_state_s "$(elapsed "$t")"
# Failed for good, the error says Do Not Retry: the same read through the host's block device,
# which native multipath would requeue on its only path forever without DNR, now fails.
if nvme io-passthru /dev/$C --namespace-id=1 --opcode=0x02 --data-len=4096 --read --cdw10=0 --cdw12=7 \
    > /tmp/pt2.out 2>&1; then
    fail "a read from a failed remote succeeded"
fi
cat /tmp/pt2.out
fact failed_status "$(grep -o 'NVMe status: .*(0x[0-9a-f]*)' /tmp/pt2.out | grep -o '0x[0-9a-f]*' | tail -1)"
t=$(up)
rc=0
timeout 60 dd if=/dev/$P of=/dev/null bs=4k count=1 iflag=direct 2>/tmp/blk.err || rc=$?
cat /tmp/blk.err
[ $rc = 124 ] && fail "a block-device read from a failed remote still hung after 60 s (requeued: no DNR?)"
[ $rc = 0 ] && fail "a block-device read from a failed remote succeeded"
fact failed_blk_read_s "$(elapsed "$t")"
kill -0 $NACRED && fact nacred_alive yes
run nvme disconnect -n $EXP
kill $NACRED
wait $NACRED || true
