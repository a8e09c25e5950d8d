# dm-crypt (cryptsetup plain aes-xts-plain64, 4 KiB sectors, large IVs) opens a nacre-encrypted disk
# The disk is /dev/vda (a virtio-blk drive given by the caller), the 64-byte key comes in with
# --file key=KEYFILE (never on the command line, never printed). Params: mib (how much plaintext
# to check, default 4), sha256 (expected sha256 of those first mib MiB of plaintext), write_mib +
# write_offset_mib (optional: write the first write_mib MiB of that plaintext back through dm-crypt
# at write_offset_mib, for the host to check the kernel's ciphertext against its oracle).
# Facts: cipher, sector_size, plain_bytes, plaintext_sha256, verified, written.
MIB=$(param mib 4)
modprobe virtio_pci; modprobe virtio_blk; modprobe dm-crypt; modprobe xts
modprobe aesni_intel 2>/dev/null || modprobe aes_generic
wait_until 20 test -b /dev/vda || fail "no /dev/vda"
cat "$(tb_file key)" > /tmp/key
[ "$(wc -c < /tmp/key)" = 64 ] || fail "the key must be 64 bytes"
export DM_DISABLE_UDEV=1        # no udev here: libdevmapper makes /dev/mapper nodes itself
step "cryptsetup open"
cryptsetup open --type plain -c aes-xts-plain64 -s 512 --sector-size 4096 --iv-large-sectors \
    --key-file /tmp/key /dev/vda nacre || fail "cryptsetup open failed"
rm -f /tmp/key
cryptsetup status nacre | grep -v -i key || true
fact cipher "$(cryptsetup status nacre | awk '$1=="cipher:"{print $2}')"
fact sector_size "$(cryptsetup status nacre | awk '$1=="sector" && $2=="size:"{print $3}')"
fact plain_bytes "$(blockdev --getsize64 /dev/mapper/nacre)"
step "read ${MIB} MiB of plaintext"
got=$(dd if=/dev/mapper/nacre bs=1M count="$MIB" iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
fact plaintext_sha256 "$got"
[ "$got" = "$(param sha256)" ] || fail "plaintext differs from what was encrypted"
fact verified "${MIB}MiB"
W=$(param write_mib 0)
if [ "$W" != 0 ]; then
    O=$(param write_offset_mib)
    step "write ${W} MiB of that plaintext at ${O} MiB through dm-crypt"
    dd if=/dev/mapper/nacre of=/tmp/p bs=1M count="$W" iflag=direct 2>/dev/null
    dd if=/tmp/p of=/dev/mapper/nacre bs=1M seek="$O" count="$W" oflag=direct conv=fsync 2>/dev/null ||
        fail "write through dm-crypt"
    fact written "${W}MiB@${O}MiB"
fi
cryptsetup close nacre
sync
