"""What a run says while it goes: log lines that name the rank, and rank 0's progress bars (both on stderr)."""
from __future__ import annotations

import logging
import os
import sys
import time

from tqdm import tqdm

LEVELS = ("debug", "info", "warning", "error")
log = logging.getLogger("rocket_mpi")


def setup_logging(rank: int, level: str) -> None:
    """Timestamped lines prefixed with the rank. Only rank 0 speaks at info and below: the other ranks report
    warnings and errors, so N ranks do not print every line N times."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank}: %(message)s", "%H:%M:%S"))
    log.handlers[:] = [handler]
    log.propagate = False
    want = getattr(logging, level.upper())
    log.setLevel(want if rank == 0 else max(want, logging.WARNING))


def bar(desc: str, total: int, enabled: bool, unit: str = "it", items=None):
    """A progress bar on stderr over `items` (or updated by hand), a no-op where not enabled: ranks other than 0,
    --quiet, short runs."""
    return tqdm(items, total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr, leave=False,
                mininterval=0.5, dynamic_ncols=True)


def process_age() -> float | None:
    """Seconds since this process started (Linux's /proc), None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces; field 22 is the 20th after it
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


class Timeline:
    """Where a run's wall time goes, in named parts: the first is the process's life before the timeline began
    (the interpreter, the imports, MPI's start), each mark() the seconds since the one before."""

    def __init__(self):
        self.parts: dict[str, float] = {}
        age = process_age()
        if age is not None:
            self.parts["start"] = age
        self._t = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - self._t
        self._t = now
