"""shm: CPU ranks of one host. Each rank owns one POSIX shared-memory segment that peers write into:

    [doorbells: size x rails uint64, 64-byte aligned][slot 0 rows][slot 1 rows]

A sender copies its rows into the peer's slot, then stores seq into the peer's doorbell word for
(sender, rail). On x86-64 stores become visible in program order (TSO), so a doorbell that reads
seq means that payload is there. The receiver polls only its own segment.
"""
from __future__ import annotations

import platform
from multiprocessing import shared_memory

import numpy as np
import torch

from rocket_mpi.errors import FabricError
from rocket_mpi.fabric.base import DoorbellFabric


class ShmFabric(DoorbellFabric):
    name = "shm"

    def __init__(self, comm, max_rows: int, hidden: int, timeout: float, rails: int = 1,
                 rail_split_min_bytes: int = 8192, job_tag: str = ""):
        super().__init__(comm.rank, comm.size, max_rows, hidden, timeout, rails, rail_split_min_bytes)
        if platform.machine() not in ("x86_64", "AMD64"):
            # Without TSO a Python-level store has no release fence; refuse rather than risk torn rows.
            raise FabricError(f"rank {comm.rank}: fabric shm needs x86-64 store ordering; use --fabric mpi here")
        self.bell_bytes = -(-self.size * rails * 8 // 64) * 64
        self.slot_bytes = max_rows * hidden * 2
        nbytes = self.bell_bytes + 2 * self.slot_bytes
        self.segments: list[shared_memory.SharedMemory | None] = [None] * self.size
        own = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
        self.segments[self.rank] = own
        try:
            names = comm.allgather(own.name)
            for r, nm in enumerate(names):
                if r != self.rank:
                    self.segments[r] = _attach(nm)
        except Exception:
            self.close()
            raise
        comm.Barrier()  # every peer attached: the creator may now unlink the name
        own.unlink()
        self._bells = [np.ndarray((self.size, rails), dtype=np.uint64, buffer=s.buf) for s in self.segments]
        self._rows = [[torch.frombuffer(s.buf, dtype=torch.bfloat16, offset=self.bell_bytes + k * self.slot_bytes,
                                        count=max_rows * hidden).view(max_rows, hidden) if max_rows else
                       torch.empty(0, hidden, dtype=torch.bfloat16) for k in (0, 1)] for s in self.segments]
        self._bytes = [[r.view(torch.uint8).reshape(-1) for r in slots] for slots in self._rows]

    def _local_rows(self, slot):
        return self._rows[self.rank][slot]

    def _put(self, peer, rail, slot, byte_offset, src):
        self._bytes[peer][slot][byte_offset:byte_offset + src.numel()].copy_(src)

    def _ring(self, peer, rail, seq):
        self._bells[peer][self.rank, rail] = seq

    def _doorbell(self, peer, rail):
        return int(self._bells[self.rank][peer, rail])

    def close(self):
        self._bells, self._rows, self._bytes = [], [], []
        for s in self.segments:
            if s is not None:
                try:
                    s.close()
                except BufferError:
                    pass
        self.segments = []


def _attach(name: str) -> shared_memory.SharedMemory:
    # Python's resource tracker would unlink segments it did not create; keep it out of peers' segments.
    try:
        return shared_memory.SharedMemory(name=name, track=False)
    except TypeError:  # Python < 3.13 has no track=
        from multiprocessing import resource_tracker
        seg = shared_memory.SharedMemory(name=name)
        try:
            resource_tracker.unregister(seg._name, "shared_memory")
        except Exception:
            pass
        return seg
