"""MPI bootstrap only: who we are, the handshake, and collectives with timeouts.

Nothing here runs on the per-layer path (except the mpi fabric, which is its own module).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from rocket_mpi.errors import AgreedError, RocketError

_MPI_ENV = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")


def launched_by_mpi() -> bool:
    return any(v in os.environ for v in _MPI_ENV)


_RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "MV2_COMM_WORLD_RANK")


def world(timeout: float = 600.0):
    """COMM_WORLD when started by mpirun/srun, else None (one rank, no MPI at all). MPI_Init (the mpi4py import)
    waits for every rank of the job: one that never starts would hold the others there for ever, so a rank still
    in it after `timeout` seconds says so and exits."""
    if not launched_by_mpi():
        return None
    if "PMI_FD" in os.environ:
        # srun --mpi=pmi2 with the mpich wheel: its UCX transport's start-up lines can pass the 1024 bytes Slurm's
        # pmi2 plugin reads at once, and a job across nodes then hangs in MPI_Init; OFI's lines are far shorter
        os.environ.setdefault("MPIR_CVAR_CH4_NETMOD", "ofi")
    rank = next((os.environ[k] for k in _RANK_ENV if k in os.environ), "?")
    # MPI_Init holds the interpreter: the watchdog is a process of its own, which ends this one if init outlasts
    # the timeout, and is itself ended as soon as init returns
    msg = (f"rocket_mpi: error: rank {rank}: MPI_Init did not complete in {timeout:g} s: a rank of the job did not "
           f"start, or the launcher cannot reach it (--startup-timeout)")
    guard = subprocess.Popen([sys.executable, "-c", _INIT_WATCHDOG, str(os.getpid()), str(timeout), msg],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RocketError(f"started under an MPI launcher but mpi4py cannot be imported ({e})") from None
    finally:
        guard.kill()
        guard.wait()
    return MPI.COMM_WORLD


_INIT_WATCHDOG = """
import os, signal, sys, time
pid, timeout, msg = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
end = time.monotonic() + timeout
while time.monotonic() < end:
    time.sleep(0.2)
    if os.getppid() != pid:
        sys.exit(0)
print(msg, file=sys.stderr, flush=True)
os.kill(pid, signal.SIGKILL)
"""


def local_rank(comm) -> int:
    if comm is None:
        return 0
    from mpi4py import MPI
    return comm.Split_type(MPI.COMM_TYPE_SHARED).rank


def wait_all(comm, timeout: float, what: str) -> None:
    """A barrier that gives up after `timeout` s, naming what it waited for."""
    if comm is None or comm.size == 1:
        return
    _wait(comm.Ibarrier(), timeout,
          lambda: f"rank {comm.rank}: timed out after {timeout:g} s waiting for all ranks to reach {what}")


def _wait(req, timeout: float, what) -> None:
    deadline = time.monotonic() + timeout
    spins = 0
    while not req.Test():
        spins += 1
        if time.monotonic() > deadline:
            raise RocketError(what())
        time.sleep(0 if spins < 200 else 1e-4)  # a few hundred yields, then short sleeps


def bcast(comm, obj, timeout: float, what: str):
    """Rank 0's `obj` on every rank (pickled; a length, then the bytes), each wait bounded by `timeout` s."""
    if comm is None or comm.size == 1:
        return obj
    import pickle

    import numpy as np
    n = np.zeros(1, dtype=np.int64)
    data = None
    if comm.rank == 0:
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        n[0] = data.size
    late = lambda: (f"rank {comm.rank}: timed out after {timeout:g} s waiting for rank 0's {what} "  # noqa: E731
                    f"(rank 0 is dead, stalled or failed)")
    _wait(comm.Ibcast(n, root=0), timeout, late)
    if comm.rank != 0:
        data = np.empty(int(n[0]), dtype=np.uint8)
    _wait(comm.Ibcast(data, root=0), timeout, late)
    return obj if comm.rank == 0 else pickle.loads(data.tobytes())


ACK_TAG = 7301  # the followers' answers to rank 0's heartbeat (acknowledge)


def acknowledge(comm, timeout: float, what: str) -> None:
    """Every rank tells rank 0 it is alive; rank 0 waits at most `timeout` s and names the ranks that did not."""
    if comm is None or comm.size == 1:
        return
    import numpy as np
    if comm.rank != 0:
        comm.Isend(np.full(1, comm.rank, dtype=np.int32), dest=0, tag=ACK_TAG).Wait()
        return
    bufs = {r: np.zeros(1, dtype=np.int32) for r in range(1, comm.size)}
    reqs = {r: comm.Irecv(bufs[r], source=r, tag=ACK_TAG) for r in bufs}
    deadline = time.monotonic() + timeout
    while reqs:
        for r in [r for r, q in reqs.items() if q.Test()]:
            del reqs[r]
        if reqs and time.monotonic() > deadline:
            for q in reqs.values():
                q.Cancel()
            raise RocketError(f"rank 0: rank(s) {', '.join(map(str, sorted(reqs)))} did not answer within "
                              f"{timeout:g} s at {what} (dead or stalled)")
        time.sleep(1e-4)


def handshake(comm, facts: dict, timeout: float) -> None:
    """Every rank must agree on config, checkpoint fingerprint and flags; name the first that differs."""
    if comm is None or comm.size == 1:
        return
    wait_all(comm, timeout, "the start-up handshake")
    all_facts = comm.allgather(facts)
    ref = all_facts[0]
    for r, f in enumerate(all_facts[1:], start=1):
        for key in ref:
            if f.get(key) != ref[key]:
                raise AgreedError(f"rank {r} differs from rank 0 in {key}: {f.get(key)!r} vs {ref[key]!r}; "
                                  f"all ranks must run the same checkpoint and flags")


def verdict(comm, mine, judge, timeout: float, what: str) -> None:
    """Rank 0 gathers every rank's `mine` and judges them (judge(list) -> None, or one line saying what is wrong);
    every rank learns the verdict, and on a fault all raise it together (rank 0 prints it). Bounded by `timeout`."""
    if comm is None or comm.size == 1:
        return
    with watchdog(comm, timeout, what):
        gathered = comm.gather(mine, root=0)
    wrong = bcast(comm, judge(gathered) if comm.rank == 0 else None, timeout, f"verdict on {what}")
    if wrong:
        raise AgreedError(wrong)


class watchdog:
    """Bootstrap phases call collectives that have no timeout of their own (allgather inside a fabric's
    endpoint exchange, say). If a phase outlives `timeout`, print one line naming the rank and the
    phase, and end the whole job."""

    def __init__(self, comm, timeout: float, what: str):
        self.comm, self.timeout, self.what = comm, timeout, what
        self.timer = None

    def _fire(self):
        rank = self.comm.rank if self.comm is not None else 0
        print(f"rocket_mpi: error: rank {rank}: timed out after {self.timeout:g} s in {self.what} "
              f"(a peer is dead, stalled or failed earlier)", file=sys.stderr, flush=True)
        if self.comm is not None and self.comm.size > 1:
            self.comm.Abort(1)
        os._exit(1)

    def __enter__(self):
        import threading
        self.timer = threading.Timer(self.timeout, self._fire)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()


def abort(comm, code: int = 1) -> None:
    """End the whole job: under mpirun, MPI_Abort so no rank is left waiting."""
    sys.stdout.flush()
    sys.stderr.flush()
    if comm is not None and comm.size > 1:
        comm.Abort(code)
    sys.exit(code)


def collective(comm, timeout: float, what: str, fn):
    """Run a set-up step on every rank; if any rank fails, every rank learns it and rank 0 prints each
    distinct error once, naming the ranks. Returns fn()'s value."""
    val, err = None, None
    try:
        val = fn()
    except RocketError as e:
        err = str(e)
    if comm is None or comm.size == 1:
        if err:
            raise RocketError(err)
        return val
    wait_all(comm, timeout, what)
    errs = comm.allgather(err)
    if any(errs):
        by_msg: dict[str, list[int]] = {}
        for r, e in enumerate(errs):
            if e:
                by_msg.setdefault(e, []).append(r)
        lines = []
        for msg, ranks in by_msg.items():
            who = "all ranks" if len(ranks) == comm.size else "rank " + ",".join(map(str, ranks))
            # a message that already names its one rank ("rank 1 of 2: ...") needs no "(rank 1): " before it
            lines.append(msg if len(ranks) == 1 and msg.startswith(f"rank {ranks[0]} ") else f"({who}): {msg}")
        raise AgreedError("; ".join(lines))
    return val


def run_guarded(comm, prog: str, fn) -> int:
    """Run an SPMD command so that no failure leaves a peer waiting: an error every rank agreed on is
    printed once by rank 0 and all exit 1 together; a local error prints one line and aborts the job
    (MPI_Abort); a bug prints its traceback and aborts with status 3."""
    rank = comm.rank if comm is not None else 0
    try:
        return fn()
    except AgreedError as e:
        if rank == 0:
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except RocketError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        abort(comm, 1)
    except Exception as e:
        import traceback
        traceback.print_exc()
        print(f"{prog}: internal error on rank {rank}: {e!r}", file=sys.stderr, flush=True)
        abort(comm, 3)
    return 1
