# NVMe in-band authentication (DH-HMAC-CHAP) with the Linux kernel as target and as host (6.12 guest)
# Needs `scripts/testbed run --kernel trixie`: Debian 12's 6.1 kernel has no NVMe authentication.
# One boot, three parts, each started by the host on the control channel (--ctl):
#  shelf   The kernel's nvmet serves a RAM disk (tb.ns_mib MiB) as tb.subnqn to tb.hostnqn only, with
#          that host's dhchap_key / dhchap_ctrl_key / dhchap_hash (tb.hash) / dhchap_dhgroup
#          (tb.dhgroup) in configfs, on NVMe/TCP eth0:4420 (hostfwd: nacred's initiator on the host
#          attaches it). While the host works it answers `sha OFFSET_MIB MIB` (TB-FACT peer_sha=...)
#          until `shelf-done`.
#  host    For each target in tb.host_rounds (comma-separated labels, default spdk): after the host's
#          `target-LABEL`, the kernel's nvme-tcp host (trixie's nvme-cli) connects to tb.host_subnqn at
#          10.0.2.100:4420 (guestfwd to the host's target) as tb.guest_hostnqn: a wrong secret is
#          refused, the right one connects (unidirectional), O_DIRECT verify; with the controller
#          secret (bidirectional), O_DIRECT verify; a wrong controller secret is refused. Facts are
#          prefixed LABEL_. The host target is told which round ended by `TB-FACT round_done=LABEL`.
#          The round labelled tls is another: the host's target is TLS-only, with tb.tls_psk for
#          tb.guest_hostnqn; a plain connect is refused, and with tlshd (ktls-utils) and the PSK
#          in the kernel's .nvme keyring `nvme connect --tls` connects and verifies (facts tls_*).
#  rdma    nacred inside the guest (--pack nacred, nacre) attaches the same nvmet subsystem over
#          NVMe/RDMA on soft-RoCE (rxe on dummy0, 192.0.2.1:4420) as tb.hostnqn with the same keys: a
#          wrong secret and a wrong controller secret are one-line errors after a single connection
#          attempt (nvmet-rdma may drop the queue before its AUTH_Failure1 reaches the host: then the
#          line says the path was lost rather than why), unidirectional and
#          bidirectional attaches go live, and a 4 MiB O_DIRECT pattern written through nacred (its
#          NVMe/TCP target, the kernel's nvme-tcp host as the client) reads back and is what the RAM
#          disk holds. Then nacred's own target serves tb.host_subnqn over NVMe/RDMA
#          (192.0.2.1:4422) with the host target's keys, and the kernel's nvme-rdma host runs the
#          host round against it (facts nacred_rdma_*). Skipped (TB-FACT rdma=skipped) when
#          tb.rdma=0.
# Files (--file): key, ctrl_key, wrong_key (nacred's secrets for the shelf, DHHC-1 strings bound to
# tb.hostnqn), host_key, host_ctrl_key, host_wrong_key (the guest host's secrets for the host target),
# tls_psk (the guest host's TLS PSK, NVMeTLSkey-1:01:...:, for the tls round).
SUBNQN=$(param subnqn nqn.2014-08.io.nacre.testbed:auth-shelf)
HOSTNQN=$(param hostnqn)
HASH=$(param hash "hmac(sha384)")
DHGROUP=$(param dhgroup ffdhe2048)
HOST_SUBNQN=$(param host_subnqn nqn.2016-06.io.spdk:auth)
GUEST_HOSTNQN=$(param guest_hostnqn)
ROUNDS=$(param host_rounds spdk)
RDMA=$(param rdma 1)
fact kernel "$(uname -r)"
fact nvme_cli "$(nvme version | head -1 | tr ' ' '_')"

# the guest's own host NQN: the one the host target allows
echo "$GUEST_HOSTNQN" > /etc/nvme/hostnqn

# secrets from fw_cfg into 0600 files (nacred refuses a key file others can read)
mkdir -p /tmp/keys; chmod 700 /tmp/keys
for k in key ctrl_key wrong_key host_key host_ctrl_key host_wrong_key tls_psk; do
    tr -d '\n' < "$(tb_file $k)" > /tmp/keys/$k
    chmod 600 /tmp/keys/$k
done
cp "$(tb_file tls_keyfile)" /tmp/keys/tls_keyfile; chmod 600 /tmp/keys/tls_keyfile

modprobe virtio_pci; modprobe virtio_net
modprobe nvmet-tcp; modprobe nvme-tcp
modprobe brd rd_nr=1 rd_size=$(($(param ns_mib 64) * 1024))
wait_until 20 test -e /sys/class/net/eth0 || fail "no eth0"
ip link set eth0 up; ip addr add 10.0.2.15/24 dev eth0

step "shelf: nvmet subsystem $SUBNQN for $HOSTNQN only, DH-HMAC-CHAP $HASH $DHGROUP, bidirectional keys"
N=/sys/kernel/config/nvmet
[ -e $N/hosts ] || fail "no nvmet configfs"
mkdir $N/hosts/"$HOSTNQN"
H=$N/hosts/$HOSTNQN
[ -e "$H/dhchap_key" ] || fail "nvmet has no dhchap_key attribute: kernel without CONFIG_NVME_TARGET_AUTH"
cat /tmp/keys/key > "$H/dhchap_key"
cat /tmp/keys/ctrl_key > "$H/dhchap_ctrl_key"
echo "$HASH" > "$H/dhchap_hash"
echo "$DHGROUP" > "$H/dhchap_dhgroup"
fact nvmet_hash "$(cat "$H/dhchap_hash")"
fact nvmet_dhgroup "$(cat "$H/dhchap_dhgroup")"
S=$N/subsystems/$SUBNQN
mkdir "$S"
echo 0 > "$S/attr_allow_any_host"
ln -s "$H" "$S/allowed_hosts/$HOSTNQN"
mkdir "$S/namespaces/1"
echo -n /dev/ram0 > "$S/namespaces/1/device_path"
echo 1 > "$S/namespaces/1/enable"
nvmet_port 1 tcp 0.0.0.0 4420 "$SUBNQN"

exec 3<>/dev/ttyS1 || fail "no /dev/ttyS1: run with --ctl"
stty -F /dev/ttyS1 -echo -icrnl 2>/dev/null || true
TB_CTL_OPEN=1
echo "TB-READY nvmet target $SUBNQN on 4420 (DH-HMAC-CHAP)"
# shellcheck disable=SC3045  # busybox ash has read -t
while :; do
    read -r -t 600 cmd <&3 || fail "no word from the host for 600 s"
    cmd=$(echo "$cmd" | tr -d '\r')
    case $cmd in
    sha\ *)
        set -- $cmd
        fact peer_sha "$(dd if=/dev/ram0 bs=1M skip="$2" count="$3" 2>/dev/null | sha256sum | cut -d' ' -f1)" ;;
    shelf-done) break ;;
    *) echo "shelf: ignoring '$cmd'" ;;
    esac
done
dmesg | grep -i 'nvmet.*auth\|dhchap' | tail -n 20 || true

# host_connect ARGS...: nvme connect to the host's target (or, for the rdma round, nacred's RDMA
# listener in this guest: HOST_T, HOST_A, HOST_S); its output in /tmp/connect.out
HOST_T=tcp HOST_A=10.0.2.100 HOST_S=4420
host_connect() {
    nvme connect -t $HOST_T -a $HOST_A -s $HOST_S -n "$HOST_SUBNQN" -i 1 "$@" > /tmp/connect.out 2>&1
}
no_ctrl_for() { ! nvme_ctrl_for "$1"; }
host_disconnect() {
    nvme disconnect -n "$HOST_SUBNQN" >/dev/null
    wait_until 20 no_ctrl_for "$HOST_SUBNQN" || fail "the controller of $HOST_SUBNQN did not go away"
}
host_round() {
    local r=$1 t c dev
    step "host ($r): a wrong secret is refused"
    t=$(up)
    if host_connect --dhchap-secret="$(cat /tmp/keys/host_wrong_key)"; then
        fail "nvme connect with a wrong DH-HMAC-CHAP secret succeeded"
    fi
    cat /tmp/connect.out
    fact "${r}_wrong_secret" refused
    fact "${r}_wrong_secret_s" "$(elapsed "$t")"
    nvme_ctrl_for "$HOST_SUBNQN" && fail "a controller is left after the refused connect"

    step "host ($r): the right secret connects (unidirectional)"
    t=$(up)
    host_connect --dhchap-secret="$(cat /tmp/keys/host_key)" ||
        { cat /tmp/connect.out; fail "nvme connect --dhchap-secret"; }
    fact "${r}_uni_connect_s" "$(elapsed "$t")"
    c=$(nvme_ctrl_for "$HOST_SUBNQN") || fail "no controller for $HOST_SUBNQN"
    fact "${r}_uni_secret_set" "$([ "$(cat /sys/class/nvme/"$c"/dhchap_secret)" = "$(cat /tmp/keys/host_key)" ] && echo yes || echo no)"
    wait_until 30 nvme_ns_dev "$HOST_SUBNQN" 1 || fail "no namespace"
    dev=/dev/$(nvme_ns_dev "$HOST_SUBNQN" 1)
    verify_rw "$dev" 4
    fact "${r}_uni_verified" yes
    host_disconnect

    step "host ($r): with the controller secret (bidirectional)"
    t=$(up)
    host_connect --dhchap-secret="$(cat /tmp/keys/host_key)" \
        --dhchap-ctrl-secret="$(cat /tmp/keys/host_ctrl_key)" ||
        { cat /tmp/connect.out; fail "nvme connect --dhchap-ctrl-secret"; }
    fact "${r}_bidi_connect_s" "$(elapsed "$t")"
    c=$(nvme_ctrl_for "$HOST_SUBNQN") || fail "no controller for $HOST_SUBNQN"
    fact "${r}_bidi_ctrl_secret_set" "$([ "$(cat /sys/class/nvme/"$c"/dhchap_ctrl_secret)" = "$(cat /tmp/keys/host_ctrl_key)" ] && echo yes || echo no)"
    fact "${r}_io_queues" "$(nvme_io_queues "$c")"
    wait_until 30 nvme_ns_dev "$HOST_SUBNQN" 1 || fail "no namespace"
    dev=/dev/$(nvme_ns_dev "$HOST_SUBNQN" 1)
    verify_rw "$dev" 4 8
    fact "${r}_bidi_verified" yes
    host_disconnect

    step "host ($r): a wrong controller secret is refused (the controller's response does not verify)"
    if host_connect --dhchap-secret="$(cat /tmp/keys/host_key)" \
        --dhchap-ctrl-secret="$(cat /tmp/keys/host_wrong_key)"; then
        fail "nvme connect with a wrong controller secret succeeded"
    fi
    cat /tmp/connect.out
    fact "${r}_wrong_ctrl_secret" refused
    nvme_ctrl_for "$HOST_SUBNQN" && fail "a controller is left after the refused connect"
    fact round_done "$r"
}
# tls_round: the host's target is TLS-only with tb.tls_psk for this host (NVMe/TCP over TLS 1.3):
# a plain connect is refused; with tlshd running and the PSK in the kernel's .nvme keyring,
# `nvme connect --tls` connects and O_DIRECT-verifies.
tls_round() {
    local c dev
    step "tls: a plain connect to the TLS listener is refused"
    if host_connect; then fail "a plain nvme connect to a TLS-only listener succeeded"; fi
    cat /tmp/connect.out
    fact tls_plain refused
    nvme_ctrl_for "$HOST_SUBNQN" && fail "a controller is left after the refused connect"

    step "tls: tlshd, the TLS PSK nacred derives imported as it is (nvme tls-key --import), nvme connect --tls"
    modprobe tls
    modprobe nvme-keyring 2>/dev/null || true
    printf '[debug]\nloglevel=0\ntls=0\nnl=0\n[authenticate]\nkeyrings=.nvme\n' > /etc/tlshd.conf
    # tlshd names its peer (getnameinfo) before any handshake and gives up when it cannot: the
    # guest has no DNS, so the target's address gets a name in /etc/hosts
    echo "hosts: files" > /etc/nsswitch.conf
    echo "10.0.2.100 nacre-target" >> /etc/hosts
    tlshd -s > /tmp/tlshd.log 2>&1 &
    TLSHD=$!
    nvme tls-key --import --keyfile=/tmp/keys/tls_keyfile > /tmp/import.out 2>&1 ||
        { cat /tmp/import.out; fail "nvme tls-key --import"; }
    cat /tmp/import.out
    grep -q "Failed" /tmp/import.out && fail "nvme tls-key --import: $(cat /tmp/import.out)"
    host_connect --tls || { cat /tmp/connect.out /tmp/tlshd.log; fail "nvme connect --tls"; }
    c=$(nvme_ctrl_for "$HOST_SUBNQN") || fail "no controller for $HOST_SUBNQN"
    fact tls_connected yes
    fact tls_key_set "$([ -n "$(cat /sys/class/nvme/"$c"/tls_key 2>/dev/null)" ] && echo yes || echo no)"
    wait_until 30 nvme_ns_dev "$HOST_SUBNQN" 1 || fail "no namespace"
    dev=/dev/$(nvme_ns_dev "$HOST_SUBNQN" 1)
    verify_rw "$dev" 4 12
    fact tls_verified yes
    host_disconnect

    step "tls: the PSK as this nvme-cli derives it (check-tls-key --insert) is refused"
    # nvme-cli 2.13 (libnvme 1.13) encodes HKDF-Expand-Label without its length prefixes: the
    # key it derives is not the one RFC 8446's encoding (nacred's, SPDK's) gives
    nvme check-tls-key --insert --keydata="$(cat /tmp/keys/tls_psk)" --hostnqn="$GUEST_HOSTNQN" \
        --subsysnqn="$HOST_SUBNQN" > /tmp/check.out 2>&1 || { cat /tmp/check.out; fail "nvme check-tls-key --insert"; }
    cat /tmp/check.out
    if host_connect --tls; then
        fact tls_nvme_cli_derived accepted
        host_disconnect
    else
        fact tls_nvme_cli_derived refused
    fi
    kill $TLSHD 2>/dev/null || true
    fact round_done tls
}
for r in $(echo "$ROUNDS" | tr ',' ' '); do
    wait_host "target-$r" 300
    case $r in
        tls) tls_round ;;
        *) host_round "$r" ;;
    esac
done

if [ "$RDMA" != 1 ]; then fact rdma skipped; exit 0; fi
wait_host rdma 300
for b in nacred nacre; do
    command -v $b >/dev/null || fail "no $b in the guest (run with --pack target/debug/$b)"
done
step "rdma: the same subsystem on NVMe/RDMA (soft-RoCE 192.0.2.1:4420)"
modprobe rdma_rxe; modprobe rdma_ucm; modprobe nvmet-rdma
rxe_loopback
nvmet_port 2 rdma 192.0.2.1 4420 "$SUBNQN"
start_nacred info
# rattach NAME ARGS...: nacre remote attach over RDMA as tb.hostnqn; its output in /tmp/attach.out
rattach() {
    local n=$1; shift
    nacre remote attach "$n" --transport rdma --address 192.0.2.1 --port 4420 --subnqn "$SUBNQN" \
        --hostnqn "$HOSTNQN" --io-queues 2 --queue-depth 32 --ctrl-loss-timeout-sec 5 "$@" \
        > /tmp/attach.out 2>&1
}
t=$(up)
if rattach bad --dhchap-secret /tmp/keys/wrong_key; then fail "attach with a wrong secret succeeded"; fi
cat /tmp/attach.out
fact rdma_wrong_secret_s "$(elapsed "$t")"
fact rdma_wrong_secret_lines "$(wc -l < /tmp/attach.out)"
fact rdma_wrong_secret_error "$(head -1 /tmp/attach.out | tr ' ' '_')"
# refused at once: one connection attempt, and no remote left behind
fact rdma_wrong_secret_attempts "$(grep -c 'connection attempt failed controller=bad\|controller failed controller=bad' /tmp/nacred.log)"
fact rdma_refused_left "$(nacre --json remote list | grep -c '"name"' || true)"
if rattach bad --dhchap-secret /tmp/keys/key --dhchap-ctrl-secret /tmp/keys/wrong_key; then
    fail "attach with a wrong controller secret succeeded"
fi
cat /tmp/attach.out
fact rdma_wrong_ctrl_lines "$(wc -l < /tmp/attach.out)"
fact rdma_wrong_ctrl_error "$(head -1 /tmp/attach.out | tr ' ' '_')"

t=$(up)
rattach uni --dhchap-secret /tmp/keys/key || { cat /tmp/attach.out; fail "unidirectional attach over RDMA"; }
fact rdma_uni_attach_s "$(elapsed "$t")"
nacre --json remote list > /tmp/rl
fact rdma_uni_dhchap "$(sed -n 's/.*"dhchap": *"\([a-z]*\)".*/\1/p' /tmp/rl | head -1)"
run nacre remote detach uni

t=$(up)
rattach bidi --dhchap-secret /tmp/keys/key --dhchap-ctrl-secret /tmp/keys/ctrl_key ||
    { cat /tmp/attach.out; fail "bidirectional attach over RDMA"; }
fact rdma_bidi_attach_s "$(elapsed "$t")"
nacre --json remote list > /tmp/rl
fact rdma_bidi_state "$(sed -n 's/.*"state": *"\([a-z]*\)".*/\1/p' /tmp/rl | head -1)"
fact rdma_bidi_dhchap "$(sed -n 's/.*"dhchap": *"\([a-z]*\)".*/\1/p' /tmp/rl | head -1)"
fact rdma_transport "$(sed -n 's/.*"transport": *"\([a-z]*\)".*/\1/p' /tmp/rl | head -1)"

step "rdma: 4 MiB through nacred (its NVMe/TCP target, the kernel's nvme-tcp host) to the RAM disk"
EXP=nqn.2014-08.io.nacre.testbed:auth-export
run nacre rpc volume_create '{"name": "v", "backend": "remote", "size": 0, "block_size": 512, "remote": {"extents": ["bidi:1"]}}'
run nacre rpc nvmf_subsystem_create "{\"nqn\": \"$EXP\", \"allow_any_host\": true}"
run nacre rpc nvmf_subsystem_add_ns "{\"nqn\": \"$EXP\", \"volume\": \"v\", \"nsid\": 1}"
run nacre rpc nvmf_subsystem_add_listener "{\"nqn\": \"$EXP\", \"address\": \"127.0.0.1\", \"port\": 4421}"
run nvme connect -t tcp -a 127.0.0.1 -s 4421 -n $EXP -i 1 || fail "nvme connect to nacred"
wait_until 30 nvme_ns_dev $EXP 1 || fail "nacred's namespace did not appear"
D=/dev/$(nvme_ns_dev $EXP 1)
dd if=/dev/urandom of=/tmp/pat bs=1M count=4 2>/dev/null
dd if=/tmp/pat of="$D" bs=1M seek=32 count=4 oflag=direct conv=fsync 2>/dev/null || fail "O_DIRECT write through nacred"
dd if="$D" of=/tmp/back bs=1M skip=32 count=4 iflag=direct 2>/dev/null || fail "O_DIRECT read through nacred"
cmp /tmp/pat /tmp/back || fail "data read back through nacred differs"
dd if=/dev/ram0 of=/tmp/ram bs=1M skip=32 count=4 2>/dev/null
cmp /tmp/pat /tmp/ram || fail "the RAM disk does not hold what was written through nacred over RDMA"
fact rdma_verified yes
run nvme disconnect -n $EXP
run nacre remote list

step "rdma: nacred's own NVMe/RDMA target for this guest's kernel host, with its DH-HMAC-CHAP keys"
run nacre volume create hostv --size 32M --backend ram
run nacre nvmf create "$HOST_SUBNQN"
run nacre nvmf add-ns "$HOST_SUBNQN" --volume hostv
run nacre nvmf add-host "$HOST_SUBNQN" "$GUEST_HOSTNQN" --dhchap-key /tmp/keys/host_key \
    --dhchap-ctrl-key /tmp/keys/host_ctrl_key
run nacre nvmf add-listener "$HOST_SUBNQN" --transport rdma --address 192.0.2.1 --port 4422
modprobe nvme-rdma
HOST_T=rdma HOST_A=192.0.2.1 HOST_S=4422
fact nacred_rdma_listener "$(nacre nvmf list | grep -o 'rdma:192.0.2.1:4422' | head -1)"
host_round nacred_rdma
