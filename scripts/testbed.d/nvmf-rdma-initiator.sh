# nacred's NVMe/RDMA initiator against the kernel's nvmet-rdma target, over soft-RoCE, in one guest
# nacred and nacre come in with `scripts/testbed run --pack` (their libraries with them). rxe on a
# dummy netdev (192.0.2.1): rxe loopback. The kernel target (nvmet-rdma) serves two RAM disks
# (brd): namespace 1 plain, namespace 2 for an encrypted volume. nacred attaches them with
# `nacre remote attach --transport rdma`, builds a plain and an encrypted volume on them and serves
# both on its NVMe/TCP target on 127.0.0.1; the kernel's nvme-tcp host is the local client.
# Plain: O_DIRECT write/read/compare through the whole chain, and the RAM disk holds the bytes.
# Encrypted: a known pattern (16-byte lines "%015d\n", reproducible on the host) is written at
# 1 MiB, read back, and the RAM disk's bytes are printed as a sha256 with the exported XTS key, so
# the host-side test can check them against an independent oracle. Then the clear errors: an RDMA
# CM reject (no listener on the port) and an address nothing answers (resolution times out).
# 4 KiB writes go inside the command capsule (counted by the queues' debug lines). Discovery over
# RDMA lists the subsystem; a restarted nacred replays the RDMA remote and the data reads back.
# Zero copy: libblkio (vhost-verify) drives vhost-user-blk devices on the plain and the encrypted
# volume; the queues' bounce-copy count stays where it was while every byte moves directly.
# Params: mib (plain verify size, default 4). Facts: attached, transport, io_queues, namespaces,
# io_icd_max, plain_verified, plain_backing, small_writes, bounce_copy_bytes, stripe_verified, enc_readback, enc_pattern_sha,
# enc_backing_sha, enc_key, zc_bounce_bytes, zc_direct_bytes, zc_registrations, zc_regions, discovered_transport, reject_error, unreachable_error, unreachable_s,
# status_reject, self_namespaces, nacred_alive, in_capsule_writes, replayed. Also nacred's own NVMe/RDMA
# target as the peer: an I/O queue deeper than it takes is rejected with NVME_RDMA_CM_INVALID_HSQSIZE
# (named in the one-line error), a normal one connects.
NQN=nqn.2014-08.io.nacre.testbed:rdma-shelf
EXP=nqn.2014-08.io.nacre.testbed:rdma-export
MIB=$(param mib 4)
for b in nacred nacre vhost-verify; do
    command -v $b >/dev/null || fail "no $b in the guest (run with --pack target/debug/$b)"
done
modprobe rdma_rxe; modprobe rdma_ucm; modprobe nvmet-rdma; modprobe nvme-tcp
modprobe brd rd_nr=2 rd_size=16384
ip link set lo up
rxe_loopback

step "kernel nvmet-rdma target: two RAM disks on 192.0.2.1:4420"
nvmet_subsys $NQN 1 /dev/ram0
nvmet_subsys $NQN 2 /dev/ram1
nvmet_port 1 rdma 192.0.2.1 4420 $NQN

step "start nacred"
# the RDMA queues' debug lines say what each queue negotiated and, when it closes, what it carried
LOG=info,nacre_dpu::fabric::rdma=debug
start_nacred $LOG
dump_nacred() { echo "--- nacred log"; cat /tmp/nacred.log /tmp/nacred2.log 2>/dev/null; echo "---"; }

step "attach the kernel target over NVMe/RDMA"
t=$(up)
run nacre remote attach shelf --transport rdma --address 192.0.2.1 --port 4420 --subnqn $NQN \
    --io-queues 2 --queue-depth 32 --reconnect-delay-sec 1 --ctrl-loss-timeout-sec 10 ||
    fail "nacre remote attach --transport rdma"
echo "attached in $(elapsed "$t")s"
nacre remote list
nacre --json remote list > /tmp/rl
fact attached "$(sed -n 's/.*"state": *"\([a-z]*\)".*/\1/p' /tmp/rl | head -1)"
fact transport "$(sed -n 's/.*"transport": *"\([a-z]*\)".*/\1/p' /tmp/rl | head -1)"
fact io_queues "$(sed -n 's/.*"io_queues": *\([0-9]*\).*/\1/p' /tmp/rl | head -1)"
fact namespaces "$(grep -o '"nsid": *[0-9]*' /tmp/rl | wc -l)"
# in-capsule data the I/O queues may carry: what nvmet-rdma's IOCCSZ allows (its port's
# inline_data_size, a page by default), capped by nacre's 8 KiB
fact io_icd_max "$(grep 'NVMe/RDMA queue established' /tmp/nacred.log | grep 'qid=1 ' | grep -o 'icd_max=[0-9]*' | head -1 | cut -d= -f2)"

step "a plain and an encrypted volume on the remote namespaces, served on nacred's NVMe/TCP target"
head -c 32 /dev/urandom > /tmp/kek
run nacre rpc tenant_create '{"name": "t", "kek": {"key_file": "/tmp/kek"}, "policy": {"data_unit": 512, "tweak": "plain64"}}'
run nacre rpc volume_create '{"name": "plain", "backend": "remote", "size": 0, "block_size": 512, "remote": {"extents": ["shelf:1"]}}'
run nacre rpc volume_create '{"name": "enc", "backend": "remote", "size": 0, "block_size": 512, "remote": {"extents": ["shelf:2"]}, "tenant": "t", "encrypt": true}'
run nacre rpc nvmf_subsystem_create "{\"nqn\": \"$EXP\", \"allow_any_host\": true}"
run nacre rpc nvmf_subsystem_add_ns "{\"nqn\": \"$EXP\", \"volume\": \"plain\", \"nsid\": 1}"
run nacre rpc nvmf_subsystem_add_ns "{\"nqn\": \"$EXP\", \"volume\": \"enc\", \"nsid\": 2}"
# a stripe over both remote namespaces (128 KiB units: even units on namespace 1, odd on 2)
run nacre rpc volume_create '{"name": "stripe", "backend": "remote", "size": 0, "block_size": 512, "remote": {"extents": ["shelf:1", "shelf:2"], "stripe_size": 131072}}'
run nacre rpc nvmf_subsystem_add_ns "{\"nqn\": \"$EXP\", \"volume\": \"stripe\", \"nsid\": 3}"
run nacre rpc nvmf_subsystem_add_listener "{\"nqn\": \"$EXP\", \"address\": \"127.0.0.1\", \"port\": 4421}"
run nvme connect -t tcp -a 127.0.0.1 -s 4421 -n $EXP -i 1 || fail "nvme connect to nacred"
wait_until 30 nvme_ns_dev $EXP 3 || fail "nacred's namespaces did not appear"
P=$(nvme_ns_dev $EXP 1)
E=$(nvme_ns_dev $EXP 2)
S=$(nvme_ns_dev $EXP 3)
nvme list

step "plain: write, read back, compare ($MIB MiB, O_DIRECT) through nacred to the kernel target"
t=$(up)
verify_rw /dev/$P "$MIB" 2
fact plain_verified "${MIB}MiB"
fact plain_verify_s "$(elapsed "$t")"
# what the client wrote is what the target's RAM disk holds (verify_rw prints the pattern's sha)
dd if=/dev/urandom of=/tmp/pp bs=1M count=1 2>/dev/null
dd if=/tmp/pp of=/dev/$P bs=1M seek=1 count=1 oflag=direct conv=fsync 2>/dev/null || fail "write"
[ "$(dd if=/dev/ram0 bs=1M skip=1 count=1 2>/dev/null | sha256sum | cut -d' ' -f1)" = \
  "$(sha256sum < /tmp/pp | cut -d' ' -f1)" ] || fail "the kernel target's RAM disk does not hold the plaintext written"
fact plain_backing match
# 4 KiB writes: small enough to travel inside the RDMA command capsule
dd if=/dev/urandom of=/tmp/small bs=4k count=8 2>/dev/null
i=0
while [ $i -lt 8 ]; do
    dd if=/tmp/small of=/dev/$P bs=4k skip=$i seek=$((2048 + i)) count=1 oflag=direct 2>/dev/null ||
        fail "4 KiB write $i"
    i=$((i + 1))
done
dd if=/dev/$P of=/tmp/small.back bs=4k skip=2048 count=8 iflag=direct 2>/dev/null || fail "read"
cmp /tmp/small /tmp/small.back || fail "4 KiB writes read back differ"
dd if=/dev/ram0 of=/tmp/small.ram bs=4k skip=2048 count=8 2>/dev/null
cmp /tmp/small /tmp/small.ram || fail "4 KiB writes are not on the target's RAM disk"
fact small_writes 8x4KiB
# every byte of that went through the RDMA queues' registered slot buffers (no zero copy yet)
fact bounce_copy_bytes "$(nacre --json remote list shelf | sed -n 's/^ *"bounce_copy_bytes": *\([0-9]*\).*/\1/p' | head -1)"

step "stripe over the two remote namespaces: 1 MiB at 24 MiB lands unit by unit on both RAM disks"
dd if=/dev/urandom of=/tmp/sp bs=128k count=8 2>/dev/null
dd if=/tmp/sp of=/dev/$S bs=1M seek=24 count=1 oflag=direct conv=fsync 2>/dev/null || fail "stripe write"
dd if=/dev/$S of=/tmp/sp.back bs=1M skip=24 count=1 iflag=direct 2>/dev/null || fail "stripe read"
cmp /tmp/sp /tmp/sp.back || fail "stripe read back differs"
# volume unit 192 + k: namespace 1 + (k % 2), at byte (96 + k / 2) * 128 KiB = 12 MiB + k / 2 units
for k in 0 1 2 3 4 5 6 7; do
    dd if=/tmp/sp bs=128k skip=$k count=1 2>/dev/null > /tmp/u.want
    dd if=/dev/ram$((k % 2)) bs=128k skip=$((96 + k / 2)) count=1 2>/dev/null > /tmp/u.got
    cmp /tmp/u.want /tmp/u.got || fail "stripe unit $k is not where the layout puts it"
done
fact stripe_verified 1MiB

step "encrypted: a known pattern at 1 MiB; the RAM disk must hold the XTS ciphertext"
awk 'BEGIN { for (i = 0; i < 65536; i++) printf "%015d\n", i }' > /tmp/encpat
[ "$(wc -c < /tmp/encpat)" = 1048576 ] || fail "pattern is not 1 MiB"
dd if=/tmp/encpat of=/dev/$E bs=1M seek=1 count=1 oflag=direct conv=fsync 2>/dev/null || fail "write enc"
dd if=/dev/$E of=/tmp/encback bs=1M skip=1 count=1 iflag=direct 2>/dev/null || fail "read enc"
cmp /tmp/encpat /tmp/encback || fail "encrypted volume read back differs"
fact enc_readback ok
fact enc_pattern_sha "$(sha256sum < /tmp/encpat | cut -d' ' -f1)"
fact enc_backing_sha "$(dd if=/dev/ram1 bs=1M skip=1 count=1 2>/dev/null | sha256sum | cut -d' ' -f1)"
run nacre rpc volume_export_key '{"name": "enc", "path": "/tmp/xts.key", "confirm": true}' > /dev/null
fact enc_key "$(od -An -tx1 -v /tmp/xts.key | tr -d ' \n')"
run nvme disconnect -n $EXP

step "zero copy: vhost-user-blk requests move between guest memory and the target with no copy"
# libblkio (vhost-verify) is the guest driver; its requests are single contiguous buffers in the
# memory it shares with nacred, which nacred announces, and the RDMA queues register once
counter() { nacre --json remote list shelf | sed -n "s/^ *\"$1\": *\([0-9]*\).*/\1/p" | head -1; }
B0=$(counter bounce_copy_bytes)
D0=$(counter direct_bytes)
run nacre rpc vhost_blk_create '{"name": "vplain", "volume": "plain", "queues": 2}'
run nacre rpc vhost_blk_create '{"name": "venc", "volume": "enc"}'
# 2 MiB in 128 KiB requests (keyed SGLs straight at guest memory) and 1 MiB in 4 KiB requests
# (writes in the capsule, gathered from guest memory), plain; 1 MiB encrypted (the ciphertext
# buffers are announced: the XTS copy is the only one)
# (the plain device's two virtqueues are two worker threads, each kept to its own RDMA I/O queue)
run vhost-verify /run/nacre/vhost-vplain.sock 6 2 128 2 || fail "vhost verify, plain, 128 KiB"
run vhost-verify /run/nacre/vhost-vplain.sock 9 1 4 || fail "vhost verify, plain, 4 KiB"
run vhost-verify /run/nacre/vhost-venc.sock 4 1 128 || fail "vhost verify, encrypted"
fact zc_bounce_bytes "$(($(counter bounce_copy_bytes) - B0))"
fact zc_direct_bytes "$(($(counter direct_bytes) - D0))"
# each announced region (three guest memory tables, the ciphertext buffers) is registered once
# for the device, though the first table is used from both RDMA I/O queues
fact zc_registrations "$(grep -c 'zero copy: announced memory registered' /tmp/nacred.log)"
fact zc_regions "$(grep 'zero copy: announced memory registered' /tmp/nacred.log | grep -o 'region=[0-9]*' | sort -u | wc -l)"
nacre remote list
run nacre rpc vhost_blk_delete '{"name": "vplain"}'
run nacre rpc vhost_blk_delete '{"name": "venc"}'

step "discovery over RDMA"
run nacre remote discover --transport rdma --address 192.0.2.1 --port 4420 > /tmp/disc || fail "discover"
cat /tmp/disc
grep -q "$NQN" /tmp/disc || fail "discovery over RDMA does not list $NQN"
nacre --json remote discover --transport rdma --address 192.0.2.1 --port 4420 > /tmp/disc.json
fact discovered_transport "$(sed -n 's/.*"transport": *"\([a-z]*\)".*/\1/p' /tmp/disc.json | head -1)"

step "clear errors: an RDMA CM reject (no listener on port 4430)"
if nacre remote attach nolistener --transport rdma --address 192.0.2.1 --port 4430 --subnqn $NQN 2>/tmp/err; then
    fail "attach to a port nothing listens on succeeded"
fi
cat /tmp/err
[ "$(wc -l < /tmp/err)" = 1 ] || fail "the error is not one line"
grep -q "rejected the RDMA connection of queue 0" /tmp/err || fail "unclear reject error: $(cat /tmp/err)"
fact reject_error "$(grep -o 'RDMA CM reject reason [0-9]*' /tmp/err | tr ' ' _)"

step "clear errors: an address nothing answers (192.0.2.99)"
t=$(up)
if nacre remote attach nobody --transport rdma --address 192.0.2.99 --port 4420 --subnqn $NQN 2>/tmp/err; then
    fail "attach to 192.0.2.99 succeeded"
fi
fact unreachable_s "$(elapsed "$t")"
cat /tmp/err
[ "$(wc -l < /tmp/err)" = 1 ] || fail "the error is not one line"
grep -qi "RDMA CM" /tmp/err || fail "unclear error: $(cat /tmp/err)"
fact unreachable_error yes
[ "$(nacre --json remote list | grep -o '"name": *"[a-z]*"' | wc -l)" = 1 ] || fail "a failed attach left a remote behind"

step "nacred's own NVMe/RDMA target as the peer: a reject carrying an NVMe RDMA status, then a connection"
run nacre rpc nvmf_subsystem_add_listener "{\"nqn\": \"$EXP\", \"address\": \"192.0.2.1\", \"port\": 4431, \"transport\": \"rdma\"}"
# 512 entries per I/O queue: more than nacred's RDMA target takes (256), though its CAP.MQES allows it
if nacre remote attach self --transport rdma --address 192.0.2.1 --port 4431 --subnqn $EXP \
    --io-queues 1 --queue-depth 512 2>/tmp/err; then
    fail "an I/O queue deeper than the target takes was accepted"
fi
cat /tmp/err
[ "$(wc -l < /tmp/err)" = 1 ] || fail "the error is not one line"
fact status_reject "$(grep -o 'NVME_RDMA_CM_[A-Z_]*' /tmp/err | head -1)"
run nacre remote attach self --transport rdma --address 192.0.2.1 --port 4431 --subnqn $EXP \
    --io-queues 1 --queue-depth 32 || fail "attach nacred's own RDMA target"
fact self_namespaces "$(nacre --json remote list self | grep -o '"nsid": *[0-9]*' | wc -l)"
run nacre remote detach self

kill -0 $NACRED && fact nacred_alive yes
run nacre remote list

step "restart nacred: the RDMA remote is replayed from its state, the data is still there"
kill $NACRED
wait $NACRED || true
grep 'NVMe/RDMA queue closed' /tmp/nacred.log | grep -v 'qid=0 ' || true
fact in_capsule_writes "$(grep 'NVMe/RDMA queue closed' /tmp/nacred.log | grep -o 'in_capsule=[0-9]*' |
    cut -d= -f2 | awk '{ n += $1 } END { print n + 0 }')"
nacred --state-dir /tmp/nacre-state --run-dir /run/nacre --no-default --log $LOG > /tmp/nacred2.log 2>&1 &
NACRED=$!
wait_until 60 test -S /run/nacre/nacred.sock || fail "nacred did not restart"
wait_until 30 sh -c "nacre --json remote list shelf | grep -q '\"state\": \"live\"'" ||
    fail "the RDMA remote is not live after the restart: $(nacre remote list)"
run nvme connect -t tcp -a 127.0.0.1 -s 4421 -n $EXP -i 1 || fail "nvme connect after the restart"
wait_until 30 nvme_ns_dev $EXP 2 || fail "nacred's namespaces did not come back"
E=$(nvme_ns_dev $EXP 2)
dd if=/dev/$E of=/tmp/encback2 bs=1M skip=1 count=1 iflag=direct 2>/dev/null || fail "read after restart"
cmp /tmp/encpat /tmp/encback2 || fail "the encrypted volume reads back different after the restart"
fact replayed yes
run nvme disconnect -n $EXP
kill $NACRED
wait $NACRED || true
