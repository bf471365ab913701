"""The graphed step's exchange over the doorbell fabrics (shm, verbs) on GPU ranks: DoorbellSlots.

Per MoE layer, inside the captured step, two kernels around a host proxy (csrc/proxy_bells.cu, csrc/proxy.cpp):

  stage   (GPU)   this rank's block (the expert kernel's `out`, meta rows) -> slot seq & 1 of our region on every
                  peer's segment (shm: each segment mapped here and registered with CUDA) or on our own staging
                  (verbs: registered with the NIC and CUDA), then the ready record {seq, rows} with release order
                  (the grid's last block writes it);
  proxy   (host)  a native thread sees the record and rings each peer's doorbell words (every rail): shm by
                  release stores, verbs by pyverbs RDMA writes of the block and then of the doorbells
                  (fabric/proxy.py);
  gather  (GPU)   its block 0 waits on our own doorbell words in host memory (a spin with a clock timeout: a dead
                  peer is recorded in `err` as (1, peer, seq, layer) and raised by the host after the step, as
                  cuda-ipc's) and tells the other blocks on a device word; then they all copy every peer's block from
                  its region into the device rows in slot space (a block per GATHER_BYTES of capacity, up to 16).

The rows the scatter reads are in device memory ([ranks x cap] rows, one set: our block is `out`, a view of them),
so the staging's two slots by seq parity carry the double-buffer argument of DoorbellFabric unchanged: we stage
seq+1 only after our gather of seq, and a peer writes slot (seq+2) & 1 only after our doorbell for seq+1.
On a CPU device the fabric's own exchange serves (HostSlots); `kernels` lets the CPU tests run this class with a
stand-in for the two kernels (tests/test_proxy.py).
"""
from __future__ import annotations

import ctypes
import logging
import os
import time

import torch

from rocket_mpi.errors import FabricError
from rocket_mpi.fabric.base import SEQ_MASK, SlotExchange, seq_ahead
from rocket_mpi.fabric.proxy import Proxy, library
from rocket_mpi.ops import _ext

log = logging.getLogger("rocket_mpi")

STAGE_BLOCKS = 16    # blocks of the stage kernel (host memory takes a few SMs' stores at full rate)
GATHER_BLOCKS = 16   # most blocks of the gather kernel (its block 0 alone polls the doorbells; all copy)
GATHER_BYTES = 512   # a gather block per this many bytes of the peers' blocks at full capacity (H200: 512, 2048 and
                     # 8192 within 1-3 us of each other from 2 to 128 KiB, 512 the fastest)


def serial_max(a: int, b: int) -> int:
    """The later of two 64-bit seqs (serial-number order, as seq_ahead)."""
    return a if ((a - b) & SEQ_MASK) < 1 << 63 else b


class DoorbellSlots(SlotExchange):
    mode = "doorbell"
    n_sets = 1

    def __init__(self, fab, cap: int, device: torch.device, lib=None, kernels=None):
        super().__init__(fab, cap)
        if cap > fab.max_rows:
            raise FabricError(f"rank {fab.rank}: fabric {fab.name}: regions of {fab.max_rows} rows, the graphed step "
                              f"needs {cap} per rank")
        self.device = device
        self.set_stride = fab.size * cap
        self.rows = torch.zeros(fab.size * cap, fab.hidden, dtype=torch.bfloat16, device=device)
        self.out = self.rows[fab.rank * cap:(fab.rank + 1) * cap]
        self.err = torch.zeros(4, dtype=torch.long, device=device)
        # the kernels' device words: the stage's count of blocks done, the seq the gather's poller saw rung
        self.sync = torch.zeros(2, dtype=torch.long, device=device)
        self.gather_blocks = max(1, min(GATHER_BLOCKS, -(-(fab.size - 1) * cap * fab.row_bytes // GATHER_BYTES)))
        self.kernels = kernels if kernels is not None else _ext.require()
        self.proxy = None
        fab.attach_slots(self)  # a former run's exchange stops its proxy first
        self.staging = fab.device_staging(device)  # our staging's base address as the kernels see it
        base, _ = fab.staging()
        self.ready = (ctypes.c_uint64 * 16).from_address(base + fab.ready_offset)
        last = serial_max(self.ready[0], self.ready[8])  # records a former exchange left: done (drained)
        who = f"rank {fab.rank}: fabric {fab.name}: "
        common = dict(ready=base + fab.ready_offset, rank=fab.rank, size=fab.size, rails=fab.rails, row_bytes=fab.row_bytes,
                      slot_bytes=fab.slot_bytes, max_rows=fab.max_rows, last=last, who=who)
        self.puts = fab.device_puts(device) or []  # empty: the stage kernel writes our own staging
        bells = fab.proxy_bells()
        lib = lib if lib is not None else library()
        if bells is not None:
            self.proxy = Proxy(lib, bell=bells, **common)
        else:
            self.proxy = Proxy(lib, post=lambda seq, rows: fab.send(seq, rows * fab.row_bytes, every_rail=True),
                               **common)
        self.host_gil = bells is None  # the callback needs this process's GIL while the step runs
        cpus = os.sched_getaffinity(0)
        if len(cpus) < 2:
            log.warning(f"fabric {fab.name}: this rank may run on one CPU only ({sorted(cpus)[0]}): the proxy thread shares it with "
                        f"the thread that waits for each step, and each exchange then waits for the scheduler "
                        f"(milliseconds, not tens of microseconds). Give each rank two CPUs or more: mpirun "
                        f"--bind-to none (Open MPI binds a rank to one core), --map-by slot:PE=2, or srun "
                        f"--cpus-per-task=2")

    def exchange(self, meta, layer, step):
        f = self.fabric
        self.kernels.bell_exchange(self.out, self.rows, meta, self.staging, f.header, f.region_bytes, f.slot_bytes,
                                   f.ready_offset, self.sync, self.err, f.rank, f.rails, f.timeout, layer,
                                   STAGE_BLOCKS, self.gather_blocks, self.puts)
        return self.rows

    def check(self, words, step):
        _, _, why = self.proxy.status()
        if why is not None:
            raise FabricError(f"rank {self.fabric.rank}: fabric {self.fabric.name}: the proxy stopped at decode step "
                              f"{step}: {why}")
        if words[0]:
            raise self.fabric.timeout_error(int(words[1]), int(words[3]), step, int(words[2]))

    def drain(self) -> None:
        """Wait until the proxy has put and rung every block our GPU staged. The host path's exchange (its puts and
        rings come from this thread) and an exchange that takes over must not overtake it: a peer would see our next
        seq before the rows of this one, and a doorbell word would step back. Called with no step in flight, so the
        ready records are final; bounded by the fabric's timeout."""
        if self.proxy is None or not self.proxy.running:
            return
        f = self.fabric
        want = serial_max(self.ready[0], self.ready[8])
        deadline = time.monotonic() + f.timeout
        while True:
            handled, _, why = self.proxy.status()
            if why is not None:
                raise FabricError(f"rank {f.rank}: fabric {f.name}: the proxy stopped: {why}")
            if seq_ahead(handled, want) >= 0:
                return
            if time.monotonic() > deadline:
                raise FabricError(f"rank {f.rank}: fabric {f.name}: the proxy has not sent seq {want} after "
                                  f"{f.timeout:g} s (it is at {handled})")
            time.sleep(0)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
