# Helpers shared by the vhost-user-blk benchmarks (sourced, not run).
# Every point is one line from tests/src/bin/blkio-bench.rs: "iops=… p50_us=… server_cpu_s=… wall_s=…".

wait_socket() { # path
    for _ in $(seq 200); do [[ -S "$1" ]] && return 0; sleep 0.05; done
    echo "$(basename "$0"): no socket at $1" >&2
    return 1
}

field() { # "k=v k=v" key
    sed -n "s/.*\b$2=\([^ ]*\).*/\1/p" <<<"$1"
}

# Keep the better of two results (by IOPS): on a shared host a point can lose its core to
# someone else's compiler; the best of several alternating runs is the undisturbed figure.
better() {
    if [[ -z "$1" ]]; then echo "$2"; return; fi
    awk -v a="$(field "$1" iops)" -v b="$(field "$2" iops)" 'BEGIN { exit !(b > a) }' && echo "$2" || echo "$1"
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }'; }

# IOPS per server core: IOPS ÷ (server CPU seconds ÷ wall seconds).
percore() { awk -v i="$1" -v c="$2" -v w="$3" 'BEGIN { if (c > 0) printf "%.0f", i / (c / w); else print "-" }'; }

# One blkio-bench point pinned to CLIENT_CPU: sock server-pid rw bs qd poll|irq
point() {
    local extra=()
    [[ $6 == poll ]] && extra+=(--poll)
    nice -n "$NICE" taskset -c "$CLIENT_CPU" "$BIN/blkio-bench" --socket "$1" --server-pid "$2" --rw "$3" \
        --bs "$4" --qd "$5" --secs "$SECS" --warmup "$WARMUP" "${extra[@]}"
}
