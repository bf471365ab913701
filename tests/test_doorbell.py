"""The doorbell logic the shm and verbs fabrics share (fabric/base.py: DoorbellFabric), tested without RDMA hardware.

- Split and sequence arithmetic: split_rails covers a payload, seq_ahead across the wrap past 2**64.
- DoorbellFabric sequencing through an in-process transport (LoopFabric, ranks in threads): rail split and
  which rails ring, seq parity and wrap past 2**64, the two-slot argument, streams, timeouts naming the peer.
"""
import threading
import time

import numpy as np
import pytest
import torch

from rocket_mpi.errors import FabricError, FabricTimeout
from rocket_mpi.fabric.base import SEQ_MASK, DoorbellFabric, seq_ahead, split_rails
from thread_ranks import ThreadWorld, block_for, run_ranks


# -- split and sequence arithmetic -------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes,rails,split_min", [(0, 2, 8192), (2048, 2, 8192), (8191, 2, 8192), (8192, 2, 8192),
                                                    (65536 + 128, 2, 8192), (1 << 20, 3, 8192), (4096, 4, 64)])
def test_split_rails_covers_payload(nbytes, rails, split_min):
    pieces = split_rails(nbytes, rails, split_min)
    if nbytes == 0:
        assert pieces == []
        return
    assert pieces[0][0] == 0 and sum(n for _, n in pieces) == nbytes
    assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))
    if nbytes < split_min:
        assert pieces == [(0, nbytes)]
    else:
        assert len(pieces) == rails and all(s % 64 == 0 for s, _ in pieces)


def test_seq_ahead_wraps():
    top = SEQ_MASK
    assert seq_ahead(5, 5) == 0 and seq_ahead(6, 5) == 1 and seq_ahead(4, 5) == -1
    assert seq_ahead(0, top) == 1            # the word wrapped past 2**64 - 1: ahead, not behind
    assert seq_ahead(top, 1 << 64) == -1     # seq past the wrap, word one short of it
    assert seq_ahead(3, (1 << 64) + 3) == 0  # callers may pass seq unmasked


# -- LoopFabric: the shared doorbell logic over an in-process transport -----------------------------------
class LoopWorld:
    def __init__(self, size, max_rows=64, hidden=64, rails=1, split_min=8192, timeout=10.0, last_seq=0):
        self.size, self.max_rows, self.hidden, self.rails = size, max_rows, hidden, rails
        self.split_min, self.timeout = split_min, timeout
        # rank r's staging: a region per sender, two slots each
        self.rows = [torch.zeros(size, 2, max_rows, hidden, dtype=torch.bfloat16) for _ in range(size)]
        # every word as a long run leaves it: holding the last seq rung (0 on a fresh fabric)
        self.bells = [np.full((size, rails), last_seq & SEQ_MASK, np.uint64) for _ in range(size)]
        self.log: list[tuple] = []
        self.lock = threading.Lock()

    def fabric(self, rank):
        return LoopFabric(self, rank)


class LoopFabric(DoorbellFabric):
    name = "loop"

    def __init__(self, world, rank):
        super().__init__(rank, world.size, world.max_rows, world.hidden, world.timeout, world.rails, world.split_min,
                         poll_spins=20)
        self.w = world

    def _region(self, sender):
        return self.w.rows[self.rank][sender]

    def _put(self, peer, rail, byte_offset, src):
        with self.w.lock:
            self.w.log.append(("put", self.rank, peer, rail, byte_offset, src.numel()))
        self.w.rows[peer][self.rank].view(torch.uint8).reshape(-1)[byte_offset:byte_offset + src.numel()].copy_(src)

    def _ring(self, peer, rail, seq):
        assert 0 <= seq <= SEQ_MASK
        with self.w.lock:
            self.w.log.append(("ring", self.rank, peer, rail, seq))
        self.w.bells[peer][self.rank, rail] = seq

    def _doorbell(self, peer, rail):
        return int(self.w.bells[self.rank][peer, rail])


def exchange_all(world, seqs, counts, layer=0):
    """Every rank exchanges for each seq; row counts per rank from counts(seq). Checks every result."""
    fabs = [world.fabric(r) for r in range(world.size)]

    def rank_fn(r):
        for seq in seqs:
            c = counts(seq)
            offs = [0]
            for n in c:
                offs.append(offs[-1] + n)
            rows = fabs[r].exchange(seq, offs, block_for(r, c[r], world.hidden, seq), layer, seq)
            for p in range(world.size):
                want = block_for(p, c[p], world.hidden, seq)
                assert torch.equal(rows[offs[p]:offs[p + 1]].view(torch.int16), want.view(torch.int16)), (r, p, seq)
                # sender p's block sits at the start of its own region, in the slot of seq's parity
                landed = world.rows[r][p][seq & 1][:c[p]]
                assert torch.equal(landed.view(torch.int16), want.view(torch.int16)), (r, p, seq)
    run_ranks(world.size, rank_fn)


def test_exchange_three_ranks_rings_only_the_rails_that_carried_rows():
    w = LoopWorld(3, max_rows=96, hidden=64, rails=2)  # 128-byte rows: 64 rows are the 8 KiB split threshold
    seqs = list(range(1, 7))
    counts = {s: ([80, 4, 0] if s % 2 else [2, 3, 1]) for s in seqs}
    exchange_all(w, seqs, counts.get)
    rung = {}
    for e in w.log:
        if e[0] == "ring":
            rung.setdefault((e[1], e[2], e[4]), set()).add(e[3])
    for s in seqs:
        for r in range(3):
            used = set(range(max(1, len(split_rails(counts[s][r] * 128, 2, 8192)))))
            assert all(rung[(r, p, s)] == used for p in range(3) if p != r), (s, r)
    assert rung[(0, 1, 1)] == {0, 1} and rung[(2, 0, 1)] == {0}  # 10 KiB split; an empty block rings rail 0


def test_exchange_splits_large_blocks_over_rails():
    w = LoopWorld(2, max_rows=256, hidden=64, rails=2)
    exchange_all(w, [1, 2, 3], lambda s: [200, 40])  # rank 0: 25 600 B -> both rails; rank 1: 5 120 B -> rail 0
    puts0 = [e for e in w.log if e[0] == "put" and e[1] == 0]
    puts1 = [e for e in w.log if e[0] == "put" and e[1] == 1]
    assert {e[3] for e in puts0} == {0, 1} and {e[3] for e in puts1} == {0}
    assert sum(e[5] for e in puts0) == 3 * 200 * 128
    # per peer and rail, the payload is put before that rail's doorbell rings
    for r in (0, 1):
        order = [(e[0], e[3]) for e in w.log if e[1] == r]
        for rail in (0, 1):
            seq_events = [k for k, rl in order if rl == rail]
            for i, k in enumerate(seq_events):
                if k == "put":
                    assert seq_events[i + 1] == "ring"


def test_exchange_with_empty_blocks_and_seq_wrap():
    start = (1 << 64) - 3
    w = LoopWorld(3, max_rows=32, hidden=64, rails=2, last_seq=start - 1)
    seqs = list(range(start, start + 6))  # crosses 2**64: words wrap to 0, 1, 2 while parity keeps alternating
    exchange_all(w, seqs, lambda s: [0, 5, 0] if s % 3 else [7, 0, 2])
    assert all(0 <= e[-1] <= SEQ_MASK for e in w.log if e[0] == "ring")


def test_two_slots_protect_rows_still_in_use():
    """A fast peer's next exchange lands in the other slot of its region: the rows of the seq we are still gathering
    stay intact until we ring the next seq, and the fast peer waits for us before it could touch them again."""
    w = LoopWorld(2, max_rows=8, hidden=64)
    a, b = w.fabric(0), w.fabric(1)
    offs = [0, 3, 6]
    got = run_ranks(2, lambda r: (a, b)[r].exchange(1, offs, block_for(r, 3, 64, 1), 0, 0).clone())
    staged = w.rows[0][1][1]  # rank 1's rows of seq 1 on rank 0: its region, slot 1
    held = staged.clone()
    t = threading.Thread(target=lambda: b.exchange(2, offs, block_for(1, 3, 64, 2), 0, 1), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while int(w.bells[0][1, 0]) < 2:  # rank 1's seq-2 rows have landed at rank 0
        assert time.monotonic() < deadline, "rank 1 never rang seq 2"
        time.sleep(1e-4)
    assert torch.equal(staged.view(torch.int16), held.view(torch.int16))
    assert torch.equal(w.rows[0][1][0][:3].view(torch.int16), block_for(1, 3, 64, 2).view(torch.int16))
    assert t.is_alive()  # and rank 1 waits for us before it could touch slot 1 again
    rows = a.exchange(2, offs, block_for(0, 3, 64, 2), 0, 1)
    t.join(10)
    assert torch.equal(rows[3:6].view(torch.int16), block_for(1, 3, 64, 2).view(torch.int16))
    assert torch.equal(got[0][3:6].view(torch.int16), block_for(1, 3, 64, 1).view(torch.int16))


def test_timeout_names_rank_peer_layer_step():
    w = LoopWorld(2, max_rows=4, hidden=64, timeout=0.3)
    with pytest.raises(FabricTimeout, match=r"rank 0: fabric loop timed out .* rank 1 at layer 5, step 9 \(seq 1\)"):
        w.fabric(0).exchange(1, [0, 2, 4], block_for(0, 2, 64, 1), 5, 9)


@pytest.mark.parametrize("rails,one_rail,nbytes", [(1, None, 2048), (2, None, 16384), (2, 1, 16384), (2, None, 192)])
def test_streams_deliver_and_flow_control(rails, one_rail, nbytes):
    seq0 = (1 << 64) - 5  # the stream's seqs wrap too
    w = LoopWorld(2, max_rows=8 * 16384 // 128, hidden=64, rails=rails, last_seq=seq0)
    fabs = [w.fabric(0), w.fabric(1)]
    stride, depth = fabs[0].stream_depth(nbytes)
    for mode, send, recv in (("oneway", (True, False), (False, True)), ("duplex", (True, True), (True, True))):
        for r in (0, 1):
            if send[r]:
                ring = fabs[r].stream_ring(1 - r, send=True)
                for p in range(depth):
                    ring[p * stride:p * stride + nbytes] = (torch.arange(nbytes) % 251 + r).to(torch.uint8)
        w.log.clear()
        count = 3 * depth + 1
        ends = run_ranks(2, lambda r: fabs[r].stream(1 - r, nbytes, count, send[r], recv[r], seq0, one_rail))
        assert ends == [(seq0 + count) & SEQ_MASK] * 2
        for r in (0, 1):
            if recv[r]:
                rx = fabs[r].stream_ring(1 - r, send=False)
                want = (torch.arange(nbytes) % 251 + (1 - r)).to(torch.uint8)
                for p in range(depth):
                    assert torch.equal(rx[p * stride:p * stride + nbytes], want), (mode, r, p)
        used = {e[3] for e in w.log if e[0] == "put"}
        assert used == set(range(len(split_rails(nbytes, one_rail or rails, 8192))))
        # flow control, replayed from the log: a sender never has more than `depth` messages the receiver has
        # not seen (the oneway receiver's acks are the only rings from it)
        if mode == "oneway":
            sent = acked = 0
            for e in w.log:
                if e[0] == "ring" and e[1] == 0 and e[3] == 0:
                    sent += 1
                    assert sent - acked <= depth
                elif e[0] == "ring" and e[1] == 1:
                    acked = (e[4] - seq0) & SEQ_MASK
            assert acked == count
        seq0 = (seq0 + count) & SEQ_MASK


def test_stream_needs_room_for_two_messages():
    w = LoopWorld(2, max_rows=8, hidden=64)
    with pytest.raises(FabricError, match="needs row regions of at least 2176 bytes, these have 2048"):
        w.fabric(0).stream(1, 1024 + 1, 4, True, False, 0)


# -- shm: the real segments, ranks as threads ----------------------------------------------------------------
def named_segments() -> set[str]:
    """The named shared-memory files this process maps (a memfd shows as /memfd:NAME (deleted))."""
    with open("/proc/self/maps") as f:
        return {ln.split(maxsplit=5)[5].strip() for ln in f if "/dev/shm/" in ln}


class SnoopComm:
    """A thread rank's comm that lists our named segments at every collective of the set-up: what a kill -9 there
    would leave behind."""

    def __init__(self, comm, seen):
        self.comm, self.seen = comm, seen
        self.rank, self.size = comm.rank, comm.size

    def allgather(self, obj):
        self.seen.append(named_segments())
        return self.comm.allgather(obj)


def test_shm_exchange_leaves_nothing_named_at_any_point():
    """Three shm ranks (threads): the rows arrive, and at no step of the set-up or the run does this process map a
    named segment (/dev/shm): the segments are memfds opened through /proc, so a rank killed anywhere leaks nothing."""
    from rocket_mpi.fabric.shm import ShmFabric
    before = named_segments()  # others' in this process (an MPI library's), not ours
    world, seen = ThreadWorld(3), []
    fabs = run_ranks(3, lambda r: ShmFabric(SnoopComm(world.comm(r), seen), 40, 64, 10.0, rails=2,
                                            rail_split_min_bytes=1024))
    try:
        with open("/proc/self/maps") as f:
            assert sum("memfd:rocket_mpi-shm" in ln for ln in f) >= 9  # 3 ranks x 3 segments
        for f in fabs:
            f.poll_spins = 20
        counts = {1: [30, 0, 5], 2: [1, 2, 3], 3: [0, 40, 0]}

        def rank_fn(r):
            for seq, c in counts.items():
                offs = [0, c[0], c[0] + c[1], sum(c)]
                rows = fabs[r].exchange(seq, offs, block_for(r, c[r], 64, seq), 0, seq)
                for p in range(3):
                    assert torch.equal(rows[offs[p]:offs[p + 1]].view(torch.int16),
                                       block_for(p, c[p], 64, seq).view(torch.int16)), (r, p, seq)
        run_ranks(3, rank_fn)
        seen.append(named_segments())
    finally:
        for f in fabs:
            f.close()
    assert len(seen) >= 7 and not any(s - before for s in seen), seen


def test_shm_ranks_that_disagree_fail_together():
    from rocket_mpi.fabric.shm import ShmFabric, ShmSetupError
    world, errs = ThreadWorld(2), []

    def rank_fn(r):
        try:
            ShmFabric(world.comm(r), 16 if r == 0 else 32, 64, 1.0)
        except ShmSetupError as e:
            errs.append(str(e))
    run_ranks(2, rank_fn)
    assert len(errs) == 2 and errs[0] == errs[1] and "ranks disagree on ranks, rails or max_rows x hidden" in errs[0]
