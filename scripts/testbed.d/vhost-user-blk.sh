# virtio-blk over vhost-user: a host-side backend serves /dev/vda; data survives a guest reboot
# Boot with tb.phase=write, then again (same backend) with tb.phase=verify tb.sha256=<from the first>.
# Params: phase, bytes (expected size of vda), queues (expected virtqueues), lbs (expected logical
# block size, default 512), mib (pattern size, default 8), offset_mib (where the pattern goes,
# default 1), sha256 (verify phase), restart (1: in the verify phase, wait for the host to restart
# the backend, then check old data and new I/O; the chardev needs QEMU's reconnect option). Facts: bytes, queues, logical_block_size of vda and
# <vdX>_bytes of every virtio disk, sha256, verified, survived_restart.
phase=$(param phase)
mib=$(param mib 8)
[ "$mib" -ge 4 ] || fail "mib must be at least 4"
off=$(param offset_mib 1)
modprobe virtio_pci; modprobe virtio_blk
wait_until 20 test -b /dev/vda || fail "no /dev/vda"
fact bytes "$(blk_bytes vda)"
fact queues "$(ls /sys/block/vda/mq | wc -l)"
fact logical_block_size "$(cat /sys/block/vda/queue/logical_block_size)"
for d in /sys/block/vd*; do fact "${d##*/}_bytes" "$(blk_bytes "${d##*/}")"; done
[ "$(cat /sys/block/vda/queue/logical_block_size)" = "$(param lbs 512)" ] || fail "/dev/vda has the wrong block size"
[ "$(blk_bytes vda)" = "$(param bytes)" ] || fail "/dev/vda has $(blk_bytes vda) bytes, want $(param bytes)"
[ "$(ls /sys/block/vda/mq | wc -l)" = "$(param queues)" ] || fail "/dev/vda has the wrong number of queues"
case $phase in
write)
    step "write ${mib} MiB at ${off} MiB"
    dd if=/dev/urandom of=/tmp/pat bs=1M count="$mib" 2>/dev/null
    dd if=/tmp/pat of=/dev/vda bs=1M seek="$off" count="$mib" oflag=direct conv=fsync 2>/dev/null
    step "read back"
    dd if=/dev/vda of=/tmp/back bs=1M skip="$off" count="$mib" iflag=direct 2>/dev/null
    cmp /tmp/pat /tmp/back || fail "read-back differs in the same boot"
    step "four parallel writers"
    # several writers at once spread I/O over the queues (one per CPU)
    for i in 0 1 2 3; do
        dd if=/tmp/pat of=/dev/vda bs=64K seek=$(((off + mib) * 16 + i * 64)) count=64 oflag=direct 2>/dev/null &
    done
    wait
    step "flush"
    blockdev --flushbufs /dev/vda
    fact sha256 "$(sha256sum < /tmp/pat | cut -d' ' -f1)"
    ;;
verify)
    step "read ${mib} MiB at ${off} MiB after reboot"
    dd if=/dev/vda of=/tmp/back bs=1M skip="$off" count="$mib" iflag=direct 2>/dev/null
    got=$(sha256sum < /tmp/back | cut -d' ' -f1)
    fact sha256 "$got"
    [ "$got" = "$(param sha256)" ] || fail "data after reboot differs (sha256 $got)"
    # the four parallel copies written last boot
    head -c 4194304 /tmp/back > /tmp/first4
    for i in 0 1 2 3; do
        dd if=/dev/vda of=/tmp/c bs=64K skip=$(((off + mib) * 16 + i * 64)) count=64 iflag=direct 2>/dev/null
        cmp /tmp/c /tmp/first4 || fail "parallel copy $i differs after reboot"
    done
    fact verified "${mib}MiB"
    if [ "$(param restart 0)" = 1 ]; then
        # The backend is killed and restarted while this guest runs (QEMU's chardev reconnects):
        # what was there must still be there, and new I/O must work.
        wait_host restarted 120
        step "I/O after the backend restarted"
        dd if=/dev/vda of=/tmp/again bs=1M skip="$off" count="$mib" iflag=direct 2>/dev/null ||
            fail "read after the backend restarted"
        cmp /tmp/again /tmp/back || fail "data differs after the backend restarted"
        dd if=/dev/urandom of=/tmp/new bs=1M count=4 2>/dev/null
        dd if=/tmp/new of=/dev/vda bs=1M seek=$((off + mib + 8)) count=4 oflag=direct conv=fsync 2>/dev/null ||
            fail "write after the backend restarted"
        dd if=/dev/vda of=/tmp/new2 bs=1M skip=$((off + mib + 8)) count=4 iflag=direct 2>/dev/null
        cmp /tmp/new /tmp/new2 || fail "new data differs after the backend restarted"
        fact survived_restart yes
    fi
    ;;
*) fail "phase must be write or verify" ;;
esac
