# the guest's kernel nvme-tcp host against a target on the host's loopback (guestfwd + socat)
# Params: nqn, addr/port (where the guest dials: default 10.0.2.100:4420, a guestfwd rule), queues
# (I/O queues, default 2), mib (O_DIRECT pattern size, default 32), hotplug (1: after the digest
# connect, wait for host signals ns-add / ns-remove and watch namespace 2 come and go).
# Facts per pass (off = no digests, on = header+data digests): model_, serial_, firmware_,
# io_queues_, ns<N>_bytes_, verified_; discovered; ns2_added_bytes, ns2_removed.
NQN=$(param nqn)
A=$(param addr 10.0.2.100)
P=$(param port 4420)
Q=$(param queues 2)
MIB=$(param mib 32)
modprobe virtio_pci; modprobe virtio_net; modprobe nvme-tcp
wait_until 20 test -e /sys/class/net/eth0 || fail "no eth0"
ip link set eth0 up; ip addr add 10.0.2.15/24 dev eth0   # no default route: slirp's 10.0.2.x only

step "discover $A:$P"
nvme discover -t tcp -a "$A" -s "$P" > /tmp/disc || fail "nvme discover failed"
cat /tmp/disc
grep -q "subnqn: *$NQN\$" /tmp/disc || fail "discovery log does not list $NQN"
fact discovered "$NQN"

for digests in off on; do
    step "connect, $Q I/O queues, digests $digests"
    if [ $digests = on ]; then dg="-g -G"; else dg=""; fi
    # shellcheck disable=SC2086
    run nvme connect -t tcp -a "$A" -s "$P" -n "$NQN" -i "$Q" $dg || fail "nvme connect failed"
    wait_until 20 nvme_ctrl_for "$NQN" || fail "no controller for $NQN"
    C=$(nvme_ctrl_for "$NQN")
    wait_until 20 nvme_ns_dev "$NQN" 1 || fail "namespace 1 did not appear"
    NS1=$(nvme_ns_dev "$NQN" 1)
    nvme list
    nvme list | grep -q "^/dev/$NS1 " || fail "nvme list does not show /dev/$NS1"
    fact "model_$digests" "$(sed 's/ *$//' /sys/class/nvme/$C/model)"
    fact "serial_$digests" "$(sed 's/ *$//' /sys/class/nvme/$C/serial)"
    fact "firmware_$digests" "$(sed 's/ *$//' /sys/class/nvme/$C/firmware_rev)"
    fact "io_queues_$digests" "$(nvme_io_queues $C)"
    for d in $(nvme_ns_devs "$NQN"); do
        fact "ns$(cat /sys/block/$d/nsid)_bytes_$digests" "$(blk_bytes $d)"
    done
    verify_rw /dev/$NS1 "$MIB" 0
    fact "verified_$digests" "${MIB}MiB"
    if [ $digests = on ] && [ "$(param hotplug 0)" = 1 ]; then
        step "namespace hot-add"
        ! nvme_ns_dev "$NQN" 2 >/dev/null || fail "namespace 2 exists before ns-add"
        wait_host ns-add
        # the target's Namespace Attribute Changed event makes the host rescan: no reconnect
        wait_until 30 nvme_ns_dev "$NQN" 2 || fail "namespace 2 did not appear after ns-add"
        NS2=$(nvme_ns_dev "$NQN" 2)
        fact ns2_added_bytes "$(blk_bytes $NS2)"
        [ "$(nvme_ctrl_for "$NQN")" = "$C" ] || fail "controller changed: reconnected?"
        dd if=/dev/$NS2 of=/dev/null bs=1M count=1 iflag=direct 2>/dev/null || fail "read from new namespace"
        step "namespace hot-remove"
        wait_host ns-remove
        wait_until 30 sh -c "! test -e /sys/block/$NS2" || fail "namespace 2 still present after ns-remove"
        fact ns2_removed yes
        [ "$(nvme_ctrl_for "$NQN")" = "$C" ] || fail "controller changed: reconnected?"
        test -b /dev/$NS1 || fail "namespace 1 vanished with namespace 2"
    fi
    run nvme disconnect -n "$NQN"
    wait_until 10 sh -c "! test -e /sys/class/nvme/$C" || fail "$C still present after disconnect"
done
step "done"
