#!/usr/bin/env python3
"""An OPI storage API client for nacred's tests: Python grpcio with stubs generated at run
time by grpcio-tools from proto/opi/storage/v1, services listed through server reflection
(grpcio-reflection). Each subcommand runs one part of tests/opi_grpc.rs and prints one JSON
object on its last line; any failed expectation raises (exit status 1).

  opi_client.py services ADDR
  opi_client.py create   ADDR TARGET_ADDR TARGET_NQN FRONT_NQN
  opi_client.py verify   ADDR
  opi_client.py delete   ADDR
  opi_client.py crud     ADDR RPC_SOCKET
  opi_client.py tls      ADDR TLS_DIR       (the CA made by `nacre cert init`)
  opi_client.py encrypt  ADDR FILE KEY_HEX FRONT_NQN   (--opi-tenant set and unlocked)
  opi_client.py unencrypt ADDR
  opi_client.py reset    ADDR              (after create)
  opi_client.py bench    ADDR CYCLES        (scripts/bench-opi)
"""

import importlib
import json
import os
import socket
import sys
import tempfile

try:
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    from grpc_tools import protoc
    from google.protobuf import field_mask_pb2, wrappers_pb2 as wrap
except ImportError as e:  # the test must fail, saying what is missing
    sys.exit(f"opi_client.py: {e}: run scripts/setup --test "
             "(pip install grpcio grpcio-tools grpcio-reflection protobuf)")

PROTO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto",
                         "opi", "storage", "v1")
FILES = ["opicommon", "frontend_nvme", "frontend_virtio_blk", "backend_nvme", "backend_null",
         "backend_malloc", "backend_aio", "middleend_qos_volume", "middleend_encryption"]


def stubs():
    out = tempfile.mkdtemp(prefix="opi-stubs-")
    import grpc_tools
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{well_known}", f"--python_out={out}",
            f"--grpc_python_out={out}"] + [os.path.join(PROTO_DIR, f + ".proto") for f in FILES]
    if protoc.main(args) != 0:
        sys.exit("opi_client.py: grpcio-tools could not compile the protos")
    sys.path.insert(0, out)
    return {f: (importlib.import_module(f + "_pb2"), importlib.import_module(f + "_pb2_grpc"))
            for f in FILES}


M = stubs()
common = M["opicommon"][0]
fe, fe_grpc = M["frontend_nvme"]
vb, vb_grpc = M["frontend_virtio_blk"]
be, be_grpc = M["backend_nvme"]
nul, nul_grpc = M["backend_null"]
mal, mal_grpc = M["backend_malloc"]
aio, aio_grpc = M["backend_aio"]
qos, qos_grpc = M["middleend_qos_volume"]
enc, enc_grpc = M["middleend_encryption"]


class Client:
    def __init__(self, addr):
        self.ch = grpc.insecure_channel(addr)
        grpc.channel_ready_future(self.ch).result(timeout=20)
        self.fe = fe_grpc.FrontendNvmeServiceStub(self.ch)
        self.vb = vb_grpc.FrontendVirtioBlkServiceStub(self.ch)
        self.be = be_grpc.NvmeRemoteControllerServiceStub(self.ch)
        self.null = nul_grpc.NullVolumeServiceStub(self.ch)
        self.malloc = mal_grpc.MallocVolumeServiceStub(self.ch)
        self.aio = aio_grpc.AioVolumeServiceStub(self.ch)
        self.qos = qos_grpc.MiddleendQosVolumeServiceStub(self.ch)
        self.enc = enc_grpc.MiddleendEncryptionServiceStub(self.ch)


def expect(code, fn, *args, **kw):
    """Call and expect a gRPC error with `code`; returns its message (one line)."""
    try:
        r = fn(*args, **kw)
    except grpc.RpcError as e:
        assert e.code() == code, f"{fn._method}: expected {code}, got {e.code()}: {e.details()}"
        assert "\n" not in e.details(), f"message is not one line: {e.details()!r}"
        return e.details()
    raise AssertionError(f"{fn._method}: expected {code}, got success: {r}")


def rpc(sock, method, params=None):
    """One JSON-RPC call on nacred's Unix socket."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.sendall(json.dumps({"jsonrpc": "2.0", "id": 1, "method": method,
                          "params": params or {}}).encode() + b"\n")
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        assert chunk, "nacred closed the RPC socket"
        buf += chunk
    s.close()
    return json.loads(buf)


def rpc_ok(sock, method, params=None):
    r = rpc(sock, method, params)
    assert "error" not in r, f"{method}: {r['error']}"
    return r["result"]


def services(addr):
    ch = grpc.insecure_channel(addr)
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
    reqs = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    names = []
    for r in stub.ServerReflectionInfo(reqs, timeout=20):
        names += [s.name for s in r.list_services_response.service]
    # Reflection also describes each service's file (what grpcurl describe needs).
    reqs = iter([reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="opi_api.storage.v1.FrontendNvmeService")])
    for r in stub.ServerReflectionInfo(reqs, timeout=20):
        assert r.file_descriptor_response.file_descriptor_proto, r
    return {"services": sorted(names)}


FE_CTRL = "nvmeRemoteControllers/nvme-1"


def create(addr, target_addr, target_nqn, front_nqn):
    """godpu storage create's order: backend controller and path, then the frontend."""
    c = Client(addr)
    host, port = target_addr.rsplit(":", 1)
    ctrl = c.be.CreateNvmeRemoteController(be.CreateNvmeRemoteControllerRequest(
        nvme_remote_controller_id="nvme-1",
        nvme_remote_controller=be.NvmeRemoteController(
            multipath=be.NVME_MULTIPATH_FAILOVER, tcp=be.TcpController(hdgst=False))))
    assert ctrl.name == FE_CTRL, ctrl
    path = c.be.CreateNvmePath(be.CreateNvmePathRequest(
        parent=FE_CTRL, nvme_path_id="path-1",
        nvme_path=be.NvmePath(trtype=common.NVME_TRANSPORT_TYPE_TCP, traddr=host,
                              fabrics=be.FabricsPath(trsvcid=int(port), subnqn=target_nqn,
                                                     adrfam=common.NVME_ADDRESS_FAMILY_IPV4))))
    assert path.name == FE_CTRL + "/nvmePaths/path-1", path
    nss = c.be.ListNvmeRemoteNamespaces(be.ListNvmeRemoteNamespacesRequest(parent=FE_CTRL))
    assert [n.nsid for n in nss.nvme_remote_namespaces] == [1], nss
    rns = nss.nvme_remote_namespaces[0].name

    sub = c.fe.CreateNvmeSubsystem(fe.CreateNvmeSubsystemRequest(
        nvme_subsystem_id="subsys-1",
        nvme_subsystem=fe.NvmeSubsystem(spec=fe.NvmeSubsystemSpec(
            nqn=front_nqn, serial_number="OPI0001", model_number="nacre-opi"))))
    assert sub.name == "nvmeSubsystems/subsys-1", sub
    ns = c.fe.CreateNvmeNamespace(fe.CreateNvmeNamespaceRequest(
        parent=sub.name, nvme_namespace_id="ns-1",
        nvme_namespace=fe.NvmeNamespace(spec=fe.NvmeNamespaceSpec(volume_name_ref=rns))))
    assert ns.spec.host_nsid == 1, ns
    ctl = c.fe.CreateNvmeController(fe.CreateNvmeControllerRequest(
        parent=sub.name, nvme_controller_id="ctrl-1",
        nvme_controller=fe.NvmeController(spec=fe.NvmeControllerSpec(
            trtype=common.NVME_TRANSPORT_TYPE_TCP,
            fabrics_id=common.FabricsEndpoint(traddr="127.0.0.1", trsvcid="0",
                                              adrfam=common.NVME_ADDRESS_FAMILY_IPV4)))))
    tcp_port = int(ctl.spec.fabrics_id.trsvcid)
    assert tcp_port != 0, ctl

    m = c.malloc.CreateMallocVolume(mal.CreateMallocVolumeRequest(
        malloc_volume_id="malloc-1",
        malloc_volume=mal.MallocVolume(block_size=512, blocks_count=8192)))
    blk = c.vb.CreateVirtioBlk(vb.CreateVirtioBlkRequest(
        virtio_blk_id="vblk-1",
        virtio_blk=vb.VirtioBlk(volume_name_ref=m.name, max_io_qps=1,
                                pcie_id=common.PciEndpoint())))
    assert blk.volume_name_ref == "malloc-1", blk
    return {"tcp_port": tcp_port, "nsid": ns.spec.host_nsid}


def verify(addr):
    """What create made is there (after a restart: replayed)."""
    c = Client(addr)
    c.be.GetNvmeRemoteController(be.GetNvmeRemoteControllerRequest(name=FE_CTRL))
    c.be.GetNvmePath(be.GetNvmePathRequest(name=FE_CTRL + "/nvmePaths/path-1"))
    c.fe.GetNvmeSubsystem(fe.GetNvmeSubsystemRequest(name="nvmeSubsystems/subsys-1"))
    ns = c.fe.GetNvmeNamespace(fe.GetNvmeNamespaceRequest(
        name="nvmeSubsystems/subsys-1/nvmeNamespaces/ns-1"))
    ctl = c.fe.GetNvmeController(fe.GetNvmeControllerRequest(
        name="nvmeSubsystems/subsys-1/nvmeControllers/ctrl-1"))
    c.vb.GetVirtioBlk(vb.GetVirtioBlkRequest(name="virtioBlks/vblk-1"))
    st = c.fe.StatsNvmeNamespace(fe.StatsNvmeNamespaceRequest(name=ns.name)).stats
    # Stats of every resource create made.
    c.fe.StatsNvmeSubsystem(fe.StatsNvmeSubsystemRequest(name="nvmeSubsystems/subsys-1"))
    c.fe.StatsNvmeController(fe.StatsNvmeControllerRequest(name=ctl.name))
    c.vb.StatsVirtioBlk(vb.StatsVirtioBlkRequest(name="virtioBlks/vblk-1"))
    c.malloc.StatsMallocVolume(mal.StatsMallocVolumeRequest(name="mallocVolumes/malloc-1"))
    c.be.StatsNvmeRemoteController(be.StatsNvmeRemoteControllerRequest(name=FE_CTRL))
    c.be.StatsNvmePath(be.StatsNvmePathRequest(name=FE_CTRL + "/nvmePaths/path-1"))
    rns = c.be.GetNvmeRemoteNamespace(be.GetNvmeRemoteNamespaceRequest(
        name=FE_CTRL + "/nvmeRemoteNamespaces/1"))
    assert rns.nsid == 1, rns
    # Updates: what can change in place does, what cannot is INVALID_ARGUMENT naming it.
    G = grpc.StatusCode
    mask = field_mask_pb2.FieldMask
    blk = c.vb.GetVirtioBlk(vb.GetVirtioBlkRequest(name="virtioBlks/vblk-1"))
    assert c.vb.UpdateVirtioBlk(vb.UpdateVirtioBlkRequest(
        virtio_blk=blk, update_mask=mask(paths=["max_io_qps"]))) == blk
    bad = vb.VirtioBlk(name=blk.name, volume_name_ref="no-such-volume")
    assert "volume_name_ref" in expect(G.INVALID_ARGUMENT, c.vb.UpdateVirtioBlk,
                                       vb.UpdateVirtioBlkRequest(virtio_blk=bad, update_mask=mask(paths=["volume_name_ref"])))
    moved = fe.NvmeNamespace(name=ns.name, spec=fe.NvmeNamespaceSpec(host_nsid=9))
    expect(G.INVALID_ARGUMENT, c.fe.UpdateNvmeNamespace, fe.UpdateNvmeNamespaceRequest(
        nvme_namespace=moved, update_mask=mask(paths=["spec.host_nsid"])))
    assert c.fe.UpdateNvmeController(fe.UpdateNvmeControllerRequest(
        nvme_controller=ctl, update_mask=mask(paths=["spec"]))).name == ctl.name
    rc = c.be.GetNvmeRemoteController(be.GetNvmeRemoteControllerRequest(name=FE_CTRL))
    assert c.be.UpdateNvmeRemoteController(be.UpdateNvmeRemoteControllerRequest(
        nvme_remote_controller=rc, update_mask=mask(paths=["multipath"]))) == rc
    path = c.be.GetNvmePath(be.GetNvmePathRequest(name=FE_CTRL + "/nvmePaths/path-1"))
    assert c.be.UpdateNvmePath(be.UpdateNvmePathRequest(nvme_path=path)) == path
    return {"tcp_port": int(ctl.spec.fabrics_id.trsvcid), "ns_write_ops": st.write_ops_count,
            "ns_read_ops": st.read_ops_count}


def delete(addr):
    """godpu storage delete's order: frontend first, then the backend."""
    c = Client(addr)
    sub = "nvmeSubsystems/subsys-1"
    # A subsystem with children is refused, and stays.
    expect(grpc.StatusCode.FAILED_PRECONDITION, c.fe.DeleteNvmeSubsystem,
           fe.DeleteNvmeSubsystemRequest(name=sub))
    c.vb.DeleteVirtioBlk(vb.DeleteVirtioBlkRequest(name="virtioBlks/vblk-1"))
    c.malloc.DeleteMallocVolume(mal.DeleteMallocVolumeRequest(name="mallocVolumes/malloc-1"))
    c.fe.DeleteNvmeController(fe.DeleteNvmeControllerRequest(name=sub + "/nvmeControllers/ctrl-1"))
    c.fe.DeleteNvmeNamespace(fe.DeleteNvmeNamespaceRequest(name=sub + "/nvmeNamespaces/ns-1"))
    c.fe.DeleteNvmeSubsystem(fe.DeleteNvmeSubsystemRequest(name=sub))
    expect(grpc.StatusCode.FAILED_PRECONDITION, c.be.DeleteNvmeRemoteController,
           be.DeleteNvmeRemoteControllerRequest(name=FE_CTRL))
    c.be.DeleteNvmePath(be.DeleteNvmePathRequest(name=FE_CTRL + "/nvmePaths/path-1"))
    c.be.DeleteNvmeRemoteController(be.DeleteNvmeRemoteControllerRequest(name=FE_CTRL))
    # Everything is gone; deleting again is NOT_FOUND, or nothing with allow_missing.
    assert not c.fe.ListNvmeSubsystems(fe.ListNvmeSubsystemsRequest()).nvme_subsystems
    assert not c.vb.ListVirtioBlks(vb.ListVirtioBlksRequest()).virtio_blks
    assert not c.be.ListNvmeRemoteControllers(
        be.ListNvmeRemoteControllersRequest()).nvme_remote_controllers
    expect(grpc.StatusCode.NOT_FOUND, c.fe.DeleteNvmeSubsystem,
           fe.DeleteNvmeSubsystemRequest(name=sub))
    c.fe.DeleteNvmeSubsystem(fe.DeleteNvmeSubsystemRequest(name=sub, allow_missing=True))
    return {"deleted": True}


def crud(addr, sock):
    c = Client(addr)
    G = grpc.StatusCode
    state = lambda: [rpc_ok(sock, m) for m in  # noqa: E731
                     ("volume_list", "nvmf_get_subsystems", "remote_list", "vhost_blk_list")]
    checks = 0

    # Null volumes: Create (client id, then server UUID), idempotent Create, Get, List with
    # pages, Update (a resize), Stats, Delete with allow_missing.
    v = c.null.CreateNullVolume(nul.CreateNullVolumeRequest(
        null_volume_id="null-a", null_volume=nul.NullVolume(block_size=512, blocks_count=2048)))
    assert v.name == "nullVolumes/null-a" and v.blocks_count == 2048, v
    again = c.null.CreateNullVolume(nul.CreateNullVolumeRequest(
        null_volume_id="null-a", null_volume=nul.NullVolume(block_size=512, blocks_count=2048)))
    assert again == v, (again, v)
    expect(G.ALREADY_EXISTS, c.null.CreateNullVolume, nul.CreateNullVolumeRequest(
        null_volume_id="null-a", null_volume=nul.NullVolume(block_size=512, blocks_count=4096)))
    u = c.null.CreateNullVolume(nul.CreateNullVolumeRequest(
        null_volume=nul.NullVolume(block_size=4096, blocks_count=16)))
    uid = u.name.split("/", 1)[1]
    assert len(uid) == 36 and uid.count("-") == 4, u  # a UUID
    for i in range(3):
        c.null.CreateNullVolume(nul.CreateNullVolumeRequest(
            null_volume_id=f"null-p{i}", null_volume=nul.NullVolume(block_size=512, blocks_count=8)))
    seen, token, pages = [], "", 0
    while True:
        r = c.null.ListNullVolumes(nul.ListNullVolumesRequest(page_size=2, page_token=token))
        assert len(r.null_volumes) <= 2
        seen += [x.name for x in r.null_volumes]
        pages += 1
        token = r.next_page_token
        if not token:
            break
    assert len(seen) == 5 and len(set(seen)) == 5 and pages == 3, (seen, pages)
    huge = c.null.ListNullVolumes(nul.ListNullVolumesRequest(page_size=2**31 - 1))
    assert len(huge.null_volumes) == 5 and not huge.next_page_token
    expect(G.INVALID_ARGUMENT, c.null.ListNullVolumes, nul.ListNullVolumesRequest(page_size=-1))
    expect(G.INVALID_ARGUMENT, c.null.ListNullVolumes,
           nul.ListNullVolumesRequest(page_token="not-a-token"))
    got = c.null.GetNullVolume(nul.GetNullVolumeRequest(name="nullVolumes/null-a"))
    assert got == v, got
    up = c.null.UpdateNullVolume(nul.UpdateNullVolumeRequest(
        null_volume=nul.NullVolume(name="nullVolumes/null-a", block_size=512, blocks_count=4096),
        update_mask=field_mask_pb2.FieldMask(paths=["blocks_count"])))
    assert up.blocks_count == 4096, up
    expect(G.INVALID_ARGUMENT, c.null.UpdateNullVolume, nul.UpdateNullVolumeRequest(
        null_volume=nul.NullVolume(name="nullVolumes/null-a", block_size=512, blocks_count=1),
        update_mask=field_mask_pb2.FieldMask(paths=["no_such_field"])))
    expect(G.NOT_FOUND, c.null.UpdateNullVolume, nul.UpdateNullVolumeRequest(
        null_volume=nul.NullVolume(name="nullVolumes/null-new", block_size=512, blocks_count=8)))
    made = c.null.UpdateNullVolume(nul.UpdateNullVolumeRequest(
        null_volume=nul.NullVolume(name="nullVolumes/null-new", block_size=512, blocks_count=8),
        allow_missing=True))
    assert made.name == "nullVolumes/null-new", made
    st = c.null.StatsNullVolume(nul.StatsNullVolumeRequest(name="nullVolumes/null-a")).stats
    assert st.read_ops_count == 0, st
    checks += 1

    # Bad input: each refused with its status, the state unchanged.
    before = state()
    expect(G.INVALID_ARGUMENT, c.null.CreateNullVolume, nul.CreateNullVolumeRequest(
        null_volume_id="bad/id", null_volume=nul.NullVolume(block_size=512, blocks_count=8)))
    expect(G.INVALID_ARGUMENT, c.null.CreateNullVolume, nul.CreateNullVolumeRequest(
        null_volume_id="bad-bs", null_volume=nul.NullVolume(block_size=1000, blocks_count=8)))
    expect(G.INVALID_ARGUMENT, c.null.GetNullVolume, nul.GetNullVolumeRequest(name="nope/x"))
    expect(G.NOT_FOUND, c.null.GetNullVolume, nul.GetNullVolumeRequest(name="nullVolumes/nope"))
    expect(G.NOT_FOUND, c.fe.CreateNvmeNamespace, fe.CreateNvmeNamespaceRequest(
        parent="nvmeSubsystems/no-such", nvme_namespace_id="x",
        nvme_namespace=fe.NvmeNamespace(spec=fe.NvmeNamespaceSpec(volume_name_ref="null-a"))))
    expect(G.NOT_FOUND, c.be.CreateNvmePath, be.CreateNvmePathRequest(
        parent="nvmeRemoteControllers/no-such", nvme_path_id="p",
        nvme_path=be.NvmePath(trtype=common.NVME_TRANSPORT_TYPE_TCP, traddr="127.0.0.1")))
    # A malloc volume is not a null volume.
    expect(G.NOT_FOUND, c.malloc.GetMallocVolume,
           mal.GetMallocVolumeRequest(name="mallocVolumes/null-a"))
    assert state() == before, "bad input changed the state"
    checks += 1

    # Malloc and AIO volumes.
    m = c.malloc.CreateMallocVolume(mal.CreateMallocVolumeRequest(
        malloc_volume_id="mal-a", malloc_volume=mal.MallocVolume(block_size=4096, blocks_count=64)))
    assert c.malloc.GetMallocVolume(mal.GetMallocVolumeRequest(name=m.name)).blocks_count == 64
    assert [x.name for x in c.malloc.ListMallocVolumes(
        mal.ListMallocVolumesRequest()).malloc_volumes] == [m.name]
    img = os.path.join(os.path.dirname(sock), "aio-a.img")
    with open(img, "wb") as f:
        f.truncate(1 << 20)
    a = c.aio.CreateAioVolume(aio.CreateAioVolumeRequest(
        aio_volume_id="aio-a", aio_volume=aio.AioVolume(filename=img, block_size=512)))
    assert a.blocks_count == 2048 and a.filename == img, a
    c.aio.StatsAioVolume(aio.StatsAioVolumeRequest(name=a.name))
    c.aio.DeleteAioVolume(aio.DeleteAioVolumeRequest(name=a.name))
    assert os.path.exists(img), "deleting an AIO volume removed the client's file"
    checks += 1

    # QoS volumes: limits on a volume, seen by JSON-RPC's qos_get.
    q = c.qos.CreateQosVolume(qos.CreateQosVolumeRequest(
        qos_volume_id="qos-a", qos_volume=qos.QosVolume(
            volume_name_ref="mallocVolumes/mal-a",
            limits=qos.Limits(max=common.QosLimit(rd_iops_kiops=2, wr_bandwidth_mbs=5)))))
    limits = rpc_ok(sock, "qos_show", {"volume": "mal-a"})
    assert limits[0]["limits"]["read_iops"] == 2000, limits
    assert limits[0]["limits"]["write_bps"] == 5_000_000, limits
    q2 = c.qos.UpdateQosVolume(qos.UpdateQosVolumeRequest(
        qos_volume=qos.QosVolume(name=q.name, volume_name_ref="mal-a",
                                 limits=qos.Limits(max=common.QosLimit(rd_iops_kiops=3))),
        update_mask=field_mask_pb2.FieldMask(paths=["limits"])))
    assert q2.limits.max.rd_iops_kiops == 3, q2
    assert rpc_ok(sock, "qos_show", {"volume": "mal-a"})[0]["limits"]["read_iops"] == 3000
    expect(G.INVALID_ARGUMENT, c.qos.CreateQosVolume, qos.CreateQosVolumeRequest(
        qos_volume_id="qos-min", qos_volume=qos.QosVolume(
            volume_name_ref="null-a", limits=qos.Limits(min=common.QosLimit(rd_iops_kiops=1)))))
    assert len(c.qos.ListQosVolumes(qos.ListQosVolumesRequest()).qos_volumes) == 1
    c.qos.StatsQosVolume(qos.StatsQosVolumeRequest(name=q.name))
    c.qos.DeleteQosVolume(qos.DeleteQosVolumeRequest(name=q.name))
    left = rpc_ok(sock, "qos_show", {"volume": "mal-a"})
    assert all(not x["limits"].get("read_iops") for x in left), left
    checks += 1

    # Encryption: keys checked, request refused without an unlocked tenant.
    key = bytes(range(32))
    expect(G.INVALID_ARGUMENT, c.enc.CreateEncryptedVolume, enc.CreateEncryptedVolumeRequest(
        encrypted_volume_id="enc-a", encrypted_volume=enc.EncryptedVolume(
            volume_name_ref="mal-a", key=key[:31], cipher=common.ENCRYPTION_TYPE_AES_XTS_128)))
    expect(G.INVALID_ARGUMENT, c.enc.CreateEncryptedVolume, enc.CreateEncryptedVolumeRequest(
        encrypted_volume_id="enc-a", encrypted_volume=enc.EncryptedVolume(
            volume_name_ref="mal-a", key=bytes(16) * 2, cipher=common.ENCRYPTION_TYPE_AES_XTS_128)))
    expect(G.INVALID_ARGUMENT, c.enc.CreateEncryptedVolume, enc.CreateEncryptedVolumeRequest(
        encrypted_volume_id="enc-a", encrypted_volume=enc.EncryptedVolume(
            volume_name_ref="mal-a", key=key, cipher=common.ENCRYPTION_TYPE_AES_CBC_256)))
    expect(G.FAILED_PRECONDITION, c.enc.CreateEncryptedVolume, enc.CreateEncryptedVolumeRequest(
        encrypted_volume_id="enc-a", encrypted_volume=enc.EncryptedVolume(
            volume_name_ref="mal-a", key=key, cipher=common.ENCRYPTION_TYPE_AES_XTS_128)))
    checks += 1

    # Frontend: subsystem/namespace/controller CRUD, PCIe refused, and the two APIs agree.
    sub = c.fe.CreateNvmeSubsystem(fe.CreateNvmeSubsystemRequest(
        nvme_subsystem_id="sub-x", nvme_subsystem=fe.NvmeSubsystem(
            spec=fe.NvmeSubsystemSpec(nqn="nqn.2024-01.io.nacre:opi-x"))))
    rpc_subs = {s["nqn"]: s for s in rpc_ok(sock, "nvmf_get_subsystems")}
    assert "nqn.2024-01.io.nacre:opi-x" in rpc_subs, rpc_subs
    expect(G.ALREADY_EXISTS, c.fe.CreateNvmeSubsystem, fe.CreateNvmeSubsystemRequest(
        nvme_subsystem_id="sub-y", nvme_subsystem=fe.NvmeSubsystem(
            spec=fe.NvmeSubsystemSpec(nqn="nqn.2024-01.io.nacre:opi-x"))))
    expect(G.INVALID_ARGUMENT, c.fe.CreateNvmeController, fe.CreateNvmeControllerRequest(
        parent=sub.name, nvme_controller_id="pcie-0", nvme_controller=fe.NvmeController(
            spec=fe.NvmeControllerSpec(trtype=common.NVME_TRANSPORT_TYPE_PCIE))))
    ns = c.fe.CreateNvmeNamespace(fe.CreateNvmeNamespaceRequest(
        parent=sub.name, nvme_namespace_id="ns-x",
        nvme_namespace=fe.NvmeNamespace(spec=fe.NvmeNamespaceSpec(volume_name_ref="null-a", host_nsid=7))))
    assert ns.spec.host_nsid == 7, ns
    rpc_sub = [s for s in rpc_ok(sock, "nvmf_get_subsystems") if s["nqn"] == "nqn.2024-01.io.nacre:opi-x"][0]
    assert [n["nsid"] for n in rpc_sub["namespaces"]] == [7], rpc_sub
    sub2 = c.fe.UpdateNvmeSubsystem(fe.UpdateNvmeSubsystemRequest(
        nvme_subsystem=fe.NvmeSubsystem(name=sub.name, spec=fe.NvmeSubsystemSpec(
            nqn="nqn.2024-01.io.nacre:opi-x", hostnqn="nqn.2024-01.io.nacre:host-1")),
        update_mask=field_mask_pb2.FieldMask(paths=["spec.hostnqn"])))
    assert sub2.spec.hostnqn == "nqn.2024-01.io.nacre:host-1", sub2
    rpc_sub = [s for s in rpc_ok(sock, "nvmf_get_subsystems") if s["nqn"] == "nqn.2024-01.io.nacre:opi-x"][0]
    assert rpc_sub["hosts"] == ["nqn.2024-01.io.nacre:host-1"] and not rpc_sub["allow_any_host"], rpc_sub
    c.fe.StatsNvmeSubsystem(fe.StatsNvmeSubsystemRequest(name=sub.name))
    # Removed through JSON-RPC: gone for OPI too.
    rpc_ok(sock, "nvmf_subsystem_remove_ns", {"nqn": "nqn.2024-01.io.nacre:opi-x", "nsid": 7})
    expect(G.NOT_FOUND, c.fe.GetNvmeNamespace, fe.GetNvmeNamespaceRequest(name=ns.name))
    # Made through JSON-RPC: listed by OPI, deleted through OPI.
    rpc_ok(sock, "nvmf_subsystem_create", {"nqn": "nqn.2024-01.io.nacre:from-rpc"})
    names = [s.name for s in c.fe.ListNvmeSubsystems(fe.ListNvmeSubsystemsRequest()).nvme_subsystems]
    assert "nvmeSubsystems/nqn.2024-01.io.nacre:from-rpc" in names, names
    c.fe.DeleteNvmeSubsystem(fe.DeleteNvmeSubsystemRequest(
        name="nvmeSubsystems/nqn.2024-01.io.nacre:from-rpc"))
    assert "nqn.2024-01.io.nacre:from-rpc" not in {s["nqn"] for s in rpc_ok(sock, "nvmf_get_subsystems")}
    c.fe.DeleteNvmeSubsystem(fe.DeleteNvmeSubsystemRequest(name=sub.name))
    # A volume made through JSON-RPC is an OPI null volume; one made by OPI deletes via RPC.
    rpc_ok(sock, "volume_create", {"name": "rpc-null", "size": 1 << 20, "backend": "null"})
    assert c.null.GetNullVolume(nul.GetNullVolumeRequest(name="nullVolumes/rpc-null")).blocks_count == 256
    rpc_ok(sock, "volume_delete", {"name": "null-new"})
    expect(G.NOT_FOUND, c.null.GetNullVolume, nul.GetNullVolumeRequest(name="nullVolumes/null-new"))
    c.null.DeleteNullVolume(nul.DeleteNullVolumeRequest(name="nullVolumes/rpc-null"))
    c.null.DeleteNullVolume(nul.DeleteNullVolumeRequest(name="nullVolumes/null-new", allow_missing=True))
    expect(G.NOT_FOUND, c.null.DeleteNullVolume, nul.DeleteNullVolumeRequest(name="nullVolumes/null-new"))
    checks += 1
    return {"checks": checks}


PCIE_SUB = "nvmeSubsystems/pcie-sub"
PCIE_CTRL = PCIE_SUB + "/nvmeControllers/pcie-1"


def pcie(addr, nqn):
    """A PCIe controller: a subsystem, a namespace, and a controller on pcie_id 0/0/1."""
    c = Client(addr)
    G = grpc.StatusCode
    c.null.CreateNullVolume(nul.CreateNullVolumeRequest(
        null_volume_id="pcie-v", null_volume=nul.NullVolume(block_size=512, blocks_count=2048)))
    sub = c.fe.CreateNvmeSubsystem(fe.CreateNvmeSubsystemRequest(
        nvme_subsystem_id="pcie-sub", nvme_subsystem=fe.NvmeSubsystem(
            spec=fe.NvmeSubsystemSpec(nqn=nqn, serial_number="OPIPCIE1"))))
    ns = c.fe.CreateNvmeNamespace(fe.CreateNvmeNamespaceRequest(
        parent=sub.name, nvme_namespace_id="ns-1",
        nvme_namespace=fe.NvmeNamespace(spec=fe.NvmeNamespaceSpec(volume_name_ref="pcie-v"))))
    ep = lambda vf: common.PciEndpoint(port_id=wrap.Int32Value(value=0),  # noqa: E731
                                       physical_function=wrap.Int32Value(value=0),
                                       virtual_function=wrap.Int32Value(value=vf))
    req = lambda cid, vf, parent=sub.name: fe.CreateNvmeControllerRequest(  # noqa: E731
        parent=parent, nvme_controller_id=cid, nvme_controller=fe.NvmeController(
            spec=fe.NvmeControllerSpec(trtype=common.NVME_TRANSPORT_TYPE_PCIE,
                                       pcie_id=ep(vf))))
    ctl = c.fe.CreateNvmeController(req("pcie-1", 1))
    assert ctl.name == PCIE_CTRL and ctl.spec.pcie_id.virtual_function.value == 1, ctl
    # Idempotent; another endpoint under the same id, or the same endpoint twice, is not.
    assert c.fe.CreateNvmeController(req("pcie-1", 1)).name == ctl.name
    expect(G.ALREADY_EXISTS, c.fe.CreateNvmeController, req("pcie-1", 2))
    expect(G.ALREADY_EXISTS, c.fe.CreateNvmeController, req("pcie-2", 1))
    other = c.fe.CreateNvmeSubsystem(fe.CreateNvmeSubsystemRequest(
        nvme_subsystem_id="pcie-other", nvme_subsystem=fe.NvmeSubsystem(
            spec=fe.NvmeSubsystemSpec(nqn=nqn + "-other"))))
    expect(G.ALREADY_EXISTS, c.fe.CreateNvmeController, req("pcie-3", 1, other.name))
    c.fe.DeleteNvmeSubsystem(fe.DeleteNvmeSubsystemRequest(name=other.name))
    expect(G.INVALID_ARGUMENT, c.fe.CreateNvmeController, fe.CreateNvmeControllerRequest(
        parent=sub.name, nvme_controller_id="pcie-4", nvme_controller=fe.NvmeController(
            spec=fe.NvmeControllerSpec(trtype=common.NVME_TRANSPORT_TYPE_PCIE))))
    got = c.fe.GetNvmeController(fe.GetNvmeControllerRequest(name=PCIE_CTRL))
    assert got.spec.trtype == common.NVME_TRANSPORT_TYPE_PCIE, got
    listed = c.fe.ListNvmeControllers(fe.ListNvmeControllersRequest(parent=sub.name))
    assert [x.name for x in listed.nvme_controllers] == [PCIE_CTRL], listed
    c.fe.StatsNvmeController(fe.StatsNvmeControllerRequest(name=PCIE_CTRL))
    return {"nsid": ns.spec.host_nsid}


def pcie_delete(addr):
    c = Client(addr)
    assert c.fe.GetNvmeController(fe.GetNvmeControllerRequest(name=PCIE_CTRL)).name == PCIE_CTRL
    c.fe.DeleteNvmeController(fe.DeleteNvmeControllerRequest(name=PCIE_CTRL))
    expect(grpc.StatusCode.NOT_FOUND, c.fe.GetNvmeController,
           fe.GetNvmeControllerRequest(name=PCIE_CTRL))
    return {"deleted": True}


def bench(addr, cycles):
    """Namespace create/delete cycles on one subsystem over a null volume; seconds per op."""
    import time
    c = Client(addr)
    c.null.CreateNullVolume(nul.CreateNullVolumeRequest(
        null_volume_id="bench-vol", null_volume=nul.NullVolume(block_size=512, blocks_count=2048)))
    sub = c.fe.CreateNvmeSubsystem(fe.CreateNvmeSubsystemRequest(
        nvme_subsystem_id="bench-sub", nvme_subsystem=fe.NvmeSubsystem(
            spec=fe.NvmeSubsystemSpec(nqn="nqn.2024-01.io.nacre:bench-opi"))))
    create_s = delete_s = 0.0
    for i in range(int(cycles)):
        t0 = time.perf_counter()
        ns = c.fe.CreateNvmeNamespace(fe.CreateNvmeNamespaceRequest(
            parent=sub.name, nvme_namespace_id=f"ns-{i}",
            nvme_namespace=fe.NvmeNamespace(spec=fe.NvmeNamespaceSpec(volume_name_ref="bench-vol"))))
        t1 = time.perf_counter()
        c.fe.DeleteNvmeNamespace(fe.DeleteNvmeNamespaceRequest(name=ns.name))
        t2 = time.perf_counter()
        create_s += t1 - t0
        delete_s += t2 - t1
    n = max(int(cycles), 1)
    return {"cycles": n, "create_ms": 1000 * create_s / n, "delete_ms": 1000 * delete_s / n}


def client_cert(ca_cert, ca_key, days_from, days_to):
    """A client certificate (PEM cert, PEM key) signed by `ca_key`, valid between the two
    offsets in days from now."""
    import datetime
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "opi-client")]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now + datetime.timedelta(days=days_from))
            .not_valid_after(now + datetime.timedelta(days=days_to))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def foreign_ca():
    import datetime
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "someone else's CA")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def tls(addr, tls_dir):
    """Mutual TLS: a certificate from the DPU's CA is served; none, an expired one, one from
    another CA, and plaintext are refused."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    ca_pem = open(os.path.join(tls_dir, "ca.pem"), "rb").read()
    ca_cert = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key(
        open(os.path.join(tls_dir, "ca.key"), "rb").read(), password=None)
    opts = (("grpc.ssl_target_name_override", "nacred"),)

    def call(creds):
        ch = grpc.secure_channel(addr, creds, options=opts) if creds else grpc.insecure_channel(addr)
        stub = nul_grpc.NullVolumeServiceStub(ch)
        try:
            return stub.ListNullVolumes(nul.ListNullVolumesRequest(), timeout=10)
        finally:
            ch.close()

    cert, key = client_cert(ca_cert, ca_key, -1, 30)
    ok = call(grpc.ssl_channel_credentials(ca_pem, key, cert))
    assert not ok.null_volumes, ok
    refused = {}
    expired_cert, expired_key = client_cert(ca_cert, ca_key, -30, -1)
    other_ca, other_key = foreign_ca()
    other_cert, other_ckey = client_cert(other_ca, other_key, -1, 30)
    cases = {
        "no client certificate": grpc.ssl_channel_credentials(ca_pem),
        "expired certificate": grpc.ssl_channel_credentials(ca_pem, expired_key, expired_cert),
        "another CA's certificate": grpc.ssl_channel_credentials(ca_pem, other_ckey, other_cert),
        "plaintext": None,
    }
    for what, creds in cases.items():
        try:
            r = call(creds)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, (what, e.code(), e.details())
            refused[what] = e.code().name
            continue
        raise AssertionError(f"{what}: served: {r}")
    return {"served": True, "refused": refused}

ENC = "encryptedVolumes/enc-1"


def encrypt(addr, path, key_hex, front_nqn):
    """An encrypted volume over an AIO volume serving FILE, with the client's key, exported
    through a subsystem, a namespace and an NVMe/TCP controller."""
    c = Client(addr)
    G = grpc.StatusCode
    key = bytes.fromhex(key_hex)
    base = c.aio.CreateAioVolume(aio.CreateAioVolumeRequest(
        aio_volume_id="base", aio_volume=aio.AioVolume(block_size=512, filename=path)))
    cipher = common.ENCRYPTION_TYPE_AES_XTS_256 if len(key) == 64 else common.ENCRYPTION_TYPE_AES_XTS_128

    def req(k, ci=cipher, ref=base.name, vid="enc-1"):
        return enc.CreateEncryptedVolumeRequest(
            encrypted_volume_id=vid,
            encrypted_volume=enc.EncryptedVolume(volume_name_ref=ref, key=k, cipher=ci))

    # Bad keys and ciphers, and a missing base: nothing is made.
    half = len(key) // 2
    expect(G.INVALID_ARGUMENT, c.enc.CreateEncryptedVolume, req(key[:half] * 2))
    expect(G.INVALID_ARGUMENT, c.enc.CreateEncryptedVolume, req(key[:-1]))
    expect(G.INVALID_ARGUMENT, c.enc.CreateEncryptedVolume, req(key, ci=common.ENCRYPTION_TYPE_AES_CBC_256))
    expect(G.INVALID_ARGUMENT, c.enc.CreateEncryptedVolume,
           req(key, ci=common.ENCRYPTION_TYPE_AES_XTS_128 if len(key) == 64 else common.ENCRYPTION_TYPE_AES_XTS_256))
    expect(G.NOT_FOUND, c.enc.CreateEncryptedVolume, req(key, ref="aioVolumes/none"))
    assert not c.enc.ListEncryptedVolumes(enc.ListEncryptedVolumesRequest()).encrypted_volumes

    ev = c.enc.CreateEncryptedVolume(req(key))
    assert ev.name == ENC and ev.volume_name_ref == base.name and not ev.key, ev
    # The same again is the same resource; another key under the same id is not.
    assert c.enc.CreateEncryptedVolume(req(key)) == ev
    other = bytes(reversed(key))
    expect(G.ALREADY_EXISTS, c.enc.CreateEncryptedVolume, req(other))
    assert c.enc.GetEncryptedVolume(enc.GetEncryptedVolumeRequest(name=ENC)) == ev
    listed = c.enc.ListEncryptedVolumes(enc.ListEncryptedVolumesRequest()).encrypted_volumes
    assert [v.name for v in listed] == [ENC], listed
    # The layer is not an AIO volume, and its base cannot go from under it.
    assert [v.name for v in c.aio.ListAioVolumes(aio.ListAioVolumesRequest()).aio_volumes] \
        == [base.name]
    expect(G.FAILED_PRECONDITION, c.aio.DeleteAioVolume,
           aio.DeleteAioVolumeRequest(name=base.name))
    # Nothing about it changes in place; the same spec is no change.
    mask = field_mask_pb2.FieldMask
    assert c.enc.UpdateEncryptedVolume(enc.UpdateEncryptedVolumeRequest(
        encrypted_volume=enc.EncryptedVolume(name=ENC, volume_name_ref=base.name, key=key,
                                             cipher=cipher))) == ev
    expect(G.INVALID_ARGUMENT, c.enc.UpdateEncryptedVolume, enc.UpdateEncryptedVolumeRequest(
        encrypted_volume=enc.EncryptedVolume(name=ENC, key=other, cipher=cipher),
        update_mask=mask(paths=["key"])))

    sub = c.fe.CreateNvmeSubsystem(fe.CreateNvmeSubsystemRequest(
        nvme_subsystem_id="enc-sub", nvme_subsystem=fe.NvmeSubsystem(
            spec=fe.NvmeSubsystemSpec(nqn=front_nqn))))
    ns = c.fe.CreateNvmeNamespace(fe.CreateNvmeNamespaceRequest(
        parent=sub.name, nvme_namespace_id="enc-ns",
        nvme_namespace=fe.NvmeNamespace(spec=fe.NvmeNamespaceSpec(volume_name_ref=ENC))))
    ctl = c.fe.CreateNvmeController(fe.CreateNvmeControllerRequest(
        parent=sub.name, nvme_controller_id="enc-ctrl",
        nvme_controller=fe.NvmeController(spec=fe.NvmeControllerSpec(
            trtype=common.NVME_TRANSPORT_TYPE_TCP,
            fabrics_id=common.FabricsEndpoint(traddr="127.0.0.1", trsvcid="0",
                                              adrfam=common.NVME_ADDRESS_FAMILY_IPV4)))))
    return {"tcp_port": int(ctl.spec.fabrics_id.trsvcid), "nsid": ns.spec.host_nsid}


def unencrypt(addr):
    """Take the export and the encrypted volume down; the AIO volume (and file) stay."""
    c = Client(addr)
    G = grpc.StatusCode
    assert c.enc.GetEncryptedVolume(enc.GetEncryptedVolumeRequest(name=ENC)).name == ENC
    st = c.enc.StatsEncryptedVolume(enc.StatsEncryptedVolumeRequest(name=ENC)).stats
    sub = "nvmeSubsystems/enc-sub"
    # Exported: the layer stays.
    expect(G.FAILED_PRECONDITION, c.enc.DeleteEncryptedVolume,
           enc.DeleteEncryptedVolumeRequest(name=ENC))
    c.fe.DeleteNvmeController(fe.DeleteNvmeControllerRequest(name=sub + "/nvmeControllers/enc-ctrl"))
    c.fe.DeleteNvmeNamespace(fe.DeleteNvmeNamespaceRequest(name=sub + "/nvmeNamespaces/enc-ns"))
    c.fe.DeleteNvmeSubsystem(fe.DeleteNvmeSubsystemRequest(name=sub))
    c.enc.DeleteEncryptedVolume(enc.DeleteEncryptedVolumeRequest(name=ENC))
    expect(G.NOT_FOUND, c.enc.GetEncryptedVolume, enc.GetEncryptedVolumeRequest(name=ENC))
    expect(G.NOT_FOUND, c.enc.DeleteEncryptedVolume, enc.DeleteEncryptedVolumeRequest(name=ENC))
    c.enc.DeleteEncryptedVolume(enc.DeleteEncryptedVolumeRequest(name=ENC, allow_missing=True))
    assert c.aio.GetAioVolume(aio.GetAioVolumeRequest(name="aioVolumes/base")).name
    return {"write_ops": st.write_ops_count, "read_ops": st.read_ops_count}


def reset(addr):
    """ResetNvmeRemoteController on create's controller; a missing one is NOT_FOUND."""
    c = Client(addr)
    c.be.ResetNvmeRemoteController(be.ResetNvmeRemoteControllerRequest(name=FE_CTRL))
    expect(grpc.StatusCode.NOT_FOUND, c.be.ResetNvmeRemoteController,
           be.ResetNvmeRemoteControllerRequest(name="nvmeRemoteControllers/none"))
    expect(grpc.StatusCode.INVALID_ARGUMENT, c.be.ResetNvmeRemoteController,
           be.ResetNvmeRemoteControllerRequest(name="nvmeSubsystems/x"))
    return {"reset": True}


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    out = {"services": services, "create": create, "verify": verify, "delete": delete,
           "crud": crud, "pcie": pcie, "pcie-delete": pcie_delete, "bench": bench, "tls": tls, "encrypt": encrypt,
           "unencrypt": unencrypt, "reset": reset}[cmd](*args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
