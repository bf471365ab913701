"""fabric-bench: the transport table of one fabric backend, measured through the fabric classes themselves.

    mpiexec -n 2 python -m rocket_mpi fabric-bench --fabric shm|mpi|verbs [--rails ...] [--sizes 2K..4M]
        [--iters N] [--reps R] [--rail-split-min-bytes BYTES] [--plot FILE.png] [--perftest]
    mpiexec -n 2 python -m rocket_mpi fabric-bench --device cuda --graph --fabric shm|verbs|cuda-ipc|nccl
        [--versus cuda-ipc|nccl]      (cli/graph_bench.py)

Columns, medians over --reps repetitions, printed by rank 0:
  oneway GB/s   rank 0 streams --iters messages (default: 64 MiB worth, 100..5000) to rank 1; bytes over the
                time from the first write to the receiver's acknowledgement of the last (as ib_write_bw);
  1-rail GB/s   the same on rail 0 alone (fabrics with 2+ rails: verbs, shm --rails N);
  pingpong us   one symmetric exchange() in flight, both ranks sending a message of this size: what a
                decode step blocks on per MoE layer;
  duplex GB/s   both ranks streaming to each other at once, both directions summed.
Every size is first checked: the rows and stream messages that arrive must be the bytes that were sent.

--perftest (verbs only) then runs ib_write_bw on every rail at once (summed) and ib_write_lat on rail 0 over
the same sizes and prints the report's comparison table. Where perftest or an RDMA device is missing it exits 1
with one line: a comparison that did not run is not a pass.
"""
from __future__ import annotations

import argparse
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections import deque

import numpy as np
import torch

from rocket_mpi.cli import graph_bench
from rocket_mpi.cli.flags import add_fabric_flags, pos_int
from rocket_mpi.cli.report import human, num
from rocket_mpi.errors import FabricError, FabricTimeout
from rocket_mpi.fabric import choose, fabric_precheck, make_fabric, verbs_status
from rocket_mpi.fabric.base import DoorbellFabric
from rocket_mpi.runtime.decode import pick_device
from rocket_mpi.runtime.dist import collective, run_guarded, wait_all, watchdog, world
from rocket_mpi.settings import Settings

HIDDEN = 32                  # bench rows of 64 bytes: sizes are whole rows
ROW = HIDDEN * 2
DEFAULT_SIZES = "2K,8K,32K,128K,512K,1M,4M"  # the report's rows
MAX_DEPTH = 64               # stream messages in flight at most (ib_write_bw's default tx depth is 128)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


# -- command line ---------------------------------------------------------------------------------
def parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", s, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"'{s}' is not a size like 2048, 2K, 4M")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_sizes(spec: str) -> list[int]:
    """'2K..4M' (every power of two from 2K to 4M) or '2K,8K,1M'; each a positive multiple of 64 bytes."""
    if ".." in spec:
        lo, hi = (parse_size(x) for x in spec.split("..", 1))
        if lo <= 0 or hi < lo:
            raise argparse.ArgumentTypeError(f"'{spec}': want LOW..HIGH with 0 < LOW <= HIGH")
        sizes = []
        while lo <= hi:
            sizes.append(lo)
            lo *= 2
    else:
        sizes = [parse_size(x) for x in spec.split(",") if x.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError(f"'{spec}' lists no size")
    for n in sizes:
        if n <= 0 or n % ROW:
            raise argparse.ArgumentTypeError(f"size {n} is not a positive multiple of {ROW} bytes (one bench row)")
    return sorted(set(sizes))


def add_parser(sub, formatter) -> None:
    p = sub.add_parser("fabric-bench", help="transport table of a fabric (run under mpiexec -n 2)",
                       description=__doc__, formatter_class=formatter)
    add_fabric_flags(p, choices=("auto", "shm", "mpi", "verbs", "cuda-ipc", "nccl"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: rows live on each rank's GPU (cuda-ipc, nccl); pingpong only")
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
                   help=f"message sizes, '2K..4M' (powers of two) or a list (default {DEFAULT_SIZES})")
    p.add_argument("--iters", type=pos_int, default=None,
                   help="messages (or exchanges) per repetition (default: 64 MiB worth, 100..5000)")
    p.add_argument("--reps", type=pos_int, default=5, help="repetitions; the table shows medians")
    p.add_argument("--plot", help="write GB/s and us against size to this PNG (needs matplotlib)")
    p.add_argument("--perftest", action="store_true",
                   help="also run ib_write_bw / ib_write_lat on the same sizes and rails (verbs) and compare")
    p.add_argument("--perftest-iters", type=pos_int, default=1000, help="perftest's -n")
    p.add_argument("--graph", action="store_true",
                   help="--device cuda: the exchange as the graphed decode step runs it, captured in a CUDA graph, "
                        "beside a plain peer copy (cli/graph_bench.py)")
    p.add_argument("--versus", choices=("cuda-ipc", "nccl"),
                   help="--graph: also time the same exchanges over this fabric in the same run, side by side")


# -- entry -----------------------------------------------------------------------------------------------
def main(args, settings: Settings) -> int:
    comm = world(max(args.fabric_timeout, 60.0))
    rank, size = (comm.rank, comm.size) if comm else (0, 1)
    if size != 2:
        if rank == 0:
            print(f"rocket_mpi: error: fabric-bench needs exactly 2 ranks (mpiexec -n 2 python -m rocket_mpi "
                  f"fabric-bench ...), got {size}", file=sys.stderr, flush=True)
        return 1
    return run_guarded(comm, "rocket_mpi", lambda: _bench(args, settings, comm))


def _bench(args, settings: Settings, comm) -> int:
    device = torch.device("cpu")
    if args.device == "cuda":
        device = pick_device("cuda", comm)
    with watchdog(comm, args.fabric_timeout, "choosing the fabric"):
        name = choose(args.fabric, comm, args.device, settings.hostname)

    def precheck():
        if args.perftest:  # first: without perftest or a device there is nothing to compare, whatever the fabric
            why = perftest_status()
            if why:
                raise FabricError(f"--perftest: nothing to compare: {why}")
            if name != "verbs":
                raise FabricError(f"--perftest compares ib_write_bw/ib_write_lat with --fabric verbs, not {name}")
        fabric_precheck(name, args.device)
        if args.rails and name not in ("shm", "verbs"):
            raise FabricError(f"--rails applies to --fabric shm or verbs, not {name}")
        if args.graph and (args.device != "cuda" or name not in ("cuda-ipc", "nccl", "shm", "verbs")):
            raise FabricError(f"--graph needs --device cuda and a GPU fabric (cuda-ipc, nccl, shm, verbs), not "
                              f"{args.device}/{name}")
        if args.versus and (not args.graph or args.versus == name):
            raise FabricError(f"--versus {args.versus} compares two fabrics' graphed exchanges: it needs --graph and "
                              f"another --fabric")
        if args.versus:
            fabric_precheck(args.versus, args.device)
        if name == "shm" and args.rails and not args.rails.isdigit():
            raise FabricError(f"--rails {args.rails}: shm takes a count of virtual rails")
    collective(comm, args.fabric_timeout, "fabric checks", precheck)

    rails = None
    if args.rails:
        rails = int(args.rails) if name == "shm" else args.rails.split(",")
    max_rows = 2 * max(args.sizes) // ROW  # pingpong: both blocks in one row set; a stream: a ring of >= 4
    with watchdog(comm, max(args.fabric_timeout, 60.0), f"setting up fabric {name}"):
        fab = make_fabric(name, comm, max_rows, HIDDEN, args.fabric_timeout, rails, args.rail_split_min_bytes,
                          args.gid_index, device, settings.hostname)
    if args.graph:
        versus = None
        try:
            if args.versus:
                with watchdog(comm, max(args.fabric_timeout, 60.0), f"setting up fabric {args.versus}"):
                    versus = make_fabric(args.versus, comm, max_rows, HIDDEN, args.fabric_timeout, None,
                                         args.rail_split_min_bytes, None, device, settings.hostname)
            results = graph_bench.run(fab, comm, args.sizes, args.iters, args.reps, device, versus)
        finally:
            fab.close()
            if versus is not None:
                versus.close()
        if comm.rank == 0:
            print(graph_bench.format_table(results, describe(fab, args)), flush=True)
        return 0
    try:
        bench = Bench(fab, comm, args.fabric_timeout, device)
        results = [bench.measure(n, iters_for(n, args.iters), args.reps) for n in args.sizes]
        cmp = run_perftest(comm, fab, args.sizes, args.perftest_iters, args.fabric_timeout) if args.perftest else None
    finally:
        fab.close()
    if comm.rank == 0:
        print(format_table(results, describe(fab, args)))
        if cmp is not None:
            print()
            print(format_perftest(results, cmp, len(getattr(fab, "ports", [])) or 1))
        if args.plot:
            plot(results, cmp, args.plot, describe(fab, args))
        sys.stdout.flush()
    return 0


def describe(fab, args) -> str:
    if getattr(fab, "ports", None):
        rails = f"rails {','.join(map(str, fab.ports))}"
    elif getattr(fab, "rails", 1) > 1:
        rails = f"{fab.rails} virtual rails"
    else:
        rails = "1 rail" if hasattr(fab, "rails") else "no rails"
    split = f", split at {args.rail_split_min_bytes} B" if getattr(fab, "rails", 1) > 1 else ""
    iters = f"{args.iters} messages" if args.iters else "64 MiB of messages (100..5000)"
    return f"fabric {fab.name}, 2 ranks, {rails}{split}; medians of {args.reps} repetitions x {iters}"


def iters_for(nbytes: int, iters: int | None) -> int:
    """--iters, else enough messages that one scheduling hiccup on a shared host does not set a small row."""
    return iters or max(100, min(5000, (64 << 20) // nbytes))


# -- measuring ---------------------------------------------------------------------------------------------
def pattern(nbytes: int, sender: int) -> torch.Tensor:
    """Bytes that name their sender and position, so a misplaced or stale message shows."""
    return ((torch.arange(nbytes, dtype=torch.int64) * 131 + 17 * sender + 1) % 251).to(torch.uint8)


class Bench:
    """Both ranks run the same calls in the same order; `seq` stays in step on both."""

    def __init__(self, fab, comm, timeout: float, device=torch.device("cpu")):
        self.fab, self.comm, self.timeout = fab, comm, timeout
        self.device = device  # a GPU fabric: blocks on the GPU, exchanges only (no one-sided streams)
        self.rank, self.peer = comm.rank, 1 - comm.rank
        self.seq = 0
        self.doorbell = isinstance(fab, DoorbellFabric)
        self._mpi_rings: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def sync(self, what: str) -> None:
        """A barrier that spins (dist.wait_all naps 1 ms, which would skew who starts a timed run first)."""
        req = self.comm.Ibarrier()
        deadline = time.monotonic() + self.timeout
        while not req.Test():
            if time.monotonic() > deadline:
                raise FabricTimeout(f"rank {self.rank}: timed out after {self.timeout:g} s waiting for rank "
                                    f"{self.peer} before {what}")
            time.sleep(0)

    # one exchange() per call, both ranks sending nbytes
    def exchange(self, nbytes: int, block: torch.Tensor, step: int) -> torch.Tensor:
        r = nbytes // ROW
        self.seq += 1
        return self.fab.exchange(self.seq, [0, r, 2 * r], block, -1, step)

    def stream(self, nbytes: int, count: int, send: bool, recv: bool, rails: int | None = None) -> float:
        """Seconds this rank spent in a stream (oneway: rank 0 sends; duplex: both)."""
        t0 = time.perf_counter()
        if self.doorbell:
            self.seq = self.fab.stream(self.peer, nbytes, count, send, recv, self.seq, rails, MAX_DEPTH)
        else:
            tx, rx = self.mpi_rings(nbytes)
            mpi_stream(self.fab.comm, self.peer, tx, rx, nbytes, count, send, recv, self.timeout)
        return time.perf_counter() - t0

    def rings(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(tx, rx, stride, depth): the byte rings a stream of nbytes sends from and receives into."""
        if self.doorbell:
            stride, depth = self.fab.stream_depth(nbytes, MAX_DEPTH)
            return (self.fab.stream_ring(self.peer, send=True), self.fab.stream_ring(self.peer, send=False),
                    stride, depth)
        tx, rx = self.mpi_rings(nbytes)
        stride = -(-nbytes // 64) * 64
        return torch.from_numpy(tx), torch.from_numpy(rx), stride, len(tx) // stride

    def pingpong(self, nbytes: int, iters: int, reps: int) -> float:
        """Median us of one symmetric exchange in flight (what a decode step blocks on per MoE layer)."""
        block = pattern(nbytes, self.rank).view(torch.bfloat16).view(nbytes // ROW, HIDDEN).to(self.device)
        for i in range(3):  # warm the path
            self.exchange(nbytes, block, i)
        ping = []
        for _ in range(reps):
            self.sync("a pingpong repetition")
            t0 = time.perf_counter()
            for i in range(iters):
                self.exchange(nbytes, block, i)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            ping.append((time.perf_counter() - t0) / iters)
        return statistics.median(ping) * 1e6

    def mpi_rings(self, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        if nbytes not in self._mpi_rings:
            stride = -(-nbytes // 64) * 64
            depth = max(2, min(MAX_DEPTH, 2 * self.fab.max_rows * ROW // stride))  # as the doorbell fabrics
            self._mpi_rings = {nbytes: (np.zeros(depth * stride, np.uint8), np.zeros(depth * stride, np.uint8))}
        return self._mpi_rings[nbytes]

    def check(self, nbytes: int) -> None:
        """Before timing: exchanged rows and streamed messages arrive as the bytes that were sent."""
        r = nbytes // ROW
        block = pattern(nbytes, self.rank).view(torch.bfloat16).view(r, HIDDEN).to(self.device)
        rows = self.exchange(nbytes, block, 0)
        got = rows[self.peer * r:(self.peer + 1) * r].reshape(-1).view(torch.uint8).cpu()
        if not torch.equal(got, pattern(nbytes, self.peer)):
            raise FabricError(f"rank {self.rank}: fabric {self.fab.name}: the {nbytes}-byte block exchanged from "
                              f"rank {self.peer} differs from what it sent")
        self.sync("the exchange check")
        if self.device.type != "cpu":
            return
        for mode, send, recv in (("oneway", self.rank == 0, self.rank == 1), ("duplex", True, True)):
            tx, rx, stride, depth = self.rings(nbytes)
            if send:
                for p in range(depth):
                    tx[p * stride:p * stride + nbytes] = pattern(nbytes, self.rank)
            self.sync(f"the {mode} check")
            self.stream(nbytes, depth + 1, send, recv)  # depth + 1: the ring wraps once
            if recv:
                want = pattern(nbytes, self.peer)
                bad = [p for p in range(depth) if not torch.equal(rx[p * stride:p * stride + nbytes], want)]
                if bad:
                    raise FabricError(f"rank {self.rank}: fabric {self.fab.name}: {mode} stream of {nbytes}-byte "
                                      f"messages from rank {self.peer}: ring position {bad[0]} holds other bytes")
            self.sync(f"the end of the {mode} check")

    def measure(self, nbytes: int, iters: int, reps: int) -> dict:
        self.check(nbytes)
        out = {"bytes": nbytes}
        if self.device.type != "cpu":  # GPU fabrics: the round trip a decode step blocks on, nothing else
            out["oneway_gbs"] = out["duplex_gbs"] = float("nan")
            out["pingpong_us"] = self.pingpong(nbytes, iters, reps)
            return out
        oneway = []
        for _ in range(reps):
            self.sync("a oneway repetition")
            oneway.append(self.stream(nbytes, iters, self.rank == 0, self.rank == 1))
        out["oneway_gbs"] = nbytes * iters / statistics.median(oneway) / 1e9  # rank 0's clock (sender)
        if getattr(self.fab, "rails", 1) > 1:
            one = []
            for _ in range(reps):
                self.sync("a one-rail repetition")
                one.append(self.stream(nbytes, iters, self.rank == 0, self.rank == 1, rails=1))
            out["one_rail_gbs"] = nbytes * iters / statistics.median(one) / 1e9
        out["pingpong_us"] = self.pingpong(nbytes, iters, reps)
        duplex = []
        for _ in range(reps):
            self.sync("a duplex repetition")
            t = self.stream(nbytes, iters, True, True)
            duplex.append(max(self.comm.allgather(t)))  # the pair is done when the slower side is
        out["duplex_gbs"] = 2 * nbytes * iters / statistics.median(duplex) / 1e9
        return out


def mpi_stream(comm, peer: int, tx: np.ndarray, rx: np.ndarray, nbytes: int, count: int, send: bool, recv: bool,
               timeout: float) -> None:
    """The mpi fabric's oneway/duplex: nonblocking point-to-point on its private communicator (what its
    exchange() uses), at most `depth` messages in flight per direction; oneway ends with the receiver's ack."""
    from mpi4py import MPI
    data_tag, ack_tag = 32000, 32001
    stride = -(-nbytes // 64) * 64
    depth = len(tx) // stride
    tx_q: deque = deque()
    rx_q: deque = deque()
    sent = posted = got = spins = 0
    deadline = time.monotonic() + timeout
    while (send and (sent < count or tx_q)) or (recv and got < count):
        moved = False
        if send:
            while tx_q and tx_q[0].Test():
                tx_q.popleft()
                moved = True
            while sent < count and len(tx_q) < depth:  # position sent % depth: its last send has completed
                p = (sent % depth) * stride
                tx_q.append(comm.Isend([tx[p:p + nbytes], MPI.BYTE], dest=peer, tag=data_tag))
                sent += 1
                moved = True
        if recv:
            while rx_q and rx_q[0].Test():
                rx_q.popleft()
                got += 1
                moved = True
            while posted < count and len(rx_q) < depth:
                p = (posted % depth) * stride
                rx_q.append(comm.Irecv([rx[p:p + nbytes], MPI.BYTE], source=peer, tag=data_tag))
                posted += 1
        if moved:
            spins, deadline = 0, time.monotonic() + timeout
        else:
            spins += 1
            if time.monotonic() > deadline:
                raise FabricTimeout(f"rank {comm.rank}: fabric mpi timed out after {timeout:g} s in a stream with "
                                    f"rank {peer} (sent {sent}, received {got} of {count}): peer dead or stalled")
            if spins > 1000:
                time.sleep(20e-6)
    if send != recv:  # oneway: the sender's time ends when the receiver has everything
        flag = np.zeros(1, np.uint8)
        req = (comm.Irecv([flag, MPI.BYTE], source=peer, tag=ack_tag) if send else
               comm.Isend([flag, MPI.BYTE], dest=peer, tag=ack_tag))
        deadline = time.monotonic() + timeout
        while not req.Test():
            if time.monotonic() > deadline:
                raise FabricTimeout(f"rank {comm.rank}: fabric mpi timed out after {timeout:g} s waiting for the "
                                    f"stream acknowledgement with rank {peer}")
            time.sleep(20e-6)


# -- report ------------------------------------------------------------------------------------------------
def format_table(results: list[dict], header: str) -> str:
    cols = [("oneway GB/s", "oneway_gbs")]
    if any("one_rail_gbs" in r for r in results):
        cols.append(("1-rail GB/s", "one_rail_gbs"))
    cols += [("pingpong us", "pingpong_us"), ("duplex GB/s", "duplex_gbs")]
    cols = [c for c in cols if not all(r[c[1]] != r[c[1]] for r in results)]  # all NaN: not measured (GPU)
    lines = [f"fabric-bench: {header}", f"{'message':>9}  " + "  ".join(f"{c[0]:>12}" for c in cols)]
    for r in results:
        lines.append(f"{human(r['bytes']):>9}  " + "  ".join(f"{num(r[key]):>12}" for _, key in cols))
    return "\n".join(lines)


def parse_table(text: str) -> list[dict]:
    """The rows of format_table's output as {column: value} (message sizes as text); for tests and scripts."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    i = next(k for k, ln in enumerate(lines) if ln.lstrip().startswith("message"))
    names = re.split(r"\s{2,}", lines[i].strip())
    rows = []
    for ln in lines[i + 1:]:
        cells = re.split(r"\s{2,}", ln.strip())
        if len(cells) != len(names) or not re.fullmatch(r"\d+ (B|KiB|MiB)", cells[0]):
            break
        rows.append({n: (c if n == "message" else float(c)) for n, c in zip(names, cells)})
    return rows


def plot(results: list[dict], cmp: dict | None, path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("fabric-bench: matplotlib is not importable (pip install matplotlib); no plot written")
        return
    x = [r["bytes"] for r in results]
    fig, (bw, lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("oneway_gbs", "oneway"), ("one_rail_gbs", "oneway, 1 rail"), ("duplex_gbs", "duplex")):
        if all(key in r for r in results):
            bw.plot(x, [r[key] for r in results], marker="o", label=label)
    lat.plot(x, [r["pingpong_us"] for r in results], marker="o", label="pingpong (exchange)")
    if cmp:
        bw.plot(x, [cmp[n][0] for n in x], marker="x", linestyle="--", label="ib_write_bw")
        lat.plot(x, [cmp[n][1] for n in x], marker="x", linestyle="--", label="ib_write_lat")
    for ax, ylabel in ((bw, "GB/s"), (lat, "us")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message bytes")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    lat.set_yscale("log")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"fabric-bench: plot written to {path}")


# -- perftest ------------------------------------------------------------------------------------------------
PERFTEST_PORT = 18515


def perftest_status() -> str | None:
    """None where ib_write_bw, ib_write_lat and an ACTIVE RDMA port are all here, else what is missing."""
    missing = [b for b in ("ib_write_bw", "ib_write_lat") if shutil.which(b) is None]
    if missing:
        return f"{' and '.join(missing)} not found (apt-get install perftest)"
    return verbs_status()


def perftest_cmd(tool: str, rail, gid_index: int, nbytes: int, iters: int, port: int, server: str | None) -> list[str]:
    cmd = [tool, "-d", rail.device, "-i", str(rail.port), "-x", str(gid_index), "-s", str(nbytes), "-n", str(iters),
           "-F", "-p", str(port)]
    if tool == "ib_write_bw":
        cmd.append("--report_gbits")
    return cmd + ([server] if server else [])


def parse_perftest(tool: str, nbytes: int, out: str) -> float:
    """ib_write_bw --report_gbits: BW average [Gb/s] -> GB/s; ib_write_lat: t_typical (the median) in us."""
    for line in out.splitlines():
        tok = line.split()
        if len(tok) >= 5 and tok[0] == str(nbytes) and tok[1].isdigit():
            return float(tok[3]) / 8 if tool == "ib_write_bw" else float(tok[4])
    tail = " | ".join(out.strip().splitlines()[-3:])
    raise FabricError(f"{tool} -s {nbytes}: no result row in its output ({tail or 'empty'})")


def run_perftest(comm, fab, sizes: list[int], iters: int, timeout: float) -> dict[int, tuple[float, float]]:
    """Rank 1 serves, rank 0 connects; ib_write_bw on every rail at once (one tcp port each), ib_write_lat on
    rail 0. Returns, on rank 0, size -> (ib_write_bw GB/s summed over rails, ib_write_lat us)."""
    server = comm.allgather(socket.gethostname())[1]
    out = {}
    for n in sizes:
        got = []
        for tool, rails in (("ib_write_bw", list(enumerate(fab.ports))), ("ib_write_lat", [(0, fab.ports[0])])):
            procs = []
            if comm.rank == 1:
                procs = [_spawn(perftest_cmd(tool, r, fab.gid_index[i], n, iters, PERFTEST_PORT + i, None))
                         for i, r in rails]
            wait_all(comm, timeout, f"{tool} servers")
            if comm.rank == 0:
                time.sleep(0.5)  # the servers listen only once they have opened the device
                procs = [_spawn(perftest_cmd(tool, r, fab.gid_index[i], n, iters, PERFTEST_PORT + i, server))
                         for i, r in rails]
            outs = [_finish(p, tool, n, 4 * timeout) for p in procs]
            if comm.rank == 0:
                vals = [parse_perftest(tool, n, o) for o in outs]
                got.append(sum(vals) if tool == "ib_write_bw" else vals[0])
            wait_all(comm, 4 * timeout, f"the end of {tool} -s {n}")
        if comm.rank == 0:
            out[n] = (got[0], got[1])
    return out


def _spawn(cmd: list[str]) -> subprocess.Popen:
    try:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        raise FabricError(f"cannot start {cmd[0]}: {e}") from None


def _finish(p: subprocess.Popen, tool: str, nbytes: int, timeout: float) -> str:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise FabricError(f"{tool} -s {nbytes} did not finish within {timeout:g} s") from None
    if p.returncode != 0:
        tail = " | ".join(out.strip().splitlines()[-2:])
        raise FabricError(f"{' '.join(p.args[:7])} ... exited {p.returncode}: {tail}")
    return out


def format_perftest(results: list[dict], cmp: dict, rails: int) -> str:
    lines = [f"perftest: ib_write_bw on {rails} rail(s) at once (summed), ib_write_lat on rail 0 (half a round trip)",
             f"{'message':>9}  {'oneway GB/s':>12}  {'ib_write_bw GB/s':>16}  {'of perftest':>11}  "
             f"{'pingpong us':>12}  {'ib_write_lat us':>15}"]
    for r in results:
        bw, lat = cmp[r["bytes"]]
        share = f"{100 * r['oneway_gbs'] / bw:.0f}%" if bw > 0 else "-"
        lines.append(f"{human(r['bytes']):>9}  {num(r['oneway_gbs']):>12}  {num(bw):>16}  {share:>11}  "
                     f"{num(r['pingpong_us']):>12}  {num(lat):>15}")
    return "\n".join(lines)
