"""mpi: CPU ranks on any hosts. Each rank's block goes to every peer by non-blocking point-to-point
messages (the data an Allgatherv moves), so a missing peer is visible by name and the wait has a
timeout."""
from __future__ import annotations

import time

import torch

from rocket_mpi.fabric.base import Fabric


class MpiFabric(Fabric):
    name = "mpi"

    def __init__(self, comm, max_rows: int, hidden: int, timeout: float):
        super().__init__(comm.rank, comm.size, max_rows, hidden, timeout)
        self.comm = comm.Dup()  # private communicator: no tag clash with the bootstrap
        self.rows = torch.empty(max_rows, hidden, dtype=torch.bfloat16)

    def _exchange(self, seq, offsets, block, layer, step):
        from mpi4py import MPI

        lo, hi = offsets[self.rank], offsets[self.rank + 1]
        rows = self.rows
        rows[lo:hi].copy_(block)
        flat = rows.view(torch.int16).numpy().reshape(-1)  # bf16 bits travel as 16-bit words
        h = self.hidden
        tag = seq & 0x7FFF
        reqs, peers = [], []
        for k in range(1, self.size):
            src = (self.rank - k) % self.size
            a, b = offsets[src] * h, offsets[src + 1] * h
            reqs.append(self.comm.Irecv([flat[a:b], MPI.SHORT], source=src, tag=tag))
            peers.append(src)
        sends = [self.comm.Isend([flat[lo * h:hi * h], MPI.SHORT], dest=(self.rank + k) % self.size, tag=tag)
                 for k in range(1, self.size)]
        deadline = time.monotonic() + self.timeout
        pending = set(range(len(reqs)))
        spins = 0
        while pending:
            for i in list(pending):
                if reqs[i].Test():
                    pending.discard(i)
            if pending:
                spins += 1
                if time.monotonic() > deadline:
                    raise self.timeout_error(peers[min(pending)], layer, step, seq)
                if spins > 1000:
                    time.sleep(20e-6)
        MPI.Request.Waitall(sends)  # receives done means peers are live; sends complete locally
        return rows[:offsets[-1]]

    def close(self):
        try:
            self.comm.Free()
        except Exception:
            pass
