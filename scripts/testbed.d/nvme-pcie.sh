# the guest's own nvme driver binds nacred's PCIe NVMe controller (vfio-user-pci): PCI identity, nvme list, O_DIRECT verify;
# then what a guest does to a controller in its life: a controller reset (nvme reset), an unbind and
# rebind of the nvme driver, (with --ctl) a namespace the host attaches and detaches while the
# guest runs, which the guest learns of by a Namespace Attribute Changed event, and a reboot.
# The scenario runs again after the reboot: a marker block the first boot writes at 96 MiB
# ("nacre-tb-reboot SHA256", of the first 4 MiB) tells the second boot apart; the second boot
# checks those 4 MiB and goes on with the failure part.
# Params: model, serial, bytes (expected namespace size), queues (expected I/O queues), mib (verify size),
# hotplug (1: wait for the host's add-ns and remove-ns on the control channel), reboot (1: write
# the marker, wait for the host's reboot (it makes a guest reboot reset the VM), reboot -f),
# failure (1: a writer of numbered 4 KiB blocks from 64 MiB on, each written O_DIRECT and flushed
# (conv=fsync) before it counts as acknowledged; the host kills nacred meanwhile (kill) and starts
# it again (restarted); what the guest's I/O does each time; the scenario ends there),
# replug (1, with failure=1: then the host plugs a new function in (replug, QMP device_add) and
# the guest reads every acknowledged block back through it).
# unplug (a subsystem NQN, with replug=1: then the host plugs in a function with MSI of that
# subsystem (msi-plug), the guest writes 4 MiB to it, the host removes it (unplug, QMP
# device_del) and plugs it in again (msi-replug), and the guest reads the 4 MiB back; then
# another 4 MiB written and flushed, the host stops nacred (stop: SIGTERM), the guest's I/O
# meets the stopped controller, and the host's recovery (recover: device_del of the dead
# function, nacred started again, device_add) gives the disk back with those 4 MiB).
# vblk_bytes (not 0: a virtio-blk PCI function of that size is on the bus too; see below).
# Facts: pci (vendor:device class of the NVMe function), model, serial, transport, bytes, queues, bound_s
# (seconds from modprobe to /dev/nvme0n1), verified, reset_verified, rebind_verified, hot_added
# (bytes of nvme0n2 once it appeared), hot_added_verified, hot_added_sha256 (of the 4 MiB written
# at its start), hot_removed, rebooted (the second boot found the marker), reboot_verified,
# killed_io (ok/error), killed_io_s, writer (error: the writer stopped on a failed write or flush),
# acked_blocks (blocks acknowledged before the kill), killed_state, restarted_io, restarted_state
# (the controller's sysfs state, or gone), restarted_disk (namespace 1's block device, or gone),
# replugged_functions (NVMe functions on the bus then),
# replugged_acked (acknowledged blocks read back intact through the new function),
# msi_irqs (the MSI function's interrupt modes, as sysfs names them), msi_queues, msi_verified,
# unplugged (yes: the function and its disk left the guest), msi_replug_verified, stopped_io
# (ok/error: a read once nacred was stopped), stopped_disk (the disk then, or gone),
# stopped_recovered (yes: the 4 MiB flushed before the stop read back after the recovery).
mib=$(param mib 64)
step "PCI functions"
# nvme_fn: the sysfs directory of the NVM Express function (class 010802), if there is one
nvme_fn() {
    local d
    for d in /sys/bus/pci/devices/*; do
        [ "$(cat "$d/class")" = 0x010802 ] && { echo "$d"; return 0; }
    done
    return 1
}
# ns1: the block device of namespace 1 (the controller's instance number changes when the function
# is plugged again while an old controller is still being released)
ns1() {
    local d
    for d in /sys/block/nvme*n*; do
        case ${d##*/} in nvme*c*) continue ;; esac
        [ "$(cat "$d/nsid" 2>/dev/null)" = 1 ] && { echo "/dev/${d##*/}"; return 0; }
    done
    return 1
}
# The virtio-blk PCI function (1af4:1042) the host may plug beside the controller (vblk_bytes: its
# size): the guest's virtio_pci and virtio_blk drivers bind it as vda; 4 MiB written O_DIRECT and
# read back, a discard; then unbound, so that nothing later (nacred killed, the shutdown's device
# resets) waits on it. Facts: vblk_pci (vendor:device class rev), vblk_driver, vblk_bytes,
# vblk_verified, vblk_discarded, vblk_unbound.
vbytes=$(param vblk_bytes 0)
if [ "$vbytes" != 0 ]; then
    step "virtio-blk PCI function"
    vfn=
    for d in /sys/bus/pci/devices/*; do
        [ "$(cat "$d/vendor"):$(cat "$d/device")" = 0x1af4:0x1042 ] && vfn=$d
    done
    [ -n "$vfn" ] || fail "no virtio-blk PCI function (1af4:1042) on the PCI bus"
    fact vblk_pci "$(cat "$vfn/vendor"):$(cat "$vfn/device") $(cat "$vfn/class") rev $(cat "$vfn/revision")"
    modprobe virtio_pci; modprobe virtio_blk
    wait_until 20 test -b /dev/vda || fail "no /dev/vda from the virtio-blk PCI function"
    fact vblk_driver "$(basename "$(readlink /sys/block/vda/device/driver)")"
    fact vblk_bytes "$(blk_bytes vda)"
    [ "$(blk_bytes vda)" = "$vbytes" ] || fail "/dev/vda has $(blk_bytes vda) bytes, want $vbytes"
    dd if=/dev/urandom of=/tmp/vpat bs=1M count=4 2>/dev/null
    dd if=/tmp/vpat of=/dev/vda bs=1M seek=1 count=4 oflag=direct conv=fsync 2>/dev/null ||
        fail "O_DIRECT write to the virtio-blk function"
    dd if=/dev/vda of=/tmp/vback bs=1M skip=1 count=4 iflag=direct 2>/dev/null ||
        fail "O_DIRECT read from the virtio-blk function"
    cmp /tmp/vpat /tmp/vback || fail "data read back from the virtio-blk function differs"
    fact vblk_verified 4MiB
    rm -f /tmp/vpat /tmp/vback
    if blkdiscard -o 1048576 -l 1048576 /dev/vda; then fact vblk_discarded yes; else fact vblk_discarded no; fi
    echo "${vfn##*/}" > /sys/bus/pci/drivers/virtio-pci/unbind
    wait_until 10 sh -c '! test -b /dev/vda' || fail "/dev/vda stayed after unbinding its function"
    fact vblk_unbound yes
fi
dev=$(nvme_fn) || fail "no NVM Express function (class 010802) on the PCI bus"
fact pci "$(cat "$dev/vendor"):$(cat "$dev/device") $(cat "$dev/class")"
t0=$(up)
# short command timeouts (Linux's default is 30 s): with failure=1 the controller goes away.
# Native NVMe multipath off: with it (the kernel's default; nacred's controllers say CMIC
# multi-controller) a namespace whose only path died queues its I/O until a path comes back
# or the head is torn down, whichever the kernel gets to first; under load that left the
# killed part's writer waiting for minutes. Without it the I/O fails once the driver
# removes the controller, which is what this scenario checks (docs/nvme-pcie.md has both).
modprobe nvme_core io_timeout=5 admin_timeout=5 multipath=N
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

# The reboot marker: one 4 KiB block at 96 MiB, "nacre-tb-reboot SHA256" (of the first 4 MiB).
MARK=$((96 * 256))
marker() { dd if=/dev/nvme0n1 bs=4096 skip=$MARK count=1 iflag=direct 2>/dev/null | head -n 1; }
m=$(marker)
if [ "${m%% *}" = nacre-tb-reboot ]; then
    step "second boot: the data written before the reboot"
    fact rebooted yes
    [ "$(dd if=/dev/nvme0n1 bs=1M count=4 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)" = "${m#* }" ] ||
        fail "the first 4 MiB differ from what the first boot wrote"
    fact reboot_verified yes
else
step "write ${mib} MiB O_DIRECT from four writers, read back"
dd if=/dev/urandom of=/tmp/pat bs=1M count="$mib" 2>/dev/null
q=$((mib / 4))
for i in 0 1 2 3; do
    dd if=/tmp/pat of=/dev/nvme0n1 bs=1M skip=$((i * q)) seek=$((i * q)) count="$q" oflag=direct 2>/dev/null &
done
wait
dd if=/dev/nvme0n1 of=/tmp/back bs=1M count="$mib" iflag=direct 2>/dev/null
cmp /tmp/pat /tmp/back || fail "read-back differs"
fact verified "${mib}MiB"

# the first MiB read again and compared with what was written
reread() {
    dd if="${1:-/dev/nvme0n1}" of=/tmp/again bs=1M count=1 iflag=direct 2>/dev/null || return 1
    cmp -n 1048576 /tmp/pat /tmp/again
}
step "controller reset from the guest (CC.EN 1 -> 0 -> 1, queues created again)"
echo 1 > $c/reset_controller || fail "reset_controller"
wait_until 30 sh -c "[ \"\$(cat $c/state)\" = live ]" || fail "controller not live after reset: $(cat $c/state)"
reread || fail "data differs after a controller reset"
dd if=/tmp/pat of=/dev/nvme0n1 bs=1M count=1 seek=1 skip=1 oflag=direct 2>/dev/null || fail "write after reset"
fact reset_verified yes

step "unbind and rebind the nvme driver"
bdf=$(basename "$dev")
echo "$bdf" > /sys/bus/pci/drivers/nvme/unbind || fail "unbind"
wait_until 20 sh -c '! test -e /dev/nvme0n1' || fail "/dev/nvme0n1 still there after unbind"
echo "$bdf" > /sys/bus/pci/drivers/nvme/bind || fail "bind"
wait_until 30 test -b /dev/nvme0n1 || fail "no /dev/nvme0n1 after rebind"
reread || fail "data differs after a driver rebind"
fact rebind_verified yes

if [ "$(param hotplug 0)" = 1 ]; then
    step "namespace 2 attached by the host while the guest runs"
    wait_host add-ns 120
    wait_until 30 test -b /dev/nvme0n2 || fail "no /dev/nvme0n2 after the host attached namespace 2"
    fact hot_added "$(blk_bytes nvme0n2)"
    dd if=/dev/urandom of=/tmp/pat2 bs=1M count=4 2>/dev/null
    dd if=/tmp/pat2 of=/dev/nvme0n2 bs=1M count=4 oflag=direct 2>/dev/null || fail "write nvme0n2"
    dd if=/dev/nvme0n2 of=/tmp/back2 bs=1M count=4 iflag=direct 2>/dev/null || fail "read nvme0n2"
    cmp /tmp/pat2 /tmp/back2 || fail "nvme0n2 read-back differs"
    fact hot_added_verified yes
    fact hot_added_sha256 "$(sha256sum /tmp/pat2 | cut -d' ' -f1)"
    step "namespace 2 detached by the host"
    wait_host remove-ns 120
    wait_until 30 sh -c '! test -e /dev/nvme0n2' || fail "/dev/nvme0n2 still there after the host detached it"
    reread || fail "namespace 1 changed when namespace 2 went"
    fact hot_removed yes
fi

if [ "$(param reboot 0)" = 1 ]; then
    step "reboot"
    d1=$(ns1)
    printf 'nacre-tb-reboot %s\n' "$(head -c 4194304 /tmp/pat | sha256sum | cut -d' ' -f1)" |
        dd of="$d1" bs=4096 seek=$MARK count=1 conv=sync,fsync oflag=direct 2>/dev/null ||
        fail "writing the reboot marker"
    wait_host reboot 120
    reboot -f
    sleep 30
    fail "still running 30 s after reboot -f"
fi
fi

if [ "$(param failure 0)" = 1 ]; then
    # Block i at 64 MiB + 4 KiB * i holds "nacre-tb-block i" (zero-padded); it counts as
    # acknowledged once its write and the flush after it (fsync: Flush, the cache is volatile)
    # both returned success.
    step "numbered 4 KiB blocks written O_DIRECT and flushed, one after another; the host kills nacred"
    BASE=$((64 * 256))
    d1=$(ns1)
    : > /tmp/acked
    (
        i=0
        while printf 'nacre-tb-block %d\n' $i |
            dd of="$d1" bs=4096 seek=$((BASE + i)) count=1 conv=sync,fsync oflag=direct 2>/dev/null; do
            echo $i >> /tmp/acked
            i=$((i + 1))
        done
        exit 1  # only a failed write or flush ends the loop
    ) &
    writer=$!
    wait_until 60 sh -c '[ "$(wc -l < /tmp/acked)" -ge 8 ]' || fail "the writer acknowledged no 8 blocks"
    wait_host kill 120
    step "the guest's I/O with nacred gone"
    # The writer's next write or flush meets the dead controller: its command times out
    # (io_timeout=5), the driver's reset fails and it removes the controller, failing the
    # I/O. A process in uninterruptible sleep cannot be killed, so the wait is bounded by
    # polling rather than by `timeout`.
    t=$(up)
    if ! wait_until 60 sh -c "! kill -0 $writer 2>/dev/null"; then
        dmesg | grep -i nvme | tail -n 20
        fail "the writer's I/O neither completed nor failed within 60 s of nacred's kill"
    fi
    fact killed_io_s "$(elapsed "$t")"
    if wait $writer; then
        fail "the writer ended without an error"
    fi
    fact writer error
    fact killed_io error
    acked=$(wc -l < /tmp/acked)
    fact acked_blocks "$acked"
    fact killed_state "$(cat $c/state 2>/dev/null || echo gone)"
    dmesg | grep -i 'nvme' | tail -n 8
    wait_host restarted 120
    step "the guest's I/O once nacred is back"
    sleep 2
    if timeout 60 dd if="$d1" of=/dev/null bs=4k count=1 skip=8192 iflag=direct 2>/tmp/ioerr; then
        fact restarted_io ok
    else
        fact restarted_io error
    fi
    fact restarted_state "$(cat $c/state 2>/dev/null || echo gone)"
    fact restarted_disk "$(ns1 || echo gone)"
    dmesg | grep -i 'nvme' | tail -n 4
    if [ "$(param replug 0)" = 1 ]; then
        step "the host plugs a new function in (QMP device_add): every acknowledged block"
        wait_host replug 120
        wait_until 30 ns1 || fail "no namespace 1 block device after the host plugged a new function in"
        fact replugged_functions "$(for d in /sys/bus/pci/devices/*; do cat "$d/class"; done | grep -c 0x010802)"
        d1=$(ns1)
        dd if="$d1" of=/tmp/blocks bs=4096 skip=$BASE count="$acked" iflag=direct 2>/dev/null ||
            fail "reading the acknowledged blocks back"
        i=0
        while [ $i -lt "$acked" ]; do
            [ "$(dd if=/tmp/blocks bs=4096 skip=$i count=1 2>/dev/null | head -n 1)" = "nacre-tb-block $i" ] ||
                fail "acknowledged block $i lost"
            i=$((i + 1))
        done
        fact replugged_acked "$acked"
    fi
    unqn=$(param unplug "")
    if [ -n "$unqn" ]; then
        msi_disk() { local c; c=$(nvme_ctrl_for "$1") && test -b "/dev/${c}n1"; }
        step "the host plugs in a function with MSI (QMP device_add)"
        wait_host msi-plug 120
        wait_until 30 msi_disk "$unqn" ||
            fail "no disk of the function with MSI ($unqn) after the host plugged it in"
        mc=$(nvme_ctrl_for "$unqn")
        mfn=$(readlink -f "/sys/class/nvme/$mc/device")
        fact msi_irqs "$(cat "$mfn"/msi_irqs/* | sort -u | tr '\n' ' ' | sed 's/ $//')"
        fact msi_queues "$(ls "/sys/block/${mc}n1/mq" | wc -l)"
        dd if=/dev/urandom of=/tmp/patm bs=1M count=4 2>/dev/null
        dd if=/tmp/patm of="/dev/${mc}n1" bs=1M count=4 oflag=direct conv=fsync 2>/dev/null || fail "write through the function with MSI"
        dd if="/dev/${mc}n1" of=/tmp/backm bs=1M count=4 iflag=direct 2>/dev/null || fail "read through the function with MSI"
        cmp /tmp/patm /tmp/backm || fail "read-back through the function with MSI differs"
        fact msi_verified 4MiB
        step "the host removes it (QMP device_del)"
        wait_host unplug 120
        wait_until 30 sh -c "! test -e $mfn" || fail "the function is still on the bus after device_del"
        ! nvme_ctrl_for "$unqn" >/dev/null || fail "the controller is still there after device_del"
        fact unplugged yes
        step "the host plugs it in again"
        wait_host msi-replug 120
        wait_until 30 msi_disk "$unqn" ||
            fail "no disk of the function with MSI after it was plugged in again"
        mc=$(nvme_ctrl_for "$unqn")
        dd if="/dev/${mc}n1" of=/tmp/backm bs=1M count=4 iflag=direct 2>/dev/null || fail "read after the function came back"
        cmp /tmp/patm /tmp/backm || fail "the 4 MiB differ after the function was removed and plugged in again"
        fact msi_replug_verified yes
        step "nacred stopped (SIGTERM) while the guest has the function with MSI"
        dd if=/dev/urandom of=/tmp/pats bs=1M count=4 2>/dev/null
        dd if=/tmp/pats of="/dev/${mc}n1" bs=1M count=4 seek=4 oflag=direct conv=fsync 2>/dev/null ||
            fail "write and flush before the stop"
        wait_host stop 120
        if timeout 60 dd if="/dev/${mc}n1" of=/dev/null bs=4k count=1 skip=2048 iflag=direct 2>/dev/null; then
            fact stopped_io ok
        else
            fact stopped_io error
        fi
        wait_until 30 sh -c "! test -b /dev/${mc}n1" || true
        fact stopped_disk "$(test -b "/dev/${mc}n1" && echo "${mc}n1" || echo gone)"
        step "the host's recovery: device_del, nacred started again, device_add"
        wait_host recover 120
        wait_until 30 msi_disk "$unqn" || fail "no disk of the function with MSI after the recovery"
        mc=$(nvme_ctrl_for "$unqn")
        dd if="/dev/${mc}n1" of=/tmp/backs bs=1M count=4 skip=4 iflag=direct 2>/dev/null || fail "read after the recovery"
        cmp /tmp/pats /tmp/backs || fail "the 4 MiB flushed before nacred's stop differ after the recovery"
        fact stopped_recovered yes
    fi
    exit 0
fi

step "flush and shut down the controller"
blockdev --flushbufs /dev/nvme0n1
