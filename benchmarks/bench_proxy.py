"""Where the doorbell exchange's proxy runs, measured on the CPU (not a test): two shm ranks ping-pong one exchange
at a time, the main thread doing the GPU's part and the proxy one of three ways.

    mpiexec -n 2 python benchmarks/bench_proxy.py [--sizes 2K,32K,128K] [--iters 300] [--reps 5]

The main thread stands in for the GPU and for the host thread of a graphed decode at once: it stages its block
and writes the ready record (the stage kernel), then waits for the peer's doorbell and gathers (the gather kernel),
and while it waits it either holds the GIL (`spin`: polling, giving the GIL up only every 1024 polls, as the host's
wait for a step polls torch's event) or gives it up on every poll (`nap`: a 20 us sleep, what that wait does for a
proxy that needs the GIL). The proxy that sends the block and rings the peer's doorbells is
  native          the native thread with shm's native transport: the main thread has put the block into the peer's
                  region itself (as the stage kernel does on shm) and the proxy only rings (release stores): the
                  product's shm path;
  native+py post  the native thread calling back into Python for each exchange (fabric.send, under the GIL, which
                  puts the block staged in our own region, then rings): the product's verbs path, here over shm;
  python thread   a Python thread polling the ready records and calling fabric.send: the design not taken.
Prints, per message size, the median us per exchange (both ranks sending that size, each waiting for the other's
rows) of each; the absolute numbers include the Python stand-in for the GPU, so only the columns' differences are
the proxy's. The proxy's native code comes from the extension where it is built, else from csrc/proxy.cpp compiled
into a temporary folder.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

import numpy as np
import torch
from mpi4py import MPI

from rocket_mpi.cli.fabric_bench import parse_sizes
from rocket_mpi.cli.report import human
from rocket_mpi.fabric import proxy
from rocket_mpi.fabric.base import seq_ahead
from rocket_mpi.fabric.shm import ShmFabric
from rocket_mpi.ops import _ext

HIDDEN = 32   # 64-byte rows
ROW = 2 * HIDDEN


def native_library() -> ctypes.CDLL:
    if _ext.load() is not None:
        return proxy.library()
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "proxy.cpp")
    out = os.path.join(tempfile.mkdtemp(prefix="rocket_proxy_"), "librocket_proxy.so")
    cxx = shutil.which(os.environ.get("CXX", "c++")) or "g++"
    subprocess.run([cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-pthread", src, "-o", out], check=True)
    return proxy.bind(ctypes.CDLL(out))


class PythonProxy:
    """The design not taken: a Python thread that polls the ready records and sends under the GIL."""

    def __init__(self, fab: ShmFabric, last: int):
        self.fab, self.last, self.stop_flag = fab, last, False
        base = fab.staging()[0] + fab.ready_offset
        self.ready = np.frombuffer((ctypes.c_uint64 * 16).from_address(base), dtype=np.uint64)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop_flag:
            for rec in (0, 8):
                seq = int(self.ready[rec])
                if seq_ahead(seq, self.last + 1) == 0:
                    self.fab.send(seq, int(self.ready[rec + 1]) * self.fab.row_bytes, every_rail=True)
                    self.last = seq

    def stop(self):
        self.stop_flag = True
        self.thread.join()


class FakeStep:
    """The GPU's part of one exchange, done by the main thread (stage, record, wait, gather), as in
    tests/test_proxy.py FakeGpu."""

    def __init__(self, fab: ShmFabric, nap: bool, puts: list[int]):
        self.fab, self.nap, self.puts = fab, nap, puts
        self.base = fab.staging()[0]
        self.rows_out = np.zeros(fab.size * fab.max_rows * ROW, dtype=np.uint8)

    def exchange(self, seq: int, nbytes: int) -> None:
        f, slot = self.fab, seq & 1
        for dst in self.puts:
            ctypes.memmove(dst + slot * f.slot_bytes, self.rows_out.ctypes.data, nbytes)
        rec = self.base + f.ready_offset + 64 * slot
        ctypes.c_uint64.from_address(rec + 8).value = nbytes // ROW
        ctypes.c_uint64.from_address(rec).value = seq
        deadline = time.monotonic() + f.timeout
        for peer in range(f.size):
            if peer == f.rank:
                continue
            word = ctypes.c_uint64.from_address(self.base + 8 * peer * f.rails)
            spins = 0
            while seq_ahead(word.value, seq) < 0:
                spins += 1
                if self.nap:
                    time.sleep(20e-6)
                elif spins % 1024 == 0:
                    time.sleep(0)
                if spins % 1024 == 0 and time.monotonic() > deadline:
                    raise TimeoutError(f"rank {f.rank}: no doorbell {seq} from rank {peer}")
            src = self.base + f.header + peer * f.region_bytes + slot * f.slot_bytes
            ctypes.memmove(self.rows_out.ctypes.data + peer * f.max_rows * ROW, src, nbytes)


def start(kind: str, fab: ShmFabric, lib, last: int):
    base = fab.staging()[0]
    common = dict(ready=base + fab.ready_offset, rank=fab.rank, size=fab.size, rails=fab.rails,
                  row_bytes=fab.row_bytes, slot_bytes=fab.slot_bytes, max_rows=fab.max_rows, last=last)
    if kind == "native":
        return proxy.Proxy(lib, bell=fab.proxy_bells(), **common)
    if kind == "native+py post":
        return proxy.Proxy(lib, post=lambda seq, rows: fab.send(seq, rows * fab.row_bytes, every_rail=True), **common)
    return PythonProxy(fab, last)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=parse_sizes, default=parse_sizes("2K,32K,128K"))
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    lib = native_library()
    fab = ShmFabric(comm, max(args.sizes) // ROW, HIDDEN, 30.0)
    kinds = ("native", "native+py post", "python thread")
    cols = [(k, nap) for k in kinds for nap in (False, True)]
    seq, table = 0, {}
    try:
        for n in args.sizes:
            for kind, nap in cols:
                p = start(kind, fab, lib, seq)
                own = [fab.staging()[0] + fab.header + fab.rank * fab.region_bytes]
                step = FakeStep(fab, nap, fab.device_puts(torch.device("cpu")) if kind == "native" else own)
                times = []
                for _ in range(args.reps):
                    comm.Barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        seq += 1
                        step.exchange(seq, n)
                    times.append((time.perf_counter() - t0) / args.iters * 1e6)
                comm.Barrier()
                p.stop()
                table[n, kind, nap] = max(comm.allgather(statistics.median(times)))
    finally:
        fab.close()
    if comm.rank == 0:
        print(f"doorbell exchange round trip on the CPU, shm, {comm.size} ranks: median us per exchange "
              f"({args.reps} x {args.iters}); spin: the waiting main thread holds the GIL, nap: it gives it up")
        head = "".join(f"  {k + (' nap' if nap else ' spin'):>20}" for k, nap in cols)
        print(f"{'message':>9}{head}")
        for n in args.sizes:
            print(f"{human(n):>9}" + "".join(f"  {table[n, k, nap]:>20.1f}" for k, nap in cols))


if __name__ == "__main__":
    main()
