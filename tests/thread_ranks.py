"""Ranks as threads of one process, for the fabric tests (test_doorbell.py, test_verbs.py): mpi4py's bootstrap
collectives for N thread ranks, fn(rank) run in one thread per rank, and rows whose bits name rank, row and seq.

Imported as `from thread_ranks import ...` (tests/ is on sys.path under pytest, as for oracle.py).
"""
import threading
from types import SimpleNamespace

import torch


class ThreadWorld:
    """mpi4py's bootstrap collectives for N ranks that are threads of this process."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=20)
        self.slots = [None] * size

    def comm(self, rank):
        return ThreadComm(self, rank)


class ThreadComm:
    def __init__(self, world, rank):
        self.world, self.rank, self.size = world, rank, world.size

    def _swap(self, obj):
        w = self.world
        w.barrier.wait()
        w.slots[self.rank] = obj
        w.barrier.wait()
        out = list(w.slots)
        w.barrier.wait()
        return out

    def allgather(self, obj):
        return self._swap(obj)

    def alltoall(self, objs):
        return [row[self.rank] for row in self._swap(objs)]

    def Ibarrier(self):
        return SimpleNamespace(Test=lambda: self.world.barrier.wait() is not None)


def run_ranks(size, fn, timeout=30):
    """fn(rank) in one thread per rank; returns the results, re-raises the first failure."""
    out, errs = [None] * size, [None] * size

    def go(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            errs[r] = e

    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank thread hung"
    for e in errs:
        if e is not None:
            raise e
    return out


def block_for(rank, rows, hidden, seq):
    """bf16 rows whose bits name rank, row and seq."""
    bits = (torch.arange(rows * hidden, dtype=torch.int32) * 7 + 1009 * rank + 31 * (seq % 97)) % 32749
    return bits.to(torch.int16).view(torch.bfloat16).view(rows, hidden)
