# kernel nvmet-tcp target + nvme-tcp host on 127.0.0.1 in one guest: proves the bed works
# Checks: discovery lists the subsystem, connect with 2 I/O queues, `nvme list` shows both
# namespaces with the right sizes, O_DIRECT write/read/compare, again with header+data digests.
NQN=nqn.2014-08.io.nacre.testbed:selftest
step "modules"
modprobe nvmet-tcp; modprobe nvme-tcp
modprobe null_blk nr_devices=1 gb=1
modprobe brd rd_nr=1 rd_size=65536            # 64 MiB RAM disk
nvmet_subsys $NQN 1 /dev/nullb0
nvmet_subsys $NQN 2 /dev/ram0
nvmet_port 1 tcp 127.0.0.1 4420 $NQN

step "discover"
nvme discover -t tcp -a 127.0.0.1 -s 4420 > /tmp/disc
cat /tmp/disc
grep -q "subnqn: *$NQN" /tmp/disc || fail "discovery log does not list $NQN"
fact discovered "$NQN"

for digests in off on; do
    step "connect (digests $digests)"
    if [ $digests = on ]; then dg="-g -G"; else dg=""; fi
    # shellcheck disable=SC2086
    run nvme connect -t tcp -a 127.0.0.1 -s 4420 -n $NQN -i 2 $dg
    wait_until 10 nvme_ctrl_for $NQN || fail "no controller for $NQN"
    C=$(nvme_ctrl_for $NQN)
    wait_until 10 test -b /dev/${C}n2 || fail "namespace 2 did not appear"
    nvme list
    nvme list | grep -q "/dev/${C}n1" || fail "nvme list does not show /dev/${C}n1"
    fact "model_$digests" "$(cat /sys/class/nvme/$C/model | tr -d ' ')"
    fact "transport_$digests" "$(cat /sys/class/nvme/$C/transport)"
    fact "ns1_bytes_$digests" "$(blk_bytes ${C}n1)"
    fact "ns2_bytes_$digests" "$(blk_bytes ${C}n2)"
    fact "io_queues_$digests" "$(nvme_io_queues $C)"
    [ "$(nvme_io_queues $C)" = 2 ] || fail "asked for 2 I/O queues, got $(nvme_io_queues $C)"
    verify_rw /dev/${C}n2 16 8
    fact "verified_$digests" 16MiB
    run nvme disconnect -n $NQN
    wait_until 10 sh -c "! test -e /sys/class/nvme/$C" || fail "$C still present after disconnect"
done
step "done"
