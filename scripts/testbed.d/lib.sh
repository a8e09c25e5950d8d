# Guest library, sourced before every scenario (busybox ash: `local`, `read -t` and `echo -n` exist).
# Scenarios run with `set -e`: the first failing command ends the scenario with its status.
# shellcheck shell=sh disable=SC3043,SC3045,SC3037
set -e
ip() { /usr/sbin/ip "$@"; }
modprobe() { /usr/sbin/modprobe "$@"; }
up() { cut -d' ' -f1 /proc/uptime; }
elapsed() { awk -v a="$1" -v b="$(up)" 'BEGIN{printf "%.2f", b-a}'; }
step() { echo "TB-STEP [$(up)] $*"; }
fact() { echo "TB-FACT $1=$2"; }        # fact KEY VALUE: a value the host-side test asserts on
fail() { echo "TB-FAIL $*"; exit 1; }
run() { echo "+ $*"; "$@"; }

# param KEY [DEFAULT]: the value of tb.KEY=VALUE from the kernel command line
param() {
    local a
    for a in $(cat /proc/cmdline); do
        case $a in "tb.$1="*) echo "${a#tb."$1"=}"; return 0 ;; esac
    done
    [ $# -ge 2 ] || fail "missing tb.$1 on the kernel command line"
    echo "$2"
}

# tb_file NAME: path of the host file passed with `scripts/testbed run --file NAME=PATH` (fw_cfg)
tb_file() {
    [ -d /sys/firmware/qemu_fw_cfg ] || modprobe qemu_fw_cfg
    local f=/sys/firmware/qemu_fw_cfg/by_name/opt/tb/$1/raw
    [ -r "$f" ] || fail "no fw_cfg file opt/tb/$1"
    echo "$f"
}

# wait_host WORD [TIMEOUT_S]: print `TB-WAIT WORD`, then wait for a line WORD on /dev/ttyS1 (the
# `--ctl` socket of scripts/testbed). ttyS1 stays open from the first call on: a closed 8250 port
# drops what arrives.
TB_CTL_OPEN=
wait_host() {
    local line n=0
    if [ -z "$TB_CTL_OPEN" ]; then
        exec 3<>/dev/ttyS1 || fail "no /dev/ttyS1: run with --ctl"
        stty -F /dev/ttyS1 -echo -icrnl 2>/dev/null || true
        TB_CTL_OPEN=1
    fi
    echo "TB-WAIT $1"
    while :; do
        if read -r -t "${2:-120}" line <&3; then
            line=$(echo "$line" | tr -d '\r')
            [ "$line" = "$1" ] && return 0
        else
            fail "no '$1' from the host within ${2:-120}s"
        fi
        n=$((n + 1)); [ $n -lt 1000 ] || fail "too many stray lines on ttyS1"
    done
}

# wait_until SECONDS CMD...: poll CMD every 0.2 s until it succeeds
wait_until() {
    local t=$1 i=0; shift
    while ! "$@" >/dev/null 2>&1; do
        i=$((i + 1)); [ $i -lt $((t * 5)) ] || return 1
        sleep 0.2
    done
}

# Kernel nvmet target (configfs)
nvmet_subsys() {  # nvmet_subsys NQN NSID DEVICE
    local s=/sys/kernel/config/nvmet/subsystems/$1
    [ -d "$s" ] || { mkdir "$s"; echo 1 > "$s/attr_allow_any_host"; }
    mkdir "$s/namespaces/$2"
    echo -n "$3" > "$s/namespaces/$2/device_path"
    echo 1 > "$s/namespaces/$2/enable"
}
nvmet_ns_remove() {  # nvmet_ns_remove NQN NSID
    local n=/sys/kernel/config/nvmet/subsystems/$1/namespaces/$2
    echo 0 > "$n/enable"; rmdir "$n"
}
nvmet_port() {    # nvmet_port ID TRTYPE TRADDR TRSVCID NQN
    local p=/sys/kernel/config/nvmet/ports/$1
    mkdir "$p"
    echo "$2" > "$p/addr_trtype"; echo ipv4 > "$p/addr_adrfam"
    echo "$3" > "$p/addr_traddr"; echo "$4" > "$p/addr_trsvcid"
    ln -s "/sys/kernel/config/nvmet/subsystems/$5" "$p/subsystems/$5"
}

# Block helpers
blk_bytes() { echo $(($(cat "/sys/class/block/$(basename "$1")/size") * 512)); }

# verify_rw DEV MIB [OFFSET_MIB]: write MIB MiB of random data with O_DIRECT, read it back with
# O_DIRECT, compare. Prints the pattern's sha256 as fact `pattern_sha256` (for a host-side check).
verify_rw() {
    local dev=$1 mib=$2 off=${3:-0} t
    dd if=/dev/urandom of=/tmp/pat bs=1M count="$mib" 2>/dev/null
    t=$(up)
    dd if=/tmp/pat of="$dev" bs=1M seek="$off" count="$mib" oflag=direct conv=fsync 2>/dev/null ||
        fail "O_DIRECT write of $mib MiB to $dev"
    dd if="$dev" of=/tmp/back bs=1M skip="$off" count="$mib" iflag=direct 2>/dev/null ||
        fail "O_DIRECT read of $mib MiB from $dev"
    cmp /tmp/pat /tmp/back || fail "data read back from $dev differs from what was written"
    fact pattern_sha256 "$(sha256sum < /tmp/pat | cut -d' ' -f1)"
    echo "VERIFY OK $dev ${mib}MiB at ${off}MiB in $(elapsed "$t")s"
    rm -f /tmp/pat /tmp/back
}

# nvme_dev_for NQN: the controller (nvmeN) connected to subsystem NQN
nvme_ctrl_for() {
    local c
    for c in /sys/class/nvme/nvme*; do
        [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$1" ] && { basename "$c"; return 0; }
    done
    return 1
}

# nvme_io_queues nvmeN: I/O queues of a fabrics controller (queue_count counts the admin queue too)
nvme_io_queues() { echo $(($(cat "/sys/class/nvme/$1/queue_count") - 1)); }

# nvme_ns_devs NQN: the namespace block devices (nvmeXnY, multipath heads or plain) of subsystem NQN
nvme_ns_devs() {
    local d
    for d in /sys/block/nvme*n*; do
        case ${d##*/} in nvme*c*) continue ;; esac
        [ "$(cat "$d/device/subsysnqn" 2>/dev/null)" = "$1" ] && echo "${d##*/}"
    done
    return 0
}
# nvme_ns_dev NQN NSID: the block device of namespace NSID of subsystem NQN (fails if absent)
nvme_ns_dev() {
    local d
    for d in $(nvme_ns_devs "$1"); do
        [ "$(cat "/sys/block/$d/nsid")" = "$2" ] && { echo "$d"; return 0; }
    done
    return 1
}

# rxe_loopback: soft-RoCE (rxe0) on a dummy netdev holding 192.0.2.1/24: RDMA between processes
# of one guest (the rdma_rxe module must be loaded)
rxe_loopback() {
    modprobe dummy numdummies=0
    ip link add dummy0 type dummy
    ip addr add 192.0.2.1/24 dev dummy0
    ip link set dummy0 up
    rdma link add rxe0 type rxe netdev dummy0 || fail "rdma link add (crc32 module missing?)"
}

# start_nacred [LOG]: nacred (packed into the guest) in the background as $NACRED, with its state
# in /tmp/nacre-state, its RPC socket up, and its log (/tmp/nacred.log) printed when the script
# exits; NACRE_RPC points the CLI at it
start_nacred() {
    export NACRE_RPC=/run/nacre/nacred.sock
    nacred --state-dir /tmp/nacre-state --run-dir /run/nacre --no-default --log "${1:-info}" \
        > /tmp/nacred.log 2>&1 &
    NACRED=$!
    wait_until 60 test -S /run/nacre/nacred.sock || { cat /tmp/nacred.log; fail "nacred did not start"; }
    dump_nacred() { echo "--- nacred log"; cat /tmp/nacred.log; echo "---"; }
    trap dump_nacred EXIT
}
