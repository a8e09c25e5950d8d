# kernel nvmet-tcp target on eth0:4420 for host-side peers (hostfwd): the storage shelf for fabric tests
# Serves tb.nqn (default nqn.2014-08.io.nacre.testbed:peer): namespace 1 is a RAM disk of
# tb.ns_mib MiB (default 64). Prints TB-READY, then obeys lines on the control channel (--ctl):
# ns-add (namespace 2: a second RAM disk of the same size), ns-remove (namespace 2),
# sha OFFSET_MIB MIB (TB-FACT peer_sha=<sha256 of that range of namespace 1's RAM disk>: what the
# shelf really holds), stop.
NQN=$(param nqn nqn.2014-08.io.nacre.testbed:peer)
modprobe virtio_pci; modprobe virtio_net; modprobe nvmet-tcp
modprobe brd rd_nr=2 rd_size=$(($(param ns_mib 64) * 1024))
wait_until 20 test -e /sys/class/net/eth0 || fail "no eth0"
ip link set eth0 up; ip addr add 10.0.2.15/24 dev eth0
nvmet_subsys "$NQN" 1 /dev/ram0
nvmet_port 1 tcp 0.0.0.0 4420 "$NQN"
exec 3<>/dev/ttyS1 || fail "no /dev/ttyS1: run with --ctl"
stty -F /dev/ttyS1 -echo -icrnl 2>/dev/null || true
echo "TB-READY nvmet target $NQN on 4420"
# shellcheck disable=SC3045  # busybox ash has read -t
while read -r -t 600 cmd <&3; do
    cmd=$(echo "$cmd" | tr -d '\r')
    case $cmd in
    ns-add)
        nvmet_subsys "$NQN" 2 /dev/ram1; echo "TB-FACT peer_ns2=added" ;;
    ns-remove) nvmet_ns_remove "$NQN" 2; echo "TB-FACT peer_ns2=removed" ;;
    sha\ *)
        set -- $cmd
        echo "TB-FACT peer_sha=$(dd if=/dev/ram0 bs=1M skip="$2" count="$3" 2>/dev/null | sha256sum | cut -d' ' -f1)" ;;
    stop) break ;;
    *) echo "peer: ignoring '$cmd'" ;;
    esac
done
