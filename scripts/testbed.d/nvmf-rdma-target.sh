# nacred's NVMe/RDMA target inside the guest; the kernel's nvme-rdma host connects over soft-RoCE
# nacred, nacre and rdma-cm-probe (a misbehaving host, tests/src/bin) come in with
# `scripts/testbed run --pack` (their libraries with them: libibverbs, librdmacm). rxe on a dummy netdev (192.0.2.1): rxe loopback inside one guest. nacred serves a RAM
# volume; an RDMA listener on an address no RDMA device has fails with one error line; discovery over
# RDMA lists the subsystem with trtype rdma; bad RDMA CM private data gets RDMA_CM_REJECT with its
# status, a bad SGL its NVMe status, an unusable rkey closes only that queue; then the kernel host
# connects, `nvme list` shows nacre, 32 MiB O_DIRECT write/read/compare, 4 KiB writes (in-capsule),
# Write Zeroes, DSM, disconnect, reconnect and read again; no thread or descriptor is left behind;
# after a restart of nacred the listener is back from its state and serves again; restarted with
# per-listener caps, a second silent queue evicts the first and a full listener rejects (status 6);
# started before its RDMA device exists, nacred retries the saved listener until the device is up.
# Facts: bad_listener, probe_recfmt, probe_qid, probe_hsqsize, probe_bad_sgl, probe_bad_key,
# probe_idle, idle_closed_after_s,
# discovered_trtype, model, serial, transport, io_queues, ns1_bytes, verified, small_writes, zeroed,
# discarded, reverified, leaked, nacred_alive, replayed, cap_evicted, cap_rejected, cap_served,
# retry_failed_first, retry_served.
NQN=nqn.2014-08.io.nacre.testbed:rdma-target
MIB=$(param mib 32)
for b in nacred nacre rdma-cm-probe; do
    command -v $b >/dev/null || fail "no $b in the guest (run with --pack target/debug/$b)"
done
modprobe rdma_rxe; modprobe rdma_ucm; modprobe nvme-rdma
rxe_loopback

step "start nacred"
start_nacred
run nacre volume create rdma0 --size 64M --backend ram
run nacre nvmf create $NQN --allow-any-host --serial NACRE-RDMA-1
run nacre nvmf add-ns $NQN --volume rdma0

step "an RDMA listener on an address no RDMA device has: one clear error"
if nacre nvmf add-listener $NQN --transport rdma --address 192.0.2.77 --port 4420 2>/tmp/err; then
    fail "an RDMA listener on 192.0.2.77 (no such address) was accepted"
fi
cat /tmp/err
[ "$(wc -l < /tmp/err)" = 1 ] || fail "the error is not one line"
grep -q "cannot listen for NVMe/RDMA on 192.0.2.77:4420" /tmp/err || fail "unclear error: $(cat /tmp/err)"
fact bad_listener refused

step "RDMA listener on rxe0's address"
run nacre nvmf add-listener $NQN --transport rdma --address 192.0.2.1 --port 4420
nacre nvmf list

# nacred's threads and descriptors with the listener up and no host: every queue must give back its
# thread, its CM channel, completion channel and uverbs objects when it ends
counts() { echo "$(ls /proc/$NACRED/task | wc -l)/$(ls /proc/$NACRED/fd | wc -l)"; }
BASE=$(counts)
echo "nacred threads/fds before any host: $BASE"

# a host that connects its admin queue and never sends Connect: closed after the setup timeout
# (30 s; runs while the rest goes on)
rdma-cm-probe 192.0.2.1 4420 idle > /tmp/idle.out 2>&1 &
IDLE=$!

step "misbehaving hosts: bad private data, a bad SGL, an rkey never issued"
for c in recfmt qid hsqsize bad-sgl bad-key; do
    r=$(rdma-cm-probe 192.0.2.1 4420 $c) || fail "rdma-cm-probe $c failed: $r"
    echo "$r"
    fact "probe_$(echo $c | tr - _)" "$(echo "$r" | sed 's/^PROBE case=[^ ]* result=//' | tr ' ' ,)"
done
kill -0 $NACRED || fail "nacred died"

step "discover over RDMA"
nvme discover -t rdma -a 192.0.2.1 -s 4420 > /tmp/disc || fail "nvme discover -t rdma"
cat /tmp/disc
grep -q "subnqn: *$NQN\$" /tmp/disc || fail "discovery log does not list $NQN"
fact discovered_trtype "$(awk '/^trtype:/ {print $2; exit}' /tmp/disc)"

step "connect over RDMA"
run nvme connect -t rdma -a 192.0.2.1 -s 4420 -n $NQN -i 2 || fail "nvme connect -t rdma"
wait_until 30 nvme_ns_dev $NQN 1 || fail "namespace 1 did not appear"
C=$(nvme_ctrl_for $NQN)
NS1=$(nvme_ns_dev $NQN 1)
nvme list
nvme list | grep -q "^/dev/$NS1 .* nacre " || fail "nvme list does not show /dev/$NS1 as nacre"
fact model "$(sed 's/ *$//' /sys/class/nvme/$C/model)"
fact serial "$(sed 's/ *$//' /sys/class/nvme/$C/serial)"
fact transport "$(cat /sys/class/nvme/"$C"/transport)"
fact io_queues "$(nvme_io_queues "$C")"
fact ns1_bytes "$(blk_bytes $NS1)"

step "write, read back, compare ($MIB MiB, O_DIRECT)"
verify_rw /dev/$NS1 "$MIB" 0
fact verified "${MIB}MiB"
# the same pattern again at 3 MiB, kept for the read after reconnecting
dd if=/dev/urandom of=/tmp/pat2 bs=1M count=4 2>/dev/null
dd if=/tmp/pat2 of=/dev/$NS1 bs=1M seek=3 count=4 oflag=direct conv=fsync 2>/dev/null || fail "write"

step "4 KiB O_DIRECT writes (the host puts them in the capsule), write zeroes"
dd if=/dev/urandom of=/tmp/small bs=4k count=8 2>/dev/null
i=0
while [ $i -lt 8 ]; do
    dd if=/tmp/small of=/dev/$NS1 bs=4k skip=$i seek=$((10240 + i)) count=1 oflag=direct 2>/dev/null ||
        fail "4 KiB write $i"
    i=$((i + 1))
done
dd if=/dev/$NS1 of=/tmp/small.back bs=4k skip=10240 count=8 iflag=direct 2>/dev/null || fail "read"
cmp /tmp/small /tmp/small.back || fail "4 KiB writes read back differ"
fact small_writes 8x4KiB
# Write Zeroes over 1 MiB at 48 MiB (4 KiB blocks), then Dataset Management (deallocate, its range
# list in the capsule) over the MiB after it
dd if=/dev/urandom of=/dev/$NS1 bs=1M seek=48 count=2 oflag=direct 2>/dev/null || fail "write"
run nvme write-zeroes /dev/$NS1 -n 1 -s $((48 * 256)) -c 255 || fail "nvme write-zeroes"
dd if=/dev/$NS1 of=/tmp/z bs=1M skip=48 count=1 iflag=direct 2>/dev/null || fail "read zeroes"
[ "$(tr -d '\000' < /tmp/z | wc -c)" = 0 ] || fail "write zeroes left data"
fact zeroed 1MiB
run blkdiscard -o $((49 << 20)) -l $((1 << 20)) /dev/$NS1 || fail "blkdiscard (DSM deallocate)"
fact discarded 1MiB

step "disconnect, reconnect, read again: the data lives in nacred"
run nvme disconnect -n $NQN
wait_until 20 sh -c "! test -e /sys/class/nvme/$C" || fail "$C still present after disconnect"
run nvme connect -t rdma -a 192.0.2.1 -s 4420 -n $NQN || fail "nvme reconnect -t rdma"
wait_until 30 nvme_ns_dev $NQN 1 || fail "namespace 1 did not reappear"
NS1=$(nvme_ns_dev $NQN 1)
dd if=/dev/$NS1 of=/tmp/back2 bs=1M skip=3 count=4 iflag=direct 2>/dev/null || fail "re-read"
cmp /tmp/pat2 /tmp/back2 || fail "data after reconnect differs"
fact reverified 4MiB
run nvme disconnect -n $NQN
step "the silent host's queue is closed after the setup timeout"
wait $IDLE || fail "rdma-cm-probe idle failed: $(cat /tmp/idle.out)"
cat /tmp/idle.out
r=$(sed 's/^PROBE case=[^ ]* result=//' /tmp/idle.out)
case $r in "closed after="*) ;; *) fail "silent host not closed: $r" ;; esac
fact probe_idle closed
fact idle_closed_after_s "${r#closed after=}"

step "every queue gave its thread and descriptors back"
wait_until 20 sh -c "[ \"\$(ls /proc/$NACRED/task | wc -l)/\$(ls /proc/$NACRED/fd | wc -l)\" = $BASE ]" ||
    fail "nacred threads/fds $(counts), $BASE before any host"
fact leaked none
kill -0 $NACRED && fact nacred_alive yes

step "restart nacred: the RDMA listener is replayed from its state"
kill $NACRED
wait $NACRED || true
nacred --state-dir /tmp/nacre-state --run-dir /run/nacre --no-default --log info > /tmp/nacred.log 2>&1 &
NACRED=$!
wait_until 60 test -S /run/nacre/nacred.sock || fail "nacred did not restart"
grep -q "NVMe/RDMA subsystem $NQN (1 namespace(s)) listens on 192.0.2.1:4420" /tmp/nacred.log ||
    fail "no RDMA listener line at start-up"
run nvme connect -t rdma -a 192.0.2.1 -s 4420 -n $NQN || fail "nvme connect after restart"
wait_until 30 nvme_ns_dev $NQN 1 || fail "namespace 1 did not appear after restart"
NS1=$(nvme_ns_dev $NQN 1)
verify_rw /dev/$NS1 4 8
fact replayed yes
run nvme disconnect -n $NQN

step "per-listener caps hold for RDMA queues: 2 queues per listener, 1 of them short of Connect"
kill $NACRED
wait $NACRED || true
NACRE_NVMF_MAX_CONNECTIONS=2 NACRE_NVMF_MAX_SETUP_CONNECTIONS=1 \
    nacred --state-dir /tmp/nacre-state --run-dir /run/nacre --no-default --log info > /tmp/nacred.log 2>&1 &
NACRED=$!
wait_until 60 test -S /run/nacre/nacred.sock || fail "nacred did not restart with caps"
wait_until 30 grep -q "listens on 192.0.2.1:4420" /tmp/nacred.log || fail "no RDMA listener after restart"
threads() { ls /proc/$NACRED/task | wc -l; }
T0=$(threads)
# a silent queue, then a second: the second evicts the first (a queue thread each while they live)
rdma-cm-probe 192.0.2.1 4420 idle > /tmp/evicted.out 2>&1 &
P1=$!
wait_until 20 sh -c "[ \$(ls /proc/$NACRED/task | wc -l) -gt $T0 ]" || fail "the first silent queue never came up"
rdma-cm-probe 192.0.2.1 4420 idle > /tmp/survivor.out 2>&1 &
P2=$!
wait $P1 || fail "rdma-cm-probe (evicted) failed: $(cat /tmp/evicted.out)"
cat /tmp/evicted.out
r=$(sed 's/^PROBE case=[^ ]* result=//' /tmp/evicted.out)
case $r in "closed after="*) ;; *) fail "the oldest silent queue was not evicted: $r" ;; esac
secs=${r#closed after=}
[ "${secs%s}" -lt 20 ] || fail "the oldest silent queue was closed by the setup timeout (30 s), not evicted: $r"
fact cap_evicted closed
kill $P2 2>/dev/null
wait $P2 2>/dev/null || true
# the killed host's queue ends (its CM id goes with the process) and gives its place back
wait_until 30 sh -c "[ \$(ls /proc/$NACRED/task | wc -l) -le $T0 ]" || fail "the killed host's queue lingers"
# admin + 1 I/O queue fill the listener: a third queue is rejected, the two keep working
run nvme connect -t rdma -a 192.0.2.1 -s 4420 -n $NQN -i 1 || fail "nvme connect -i 1 under caps"
wait_until 30 nvme_ns_dev $NQN 1 || fail "namespace 1 did not appear under caps"
NS1=$(nvme_ns_dev $NQN 1)
r=$(rdma-cm-probe 192.0.2.1 4420 idle) || fail "rdma-cm-probe on a full listener failed: $r"
echo "$r"
fact cap_rejected "$(echo "$r" | sed 's/^PROBE case=[^ ]* result=//' | tr ' ' ,)"
verify_rw /dev/$NS1 2 16
fact cap_served yes
run nvme disconnect -n $NQN

step "an RDMA device that comes up after nacred: the saved listener is retried and serves"
kill $NACRED
wait $NACRED || true
run rdma link delete rxe0
nacred --state-dir /tmp/nacre-state --run-dir /run/nacre --no-default --log info > /tmp/nacred.log 2>&1 &
NACRED=$!
wait_until 60 test -S /run/nacre/nacred.sock || fail "nacred did not start without rxe0"
grep "NVMe/RDMA subsystem $NQN is NOT listening" /tmp/nacred.log || fail "no NOT listening line without rxe0"
nacre nvmf list | tee /tmp/list
grep -q "rdma:192.0.2.1:4420 (failed: .*retrying)" /tmp/list || fail "the listener is not shown as failed and retried"
fact retry_failed_first yes
run rdma link add rxe0 type rxe netdev dummy0
wait_until 30 grep -q "nvmf listener restored.*transport=Rdma" /tmp/nacred.log || fail "the RDMA listener was not retried"
nacre nvmf list | tee /tmp/list
grep -q "rdma:192.0.2.1:4420 (failed" /tmp/list && fail "still failed after it listens"
run nvme connect -t rdma -a 192.0.2.1 -s 4420 -n $NQN || fail "nvme connect to the retried listener"
wait_until 30 nvme_ns_dev $NQN 1 || fail "namespace 1 did not appear on the retried listener"
NS1=$(nvme_ns_dev $NQN 1)
verify_rw /dev/$NS1 2 20
fact retry_served yes
run nvme disconnect -n $NQN
kill $NACRED
