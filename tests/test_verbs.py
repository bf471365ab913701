"""The verbs fabric, tested without RDMA hardware.

- QP cards: wire and dict round trips, every validation error.
- VerbsFabric over a fake pyverbs (FakeNet): a synchronous in-process "NIC" that performs RDMA writes with
  memmove, checks rkeys/lkeys and QP states, and records every WR. It runs the real set-up steps, card swap,
  INIT -> RTR -> RTS, the data path, completion handling and close(), including failures part-way.
- The hardware path: skipped, with the reason, where no RDMA device is up.
The doorbell logic verbs shares with shm: test_doorbell.py.
"""
import ctypes
import re
import threading
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from conftest import rocket_mpi
from rocket_mpi.errors import FabricError
from rocket_mpi.fabric import verbs
from rocket_mpi.fabric.verbs import QPCard, Rail, VerbsFabric, resolve_rails
from thread_ranks import ThreadWorld, block_for, run_ranks


# -- cards -----------------------------------------------------------------------------------------------
CARD = dict(qpn=0x1a2b3, psn=0xabcdef, gid="0000:0000:0000:0000:0000:ffff:0a00:0002", lid=0, mtu=3,
            rkey=0x1234, addr=0x7f0000001000, length=1 << 20, bell_rkey=0x5678, bell_addr=0x7f0000200000)


def test_card_round_trips():
    c = QPCard(**CARD)
    b = c.to_bytes()
    assert isinstance(b, bytes) and QPCard.from_bytes(b) == c
    assert QPCard.from_dict(c.to_dict()) == c
    with pytest.raises(Exception):
        c.qpn = 5  # frozen


@pytest.mark.parametrize("field,value,needle", [
    ("qpn", 1 << 24, "qpn"), ("qpn", 0, "qpn=0"), ("psn", -1, "psn"), ("lid", 1 << 16, "lid"),
    ("mtu", 6, "mtu"), ("gid", "fe80::1", "gid"), ("rkey", 1 << 32, "rkey"), ("addr", 0, "row staging"),
    ("bell_addr", (1 << 64) - 4, "doorbells"), ("qpn", True, "qpn"), ("length", 1.5, "length"),
])
def test_card_validation(field, value, needle):
    with pytest.raises(FabricError, match=needle):
        QPCard(**{**CARD, field: value})


def test_card_wire_errors():
    b = QPCard(**CARD).to_bytes()
    with pytest.raises(FabricError, match="expected .* bytes"):
        QPCard.from_bytes(b[:-1])
    with pytest.raises(FabricError, match="bad header"):
        QPCard.from_bytes(b"XXXX" + b[4:])
    with pytest.raises(FabricError, match="fields"):
        QPCard.from_dict({k: v for k, v in CARD.items() if k != "psn"})


# -- a fake pyverbs: an in-process synchronous NIC ------------------------------------------------------------
E = SimpleNamespace(
    IBV_PORT_ACTIVE=4, IBV_LINK_LAYER_ETHERNET=2, IBV_LINK_LAYER_INFINIBAND=1, IBV_GID_TYPE_SYSFS_ROCE_V2=1,
    IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2, IBV_QPT_RC=2, IBV_WR_RDMA_WRITE=0, IBV_SEND_SIGNALED=2,
    IBV_SEND_INLINE=8, IBV_WC_SUCCESS=0)
RESET, INIT, RTR, RTS = "RESET", "INIT", "RTR", "RTS"
V4 = "0000:0000:0000:0000:0000:ffff:0a00:00{:02x}"


class FakeError(Exception):
    pass


class FakeNet:
    """The devices, memory registrations and QPs of every rank in this process."""

    def __init__(self, devices=None, fail=None, inline=64):
        # device -> {port: state}; port 2 of fake0 is DOWN
        self.devices = devices or {"fake0": {1: 4, 2: 1}, "fake1": {1: 4}}
        self.fail = dict(fail or {})   # class name -> fail its n-th creation (1-based)
        self.made: dict[str, int] = {}
        self.objects: list = []
        self.mrs: dict[int, tuple] = {}
        self.qps: dict[int, object] = {}
        self.wrs: list[tuple] = []
        self.lock = threading.RLock()
        self.next_key = 0x100
        self.max_inline = inline

    def born(self, obj):
        with self.lock:
            kind = type(obj).__name__
            self.made[kind] = self.made.get(kind, 0) + 1
            if self.fail.get(kind) == self.made[kind]:
                raise FakeError(f"Failed to create {kind} (injected)")
            self.objects.append(obj)
            self.next_key += 1
            return self.next_key

    def api(self):
        net = self

        class Closable:
            closed = False

            def close(self):
                self.closed = True

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.close()

        class Context(Closable):
            def __init__(self, name):
                if name not in net.devices:
                    raise FakeError(f"no device {name}")
                self.name = name
                net.born(self)

            def query_device(self):
                return SimpleNamespace(phys_port_cnt=len(net.devices[self.name]))

            def query_port(self, p):
                return SimpleNamespace(state=net.devices[self.name][p], lid=0, active_mtu=3, gid_tbl_len=4,
                                       link_layer=E.IBV_LINK_LAYER_ETHERNET)

            def query_gid(self, port, idx):
                host = 1 + list(net.devices).index(self.name)
                return SimpleNamespace(gid=("fe80:0000:0000:0000:0000:0000:0000:00{:02x}" if idx < 2 else V4)
                                       .format(host))

            def query_gid_type(self, port, idx):
                return idx % 2  # 0: RoCE v1, 1: RoCE v2, like mlx5's table

        class PD(Closable):
            def __init__(self, ctx):
                self.ctx = ctx
                net.born(self)

        class MR(Closable):
            def __init__(self, pd, length, access, address=None):
                key = net.born(self)
                assert address and address % 8 == 0, "registrations start 8-byte aligned"
                self.lkey, self.rkey, self.buf, self.length, self.access = key, key + 0x10000, address, length, access
                net.mrs[self.lkey] = net.mrs[self.rkey] = (address, length, access)

            def close(self):
                net.mrs.pop(self.lkey, None)
                net.mrs.pop(self.rkey, None)
                self.closed = True

        class CQ(Closable):
            def __init__(self, ctx, cqe, *rest):
                net.born(self)
                self.q, self.cqe = deque(), cqe

            def poll(self, n):
                out = [self.q.popleft() for _ in range(min(n, len(self.q)))]
                return len(out), out

        class QP(Closable):
            def __init__(self, pd, init):
                assert init.cap.max_inline_data >= 8 and init.sq_sig_all == 0
                if init.cap.max_inline_data > net.max_inline:
                    raise FakeError("inline size not supported")
                self.qp_num = net.born(self) & 0xFFFFFF
                self.pd, self.cq, self.state, self.attrs = pd, init.scq, RESET, {}
                net.qps[self.qp_num] = self

            def _to(self, frm, to, attr):
                assert self.state == frm, f"{frm} -> {to} from {self.state}"
                self.attrs[to] = SimpleNamespace(**vars(attr))
                self.state = to

            def to_init(self, attr):
                self._to(RESET, INIT, attr)

            def to_rtr(self, attr):
                if net.fail.get("to_rtr"):
                    raise FakeError("Failed to modify QP state to RTR (injected)")
                self._to(INIT, RTR, attr)

            def to_rts(self, attr):
                self._to(RTR, RTS, attr)

            def post_send(self, wr):
                assert self.state == RTS and not self.closed
                inline = bool(wr.send_flags & E.IBV_SEND_INLINE)
                sge = wr.sge
                status = 0
                dst = net.mrs.get(wr.rkey)
                peer = net.qps.get(self.attrs[RTR].dest_qp_num)
                if peer is None or peer.state not in (RTR, RTS) or peer.attrs[RTR].dest_qp_num != self.qp_num:
                    status = 12  # retry exceeded: nobody home
                elif dst is None or not dst[2] & E.IBV_ACCESS_REMOTE_WRITE or \
                        not (dst[0] <= wr.addr and wr.addr + sge.length <= dst[0] + dst[1]):
                    status = 10  # remote access error
                elif not inline:
                    src = net.mrs.get(sge.lkey)
                    if src is None or not (src[0] <= sge.addr and sge.addr + sge.length <= src[0] + src[1]):
                        status = 4  # local protection error
                if inline:
                    assert sge.length <= net.max_inline
                net.wrs.append((self.qp_num, self.attrs[RTR].dest_qp_num, wr.send_flags, sge.length, wr.addr, status))
                if status == 0:
                    ctypes.memmove(wr.addr, sge.addr, sge.length)
                if status or wr.send_flags & E.IBV_SEND_SIGNALED:
                    self.cq.q.append(SimpleNamespace(status=status, qp_num=self.qp_num, wr_id=wr.wr_id, vendor_err=0))

        class SGE:
            def __init__(self, addr, length, lkey):
                self.addr, self.length, self.lkey = addr, length, lkey

        class SendWR:
            def __init__(self, wr_id=0, opcode=0, num_sge=1, sg=None, send_flags=0):
                self.wr_id, self.opcode, self.send_flags = wr_id, opcode, send_flags
                self.sge = SGE(sg[0].addr, sg[0].length, sg[0].lkey)  # pyverbs copies the list
                self.rkey = self.addr = None

            @property
            def sg_list(self):
                raise AttributeError("not readable")

            @sg_list.setter
            def sg_list(self, sge):
                self.sge = sge  # pyverbs points the WR at that SGE's struct

            def set_wr_rdma(self, rkey, addr):
                self.rkey, self.addr = rkey, addr

        return SimpleNamespace(
            e=E, Context=Context, PD=PD, MR=MR, CQ=CQ, QP=QP, SGE=SGE, SendWR=SendWR,
            QPCap=lambda **kw: SimpleNamespace(**kw), QPInitAttr=lambda **kw: SimpleNamespace(**kw),
            QPAttr=lambda: SimpleNamespace(), AHAttr=lambda **kw: SimpleNamespace(**kw),
            GlobalRoute=lambda **kw: SimpleNamespace(**kw), GID=lambda val: SimpleNamespace(gid=val),
            status_str=lambda s: {4: "local protection error", 10: "remote access error",
                                  12: "transport retry counter exceeded"}.get(s, f"status {s}"),
            get_device_list=lambda: [SimpleNamespace(name=d.encode()) for d in net.devices])

    def open_objects(self):
        return [o for o in self.objects if not o.closed]


@pytest.fixture
def net(monkeypatch):
    n = FakeNet()
    monkeypatch.setattr(verbs, "pyverbs_api", n.api)
    return n


def verbs_pair(net, rails=None, max_rows=256, hidden=64, timeout=5.0, size=2, comms=None, **kw):
    world = ThreadWorld(size)
    comms = comms if comms is not None else []
    comms[:] = [world.comm(r) for r in range(size)]
    fabs = run_ranks(size, lambda r: VerbsFabric(comms[r], max_rows, hidden, timeout, rails=rails, **kw))
    for f in fabs:
        f.poll_spins = 20
    return fabs


def test_rails_resolution(net):
    api = net.api()
    assert resolve_rails(None, api) == [Rail("fake0", 1), Rail("fake1", 1)]
    assert resolve_rails(["1"], api) == [Rail("fake0", 1)] == resolve_rails(1, api)
    assert resolve_rails(["fake1", "fake0:1"], api) == [Rail("fake1", 1), Rail("fake0", 1)]
    for spec, needle in ((["nope"], "no RDMA device 'nope' here"), (["fake0:2"], "fake0:2 is DOWN, not ACTIVE"),
                         (["fake0:7"], "no port 7"), (["fake0:1", "fake0"], "named twice"), (["fa ke"], "device"),
                         (["3"], "3 ACTIVE RDMA port\\(s\\) wanted, 2 here")):
        with pytest.raises(FabricError, match=needle) as ei:
            resolve_rails(spec, api)
        assert "\n" not in str(ei.value)


def test_bad_rail_fails_every_rank_with_one_line(net):
    world = ThreadWorld(2)
    errs = []

    def rank_fn(r):
        try:
            VerbsFabric(world.comm(r), 8, 64, 1.0, rails=["fake0:1", "mlx9"])
        except FabricError as e:
            errs.append(str(e))
    run_ranks(2, rank_fn)
    assert len(errs) == 2 and errs[0] == errs[1] and errs[0].startswith("rank ") and "no RDMA device 'mlx9'" in errs[0]
    assert net.open_objects() == []


@pytest.mark.parametrize("mine,theirs,needle", [
    (dict(rails=["fake0"]), dict(rails=None), "has 2 rail\\(s\\), rank 0 has 1|has 1 rail\\(s\\), rank 1 has 2"),
    (dict(max_rows=16), dict(max_rows=32), "disagree on max_rows x hidden"),
])
def test_card_swap_catches_mismatched_ranks(net, mine, theirs, needle):
    world = ThreadWorld(2)
    errs = []

    def rank_fn(r):
        kw = {"max_rows": 16, **(mine if r == 0 else theirs)}
        try:
            VerbsFabric(world.comm(r), kw.pop("max_rows"), 64, 1.0, **kw)
        except FabricError as e:
            errs.append(str(e))
    run_ranks(2, rank_fn)
    assert len(errs) == 2 and errs[0] == errs[1]
    assert re.search(needle, errs[0]), errs[0]
    assert net.open_objects() == []


def test_verbs_setup_cards_and_states(net):
    fabs = verbs_pair(net)
    try:
        for f in fabs:
            assert [str(r) for r in f.ports] == ["fake0:1", "fake1:1"] and f.rails == 2
            assert f.gid_index == [3, 3]  # RoCE v2 with an IPv4 address, as perftest -x 3
        for rail in (0, 1):
            for r in (0, 1):
                mine, theirs = fabs[r].qp[rail][1 - r], fabs[1 - r].qp[rail][r]
                assert mine.state == RTS
                rtr, rts = mine.attrs[RTR], mine.attrs[RTS]
                assert mine.attrs[INIT].qp_access_flags & E.IBV_ACCESS_REMOTE_WRITE
                assert rtr.dest_qp_num == theirs.qp_num and rtr.rq_psn == fabs[1 - r].psn[rail][r]
                assert rts.sq_psn == fabs[r].psn[rail][1 - r] and rtr.path_mtu == 3
                assert rtr.ah_attr.gr.dgid.gid == fabs[1 - r].gid[rail] and rtr.ah_attr.gr.sgid_index == 3
                card = fabs[r].remote[rail][1 - r]
                assert card.addr == fabs[1 - r].region_addr(r) and card.bell_addr == fabs[1 - r].bell_addr(r)
        # only the staging is registered, per device: all of it for local access, and the peer's region (2 slots)
        # and its doorbell words (2 rails) for remote writes
        lens = sorted(v[1] for k, v in net.mrs.items() if k < 0x10000)
        assert lens == sorted([f._mem.nbytes for f in fabs] * 2 + [2 * 256 * 128] * 4 + [16] * 4)
    finally:
        for f in fabs:
            f.close()
    assert net.open_objects() == []


def test_verbs_exchange_writes_payload_then_inline_doorbell(net):
    fabs = verbs_pair(net, max_rows=256, hidden=64)
    try:
        def rank_fn(r):
            out = []
            for seq, counts in ((1, [100, 20]), (2, [3, 0]), (3, [0, 90])):
                offs = [0, counts[0], counts[0] + counts[1]]
                rows = fabs[r].exchange(seq, offs, block_for(r, counts[r], 64, seq), 0, seq)
                for p in (0, 1):
                    want = block_for(p, counts[p], 64, seq).view(torch.int16)
                    assert torch.equal(rows[offs[p]:offs[p + 1]].view(torch.int16), want), (r, p, seq)
                    # the peer's block landed at the start of its region on us, in the slot of seq's parity
                    landed = fabs[r]._regions[p][seq & 1][:counts[p]]
                    assert torch.equal(landed.view(torch.int16), want), (r, p, seq)
                out.append(rows.data_ptr())
            return out
        run_ranks(2, rank_fn)
        assert all(w[-1] == 0 for w in net.wrs)
        bells = [w for w in net.wrs if w[2] & E.IBV_SEND_INLINE]
        assert bells and all(w[2] == E.IBV_SEND_SIGNALED | E.IBV_SEND_INLINE and w[3] == 8 for w in bells)
        data = [w for w in net.wrs if not w[2] & E.IBV_SEND_INLINE]
        assert all(w[2] == 0 for w in data)  # payload writes unsignaled
        # rank 0's 100 rows (12 800 B) go over both rails; 20 rows (2 560 B) on rail 0 only
        by_qp: dict[int, list] = {}
        for w in net.wrs:
            by_qp.setdefault(w[0], []).append(w)
        for qpn, ws in by_qp.items():  # on every QP, each payload write is followed by its doorbell
            for a, b in zip(ws, ws[1:]):
                if not a[2] & E.IBV_SEND_INLINE:
                    assert b[2] & E.IBV_SEND_INLINE
        rank0_rail1 = fabs[0].qp[1][1].qp_num
        assert sum(w[3] for w in by_qp[rank0_rail1] if not w[2] & E.IBV_SEND_INLINE) == 12800 // 2
        # completions recycled every send-queue slot
        for f in fabs:
            f._flush()
            for rail in (0, 1):
                for p in f.peers:
                    assert f._freed[rail][p] == f._posted[rail][p]
    finally:
        for f in fabs:
            f.close()
    assert net.open_objects() == []


def test_each_peer_key_covers_only_its_region_and_doorbell_words(net):
    """Three ranks: the keys rank r hands peer p reach exactly p's region and p's doorbell words on r (local access
    only for the rest of the staging), and a write with p's key anywhere else is refused by the NIC."""
    fabs = verbs_pair(net, rails=["fake0", "fake1"], max_rows=32, size=3)
    try:
        for r, f in enumerate(fabs):
            for p in f.peers:
                for rail in (0, 1):
                    card = fabs[p].remote[rail][r]  # what p holds for writing on r
                    assert net.mrs[card.rkey][:2] == (f.region_addr(p), f.region_bytes)
                    assert net.mrs[card.bell_rkey][:2] == (f.bell_addr(p), 8 * 2)
                    assert net.mrs[card.rkey][2] & E.IBV_ACCESS_REMOTE_WRITE
            for dev, mr in f.local_mr.items():
                assert not mr.access & E.IBV_ACCESS_REMOTE_WRITE and (mr.buf, mr.length) == (f.base, f._mem.nbytes)
        # rank 1 aims its region key at rank 2's region on rank 0, then its doorbell key at rank 2's words
        card = fabs[1].remote[0][0]
        for field, value in (("addr", fabs[0].region_addr(2)), ("bell_addr", fabs[0].bell_addr(2))):
            fabs[1].remote[0][0] = QPCard(**{**card.to_dict(), field: value})
            fabs[1]._build_doorbell_wrs()
            with pytest.raises(FabricError, match=r"rank 1: verbs write to rank 0 on rail fake0:1 failed: remote "
                                                  r"access error"):
                fabs[1].send(7, 4 * 64, every_rail=True)
        assert not fabs[0]._regions[2].any() and not fabs[0]._bells_in[2].any()
    finally:
        for f in fabs:
            f.close()
    assert net.open_objects() == []


def test_verbs_streams_and_many_messages_recycle_the_send_queue(net):
    fabs = verbs_pair(net, max_rows=4 * 16384 // 128, hidden=64)
    try:
        n = 16384
        count = verbs.SQ_DEPTH * 2  # more WRs than the send queue holds: completions must free slots
        for send, recv in (((True, False), (False, True)), ((True, True), (True, True))):
            ends = run_ranks(2, lambda r: fabs[r].stream(1 - r, n, count, send[r], recv[r], 10))
            assert ends == [10 + count] * 2
        assert all(f._posted[rail][1 - r] > 2 * verbs.SQ_DEPTH for r, f in enumerate(fabs) for rail in (0, 1))
    finally:
        for f in fabs:
            f.close()


def test_fabric_bench_measures_through_fake_verbs(net):
    """fabric-bench's checks and columns, one rail against two, over the verbs class on the fake NIC."""
    from rocket_mpi.cli import fabric_bench as fb
    comms = []
    fabs = verbs_pair(net, max_rows=4 * 16384 // fb.ROW, hidden=fb.HIDDEN, comms=comms)
    try:
        res = run_ranks(2, lambda r: [fb.Bench(fabs[r], comms[r], 5.0).measure(n, 4, 2) for n in (2048, 16384)])
    finally:
        for f in fabs:
            f.close()
    rows = fb.parse_table(fb.format_table(res[0], "fake verbs"))
    assert [r["message"] for r in rows] == ["2 KiB", "16 KiB"]
    assert all(v > 0 for r in rows for k, v in r.items() if k != "message") and "1-rail GB/s" in rows[0]
    assert net.open_objects() == []


def test_verbs_completion_error_names_rank_peer_rail(net):
    fabs = verbs_pair(net, rails=["fake1"])
    try:
        fabs[0].remote[0][1] = QPCard(**{**fabs[0].remote[0][1].to_dict(), "rkey": 0xdead})
        with pytest.raises(FabricError, match=r"rank 0: verbs write to rank 1 on rail fake1:1 failed: "
                                              r"remote access error \(status 10"):
            fabs[0].exchange(1, [0, 4, 8], block_for(0, 4, 64, 1), 0, 0)
    finally:
        for f in fabs:
            f.close()


def test_verbs_full_send_queue_times_out(net, monkeypatch):
    fabs = verbs_pair(net, rails=["fake0"], timeout=0.2)
    try:
        monkeypatch.setattr(fabs[0].cq[0], "poll", lambda n: (0, []))  # a NIC that never completes
        with pytest.raises(FabricError, match=r"rank 0: verbs send queue to rank 1 on rail fake0:1 still full"):
            for i in range(verbs.SQ_DEPTH + 1):
                fabs[0]._ring(1, 0, i + 1)
    finally:
        for f in fabs:
            f.close()


@pytest.mark.parametrize("fail", [{"Context": 2}, {"MR": 3}, {"CQ": 2}, {"QP": 2}, {"to_rtr": True}])
def test_failure_part_way_releases_everything(monkeypatch, fail):
    net = FakeNet(fail=fail)
    monkeypatch.setattr(verbs, "pyverbs_api", net.api)
    world = ThreadWorld(2)
    errs = []

    def rank_fn(r):
        try:
            VerbsFabric(world.comm(r), 16, 64, 1.0)
        except FabricError as e:
            errs.append(str(e))
    run_ranks(2, rank_fn)
    assert len(errs) == 2 and errs[0] == errs[1] and "injected" in errs[0] and "\n" not in errs[0]
    assert errs[0].startswith("rank ")
    assert net.objects and net.open_objects() == []


def test_close_reports_what_it_could_not_release(net):
    fabs = verbs_pair(net, rails=["fake0"])
    qp = fabs[0].qp[0][1]

    def boom():
        qp.closed = True
        raise FakeError("Failed to destroy QP")
    qp.close = boom
    with pytest.raises(FabricError, match="rank 0: verbs close: QP: Failed to destroy QP"):
        fabs[0].close()
    fabs[1].close()
    assert net.open_objects() == []
    fabs[0].close()  # idempotent


def test_verbs_without_device_is_one_line_at_bootstrap(tiny_ckpt):
    from rocket_mpi.fabric import verbs_status
    why = verbs_status()
    if why is None:
        pytest.skip("an RDMA device is up here: the no-device message cannot be shown")
    r = rocket_mpi(2, "decode", "--checkpoint", tiny_ckpt, "--fabric", "verbs", "--tokens", "1", "--quiet", timeout=90)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert "fabric verbs:" in lines[0] and "no RDMA device" in lines[0] and "use --fabric mpi" in lines[0]


def test_verbs_on_hardware():
    """The real data path: two ranks on this host through the NIC (loopback). Needs an ACTIVE RDMA port."""
    from rocket_mpi.fabric import verbs_status
    why = verbs_status()
    if why is not None:
        pytest.skip(f"verbs hardware path not run: {why}")
    r = rocket_mpi(2, "fabric-bench", "--fabric", "verbs", "--sizes", "2K,64K", "--iters", "20", "--reps", "2",
                   timeout=120)
    assert r.returncode == 0, r.stderr
    assert "fabric-bench: fabric verbs" in r.stdout


def test_acquire_fence_runs():
    verbs._acquire_fence()  # the data path calls it only off x86; it must not block or leave the lock held
    assert not verbs._FENCE_LOCK.locked()


@pytest.mark.parametrize("device,hosts,rdma,want", [
    ("cuda", ["a", "a"], [None, None], ("cuda-ipc", "GPU ranks on one host")),
    ("cuda", ["a", "b"], [None, None], ("verbs", "GPU ranks on 2 hosts, every rank has an ACTIVE RDMA port")),
    ("cuda", ["a", "b", "b"], [None, "no RDMA device", None],
     ("nccl", "GPU ranks on 2 hosts; rank 1: no RDMA device")),
    ("cpu", ["a", "a"], [None, None], ("shm", "CPU ranks on one host")),
    ("cpu", ["a", "b"], [None, None], ("verbs", "CPU ranks on 2 hosts, every rank has an ACTIVE RDMA port")),
    ("cpu", ["a", "b"], ["pyverbs is not installed", None], ("mpi", "CPU ranks on 2 hosts; rank 0: pyverbs is not "
                                                                   "installed")),
])
def test_auto_fabric_and_its_reason(monkeypatch, device, hosts, rdma, want):
    """--fabric auto: verbs across hosts where every rank has an ACTIVE RDMA port (GPU ranks too), else nccl / mpi;
    every rank gets the same choice and the same reason (rank 0 logs it)."""
    import rocket_mpi.fabric as fabric
    n = len(hosts)
    world = ThreadWorld(n)
    status = {}
    monkeypatch.setattr(fabric, "verbs_status", lambda: status[threading.get_ident()])

    def rank_fn(r):
        status[threading.get_ident()] = rdma[r]
        return fabric.choose_why("auto", world.comm(r), device, hosts[r])
    assert run_ranks(n, rank_fn) == [want] * n
