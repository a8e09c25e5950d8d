# nacre-host in the guest (the host): its disks matched to nacred's volumes over the host channel
# Disks: virtio-blk from nacred's vhost-user-blk, an NVMe/TCP namespace of nacred (guestfwd
# 10.0.2.100:4420), a plain QEMU virtio disk. The host channel (mutual TLS) is reached through
# guestfwd 10.0.2.101:4424. The nacre-host binary comes on a read-only virtio disk with serial
# NACREHOSTBIN (fw_cfg reads large files far too slowly under TCG); it shows as a disk that is
# not nacre's too. Files: ca, cert, key (the host's credentials). Params: nqn, binsize (bytes of
# the binary). Facts: dev_<name>=<volume>,<tenant>,<encrypted>,<transport> per disk (volume "-":
# not nacre's); gpus_rc, gpus_msg; agent_rc.
NQN=$(param nqn)
modprobe virtio_pci; modprobe virtio_blk; modprobe virtio_net; modprobe nvme-tcp
wait_until 20 test -e /sys/class/net/eth0 || fail "no eth0"
ip link set eth0 up; ip addr add 10.0.2.15/24 dev eth0   # no default route: slirp's 10.0.2.x only

step "install nacre-host and its credentials"
bindev() { for d in /sys/block/vd*; do [ "$(cat "$d/serial" 2>/dev/null)" = NACREHOSTBIN ] && { echo "${d##*/}"; return 0; }; done; return 1; }
wait_until 20 bindev || fail "no disk with serial NACREHOSTBIN"
head -c "$(param binsize)" "/dev/$(bindev)" > /usr/bin/nacre-host; chmod 0755 /usr/bin/nacre-host
mkdir -p /etc/nacre-host
cp "$(tb_file ca)" /etc/nacre-host/ca.pem
cp "$(tb_file cert)" /etc/nacre-host/host.pem
cp "$(tb_file key)" /etc/nacre-host/host.key; chmod 0600 /etc/nacre-host/host.key
echo 10.0.2.101:4424 > /etc/nacre-host/dpu

step "connect NVMe/TCP"
run nvme connect -t tcp -a 10.0.2.100 -s 4420 -n "$NQN" || fail "nvme connect failed"
wait_until 20 nvme_ns_dev "$NQN" 1 || fail "namespace 1 did not appear"
wait_until 20 test -b /dev/vda || fail "no /dev/vda"
wait_until 20 test -b /dev/vdc || fail "no /dev/vdc"

step "nacre-host devices"
nacre-host devices > /tmp/devices || fail "nacre-host devices failed"
cat /tmp/devices
# DEVICE SIZE TRANSPORT SUBSYSTEM/SERIAL VOLUME TENANT ENCRYPTED PATHS
tail -n +2 /tmp/devices | while read -r dev size transport ident vol tenant enc paths; do
    fact "dev_$dev" "$vol,$tenant,$enc,$transport"
done
nacre-host devices --json || fail "nacre-host devices --json failed"

step "nacre-host gpus (no GPU in this guest)"
set +e
nacre-host gpus 2> /tmp/gpus
rc=$?
set -e
fact gpus_rc "$rc"
fact gpus_msg "$(head -n 1 /tmp/gpus)"

step "nacre-host agent: connects, stops on SIGTERM"
nacre-host agent --keepalive 1 2> /tmp/agent &
pid=$!
wait_until 30 grep -q "connected to nacred" /tmp/agent || { cat /tmp/agent; fail "agent did not connect"; }
sleep 2
kill -TERM "$pid"
set +e
wait "$pid"
rc=$?
set -e
cat /tmp/agent
fact agent_rc "$rc"
run nvme disconnect -n "$NQN"
step "done"
