"""MPI bootstrap only: who we are, the handshake, and collectives with timeouts.

Nothing here runs on the per-layer path (except the mpi fabric, which is its own module).
"""
from __future__ import annotations

import array
import atexit
import ctypes
import fcntl
import mmap
import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import termios
import time

from rocket_mpi.errors import AgreedError, FabricTimeout, RocketError

_MPI_ENV = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")


def launched_by_mpi() -> bool:
    return any(v in os.environ for v in _MPI_ENV)


_RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "MV2_COMM_WORLD_RANK")


def world(timeout: float = 600.0):
    """COMM_WORLD when started by mpirun/srun, else None (one rank, no MPI at all). MPI_Init (the mpi4py import)
    waits for every rank of the job: one that never starts would hold the others there for ever, so a rank still in
    it after `timeout` seconds says so and exits. Under MPICH's mpiexec (hydra), whose own line for a dead rank
    names a PID (often not the rank's that died), this process first becomes the rank's sentinel and the rank goes
    on in a child (Sentinel): it names the ranks of its host that never reached MPI_Init, and a rank that dies
    without a word (kill -9, a crash) with its host, decode step and layer, before the launcher ends the job. Open
    MPI's mpirun and srun name a dead rank themselves; there a watchdog process bounds MPI_Init (and srun's PMI-2
    start-up fails in a rank forked off the task it started)."""
    if not launched_by_mpi():
        return None
    if "PMI_FD" in os.environ:
        # srun --mpi=pmi2 with the mpich wheel: its UCX transport's start-up lines can pass the 1024 bytes Slurm's
        # pmi2 plugin reads at once, and a job across nodes then hangs in MPI_Init; OFI's lines are far shorter
        os.environ.setdefault("MPIR_CVAR_CH4_NETMOD", "ofi")
    rank, guard = _env_rank(os.environ), None
    if "HYDI_CONTROL_FD" in os.environ:  # a rank of MPICH's hydra
        Sentinel.start(rank, timeout)  # from here on: the rank
    else:
        msg = (f"rocket_mpi: error: rank {_name(rank)}: MPI_Init did not complete in {timeout:g} s: a rank of the job "
               f"did not start, or the launcher cannot reach it (--startup-timeout)")
        guard = subprocess.Popen([sys.executable, "-c", _INIT_WATCHDOG, str(os.getpid()), str(timeout), msg],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RocketError(f"started under an MPI launcher but mpi4py cannot be imported ({e})") from None
    finally:
        if guard is not None:
            guard.kill()
            guard.wait()
    _note(STATE, RUNNING)
    return MPI.COMM_WORLD


# the MPI_Init bound where there is no sentinel: a process of its own (MPI_Init holds the interpreter), which ends
# the rank if init outlasts the timeout and is itself ended as soon as init returns
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


def _env_rank(env) -> int | None:
    v = next((env[k] for k in _RANK_ENV if k in env), None)
    return int(v) if v is not None and v.isdigit() else None


# -- the sentinel ----------------------------------------------------------------------------------------------
# A rank's words, shared with its sentinel (an anonymous shared page, so nothing outlives the two processes)
STATE, STEP, LAYER = 0, 1, 2
STARTING, RUNNING, ENDING = 0, 1, 2     # STATE: in MPI_Init; past it; ending on purpose (done, or said why)
_words = None                           # memoryview of int64 words in the rank, None outside a launcher
_FORWARD = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCONT", "SIGALRM")
PR_SET_PDEATHSIG = 1


def _note(word: int, value: int) -> None:
    if _words is not None:
        _words[word] = value


def mark(step: int, layer: int = -1) -> None:
    """Where this rank is, for its sentinel to say if the rank dies: the decode step and the MoE layer."""
    if _words is not None:
        _words[STEP], _words[LAYER] = step, layer


def ending() -> None:
    """This rank ends on purpose (its work done, or after printing why): its sentinel stays silent."""
    _note(STATE, ENDING)


class Sentinel:
    """The process the launcher started, kept as the parent of the rank: it forwards the launcher's signals, waits
    for the rank, and exits as the rank did. A rank that ended without saying why (killed, crashed, os._exit) is
    named here, first: the launcher learns of the death only when the sentinel exits, so the line is always out
    before it ends the job. The rank runs in a process group of its own (a signal to the launcher's group reaches
    it once, forwarded) and is killed by the kernel if its sentinel dies (PR_SET_PDEATHSIG), so a launcher's
    SIGKILL of the group ends both and a rank the launcher killed is never named."""

    @classmethod
    def start(cls, rank: int | None, timeout: float) -> None:
        """Fork; return in the child, which goes on as the rank. The parent never returns."""
        global _words
        page = mmap.mmap(-1, mmap.PAGESIZE)  # MAP_SHARED | MAP_ANONYMOUS: one page seen by both sides
        words = memoryview(page).cast("q")
        words[STEP] = words[LAYER] = -1
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        child = os.fork()
        if child == 0:
            os.setpgid(0, 0)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # the sentinel died before the line above
                os._exit(1)
            _words = words
            atexit.register(ending)  # a normal exit, sys.exit, an uncaught exception's traceback: all said why
            return
        try:
            os.setpgid(child, child)
        except OSError:  # the child did it first, or is gone already
            pass
        try:
            code = cls(child, words, rank, timeout).watch()
        except BaseException as e:  # noqa: BLE001 - a bug here must not leave the rank unwatched: it dies with us
            print(f"rocket_mpi: internal error in the sentinel of rank {_name(rank)}: {e!r}", file=sys.stderr,
                  flush=True)
            code = 3
        os._exit(code)

    def __init__(self, child: int, words, rank: int | None, timeout: float):
        self.child, self.words, self.rank, self.timeout = child, words, rank, timeout
        self.asked: list[int] = []  # signals the launcher (or a user) sent: the rank ends because it was told to

    def _forward(self, sig, _frame) -> None:
        if sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            self.asked.append(sig)
        try:
            os.kill(self.child, sig)
        except ProcessLookupError:
            pass

    def watch(self) -> int:
        """Wait for the rank -> the exit status to end with (-N: killed by signal N, which the caller re-raises)."""
        for name in _FORWARD:
            signal.signal(getattr(signal, name), self._forward)
        try:
            fd = os.pidfd_open(self.child)
        except (AttributeError, OSError):  # Linux before 5.3: poll
            fd = None
        deadline = time.monotonic() + self.timeout
        while True:
            pid, status = os.waitpid(self.child, os.WNOHANG)
            if pid:
                break
            starting = self.words[STATE] == STARTING and not self.asked
            if starting and time.monotonic() > deadline:
                return self._init_timeout()
            wait = min(max(deadline - time.monotonic(), 0.0), 1.0) if starting else 1.0
            if fd is not None:
                select.select([fd], [], [], wait)
            else:
                time.sleep(min(wait, 0.05))
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and self.words[STATE] != ENDING and not self.asked:
            print(f"rocket_mpi: error: {self.obituary(code)}", file=sys.stderr, flush=True)
        if -code in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            if -code != signal.SIGKILL:  # end as the rank did, so the launcher reports the same signal
                signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
            time.sleep(1)
        return code if code >= 0 else 128 - code  # a signal that would dump the sentinel's core: the shell's code

    def obituary(self, code: int) -> str:
        how = (f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else
               f"exited with status {code}")
        where = {STARTING: "in MPI_Init", RUNNING: "in set-up", ENDING: ""}[self.words[STATE]]
        step, layer = self.words[STEP], self.words[LAYER]
        if step >= 0:
            where = f"at decode step {step}" + (f", layer {layer}" if layer >= 0 else "")
        return (f"rank {_name(self.rank)} (pid {self.child} on {socket.gethostname()}) died {where}, {how}, "
                f"without an error of its own")

    def _init_timeout(self) -> int:
        """MPI_Init outlasted the timeout: the lowest rank of this host still in it names the ranks of this host
        that never reached it (the others stay silent: one line); every one ends its rank."""
        here, missing = local_arrivals()
        lowest = min([r for r in here if r is not None] or [self.rank], default=None)
        if self.rank == lowest or self.rank is None:
            if missing:
                why = ", ".join(f"rank {_name(r)} (pid {p})" for r, p in missing) + " of this host never reached it"
            else:
                why = "every rank of this host is in it: a rank on another host did not start, or the launcher " \
                      "cannot reach it"
            print(f"rocket_mpi: error: rank {_name(self.rank)}: MPI_Init did not complete in {self.timeout:g} s: "
                  f"{why} (--startup-timeout)", file=sys.stderr, flush=True)
        else:
            time.sleep(2.0)  # the lowest rank speaks; do not end the job before it has
        os.kill(self.child, signal.SIGKILL)
        os.waitpid(self.child, 0)
        return 1


def _name(rank: int | None) -> str:
    return "?" if rank is None else str(rank)


def local_arrivals() -> tuple[list[int | None], list[tuple[int | None, int]]]:
    """The launcher's processes on this host (this process's siblings): (the ranks that reached world(), which
    forks a rank off a sentinel; [(rank, pid)] of the ones that did not). From /proc; ([], []) elsewhere."""
    launcher = os.getppid()
    parents = _parents()
    here, missing = [], []
    for pid in sorted(p for p, pp in parents.items() if pp == launcher):
        if any(pp == pid for pp in parents.values()):
            here.append(_pid_rank(pid))
        else:
            missing.append((_pid_rank(pid), pid))
    return here, missing


def local_rank(comm) -> int:
    if comm is None:
        return 0
    from mpi4py import MPI
    return comm.Split_type(MPI.COMM_TYPE_SHARED).rank


ARRIVAL_TAG = 7302  # wait_all's arrival notes to rank 0 (COMM_WORLD; the fabrics have communicators of their own)
ARRIVAL_GRACE = 2.0  # s the other ranks wait past rank 0, so that rank 0, which knows who is missing, speaks first


def wait_all(comm, timeout: float, what: str) -> None:
    """A barrier that gives up after `timeout` s, naming what it waited for. Each rank also tells rank 0 it has
    arrived, so on a timeout rank 0 names the ranks that never did (and, on its host, their state); the others give
    rank 0 ARRIVAL_GRACE s more before they speak."""
    if comm is None or comm.size == 1:
        return
    import numpy as np
    bufs = np.zeros(comm.size, dtype=np.int32)  # rank 0: one word per rank to land in; the others: their note
    if comm.rank == 0:
        notes = {r: comm.Irecv(bufs[r:r + 1], source=r, tag=ARRIVAL_TAG) for r in range(1, comm.size)}
        sent = None
    else:
        # synchronous: it completes once rank 0 has the note, so no rank leaves here with its note unsent (an
        # eager send over MPICH's OFI netmod may wait for the sender's next MPI call, which could be far off)
        sent, notes = comm.Issend(bufs[:1], dest=0, tag=ARRIVAL_TAG), {}

    def late():
        missing = [r for r, q in notes.items() if not q.Test()]
        named = f" (never arrived: {', '.join(f'rank {r}{_state_here(r)}' for r in missing)})" if missing else ""
        return f"rank {comm.rank}: timed out after {timeout:g} s waiting for all ranks to reach {what}{named}"
    _wait(comm.Ibarrier(), timeout + (0 if comm.rank == 0 else ARRIVAL_GRACE), late)
    for q in list(notes.values()) + ([sent] if sent is not None else []):  # sent before the barrier: done or soon
        _wait(q, timeout, late)


def _state_here(rank: int) -> str:
    """', pid P on this host, stopped (SIGSTOP?)' and the like where `rank` runs on this host (a rank's process is
    the child of its sentinel, a child of the launcher); '' elsewhere, or outside a launcher."""
    if _words is None:
        return ""
    mine = os.getppid()  # this rank's sentinel
    parents = _parents()
    launcher = parents.get(mine)
    for pid, parent in parents.items():
        if parent != mine and launcher is not None and parents.get(parent) == launcher and _pid_rank(pid) == rank:
            return f", pid {pid} on this host, {_proc_state(pid)}"
    return ""


def _parents() -> dict[int, int]:
    """{pid: its parent's pid} of every process here (/proc)."""
    out = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                out[pid] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    return out


def _pid_rank(pid: int) -> int | None:
    """The MPI rank a launcher gave process `pid` (its environment), None if none or unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)
    except OSError:
        return None
    return _env_rank(env)


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
        ending()
        print(f"rocket_mpi: error: rank {rank}: timed out after {self.timeout:g} s in {self.what} "
              f"(a peer is dead, stalled or failed earlier)", file=sys.stderr, flush=True)
        _drain()
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
    ending()
    sys.stdout.flush()
    sys.stderr.flush()
    if comm is not None and comm.size > 1:
        _drain()
        comm.Abort(code)
    sys.exit(code)


def _drain(timeout: float = 2.0) -> None:
    """Wait (at most `timeout` s) until the launcher has read what this rank wrote to stdout and stderr, where they
    are pipes to it: MPI_Abort ends the job at once, and a launcher that took the abort before the pipe lost the
    error line still in it (a stalled-peer run then ended with no line at all)."""
    end = time.monotonic() + timeout
    for fd in (1, 2):
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            left = array.array("i", [0])
            while time.monotonic() < end:
                fcntl.ioctl(fd, termios.FIONREAD, left)  # bytes in the pipe not yet read by the other end
                if left[0] == 0:
                    break
                time.sleep(0.002)
        except OSError:
            continue


# host and pid of every rank (boot gathers them): a timeout's line says where the rank it waited for is
_ranks: list[tuple[str, int]] = []


def remember_ranks(where: list[tuple[str, int]]) -> None:
    _ranks[:] = where


def whereabouts(msg: str, me: int) -> str:
    """The first other rank `msg` names, as ' (rank R is pid P on HOST[, its state])': on this host its state
    from /proc (stopped, a zombie, gone); '' when the message names none or the ranks are unknown."""
    for m in re.finditer(r"\brank (\d+)\b", msg):
        r = int(m.group(1))
        if r != me and r < len(_ranks):
            host, pid = _ranks[r]
            state = ""
            if host == socket.gethostname():
                state = ", " + _proc_state(pid)
            return f" (rank {r} is pid {pid} on {host}{state})"
    return ""


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"T": "stopped (SIGSTOP?)", "t": "stopped by a tracer", "Z": "dead (a zombie)", "D": "in uninterruptible "
            "I/O"}.get(code, "alive but not answering")


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
        code = fn()
        ending()
        return code
    except AgreedError as e:
        ending()
        if rank == 0:
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except RocketError as e:
        ending()
        where = whereabouts(str(e), rank) if isinstance(e, FabricTimeout) else ""
        print(f"{prog}: error: {e}{where}", file=sys.stderr, flush=True)
        abort(comm, 1)
    except Exception as e:
        import traceback
        ending()
        traceback.print_exc()
        print(f"{prog}: internal error on rank {rank}: {e!r}", file=sys.stderr, flush=True)
        abort(comm, 3)
    return 1
