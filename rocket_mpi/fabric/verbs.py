"""verbs: ranks on hosts joined by RoCE or InfiniBand, over pyverbs RC queue pairs (the report's transport).

One RC QP per (rail, peer). Each rank's staging is one page-aligned allocation of host memory that ibv_reg_mr pins:

    [doorbells in: size x rails uint64][doorbells out: size x rails][ready records: 2 x 64 B] (pad to a page)
    [region of rank 0][region of rank 1]...    region(p) = [slot 0: max_rows x hidden bf16][slot 1]

registered per rail device as one local MR (LOCAL_WRITE: the source of our writes) and, per peer p, two MRs with
REMOTE_WRITE: region(p) and in[p, :]. Peer p's card carries only those two keys, so a peer can write nothing but its
own block (its region: a block's place in the canonical rows depends on routing, so each sender has a region
of its own that any of its blocks fits, and the receiver gathers, fabric/base.py) and its own doorbell words.
The ready records are the graphed step's (fabric/slots.py), written by our GPU, never by a peer.

Per rail a sender posts one unsignaled RDMA write of its payload piece, then one signaled 8-byte inline RDMA
write of seq into in[sender, rail] on the peer. RC executes the writes of one QP in order at the responder,
so a doorbell that reads seq means that rail's piece of seq is in memory; the receiver polls its own words and
posts nothing. The MRs leave out IBV_ACCESS_RELAXED_ORDERING: relaxed PCIe ordering would let the doorbell's
DMA overtake the payload's. Completions of the signaled writes only recycle send-queue slots (an unsignaled WR's
slot frees when a later signaled WR on its QP completes); the slot-reuse argument lives in DoorbellFabric.

Set-up follows rdma-core's tests/base.py: overridable open_devices / alloc_staging / create_mrs / create_cqs /
create_qps steps, QP cards swapped over MPI, then to_rts() (RESET -> INIT at creation, INIT -> RTR -> RTS).
"""
from __future__ import annotations

import platform
import random
import re
import struct
import threading
import time
from dataclasses import asdict, dataclass, fields
from types import SimpleNamespace

import numpy as np
import torch

from rocket_mpi.errors import AgreedError, FabricError
from rocket_mpi.fabric.base import PAGE, READY_BYTES, DoorbellFabric
from rocket_mpi.fabric.slots import DoorbellSlots

SQ_DEPTH = 256          # send WRs per QP; a message costs 2 per rail (payload + doorbell)
INLINE_BYTES = 64       # asked of the QP; the doorbell needs 8
# RC retry policy as ibv_rc_pingpong and rdma-core's tests: ~67 ms ACK timeout (4.096 us * 2**14), 7 retries.
ACK_TIMEOUT, RETRY_CNT, RNR_RETRY, MIN_RNR_TIMER, HOP_LIMIT = 14, 7, 7, 12, 64
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


def pyverbs_api() -> SimpleNamespace:
    """Every pyverbs name this backend touches, in one place: tests swap in fakes here."""
    import pyverbs.enums as e
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ, cqe_status_to_str
    from pyverbs.device import Context, get_device_list
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR
    return SimpleNamespace(e=e, GID=GID, AHAttr=AHAttr, GlobalRoute=GlobalRoute, CQ=CQ, status_str=cqe_status_to_str,
                           Context=Context, get_device_list=get_device_list, MR=MR, PD=PD, QP=QP, QPAttr=QPAttr,
                           QPCap=QPCap, QPInitAttr=QPInitAttr, SGE=SGE, SendWR=SendWR)


class VerbsSetupError(FabricError, AgreedError):
    """A set-up failure every rank raises together (rank 0 alone prints it)."""


# -- the card: what a peer needs to reach one of our QPs -----------------------------------------------
_GID_RE = re.compile(r"^[0-9a-f]{4}(:[0-9a-f]{4}){7}$")
_WIRE = struct.Struct("<4sHHIIB3xII16sQQQ")
_MAGIC, _VERSION = b"RKQP", 2


@dataclass(frozen=True)
class QPCard:
    qpn: int          # our QP number (24 bits)
    psn: int          # first PSN we send with (24 bits)
    gid: str          # port GID, pyverbs form 'xxxx:xxxx:...' (8 groups)
    lid: int          # port LID (0 on RoCE)
    mtu: int          # our port's active MTU, ibv_mtu enum 1..5
    rkey: int         # the region the card's reader writes on us: both slots
    addr: int
    length: int
    bell_rkey: int    # its doorbell words on us: in[reader, :] (rails uint64)
    bell_addr: int

    def __post_init__(self):
        for name, bits in (("qpn", 24), ("psn", 24), ("lid", 16), ("rkey", 32), ("bell_rkey", 32), ("addr", 64),
                           ("length", 64), ("bell_addr", 64)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << bits:
                raise FabricError(f"QP card: {name}={v!r} is not a {bits}-bit unsigned integer")
        if self.qpn == 0:
            raise FabricError("QP card: qpn=0 is the SMI QP, not an RC QP")
        if self.mtu not in MTU_BYTES:
            raise FabricError(f"QP card: mtu={self.mtu!r} is not an ibv_mtu value (1..5)")
        if not isinstance(self.gid, str) or not _GID_RE.match(self.gid):
            raise FabricError(f"QP card: gid={self.gid!r} is not 8 colon-separated groups of 4 hex digits")
        for base, n, what in ((self.addr, self.length, "row staging"), (self.bell_addr, 8, "doorbells")):
            if base == 0 or base + n > 1 << 64:
                raise FabricError(f"QP card: {what} at {base:#x} (+{n}) is not a usable address range")

    def to_bytes(self) -> bytes:
        return _WIRE.pack(_MAGIC, _VERSION, self.lid, self.qpn, self.psn, self.mtu, self.rkey, self.bell_rkey,
                          bytes.fromhex(self.gid.replace(":", "")), self.addr, self.length, self.bell_addr)

    @classmethod
    def from_bytes(cls, b: bytes) -> QPCard:
        if not isinstance(b, (bytes, bytearray)) or len(b) != _WIRE.size:
            raise FabricError(f"QP card: expected {_WIRE.size} bytes, got "
                              f"{len(b) if isinstance(b, (bytes, bytearray)) else type(b).__name__}")
        magic, ver, lid, qpn, psn, mtu, rkey, bell_rkey, gid, addr, length, bell_addr = _WIRE.unpack(b)
        if magic != _MAGIC or ver != _VERSION:
            raise FabricError(f"QP card: bad header {magic!r} v{ver} (want {_MAGIC!r} v{_VERSION}): "
                              f"ranks run different rocket_mpi versions")
        h = gid.hex()
        return cls(qpn, psn, ":".join(h[i:i + 4] for i in range(0, 32, 4)), lid, mtu, rkey, addr, length,
                   bell_rkey, bell_addr)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> QPCard:
        want = sorted(f.name for f in fields(cls))
        if not isinstance(d, dict) or sorted(d) != want:
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise FabricError(f"QP card: fields {want} expected, got {got}")
        return cls(**d)


# -- rails: which device ports carry traffic --------------------------------------------------------------
@dataclass(frozen=True)
class Rail:
    device: str
    port: int

    def __str__(self):
        return f"{self.device}:{self.port}"


def device_names(api=None) -> list[str]:
    api = api or pyverbs_api()
    try:
        devs = api.get_device_list()
    except Exception as e:  # libibverbs raises when no provider finds hardware
        raise FabricError(f"no RDMA device ({e})") from None
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devs]
    if not names:
        raise FabricError("no RDMA device (libibverbs lists none)")
    return names


def port_states(api=None) -> dict[str, dict[int, int]]:
    """device -> {port: ibv_port_state} for every port of every device."""
    api = api or pyverbs_api()
    out = {}
    for name in device_names(api):
        try:
            with api.Context(name=name) as ctx:
                n = ctx.query_device().phys_port_cnt
                out[name] = {p: int(ctx.query_port(p).state) for p in range(1, n + 1)}
        except FabricError:
            raise
        except Exception as e:
            raise FabricError(f"RDMA device {name}: cannot query its ports ({e})") from None
    return out


def active_ports(api=None) -> list[Rail]:
    api = api or pyverbs_api()
    active = int(api.e.IBV_PORT_ACTIVE)
    return [Rail(d, p) for d, ports in port_states(api).items() for p, st in ports.items() if st == active]


_STATE = {1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}


def resolve_rails(spec, api=None) -> list[Rail]:
    """--rails: None (every ACTIVE port), a count N or ['N'] (the first N ACTIVE ports), or 'device[:port]' names."""
    api = api or pyverbs_api()
    states = port_states(api)
    active = int(api.e.IBV_PORT_ACTIVE)
    up = [Rail(d, p) for d, ports in states.items() for p, st in ports.items() if st == active]
    listing = ", ".join(f"{d}:{p} {_STATE.get(st, st)}" for d, ports in states.items() for p, st in ports.items())
    if isinstance(spec, list) and len(spec) == 1 and spec[0].strip().isdigit():
        spec = int(spec[0])
    if spec is None or isinstance(spec, int):
        want = len(up) if spec is None else spec
        if want < 1 or len(up) < want:
            raise FabricError(f"--rails: {want if spec is not None else 'any'} ACTIVE RDMA port(s) wanted, "
                              f"{len(up)} here ({listing})")
        return up[:want]
    rails: list[Rail] = []
    for item in spec:
        m = re.fullmatch(r"\s*([\w.\-]+)(?::(\d+))?\s*", item)
        if not m:
            raise FabricError(f"--rails: '{item}' is not device[:port]")
        dev, port = m.group(1), m.group(2)
        if dev not in states:
            raise FabricError(f"--rails: no RDMA device '{dev}' here (ports: {listing})")
        if port is None:
            ports = [p for p, st in states[dev].items() if st == active]
            if not ports:
                raise FabricError(f"--rails: device '{dev}' has no ACTIVE port (ports: {listing})")
            rail = Rail(dev, ports[0])
        else:
            rail = Rail(dev, int(port))
            if rail.port not in states[dev]:
                raise FabricError(f"--rails: device '{dev}' has no port {rail.port} (ports: {listing})")
            if states[dev][rail.port] != active:
                raise FabricError(f"--rails: {rail} is {_STATE.get(states[dev][rail.port], '?')}, not ACTIVE")
        if rail in rails:
            raise FabricError(f"--rails: {rail} named twice")
        rails.append(rail)
    if not rails:
        raise FabricError("--rails: empty list")
    return rails


def _acquire_fence() -> None:
    """Order an earlier doorbell load before later payload loads on CPUs without TSO.

    x86-64 never reorders loads with older loads, so nothing is needed there. Elsewhere (GB10 is aarch64) two
    uncontended lock round trips do it: glibc's sem_post is a store-release and sem_wait an acquire RMW, and
    ARMv8 orders a release before a later acquire, so load(bell) < release < acquire < load(payload).
    """
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


_FENCE_LOCK = threading.Lock()
_NEEDS_FENCE = platform.machine() not in ("x86_64", "AMD64")
_KEEP: list = []  # payload WR/SGE pairs aliased by sg_list: kept alive so no pyverbs version frees one twice


class VerbsFabric(DoorbellFabric):
    name = "verbs"

    def __init__(self, comm, max_rows: int, hidden: int, timeout: float, rails=None,
                 rail_split_min_bytes: int = 8192, gid_index: int | None = None):
        super().__init__(comm.rank, comm.size, max_rows, hidden, timeout, 1, rail_split_min_bytes)
        self.api = None
        self.peers = [p for p in range(self.size) if p != self.rank]
        self._closers: list = []       # every verbs object, in creation order; close() releases in reverse
        self.ports: list[Rail] = []
        self.gid_index: list[int] = []
        self.qp: list[dict] = []       # [rail][peer] -> QP
        self.remote: list[dict] = []   # [rail][peer] -> QPCard of the peer's QP
        try:
            err = None
            try:
                self.setup_local(rails, gid_index)
            except FabricError as e:
                err = f"rank {self.rank}: {e}"
            self._agree(comm, err)
            self.remote = self.swap_cards(comm)
            err = None
            try:
                self.to_rts()
            except FabricError as e:
                err = f"rank {self.rank}: {e}"
            self._agree(comm, err)  # also the barrier: no rank writes before every QP is RTS
        except BaseException:
            self.close()
            raise

    # -- set-up steps (override one to change it) --------------------------------------------------
    def setup_local(self, rails, gid_index) -> None:
        try:
            self.api = pyverbs_api()
        except ImportError as e:
            raise FabricError(f"pyverbs cannot be imported ({e})") from None
        self.ports = resolve_rails(rails, self.api)
        self.rails = len(self.ports)
        self.open_devices()
        self.choose_gids(gid_index)
        self.alloc_staging()
        self.create_mrs()
        self.create_cqs()
        self.create_qps()

    def _own(self, obj):
        self._closers.append(obj)
        return obj

    def _step(self, what: str, fn):
        try:
            return fn()
        except FabricError:
            raise
        except Exception as e:
            raise FabricError(f"verbs {what}: {e}") from e

    def open_devices(self) -> None:
        self.ctx, self.pd = {}, {}
        for dev in dict.fromkeys(r.device for r in self.ports):
            self.ctx[dev] = self._own(self._step(f"open {dev}", lambda: self.api.Context(name=dev)))
            self.pd[dev] = self._own(self._step(f"{dev}: alloc PD", lambda: self.api.PD(self.ctx[dev])))
        self.port_attr = [self._step(f"{r}: query port", lambda r=r: self.ctx[r.device].query_port(r.port))
                          for r in self.ports]

    def choose_gids(self, gid_index: int | None) -> None:
        """--gid-index, else per rail the first RoCE v2 GID holding an IPv4 address (routable; index 3 on a
        typical mlx5 port, the report's 'GID 3'), else any RoCE v2 GID, else index 0 (InfiniBand)."""
        e = self.api.e
        self.gid_index, self.gid = [], []
        for r, attr in zip(self.ports, self.port_attr):
            ctx = self.ctx[r.device]
            if gid_index is not None:
                idx = gid_index
            elif int(attr.link_layer) != int(e.IBV_LINK_LAYER_ETHERNET):
                idx = 0
            else:
                v4, v2 = None, None
                for i in range(attr.gid_tbl_len):
                    try:
                        g = str(ctx.query_gid(r.port, i).gid)
                        kind = int(ctx.query_gid_type(r.port, i))
                    except Exception:
                        continue
                    if kind != int(e.IBV_GID_TYPE_SYSFS_ROCE_V2) or g.replace("0", "").replace(":", "") == "":
                        continue
                    v2 = i if v2 is None else v2
                    if g.startswith("0000:0000:0000:0000:0000:ffff:"):
                        v4 = i
                        break
                idx = v4 if v4 is not None else v2
                if idx is None:
                    raise FabricError(f"rail {r}: no RoCE v2 GID in its table of {attr.gid_tbl_len}; pass --gid-index")
            gid = self._step(f"{r}: query GID {idx}", lambda: str(ctx.query_gid(r.port, idx).gid))
            if gid.replace("0", "").replace(":", "") == "":
                raise FabricError(f"rail {r}: GID index {idx} is empty; pass another --gid-index")
            self.gid_index.append(idx)
            self.gid.append(gid)

    def alloc_staging(self) -> None:
        """One page-aligned, zeroed allocation (header, then the regions); ibv_reg_mr pins it. Numpy owns it, so it
        outlives the MRs."""
        nbells = self.size * self.rails
        self.ready_offset = 2 * nbells * 8
        self.header = -(-(self.ready_offset + READY_BYTES) // PAGE) * PAGE
        self._mem = _aligned(-(-(self.header + self.size * self.region_bytes) // PAGE) * PAGE)
        self.base = self._mem.ctypes.data
        words = self._mem[:2 * nbells * 8].view(np.uint64).reshape(2, self.size, self.rails)
        self._bells_in, self._bells_out = words[0], words[1]
        flat = torch.from_numpy(self._mem[self.header:self.header + self.size * self.region_bytes]).view(torch.bfloat16)
        self._regions = flat.view(self.size, 2, self.max_rows, self.hidden)

    def staging(self):
        return self.base, self._mem.nbytes

    def slot_exchange(self, cap, device):
        if device.type == "cpu" or self.size == 1:
            return super().slot_exchange(cap, device)
        return DoorbellSlots(self, cap, device)

    def region_addr(self, sender: int) -> int:
        return self.base + self.header + sender * self.region_bytes

    def bell_addr(self, sender: int) -> int:
        """in[sender, 0]: where `sender` rings us."""
        return self.base + 8 * sender * self.rails

    def create_mrs(self) -> None:
        """Per device: the local MR over the whole staging (sources of our writes), and per peer its region and its
        doorbell words, remotely writable. No RELAXED_ORDERING: see the top of this file."""
        e = self.api.e
        local = int(e.IBV_ACCESS_LOCAL_WRITE)
        remote = local | int(e.IBV_ACCESS_REMOTE_WRITE)
        self.local_mr, self.region_mr, self.bell_mr = {}, {}, {}
        for dev, pd in self.pd.items():
            self.local_mr[dev] = self._own(self._step(f"{dev}: register {self._mem.nbytes} B of staging",
                                                      lambda: self.api.MR(pd, self._mem.nbytes, local,
                                                                          address=self.base)))
            for p in self.peers:
                self.region_mr[dev, p] = self._own(self._step(
                    f"{dev}: register rank {p}'s region", lambda: self.api.MR(pd, self.region_bytes, remote,
                                                                              address=self.region_addr(p))))
                self.bell_mr[dev, p] = self._own(self._step(
                    f"{dev}: register rank {p}'s doorbell words", lambda: self.api.MR(pd, 8 * self.rails, remote,
                                                                                      address=self.bell_addr(p))))

    def create_cqs(self) -> None:
        # Only signaled WRs complete; a QP has at most SQ_DEPTH outstanding, so this CQ cannot overflow.
        cqe = max(1, len(self.peers)) * SQ_DEPTH
        self.cq = [self._own(self._step(f"{r}: create CQ", lambda r=r: self.api.CQ(self.ctx[r.device], cqe, None,
                                                                                    None, 0)))
                   for r in self.ports]

    def create_qps(self) -> None:
        """One RC QP per (rail, peer), taken RESET -> INIT here."""
        e = self.api.e
        self.qp = [{} for _ in self.ports]
        self.psn = [{} for _ in self.ports]
        self._by_qpn: list[dict[int, int]] = [{} for _ in self.ports]
        self._posted = [{p: 0 for p in self.peers} for _ in self.ports]  # WRs posted, per QP
        self._freed = [{p: 0 for p in self.peers} for _ in self.ports]   # WRs whose SQ slot is free again
        for rail, r in enumerate(self.ports):
            for peer in self.peers:
                where = f"{r}: QP for rank {peer}"
                cap = self.api.QPCap(max_send_wr=SQ_DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1,
                                     max_inline_data=INLINE_BYTES)
                init = self.api.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq[rail], rcq=self.cq[rail], cap=cap,
                                           sq_sig_all=0)
                qp = self._own(self._step(f"{where}: create", lambda: self.api.QP(self.pd[r.device], init)))
                attr = self.api.QPAttr()
                attr.port_num, attr.pkey_index = r.port, 0
                attr.qp_access_flags = int(e.IBV_ACCESS_LOCAL_WRITE) | int(e.IBV_ACCESS_REMOTE_WRITE)
                self._step(f"{where}: RESET -> INIT", lambda: qp.to_init(attr))
                self.qp[rail][peer] = qp
                self.psn[rail][peer] = random.getrandbits(24)
                self._by_qpn[rail][qp.qp_num] = peer

    def cards(self) -> dict[int, list[QPCard]]:
        """peer -> our card for each rail's QP to that peer."""
        out = {}
        for peer in self.peers:
            out[peer] = [QPCard(qpn=self.qp[rail][peer].qp_num, psn=self.psn[rail][peer], gid=self.gid[rail],
                                lid=int(self.port_attr[rail].lid), mtu=int(self.port_attr[rail].active_mtu),
                                rkey=self.region_mr[r.device, peer].rkey, addr=self.region_addr(peer),
                                length=self.region_bytes, bell_rkey=self.bell_mr[r.device, peer].rkey,
                                bell_addr=self.bell_addr(peer))
                         for rail, r in enumerate(self.ports)]
        return out

    def swap_cards(self, comm) -> list[dict[int, QPCard]]:
        mine = self.cards()
        got = comm.alltoall([[c.to_bytes() for c in mine[p]] if p != self.rank else None for p in range(self.size)])
        err, remote = None, [{} for _ in self.ports]
        try:
            for peer in self.peers:
                if len(got[peer]) != self.rails:
                    raise FabricError(f"rank {peer} has {len(got[peer])} rail(s), rank {self.rank} has {self.rails}: "
                                      f"every rank needs the same --rails count")
                for rail, b in enumerate(got[peer]):
                    try:
                        card = QPCard.from_bytes(b)
                    except FabricError as e:
                        raise FabricError(f"rank {peer}'s card for rail {rail}: {e}") from None
                    if card.length != self.region_bytes:
                        raise FabricError(f"rank {peer} has regions of {card.length} B, rank {self.rank} "
                                          f"{self.region_bytes} B: ranks disagree on max_rows x hidden")
                    remote[rail][peer] = card
        except FabricError as e:
            err = f"rank {self.rank}: {e}"
        self._agree(comm, err)
        return remote

    def to_rts(self) -> None:
        """INIT -> RTR (aimed at the peer's card) -> RTS, per (rail, peer)."""
        for rail, r in enumerate(self.ports):
            for peer in self.peers:
                card, qp = self.remote[rail][peer], self.qp[rail][peer]
                where = f"{r}: QP for rank {peer}"
                gr = self.api.GlobalRoute(dgid=self.api.GID(val=card.gid), sgid_index=self.gid_index[rail],
                                          hop_limit=HOP_LIMIT)
                attr = self.api.QPAttr()
                attr.port_num, attr.pkey_index = r.port, 0
                attr.path_mtu = min(int(self.port_attr[rail].active_mtu), card.mtu)
                attr.dest_qp_num, attr.rq_psn = card.qpn, card.psn
                attr.max_dest_rd_atomic, attr.min_rnr_timer = 1, MIN_RNR_TIMER
                # is_global: RoCE needs the GRH; on InfiniBand it is harmless within a subnet.
                attr.ah_attr = self.api.AHAttr(port_num=r.port, is_global=1, gr=gr, dlid=card.lid)
                self._step(f"{where}: INIT -> RTR (remote qpn {card.qpn:#x}, gid {card.gid})",
                           lambda: qp.to_rtr(attr))
                attr.sq_psn, attr.max_rd_atomic = self.psn[rail][peer], 1
                attr.timeout, attr.retry_cnt, attr.rnr_retry = ACK_TIMEOUT, RETRY_CNT, RNR_RETRY
                self._step(f"{where}: RTR -> RTS", lambda: qp.to_rts(attr))
        self._build_doorbell_wrs()

    def _build_doorbell_wrs(self) -> None:
        """Prebuilt per (rail, peer): the 8-byte inline doorbell write, and a payload WR whose SGE is updated in
        place (posting copies both into the WQE, so reuse is safe and allocates nothing per message)."""
        e, api = self.api.e, self.api
        write = e.IBV_WR_RDMA_WRITE
        bell_flags = int(e.IBV_SEND_SIGNALED) | int(e.IBV_SEND_INLINE)
        self._bell_wr = [{} for _ in self.ports]
        self._data_wr = [{} for _ in self.ports]
        for rail, r in enumerate(self.ports):
            lkey = self.local_mr[r.device].lkey
            for peer in self.peers:
                card = self.remote[rail][peer]
                out = self.base + 8 * (self.size * self.rails + peer * self.rails + rail)
                wr = api.SendWR(opcode=write, num_sge=1, sg=[api.SGE(out, 8, lkey)], send_flags=bell_flags)
                wr.set_wr_rdma(card.bell_rkey, card.bell_addr + 8 * rail)
                self._bell_wr[rail][peer] = wr
                sge = api.SGE(self.region_addr(self.rank), 0, lkey)
                data = api.SendWR(opcode=write, num_sge=1, sg=[sge], send_flags=0)
                data.sg_list = sge  # the WR now reads this SGE, so _put edits addr/length in place
                _KEEP.append((data, sge))
                self._data_wr[rail][peer] = (data, sge)

    def _agree(self, comm, err: str | None) -> None:
        """Every rank reaches this; if any failed, all raise the first failure (so none waits in a collective)."""
        bad = [x for x in comm.allgather(err) if x]
        if bad:
            raise VerbsSetupError(bad[0] if len(bad) == 1 else f"{bad[0]} (and {len(bad) - 1} more rank(s))")

    # -- data path -------------------------------------------------------------------------------------
    def _region(self, sender):
        return self._regions[sender]

    def _put(self, peer, rail, byte_offset, src):
        n = src.numel()
        if n == 0:
            return
        addr, own = src.data_ptr(), self.region_addr(self.rank)
        if addr < own or addr + n > own + self.region_bytes or byte_offset < 0 or byte_offset + n > self.region_bytes:
            raise FabricError(f"rank {self.rank}: verbs put to rank {peer} on rail {self.ports[rail]}: {n} B at "
                              f"{addr:#x} / region offset {byte_offset} lie outside this rank's region")
        card = self.remote[rail][peer]
        wr, sge = self._data_wr[rail][peer]
        sge.addr, sge.length = addr, n
        wr.set_wr_rdma(card.rkey, card.addr + byte_offset)
        self._post(rail, peer, wr, signaled=False)

    def _ring(self, peer, rail, seq):
        self._bells_out[peer, rail] = seq  # inline: the NIC copies these 8 bytes when the WR is posted
        self._post(rail, peer, self._bell_wr[rail][peer], signaled=True)

    def _doorbell(self, peer, rail):
        v = int(self._bells_in[peer, rail])  # an aligned 8-byte DMA write lands whole
        if _NEEDS_FENCE:
            _acquire_fence()
        return v

    def _post(self, rail: int, peer: int, wr, signaled: bool) -> None:
        posted = self._posted[rail][peer]
        if posted + 1 - self._freed[rail][peer] > SQ_DEPTH:
            self._wait_sq(rail, peer)
        if signaled:
            wr.wr_id = posted + 1  # its completion frees every WR up to and including this one
        try:
            self.qp[rail][peer].post_send(wr)
        except Exception as e:
            raise FabricError(f"rank {self.rank}: verbs post_send to rank {peer} on rail {self.ports[rail]}: "
                              f"{e}") from e
        self._posted[rail][peer] = posted + 1

    def _wait_sq(self, rail: int, peer: int) -> None:
        deadline = time.monotonic() + self.timeout
        while self._posted[rail][peer] + 1 - self._freed[rail][peer] > SQ_DEPTH:
            if not self._poll(rail) and time.monotonic() > deadline:
                raise FabricError(f"rank {self.rank}: verbs send queue to rank {peer} on rail {self.ports[rail]} "
                                  f"still full after {self.timeout:g} s: no completions (link down or peer gone)")

    def _poll(self, rail: int) -> int:
        n, wcs = self.cq[rail].poll(16)
        ok = int(self.api.e.IBV_WC_SUCCESS)
        for wc in wcs[:n]:
            peer = self._by_qpn[rail].get(wc.qp_num, -1)
            if peer < 0:
                raise FabricError(f"rank {self.rank}: verbs completion on rail {self.ports[rail]} for QP number "
                                  f"{wc.qp_num:#x}, which is not one of ours")
            if int(wc.status) != ok:
                raise FabricError(f"rank {self.rank}: verbs write to rank {peer} on rail {self.ports[rail]} failed: "
                                  f"{self.api.status_str(wc.status)} (status {int(wc.status)}, vendor error "
                                  f"{wc.vendor_err:#x})")
            self._freed[rail][peer] = max(self._freed[rail][peer], wc.wr_id)
        return n

    def _flush(self):
        for rail in range(len(self.cq)):
            self._poll(rail)

    _progress = _flush

    # -- tear-down -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release every verbs object, newest first (QPs, CQs, MRs, PDs, contexts), even after a failed set-up.
        Raises one FabricError naming what could not be released, after trying all of them."""
        self.close_slots()
        errors = []
        while self._closers:
            obj = self._closers.pop()
            try:
                obj.close()
            except Exception as e:
                errors.append(f"{type(obj).__name__}: {e}")
        self._bell_wr, self._data_wr, self.qp = [], [], []
        if errors:
            raise FabricError(f"rank {self.rank}: verbs close: {'; '.join(errors)}")


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + PAGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % PAGE
    return raw[off:off + nbytes]
