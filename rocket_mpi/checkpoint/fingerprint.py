"""What each rank read of the checkpoint, byte for byte: a digest of the stored bytes of every shared tensor it loads.

The start-up handshake compares reader.fingerprint (config, index, every file's size and header, samples of its data)
before loading: another checkpoint of the same shapes differs there, a change that falls between its samples does
not. While a rank loads, a ContentLog keeps the xxh3-64 digest of the exact bytes of each tensor the reader hands out
that other ranks read too (the replicated stack, the routers and their biases, the experts' scale table); after
loading, first_difference compares the logs of all ranks: a tensor that two ranks read must have the same bytes on
both, so a changed byte in anything shared (another seed, one flipped bit in one rank's copy) is named with the
tensor, its file and the rank.

What this cannot see: a routed expert's weights are read by their owner alone, so a change in the owner's copy of
them has nothing to be compared with, and they are not digested (most of a rank's bytes: digesting them would only
cost). Another checkpoint differs in the fingerprint's samples of every file; a NaN or Inf anywhere is refused as it
loads (reader.all_finite); a finite change inside one expert's weights, between the samples, goes through.

Cost: one xxh3 pass over the shared bytes, in the reading thread (python-xxhash holds the GIL: a worker thread would
not overlap with the reads). benchmarks/bench_fingerprint.py measures it and scales it to air8.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

import torch
import xxhash

# a routed expert's own weights and block scales (its owner alone reads them); its weight_scale_2 is in every rank's
# scale table, and the shared experts are ".shared_experts."
PRIVATE = re.compile(r"\.experts\.\d+\.[a-z_]+\.weight(_scale)?$")


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
    """The digest of every shared tensor a CheckpointReader's get() returns, from record() until finish()."""

    def __init__(self):
        self.entries: dict[str, Entry] = {}
        self._reader = None
        self.seconds = 0.0  # time in xxh3

    @classmethod
    def record(cls, reader) -> "ContentLog":
        """Start logging what `reader` (a CheckpointReader) hands out."""
        log = cls()
        reader.log, log._reader = log, reader
        return log

    def add(self, name: str, path: str, t: torch.Tensor) -> None:
        """Digest `t` as read from `path`, unless only this rank reads it (PRIVATE)."""
        if PRIVATE.search(name):
            return
        t0 = time.perf_counter()
        digest = tensor_digest(t if t.device.type == "cpu" else t.cpu())
        self.seconds += time.perf_counter() - t0
        self.entries[name] = Entry(digest, t.numel() * t.element_size(), os.path.basename(path))

    def finish(self) -> dict[str, Entry]:
        """Stop logging (later reads, an expert cache's misses, are not) -> the entries."""
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
