"""fabric-bench --graph: the GPU exchange as the graphed decode step runs it, captured in a CUDA graph.

    mpirun -np 2 python -m rocket_mpi fabric-bench --device cuda --fabric cuda-ipc|nccl|shm|verbs --graph
        [--versus cuda-ipc|nccl] [--sizes ...]

Per message size, medians over --reps replays of one graph holding --iters exchanges back to back:
  exchange us    one symmetric exchange (both ranks send the size, each waits for the other's rows):
                 cuda-ipc = ipc_exchange_flags, one kernel, a flag word per block (the decode step's exchange,
                 fabric/cuda_ipc.py IpcSlots), one block per 4 KiB up to 32, nccl = all_gather_into_tensor,
                 shm / verbs = DoorbellSlots (fabric/slots.py: stage kernel, the proxy thread's puts and doorbells,
                 wait-and-gather kernel);
  GB/s           size / exchange time: what one rank's rows move at;
  versus us, x   with --versus: the same exchange over that fabric in the same run, and this one's time over it;
  peer copy GB/s a plain peer copy (cudaMemcpyAsync to the peer's mapped buffer) of the same size, timed
                 with events, every rank copying at once; and the exchange's share of it (cuda-ipc, either side);
and above the table the bandwidth bar: a 256 MiB plain peer copy, one rank copying alone and every rank at once.
Every size is checked first: the rows that arrive are the bytes the peer sent.
"""
from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

from rocket_mpi import ops
from rocket_mpi.cli.report import human, num
from rocket_mpi.errors import FabricError
from rocket_mpi.fabric.base import DoorbellFabric
from rocket_mpi.fabric.cuda_ipc import BELL_BYTES, FLAGS_OFFSET, IPC_MAX_BLOCKS

ROW_HIDDEN = 32   # rows of 64 bytes, as fabric-bench
ROW_BYTES = ROW_HIDDEN * 2


def push_blocks(nbytes: int) -> int:
    """Blocks of the push kernel: one per 4 KiB, one per flag word at most (fabric/cuda_ipc.py IPC_MAX_BLOCKS)."""
    return max(1, min(IPC_MAX_BLOCKS, nbytes // 4096))


class GraphExchange:
    """`iters` exchanges of `nbytes` per rank, captured once; replay() runs them all."""

    def __init__(self, fab, comm, nbytes: int, iters: int, device):
        self.fab, self.comm, self.device = fab, comm, device
        self.blocks = push_blocks(nbytes)
        self.rank, self.size = comm.rank, comm.size
        self.rows = nbytes // ROW_BYTES
        self.nbytes, self.iters = nbytes, iters
        self.src = (torch.arange(self.rows * ROW_HIDDEN, device=device, dtype=torch.int32) * (self.rank + 3)
                    ).to(torch.int16).view(torch.bfloat16).view(self.rows, ROW_HIDDEN)
        if fab.name == "cuda-ipc":
            slot_rows = fab.slot_bytes // fab.row_bytes
            if fab.row_bytes != ROW_BYTES or slot_rows < self.size * self.rows:
                raise FabricError(f"graph bench: cuda-ipc buffers of {slot_rows} rows of {fab.row_bytes} B are too "
                                  f"small for {self.size} x {self.rows}")
            fab.enable_peer_access()
            self.recv = fab.buf[BELL_BYTES:BELL_BYTES + fab.slot_bytes].view(torch.bfloat16).view(-1, ROW_HIDDEN)
            self.dst = [fab.base[r] + BELL_BYTES for r in range(self.size)]
            self.peer_flags = [fab.base[r] + FLAGS_OFFSET + 8 * IPC_MAX_BLOCKS * self.rank for r in range(self.size)]
            self.err = torch.zeros(4, dtype=torch.long, device=device)
            start = max(int(fab.bells.max()), int(fab.flags.max())) + 1 if self.size > 1 else 1
            start = max(comm.allgather(start))
            head = [0, 0, self.rows, 0, 0, 0] + [self.rows] * self.size
            self.metas = torch.tensor([head] * iters, dtype=torch.long, device=device)
            self.metas[:, 4] = torch.arange(start, start + iters, device=device)
        elif isinstance(fab, DoorbellFabric):
            if fab.row_bytes != ROW_BYTES:
                raise FabricError(f"graph bench: {fab.name} rows of {fab.row_bytes} B, the bench's are {ROW_BYTES}")
            self.slots = fab.slot_exchange(self.rows, device)  # a new proxy; the former size's stops
            self.slots.out.copy_(self.src)  # the expert kernel's output, as the step leaves it
            self.recv = self.slots.rows
            rung = [fab._doorbell(p, r) for p in range(self.size) if p != self.rank for r in range(fab.rails)]
            start = max(comm.allgather(max(rung) + 1))
            head = [0, 0, self.rows, 0, 0, 0] + [self.rows] * self.size
            self.metas = torch.tensor([head] * iters, dtype=torch.long, device=device)
            self.metas[:, 4] = torch.arange(start, start + iters, device=device)
        else:
            self.recv = torch.empty(self.size * self.rows, ROW_HIDDEN, dtype=torch.bfloat16, device=device)
        self.graph = None

    def _body(self):
        if self.fab.name == "cuda-ipc":
            C = ops._ext.require()
            for i in range(self.iters):
                C.ipc_exchange_flags(self.src, self.metas[i], self.dst, self.peer_flags, self.rows, 0, self.rank,
                                     self.blocks, self.fab.flags, self.err, self.fab.timeout, -1)
            self.metas[:, 4] += self.iters  # the next replay's seqs
        elif isinstance(self.fab, DoorbellFabric):
            for i in range(self.iters):
                self.slots.exchange(self.metas[i], -1, 0)
            self.metas[:, 4] += self.iters
        else:
            for _ in range(self.iters):
                dist.all_gather_into_tensor(self.recv, self.src)

    def check(self):
        """One eager pass; the peer's rows must arrive exactly."""
        self._body()
        torch.cuda.synchronize(self.device)
        self._raise_err()
        peer = (self.rank + 1) % self.size
        want = (torch.arange(self.rows * ROW_HIDDEN, device=self.device, dtype=torch.int32) * (peer + 3)
                ).to(torch.int16).view(torch.bfloat16).view(self.rows, ROW_HIDDEN)
        got = self.recv[peer * self.rows:(peer + 1) * self.rows]
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            raise FabricError(f"graph bench: rank {self.rank}: rows from rank {peer} differ at {self.nbytes} B")

    def _raise_err(self):
        if self.fab.name == "cuda-ipc":
            err = self.err.tolist()
            if err[0]:
                raise self.fab.timeout_error(int(err[1]), -1, 0, int(err[2]))
        elif isinstance(self.fab, DoorbellFabric):
            self.slots.check(self.slots.err.tolist(), 0)

    def capture(self) -> str:
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                self._body()
        except Exception as e:  # noqa: BLE001 - reported in the table
            torch.cuda.synchronize(self.device)
            return f"{type(e).__name__}: {e}".splitlines()[0][:200]
        self.graph = g
        return ""

    def time_us(self, reps: int) -> float:
        """Median us per exchange over `reps` replays (ranks start each replay together)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            torch.cuda.synchronize(self.device)
            self.comm.Barrier()
            start.record()
            self.graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / self.iters)
        self._raise_err()
        return statistics.median(times)


def peer_copy_gbps(fab, comm, nbytes: int, device, reps: int = 20) -> float:
    """A plain cudaMemcpyAsync of nbytes into the peer's mapped buffer (cuda-ipc), timed with events."""
    if fab.name != "cuda-ipc":
        return float("nan")
    peer = (comm.rank + 1) % comm.size
    st = fab.peer_storages[peer]
    dst = torch.empty(0, dtype=torch.uint8, device=device).set_(st)[BELL_BYTES + fab.slot_bytes:][:nbytes]
    times = _timed_copies(comm, dst, torch.ones(nbytes, dtype=torch.uint8, device=device), reps, True)
    comm.Barrier()
    return nbytes / statistics.median(times) / 1e9


def _timed_copies(comm, dst, src, reps: int, copying: bool) -> list[float]:
    """Seconds of each of `reps` dst.copy_(src), the ranks starting together; [] where not `copying`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(src.device)
        comm.Barrier()
        if copying:
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
    return times


def peer_copy_bar(fab, comm, device, nbytes: int = 256 << 20, reps: int = 10) -> tuple[float, float]:
    """GB/s of a large plain peer copy (cudaMemcpyAsync into a 256 MiB buffer of the next rank, opened through
    its IPC handle), rank 0 copying alone and every rank at once: the bar for the exchange's bandwidth."""
    if fab.name != "cuda-ipc":
        return float("nan"), float("nan")
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    handles = comm.allgather(buf.untyped_storage()._share_cuda_())
    peer = (comm.rank + 1) % comm.size
    st = torch.UntypedStorage._new_shared_cuda(device.index, *handles[peer][1:])
    dst = torch.empty(0, dtype=torch.uint8, device=device).set_(st)[:nbytes]
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    out = []
    for alone in (True, False):
        times = _timed_copies(comm, dst, src, reps, comm.rank == 0 or not alone)
        comm.Barrier()
        gbs = nbytes / statistics.median(times) / 1e9 if times else float("nan")
        out.append(comm.bcast(gbs, root=0))
    torch.cuda.synchronize(device)
    comm.Barrier()  # every rank done with the peer's buffer before the mappings go
    del dst, st
    return out[0], out[1]


def _time_one(fab, comm, n: int, k: int, reps: int, device) -> tuple[float, str]:
    """(us per exchange, why capture failed or "") of one captured exchange. Built only now: its seqs start past
    every flag value the sizes before it left."""
    ex = GraphExchange(fab, comm, n, k, device)
    ex.check()
    why = ex.capture()
    if comm.allreduce(1 if why else 0) == 0:
        ex.graph.replay()  # warm
        us = ex.time_us(reps)
    else:
        us = float("nan")
    torch.cuda.synchronize(device)
    return us, why


def run(fab, comm, sizes: list[int], iters: int | None, reps: int, device, versus=None) -> list[dict]:
    """The table's rows; versus: a second fabric timed on the same sizes in the same run (its column and the ratio).
    The peer-copy columns come from whichever of the two is cuda-ipc."""
    out = []
    ipc = fab if fab.name == "cuda-ipc" else versus if versus is not None and versus.name == "cuda-ipc" else None
    bar_alone, bar_all = peer_copy_bar(ipc, comm, device) if ipc is not None else (math.nan, math.nan)
    for n in sizes:
        k = iters or max(10, min(200, (64 << 20) // max(n, 1)))
        us, why = _time_one(fab, comm, n, k, reps, device)
        row = {"bytes": n, "exchange_us": us, "gbs": float("nan") if math.isnan(us) else n / (us * 1e-6) / 1e9,
               "copy_gbs": peer_copy_gbps(ipc, comm, n, device) if ipc is not None else math.nan, "note": why,
               "blocks": push_blocks(n) if fab.name == "cuda-ipc" else 0, "bar_alone": bar_alone, "bar_all": bar_all}
        if versus is not None:
            vus, vwhy = _time_one(versus, comm, n, k, reps, device)
            row.update(versus=versus.name, versus_us=vus, note=why or vwhy)
        out.append(row)
    return out


def format_table(results: list[dict], header: str) -> str:
    def pct(a, b):
        return "-" if math.isnan(a) or math.isnan(b) else f"{100 * a / b:.0f}"

    versus = results[0].get("versus") if results else None
    lines = [f"fabric-bench --graph: {header}" + (f", beside {versus} in the same run" if versus else "")]
    if results and not math.isnan(results[0].get("bar_alone", math.nan)):
        lines.append(f"bandwidth bar, a 256 MiB plain peer copy: {results[0]['bar_alone']:.0f} GB/s one rank copying, "
                     f"{results[0]['bar_all']:.0f} GB/s each with every rank copying")
    extra = f"  {versus + ' us':>14}  {'x':>6}" if versus else ""
    lines.append(f"{'message':>9}  {'blocks':>6}  {'exchange us':>12}  {'GB/s':>8}{extra}  {'peer copy GB/s':>14}  "
                 f"{'% of copy':>9}  {'% of bar':>8}")
    for r in results:
        cells = ""
        if versus:
            ratio = r["exchange_us"] / r["versus_us"] if r["versus_us"] and not math.isnan(r["versus_us"]) else math.nan
            cells = f"  {num(r['versus_us']):>14}  {num(ratio):>6}"
        lines.append(f"{human(r['bytes']):>9}  {r.get('blocks', 0) or '-':>6}  {num(r['exchange_us']):>12}  "
                     f"{num(r['gbs']):>8}{cells}  {num(r['copy_gbs']):>14}  "
                     f"{pct(r['gbs'], r['copy_gbs']):>9}  {pct(r['gbs'], r.get('bar_alone', math.nan)):>8}"
                     + (f"  capture failed: {r['note']}" if r["note"] else ""))
    return "\n".join(lines)
