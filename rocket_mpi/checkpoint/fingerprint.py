"""What each rank read of the checkpoint, byte for byte: a digest of the stored bytes of every tensor it loads.

The start-up handshake compares reader.fingerprint (config, index, every file's size and header, samples of its data)
before loading: another checkpoint of the same shapes differs there, a change that falls between its samples does
not. While a rank loads, a ContentLog keeps the xxh3-64 digest of the exact bytes of each tensor the reader hands out
(the replicated stack, the routers and their biases, the experts' scale table, the rank's own experts); after loading,
first_difference compares the logs of all ranks: a tensor that two ranks read must have the same bytes on both, so a
changed byte in anything shared (another seed, one flipped bit in one rank's copy) is named with the tensor, its file
and the rank.

What this cannot see: a routed expert's weights are read by their owner alone, so a change in the owner's copy of
them has nothing to be compared with. Another checkpoint differs in the fingerprint's samples of every file; a NaN or
Inf anywhere is refused as it loads (reader.all_finite); a finite change inside one expert's bytes that falls between
the samples goes through.

Cost: one xxh3 pass over the bytes a rank loads (xxhash, 4-15 GB/s a core, releasing the GIL), on worker threads
while the reader goes on, so on a host with spare cores it mostly hides behind the reads; benchmarks/bench_fingerprint.py
measures it.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xxhash

PENDING_MAX = 16  # tensors read but not yet hashed: the reader waits past this (bounds the memory they hold)
WORKERS = 2       # hashing threads


@dataclass(frozen=True)
class Entry:
    """One tensor as a rank read it."""
    digest: int     # xxh3-64 of its stored bytes
    nbytes: int
    file: str       # the file it came from (its name in the checkpoint folder)


def tensor_digest(t: torch.Tensor) -> int:
    """xxh3-64 of a CPU tensor's bytes in memory order (the stored bytes, for a tensor as safetensors returns it)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return xxhash.xxh3_64_intdigest(b"")
    return xxhash.xxh3_64_intdigest(flat.view(torch.uint8).numpy())


class ContentLog:
    """The digest of every tensor a CheckpointReader's get() returns, from record() until finish()."""

    def __init__(self, workers: int = WORKERS):
        self.entries: dict[str, Entry] = {}
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="checkpoint-digest")
        self._pending: list[tuple[str, str, int, Future]] = []
        self._reader = None
        self.seconds = 0.0  # the workers' time in xxh3, all of them together

    @classmethod
    def record(cls, reader, workers: int = WORKERS) -> "ContentLog":
        """Start logging what `reader` (a CheckpointReader) hands out."""
        log = cls(workers)
        reader.log, log._reader = log, reader
        return log

    def add(self, name: str, path: str, t: torch.Tensor) -> None:
        """Digest `t` (as read from `path`) on a worker; wait for the oldest when too many are pending."""
        if t.device.type != "cpu":
            t = t.cpu()
        self._pending.append((name, path, t.numel() * t.element_size(), self._pool.submit(self._digest, t)))
        while len(self._pending) > PENDING_MAX:
            self._collect(self._pending.pop(0))

    def _digest(self, t: torch.Tensor) -> int:
        t0 = time.perf_counter()
        d = tensor_digest(t)
        self.seconds += time.perf_counter() - t0
        return d

    def _collect(self, item) -> None:
        name, path, nbytes, fut = item
        self.entries[name] = Entry(fut.result(), nbytes, os.path.basename(path))

    def finish(self) -> dict[str, Entry]:
        """Wait for every digest and stop logging (later reads, an expert cache's misses, are not) -> the entries."""
        try:
            for item in self._pending:
                self._collect(item)
        finally:
            self._pending = []
            self._pool.shutdown(wait=True, cancel_futures=True)
            if self._reader is not None and self._reader.log is self:
                self._reader.log = None
            self._reader = None
        return self.entries

    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def summary(self) -> dict[str, tuple[int, int, str]]:
        """What a rank sends rank 0: {tensor: (digest, bytes, file)}."""
        return {name: (e.digest, e.nbytes, e.file) for name, e in self.entries.items()}


def first_difference(summaries: list[dict | None]) -> str | None:
    """None when every tensor read by two or more ranks has the same bytes on each of them; else one line naming
    the first such tensor (by name) and the first rank whose copy differs from the lowest rank that read it.
    summaries[r]: rank r's ContentLog.summary() (None: rank r logged nothing, a drawn preset)."""
    seen: dict[str, tuple[int, tuple]] = {}  # tensor -> (lowest rank that read it, its entry)
    diffs: dict[str, tuple[int, tuple, int, tuple]] = {}
    for rank, summary in enumerate(summaries):
        for name, entry in (summary or {}).items():
            ref = seen.setdefault(name, (rank, entry))
            if ref[0] != rank and tuple(ref[1][:2]) != tuple(entry[:2]) and name not in diffs:
                diffs[name] = (ref[0], ref[1], rank, entry)
    if not diffs:
        return None
    name = min(diffs)
    r0, e0, r1, e1 = diffs[name]
    more = f" (and {len(diffs) - 1} more tensor(s))" if len(diffs) > 1 else ""
    return (f"rank {r1} differs from rank {r0} in the contents of tensor '{name}': xxh3 {e1[0]:016x} ({e1[1]} B in "
            f"{e1[2]}) vs {e0[0]:016x} ({e0[1]} B in {e0[2]}){more}; all ranks must run the same checkpoint")
