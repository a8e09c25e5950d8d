# the diskless host of an emulated BlueField (scripts/testbed-arm64): the kernel's nvme-tcp host
# reaches nacred on the Arm guest over a QEMU socket network shared by the two guests
# Params: addr (the DPU, default 192.0.2.2), port (4420), nqn (nacre's embedded default),
# mib (O_DIRECT pattern size, default 8), wait (seconds to wait for the DPU, default 240).
# Facts: model, serial, firmware, ns1_bytes, verified, reverified, dpu_reached_after.
A=$(param addr 192.0.2.2)
P=$(param port 4420)
NQN=$(param nqn nqn.2014-08.io.nacre:default)
MIB=$(param mib 8)
modprobe virtio_pci; modprobe virtio_net; modprobe nvme-tcp
wait_until 20 test -e /sys/class/net/eth0 || fail "no eth0"
ip link set eth0 up; ip addr add 192.0.2.1/24 dev eth0   # no default route: the DPU only

step "wait for nacred on the DPU at $A:$P"
t=$(up)
wait_until "$(param wait 240)" sh -c "nvme discover -t tcp -a $A -s $P > /tmp/disc 2>/dev/null" ||
    fail "no NVMe/TCP discovery answer from $A:$P"
fact dpu_reached_after "$(elapsed "$t")"
cat /tmp/disc
grep -q "subnqn: *$NQN\$" /tmp/disc || fail "discovery log does not list $NQN"

step "connect"
run nvme connect -t tcp -a "$A" -s "$P" -n "$NQN" || fail "nvme connect failed"
wait_until 20 nvme_ctrl_for "$NQN" || fail "no controller for $NQN"
C=$(nvme_ctrl_for "$NQN")
wait_until 20 nvme_ns_dev "$NQN" 1 || fail "namespace 1 did not appear"
NS1=$(nvme_ns_dev "$NQN" 1)
nvme list
nvme list | grep -q "^/dev/$NS1 .* nacre " || fail "nvme list does not show /dev/$NS1 as nacre"
fact model "$(sed 's/ *$//' /sys/class/nvme/$C/model)"
fact serial "$(sed 's/ *$//' /sys/class/nvme/$C/serial)"
fact firmware "$(sed 's/ *$//' /sys/class/nvme/$C/firmware_rev)"
fact ns1_bytes "$(blk_bytes $NS1)"

step "write, read back, compare ($MIB MiB, O_DIRECT)"
dd if=/dev/urandom of=/tmp/pat bs=1M count="$MIB" 2>/dev/null
dd if=/tmp/pat of=/dev/$NS1 bs=1M seek=3 count="$MIB" oflag=direct conv=fsync 2>/dev/null || fail "write"
dd if=/dev/$NS1 of=/tmp/back bs=1M skip=3 count="$MIB" iflag=direct 2>/dev/null || fail "read"
cmp /tmp/pat /tmp/back || fail "data read back differs"
fact verified "${MIB}MiB"
fact pattern_sha256 "$(sha256sum < /tmp/pat | cut -d' ' -f1)"

step "disconnect, reconnect, read again: the data lives on the DPU"
run nvme disconnect -n "$NQN"
wait_until 10 sh -c "! test -e /sys/class/nvme/$C" || fail "$C still present after disconnect"
run nvme connect -t tcp -a "$A" -s "$P" -n "$NQN" || fail "nvme reconnect failed"
wait_until 20 nvme_ns_dev "$NQN" 1 || fail "namespace 1 did not reappear"
NS1=$(nvme_ns_dev "$NQN" 1)
dd if=/dev/$NS1 of=/tmp/back2 bs=1M skip=3 count="$MIB" iflag=direct 2>/dev/null || fail "re-read"
cmp /tmp/pat /tmp/back2 || fail "data after reconnect differs"
fact reverified "${MIB}MiB"
run nvme disconnect -n "$NQN"
