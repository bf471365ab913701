"""What a run says while it goes: log lines that name the rank, and rank 0's progress bars (both on stderr)."""
from __future__ import annotations

import logging
import sys

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
