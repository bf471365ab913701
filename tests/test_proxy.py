"""The doorbell fabrics' graphed exchange (fabric/slots.py DoorbellSlots) and its proxy thread (csrc/proxy.cpp), on
the CPU: ranks are threads, the proxy's native code is built from csrc/proxy.cpp alone, and FakeGpu stands in for
the two kernels (csrc/proxy_bells.cu: stage, then wait and gather) on the same addresses and words.

- shm: the stage puts the block into every peer's mapped region itself and the native transport only rings (release
  stores of seq into every rail's word); seq gaps where host-path exchanges ran between, the ready records of an
  earlier run, a stray record.
- verbs (the fake NIC of test_verbs.py): the callback transport, the rail split and a doorbell on every rail, a
  completion error that stops the proxy and is raised by name.
- A dead or stalled peer: the gather's timeout record, raised naming rank, peer, layer and step.
- The proxy never outlives its fabric or the process (close, interpreter exit).
The kernels themselves, in a captured graph on a GPU against cuda-ipc: test_doorbell_gpu.py.
"""
import ctypes
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT
from rocket_mpi.errors import FabricError, FabricTimeout
from rocket_mpi.fabric import proxy as proxy_mod
from rocket_mpi.fabric.base import seq_ahead
from rocket_mpi.fabric.shm import ShmFabric
from rocket_mpi.fabric.slots import DoorbellSlots
from rocket_mpi.ops.plan import META_HEAD
from thread_ranks import ThreadWorld, block_for, run_ranks

H = 64          # bf16 per row: 128-byte rows
ROW = 2 * H


def build_proxy(out_dir) -> str:
    """csrc/proxy.cpp alone as a shared library (what the extension carries)."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler here: the proxy's native code (csrc/proxy.cpp) cannot be built")
    path = os.path.join(out_dir, "librocket_proxy.so")
    subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-pthread",
                    os.path.join(ROOT, "csrc", "proxy.cpp"), "-o", path], check=True, capture_output=True, text=True)
    return path


@pytest.fixture(scope="session")
def proxy_path(tmp_path_factory):
    return build_proxy(str(tmp_path_factory.mktemp("proxy")))


@pytest.fixture(scope="session")
def lib(proxy_path):
    return proxy_mod.bind(ctypes.CDLL(proxy_path))


class FakeGpu:
    """bell_exchange (csrc/proxy_bells.cu) on the CPU: stage our block into slot seq & 1 of our region on every
    peer (puts: addresses of slot 0 there) or, without puts, on our own staging; write the ready record (rows, then
    seq); wait on our doorbell words (every peer, every rail) with the timeout,
    recording (1, peer, seq, layer) in err on expiry; copy every peer's block from its region into the rows."""

    def __init__(self):
        self.stage_only = False

    def bell_exchange(self, out, rows, meta, staging, header, region_bytes, slot_bytes, ready_offset, sync, err,
                      rank, rails, timeout, layer, stage_blocks, gather_blocks, puts=()):
        m = meta.tolist()
        ranks, cap, row = len(m) - META_HEAD, out.shape[0], out.shape[1] * 2
        mine, seq = m[2], m[4]
        slot = seq & 1
        for dst in puts or [staging + header + rank * region_bytes]:
            ctypes.memmove(dst + slot * slot_bytes, out.data_ptr(), mine * row)
        rec = staging + ready_offset + 64 * slot
        ctypes.c_uint64.from_address(rec + 8).value = mine
        ctypes.c_uint64.from_address(rec).value = seq
        if self.stage_only or err[0]:
            return
        for peer in range(ranks):
            for rail in range(rails if peer != rank else 0):
                word = ctypes.c_uint64.from_address(staging + 8 * (peer * rails + rail))
                t0 = time.monotonic()
                while seq_ahead(word.value, seq) < 0:
                    if time.monotonic() - t0 > timeout:
                        err.copy_(torch.tensor([1, peer, seq, layer]))
                        return
                    time.sleep(0)  # gives up the GIL, as the step's wait does
        for peer in range(ranks):
            if peer != rank:
                ctypes.memmove(rows.data_ptr() + peer * cap * row,
                               staging + header + peer * region_bytes + slot * slot_bytes, m[META_HEAD + peer] * row)


def meta_for(rank, counts, seq):
    return torch.tensor([0, 0, counts[rank], 0, seq, 0] + list(counts), dtype=torch.long)


def run_exchanges(xs, plan, layer=3, step=7):
    """Each rank (a thread) runs the graphed exchange for every (seq, counts) of plan and checks the rows in slot
    space; plan entries with counts None are a host-path exchange (the fabric's own) in between."""
    ranks = len(xs)

    def rank_fn(r):
        x = xs[r]
        for seq, counts in plan:
            if counts is None:
                sizes = [2 * p + 1 for p in range(ranks)]
                offs = [sum(sizes[:p]) for p in range(ranks + 1)]
                rows = x.fabric.exchange(seq, offs, block_for(r, sizes[r], H, seq), layer, step)
                for p in range(ranks):
                    assert torch.equal(rows[offs[p]:offs[p + 1]].view(torch.int16),
                                       block_for(p, sizes[p], H, seq).view(torch.int16))
                continue
            x.out[:counts[r]] = block_for(r, counts[r], H, seq)
            rows = x.exchange(meta_for(r, counts, seq), layer, step)
            x.check(x.err.tolist(), step)
            for p in range(ranks):
                got = rows[p * x.cap:p * x.cap + counts[p]].view(torch.int16)
                assert torch.equal(got, block_for(p, counts[p], H, seq).view(torch.int16)), (r, p, seq)
    run_ranks(ranks, rank_fn, timeout=60)


def shm_slots(lib, ranks=3, cap=8, max_rows=24, rails=2, timeout=10.0, gpu=None):
    world = ThreadWorld(ranks)
    fabs = run_ranks(ranks, lambda r: ShmFabric(world.comm(r), max_rows, H, timeout, rails=rails,
                                                rail_split_min_bytes=512))
    for f in fabs:
        f.poll_spins = 20
    xs = [DoorbellSlots(f, cap, torch.device("cpu"), lib=lib, kernels=gpu or FakeGpu()) for f in fabs]
    return fabs, xs


def close_all(fabs):
    for f in fabs:
        f.close()


def test_shm_proxy_puts_rings_every_rail_and_follows_gaps(lib):
    """Three ranks, two virtual rails: the stage puts each block into both peers, the native proxy rings every rail;
    seqs 4 and 5 run the host path in between (the proxy takes seq 6 next), then more graphed exchanges, empty
    blocks included."""
    fabs, xs = shm_slots(lib)
    try:
        assert all(not x.host_gil for x in xs)  # native transport: the proxy never takes the GIL
        for r, (f, x) in enumerate(zip(fabs, xs)):  # our region on the next rank, then the one after
            assert x.puts == [f.address((r + k) % 3, f.header + r * f.region_bytes) for k in (1, 2)]
        plan = [(1, [8, 3, 0]), (2, [0, 0, 5]), (3, [1, 8, 8]), (4, None), (5, None), (6, [2, 0, 7]), (7, [8, 8, 8])]
        run_exchanges(xs, plan)
        for r, (f, x) in enumerate(zip(fabs, xs)):
            handled, count, why = x.proxy.status()
            assert (handled, count, why) == (7, 5, None)
            for p in range(3):  # every rail of every peer holds the last seq
                if p != r:
                    assert [f._doorbell(p, rail) for rail in (0, 1)] == [7, 7]
    finally:
        close_all(fabs)
    assert all(not x.proxy.running for x in xs)


def test_a_new_exchange_takes_over_and_skips_old_records(lib):
    """A later run's exchange (a new DoorbellSlots on the same fabric) stops the former proxy and starts past the
    ready records it left, whatever their seqs."""
    fabs, xs = shm_slots(lib, ranks=2)
    try:
        run_exchanges(xs, [(1, [3, 4]), (2, [5, 6])])
        ys = [DoorbellSlots(f, 8, torch.device("cpu"), lib=lib, kernels=FakeGpu()) for f in fabs]
        assert not any(x.proxy.running for x in xs) and all(y.proxy.running for y in ys)
        run_exchanges(ys, [(3, [1, 2]), (4, [8, 0])])
        assert [y.proxy.status()[:2] for y in ys] == [(4, 2)] * 2
    finally:
        close_all(fabs)


def test_the_host_path_waits_for_the_proxy(lib):
    """Rank 0's proxy is slow (its puts and rings wait 0.3 s): when rank 0 moves on to a host-path exchange, it first
    lets the proxy send the graphed exchange before, so rank 1 never sees seq 2 rung before the rows of seq 1, and
    a doorbell word never steps back."""
    world = ThreadWorld(2)
    fabs = run_ranks(2, lambda r: ShmFabric(world.comm(r), 24, H, 10.0, rails=1))
    try:
        send = fabs[0].send

        def slow(seq, nbytes, every_rail=False):
            if every_rail:  # the proxy's call (the host path rings only the rails it used)
                time.sleep(0.3)
            send(seq, nbytes, every_rail)
        fabs[0].send = slow
        fabs[0].proxy_bells = lambda: None  # rank 0 stages in its own region and its proxy posts through send, as
        fabs[0].device_puts = lambda device: None  # verbs does
        xs = [DoorbellSlots(f, 8, torch.device("cpu"), lib=lib, kernels=FakeGpu()) for f in fabs]
        run_exchanges(xs, [(1, [3, 4]), (2, None), (3, [5, 6]), (4, None)])
    finally:
        close_all(fabs)


def test_dead_peer_times_out_naming_it(lib):
    """Rank 1 never stages seq 2: rank 0's wait records (1, peer 1, seq 2, layer 5) and the host raises it after the
    step as one line naming rank, peer, layer and step."""
    fabs, xs = shm_slots(lib, ranks=2, timeout=0.3)
    try:
        run_exchanges(xs, [(1, [2, 2])])
        x = xs[0]
        x.out[:2] = block_for(0, 2, H, 2)
        t0 = time.monotonic()
        x.exchange(meta_for(0, [2, 2], 2), 5, 9)
        assert time.monotonic() - t0 < 5 and x.err.tolist() == [1, 1, 2, 5]
        with pytest.raises(FabricTimeout, match=r"^rank 0: fabric shm timed out after 0.3 s waiting for rows from "
                                                r"rank 1 at layer 5, step 9 \(seq 2\): peer dead or stalled$"):
            x.check(x.err.tolist(), 9)
        x.exchange(meta_for(0, [2, 2], 3), 6, 9)  # a later layer of the step: at once, the record kept
        assert x.err.tolist() == [1, 1, 2, 5]
    finally:
        close_all(fabs)


def test_proxy_stops_with_the_fabric(lib):
    """close() stops the proxy: a block staged afterwards is never put, nor rung."""
    fabs, xs = shm_slots(lib, ranks=2)
    run_exchanges(xs, [(1, [1, 1])])
    gpu = xs[0].kernels
    fabs[0].close_slots()
    assert not xs[0].proxy.running and xs[1].proxy.running
    gpu.stage_only = True
    xs[0].out[:1] = block_for(0, 1, H, 2)
    xs[0].exchange(meta_for(0, [1, 1], 2), 0, 0)
    time.sleep(0.2)
    assert fabs[1]._doorbell(0, 0) == 1 and xs[0].proxy.status()[:2] == (1, 1)
    close_all(fabs)


def test_stray_ready_record_stops_the_proxy(lib):
    fabs, xs = shm_slots(lib, ranks=2, max_rows=24)
    try:
        base = fabs[0].staging()[0] + fabs[0].ready_offset
        ctypes.c_uint64.from_address(base + 64 + 8).value = 25  # more rows than a slot holds
        ctypes.c_uint64.from_address(base + 64).value = 1
        deadline = time.monotonic() + 5
        while xs[0].proxy.status()[2] is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(FabricError, match=r"rank 0: fabric shm: the proxy stopped at decode step 4: ready record 1 "
                                              r"holds seq 1 with 25 rows \(the slots hold 24\)"):
            xs[0].check([0, 0, 0, 0], 4)
    finally:
        close_all(fabs)


def test_two_pending_records_go_in_seq_order(lib):
    """The GPU may stage seq+1 before the proxy handled seq: both records are new, the lower seq goes first (here
    across the wrap of 64-bit seqs)."""
    mem = (ctypes.c_uint64 * 1024)()
    top = (1 << 64) - 1
    mem[8], mem[9] = top, 3   # record 1: seq 2**64 - 1
    mem[0], mem[1] = 0, 5     # record 0: seq 2**64, wrapped to 0
    seen = []
    p = proxy_mod.Proxy(lib, ready=ctypes.addressof(mem), rank=0, size=2, rails=1, row_bytes=64, slot_bytes=512,
                        max_rows=8, last=top - 1, post=lambda s, r: seen.append((s, r)))
    deadline = time.monotonic() + 10
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    p.stop()
    assert seen == [(top, 3), (0, 5)] and p.status() == (0, 2, None)


def test_proxy_rejects_bad_arguments(lib):
    with pytest.raises(FabricError, match="cannot start the proxy: a peer without mapped doorbell words"):
        proxy_mod.Proxy(lib, ready=8, rank=0, size=2, rails=1, row_bytes=128, slot_bytes=1024, max_rows=8,
                        last=0, bell=[None, None])
    with pytest.raises(FabricError, match="at most 64 ranks"):
        proxy_mod.Proxy(lib, ready=8, rank=0, size=65, rails=1, row_bytes=128, slot_bytes=1024, max_rows=8,
                        last=0, post=lambda s, r: None)


def test_proxy_never_outlives_the_process(proxy_path):
    """A process that never closes its fabric still exits at once and cleanly: interpreter exit stops the proxy
    (atexit) before the memory it polls goes."""
    code = f"""
import ctypes, sys, time
from rocket_mpi.fabric import proxy
lib = proxy.bind(ctypes.CDLL({proxy_path!r}))
mem = (ctypes.c_uint64 * 1024)()
seen = []
p = proxy.Proxy(lib, ready=ctypes.addressof(mem), rank=0, size=2, rails=1, row_bytes=64, slot_bytes=128, max_rows=2,
                last=0, post=lambda s, r: seen.append((s, r)))
mem[9], mem[8] = 2, 1  # record 1: seq 1, 2 rows
while not seen:
    time.sleep(0.001)
print("posted", seen, flush=True)
"""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0 and "posted [(1, 2)]" in r.stdout, r.stderr
    assert time.monotonic() - t0 < 30


# -- verbs, through the fake NIC: the callback transport ----------------------------------------------------------
def test_verbs_proxy_posts_payload_split_and_a_doorbell_per_rail(lib, monkeypatch):
    from test_verbs import E, FakeNet, verbs_pair
    from rocket_mpi.fabric import verbs
    net = FakeNet()
    monkeypatch.setattr(verbs, "pyverbs_api", net.api)
    fabs = verbs_pair(net, rails=["fake0", "fake1"], max_rows=64, hidden=H, rail_split_min_bytes=1024)
    try:
        xs = [DoorbellSlots(f, 32, torch.device("cpu"), lib=lib, kernels=FakeGpu()) for f in fabs]
        assert all(x.host_gil for x in xs)  # pyverbs posts: the callback takes the GIL
        net.wrs.clear()
        run_exchanges(xs, [(1, [32, 2]), (2, [0, 9])])
        # per sender and seq: payload writes (split over the rails from 1 KiB: 4 KiB as 2 x 2 KiB, 1152 B as
        # 2 x 576 B; 256 B on rail 0), then one signaled inline doorbell on every rail, whatever the size
        for r, f in enumerate(fabs):
            for rail in (0, 1):
                ws = [w for w in net.wrs if w[0] == f.qp[rail][1 - r].qp_num]
                bells = [w for w in ws if w[2] & E.IBV_SEND_INLINE]
                data = [w[3] for w in ws if not w[2] & E.IBV_SEND_INLINE]
                assert len(bells) == 2 and all(w[3] == 8 for w in bells)
                want = [2048] if r == 0 else {0: [256, 576], 1: [576]}[rail]  # rank 0's seq 2 is empty
                assert data == want, (r, rail, data)
        # a completion error stops the proxy; the rank raises it by name after the step
        fabs[0].remote[1][1] = verbs.QPCard(**{**fabs[0].remote[1][1].to_dict(), "rkey": 0xdead})
        fabs[0]._build_doorbell_wrs()
        xs[0].out[:32] = block_for(0, 32, H, 3)
        fabs[0].timeout = 0.3
        xs[0].exchange(meta_for(0, [32, 1], 3), 4, 11)
        with pytest.raises(FabricError, match=r"rank 0: fabric verbs: the proxy stopped at decode step 11: the "
                                              r"transport failed posting seq 3: rank 0: verbs write to rank 1 on rail "
                                              r"fake1:1 failed: remote access error"):
            xs[0].check(xs[0].err.tolist(), 11)
    finally:
        close_all(fabs)
    assert net.open_objects() == []
