"""shm: ranks of one host. Each rank owns one shared-memory segment that peers write into:

    [doorbells in: size x rails uint64][ready records: 2 x 64 B, pad to a page][region of rank 0][region of rank 1]...
    region(p) = [slot 0: max_rows rows][slot 1]  (fabric/base.py DoorbellFabric: what sender p writes here)

A sender copies its rows into its region of the peer's segment, then stores seq into the peer's doorbell word for
(sender, rail). On x86-64 stores become visible in program order (TSO), so a doorbell that reads seq means that
payload is there. The receiver polls only its own segment. The ready records are the graphed step's (GPU ranks:
fabric/slots.py DoorbellSlots: the GPU writes the rows into the peers' segments, registered with CUDA, and the proxy
thread rings with release order).

The segments have no name: each is a memfd that peers open through /proc/PID/fd/FD during set-up, and the creator
closes its descriptor once every peer has mapped it. So nothing of ours is left in /dev/shm whatever way a rank
ends, kill -9 inside set-up included: the memory goes when the last rank that maps it exits.
"""
from __future__ import annotations

import mmap
import os
import platform

import numpy as np
import torch

from rocket_mpi.errors import AgreedError, FabricError
from rocket_mpi.fabric.base import PAGE, READY_BYTES, DoorbellFabric
from rocket_mpi.fabric.slots import DoorbellSlots


class ShmSetupError(FabricError, AgreedError):
    """A set-up failure every rank raises together (rank 0 alone prints it)."""


def header_bytes(size: int, rails: int) -> int:
    """Doorbell words and ready records, rounded up to a page: the regions start page-aligned."""
    bells = -(-size * rails * 8 // 64) * 64
    return -(-(bells + READY_BYTES) // PAGE) * PAGE


class ShmFabric(DoorbellFabric):
    name = "shm"

    def __init__(self, comm, max_rows: int, hidden: int, timeout: float, rails: int = 1,
                 rail_split_min_bytes: int = 8192):
        super().__init__(comm.rank, comm.size, max_rows, hidden, timeout, rails, rail_split_min_bytes)
        if platform.machine() not in ("x86_64", "AMD64"):
            # Without TSO a Python-level store has no release fence; refuse rather than risk torn rows.
            raise FabricError(f"rank {comm.rank}: fabric shm needs x86-64 store ordering; use --fabric mpi here")
        self.header = header_bytes(self.size, rails)
        self.ready_offset = -(-self.size * rails * 8 // 64) * 64
        self.nbytes = -(-(self.header + self.size * self.region_bytes) // PAGE) * PAGE
        self.maps: list[mmap.mmap | None] = [None] * self.size
        self._bells, self._regions, self._bytes = [], [], []
        fd = -1
        try:
            err = None
            try:
                fd = os.memfd_create(f"rocket_mpi-shm-rank{self.rank}", os.MFD_CLOEXEC)
                os.ftruncate(fd, self.nbytes)
                self.maps[self.rank] = mmap.mmap(fd, self.nbytes)
            except OSError as e:
                err = f"rank {self.rank}: fabric shm: cannot create a {self.nbytes}-byte segment ({e})"
            cards = comm.allgather((os.getpid(), fd, self.nbytes, err))
            self._agree(comm, [c[3] for c in cards])
            err = None
            for r, (pid, pfd, nbytes, _) in enumerate(cards):
                if r == self.rank:
                    continue
                if nbytes != self.nbytes:
                    err = (f"rank {r}'s segment has {nbytes} bytes, rank {self.rank}'s {self.nbytes}: ranks disagree "
                           f"on ranks, rails or max_rows x hidden")
                    break
                path = f"/proc/{pid}/fd/{pfd}"
                try:
                    peer_fd = os.open(path, os.O_RDWR)
                    try:
                        self.maps[r] = mmap.mmap(peer_fd, self.nbytes)
                    finally:
                        os.close(peer_fd)
                except OSError as e:
                    err = (f"rank {self.rank}: fabric shm cannot map rank {r}'s segment through {path} ({e}): the "
                           f"ranks must share one host and its process table; use --fabric mpi")
                    break
            self._agree(comm, comm.allgather(err))  # also the barrier: every peer has mapped ours
        except BaseException:
            self.close()
            raise
        finally:
            if fd >= 0:
                os.close(fd)  # the mappings hold the memory; nothing named is left behind
        self._bells = [np.ndarray((self.size, rails), dtype=np.uint64, buffer=m) for m in self.maps]
        self._regions = [[torch.frombuffer(m, dtype=torch.bfloat16, offset=self.header + p * self.region_bytes,
                                           count=2 * max_rows * hidden).view(2, max_rows, hidden)
                          if max_rows else torch.empty(2, 0, hidden, dtype=torch.bfloat16)
                          for p in range(self.size)] for m in self.maps]
        self._bytes = [regions[self.rank].view(torch.uint8).reshape(-1) for regions in self._regions]

    def _agree(self, comm, errs) -> None:
        bad = [e for e in errs if e]
        if bad:
            raise ShmSetupError(bad[0] if len(bad) == 1 else f"{bad[0]} (and {len(bad) - 1} more rank(s))")

    def _region(self, sender):
        return self._regions[self.rank][sender]

    def _put(self, peer, rail, byte_offset, src):
        self._bytes[peer][byte_offset:byte_offset + src.numel()].copy_(src)

    def _ring(self, peer, rail, seq):
        self._bells[peer][self.rank, rail] = seq

    def _doorbell(self, peer, rail):
        return int(self._bells[self.rank][peer, rail])

    def staging(self):
        return self.address(self.rank), self.nbytes

    def proxy_bells(self):
        return [None if p == self.rank else self.address(p, 8 * self.rank * self.rails) for p in range(self.size)]

    def device_puts(self, device):
        # every peer's segment, mapped in this process, registered with CUDA: the stage kernel writes our block into
        # our region there (host memory over the host link), so the proxy has nothing to copy
        peers = [(self.rank + k) % self.size for k in range(1, self.size)]  # the next rank first, as send()
        return [self.device_address(device, self.address(p), self.nbytes, f"rank {p}'s segment")
                + self.header + self.rank * self.region_bytes for p in peers]

    def slot_exchange(self, cap, device):
        if device.type == "cpu" or self.size == 1:
            return super().slot_exchange(cap, device)
        return DoorbellSlots(self, cap, device)

    def address(self, rank: int, offset: int = 0) -> int:
        """The address of byte `offset` of rank `rank`'s segment in this process (the proxy's rings; registered with
        CUDA, the stage kernel's puts)."""
        return np.frombuffer(self.maps[rank], dtype=np.uint8, count=1, offset=offset).ctypes.data

    def close(self):
        self.close_slots()
        self._bells, self._regions, self._bytes = [], [], []
        for m in self.maps:
            if m is not None:
                try:
                    m.close()
                except BufferError:  # a view still exported: the mapping goes with the process
                    pass
        self.maps = []
