"""nccl: GPUs on any hosts, through torch.distributed's NCCL point-to-point ops (the scale-out path on
an existing engine). Each rank's block goes straight into every peer's row buffer at its offsets;
zero-row blocks are skipped on both sides, which both know from routing."""
from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch

from rocket_mpi.fabric.base import Fabric, SlotExchange


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class NcclFabric(Fabric):
    name = "nccl"

    def __init__(self, comm, max_rows: int, hidden: int, timeout: float, device: torch.device):
        super().__init__(comm.rank, comm.size, max_rows, hidden, timeout)
        import torch.distributed as dist
        self.dist = dist
        addr = comm.bcast(f"tcp://{socket.gethostname()}:{_free_port()}" if comm.rank == 0 else None, root=0)
        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method=addr, rank=comm.rank, world_size=comm.size,
                                    timeout=timedelta(seconds=max(timeout, 10)), device_id=device)
        self.device = device
        self.rows = torch.empty(max(max_rows, 1), hidden, dtype=torch.bfloat16, device=device)
        self.done = torch.cuda.Event()

    def _exchange(self, seq, offsets, block, layer, step):
        dist = self.dist
        lo, hi = offsets[self.rank], offsets[self.rank + 1]
        rows = self.rows
        if hi > lo:
            rows[lo:hi].copy_(block)
        ops = []
        for k in range(1, self.size):
            peer = (self.rank + k) % self.size
            if hi > lo:
                ops.append(dist.P2POp(dist.isend, rows[lo:hi], peer))
            src = (self.rank - k) % self.size
            if offsets[src + 1] > offsets[src]:
                ops.append(dist.P2POp(dist.irecv, rows[offsets[src]:offsets[src + 1]], src))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()  # makes the current stream wait; the host does not block here
            self.done.record()
            _wait_event(self, self.done, layer, step, seq)
        return rows[:offsets[-1]]

    def slot_exchange(self, cap, device):
        if device.type == "cpu" or self.size == 1:
            return super().slot_exchange(cap, device)
        return NcclSlots(self, cap, device)

    def close(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class NcclSlots(SlotExchange):
    """Every rank's cap rows gathered with all_gather_into_tensor (NCCL captures it in the step's graph)."""
    mode = "nccl"

    def __init__(self, fabric: NcclFabric, cap: int, device: torch.device):
        super().__init__(fabric, cap)
        self.set_stride = fabric.size * cap
        self.rows = torch.empty(self.set_stride, fabric.hidden, dtype=torch.bfloat16, device=device)
        self.out = self.rows[fabric.rank * cap:(fabric.rank + 1) * cap]

    def exchange(self, meta, layer, step):
        self.fabric.dist.all_gather_into_tensor(self.rows, self.out)
        return self.rows

    def bytes_sent(self, rows_mine):
        return self.cap * self.row_bytes * (self.fabric.size - 1)


def _wait_event(fab: Fabric, event: torch.cuda.Event, layer: int, step: int, seq: int) -> None:
    """Host-side bound on a device-side wait: the next host read would otherwise block for ever."""
    deadline = time.monotonic() + fab.timeout
    spins = 0
    while not event.query():  # spin: a sleep costs 50+ us on Linux, more than the exchange itself
        spins += 1
        if spins % 1024 == 0:
            if time.monotonic() > deadline:
                peers = ", ".join(str(p) for p in range(fab.size) if p != fab.rank)
                raise fab.timeout_error(peers, layer, step, seq)
            time.sleep(0)
