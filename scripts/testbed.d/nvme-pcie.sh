# the guest's own nvme driver binds nacred's PCIe NVMe controller (vfio-user-pci): PCI identity, nvme list, O_DIRECT verify
# Params: model, serial, bytes (expected namespace size), queues (expected I/O queues), mib (verify size).
# Facts: pci (vendor:device class of the NVMe function), model, serial, transport, bytes, queues, bound_s
# (seconds from modprobe to /dev/nvme0n1), verified.
mib=$(param mib 64)
step "PCI functions"
dev=""
for d in /sys/bus/pci/devices/*; do
    [ "$(cat "$d/class")" = 0x010802 ] && dev=$d
done
[ -n "$dev" ] || fail "no NVM Express function (class 010802) on the PCI bus"
fact pci "$(cat "$dev/vendor"):$(cat "$dev/device") $(cat "$dev/class")"
t0=$(up)
modprobe nvme
wait_until 30 test -b /dev/nvme0n1 || fail "no /dev/nvme0n1 after modprobe nvme"
fact bound_s "$(elapsed "$t0")"
c=/sys/class/nvme/nvme0
fact model "$(sed 's/ *$//' "$c/model")"
fact serial "$(sed 's/ *$//' "$c/serial")"
fact transport "$(cat "$c/transport")"
fact bytes "$(blk_bytes nvme0n1)"
# With native multipath (CMIC says multi-controller) nvme0n1 is the head; the queues are the path's.
mq=/sys/class/nvme/nvme0/nvme0c0n1/mq
[ -d "$mq" ] || mq=/sys/block/nvme0n1/mq
fact queues "$(ls "$mq" | wc -l)"
nvme list
[ "$(cat "$c/transport")" = pcie ] || fail "transport is not pcie"
[ "$(sed 's/ *$//' "$c/model")" = "$(param model)" ] || fail "wrong model"
[ "$(blk_bytes nvme0n1)" = "$(param bytes)" ] || fail "wrong size"
[ "$(ls "$mq" | wc -l)" = "$(param queues)" ] || fail "wrong number of I/O queues"
step "write ${mib} MiB O_DIRECT from four writers, read back"
dd if=/dev/urandom of=/tmp/pat bs=1M count="$mib" 2>/dev/null
q=$((mib / 4))
for i in 0 1 2 3; do
    dd if=/tmp/pat of=/dev/nvme0n1 bs=1M skip=$((i * q)) seek=$((i * q)) count="$q" oflag=direct 2>/dev/null &
done
wait
dd if=/dev/nvme0n1 of=/tmp/back bs=1M count="$mib" iflag=direct 2>/dev/null
cmp /tmp/pat /tmp/back || fail "read-back differs"
step "flush and shut down the controller"
blockdev --flushbufs /dev/nvme0n1
fact verified "${mib}MiB"
