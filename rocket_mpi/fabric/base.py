"""The fabric interface: exchange(seq, offsets, block) -> the full row set, identical on every rank.

Each rank writes its block of BF16 rows into every peer's row buffer at the offsets the canonical
row order gives it (the same offsets on every rank), then rings a doorbell carrying `seq`. Every wait
has a timeout and a timeout names the rank, peer, layer and step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rocket_mpi.errors import FabricTimeout


@dataclass
class FabricStats:
    exchanges: int = 0
    seconds: float = 0.0       # inside exchange(): copies, doorbells and waiting for peers
    bytes_sent: int = 0

    def reset(self):
        self.exchanges, self.seconds, self.bytes_sent = 0, 0.0, 0


class Fabric:
    """One rank's end of the row exchange."""

    name = "base"

    def __init__(self, rank: int, size: int, max_rows: int, hidden: int, timeout: float):
        self.rank, self.size = rank, size
        self.max_rows, self.hidden = max_rows, hidden
        self.timeout = timeout
        self.stats = FabricStats()

    def exchange(self, seq: int, offsets: list[int], block: torch.Tensor, layer: int, step: int) -> torch.Tensor:
        """block [offsets[r+1]-offsets[r], H] bf16 -> rows [offsets[-1], H] bf16, same on every rank."""
        t0 = time.perf_counter()
        rows = self._exchange(seq, offsets, block, layer, step)
        self.stats.exchanges += 1
        self.stats.seconds += time.perf_counter() - t0
        self.stats.bytes_sent += block.numel() * block.element_size() * (self.size - 1)
        return rows

    def _exchange(self, seq, offsets, block, layer, step) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def timeout_error(self, peer: int, layer: int, step: int, seq: int, what: str = "rows") -> FabricTimeout:
        return FabricTimeout(f"rank {self.rank}: fabric {self.name} timed out after {self.timeout:g} s waiting for "
                             f"{what} from rank {peer} at layer {layer}, step {step} (seq {seq}): peer dead or stalled")


class LocalFabric(Fabric):
    """One rank: the block is the whole row set."""

    name = "local"

    def _exchange(self, seq, offsets, block, layer, step):
        return block


def split_rails(nbytes: int, rails: int, split_min: int, align: int = 64) -> list[tuple[int, int]]:
    """(start, length) per rail that carries part of an `nbytes` payload; [] for an empty payload.

    Payloads of at least `split_min` bytes are cut into `rails` aligned pieces, smaller ones go on
    rail 0 alone. Sender and receiver both know nbytes from routing, so both compute the same split.
    """
    if nbytes <= 0:
        return []
    if rails <= 1 or nbytes < split_min:
        return [(0, nbytes)]
    piece = -(-nbytes // rails)
    piece = -(-piece // align) * align
    out, start = [], 0
    while start < nbytes:
        n = min(piece, nbytes - start)
        out.append((start, n))
        start += n
    return out


class DoorbellFabric(Fabric):
    """Shared logic of the one-sided backends (shm, verbs): double-buffered row slots selected by
    seq parity, a rail split per payload, one doorbell word per (peer, rail) holding the last seq.

    Why two slots are enough: a peer writes slot (seq+1)&1 only after it has our doorbell for seq,
    which we ring only after finishing with the rows of seq-1 (same parity as seq+1).
    Subclasses provide: _local_rows(slot) -> [max_rows, H] tensor this rank receives into,
    _put(peer, rail, slot, byte_offset, src) one-sided payload write, _ring(peer, rail, seq),
    _doorbell(peer, rail) -> last seq that peer rang here on that rail.
    """

    def __init__(self, rank, size, max_rows, hidden, timeout, rails: int = 1, rail_split_min_bytes: int = 8192,
                 poll_spins: int = 2000):
        super().__init__(rank, size, max_rows, hidden, timeout)
        self.rails = rails
        self.split_min = rail_split_min_bytes
        self.poll_spins = poll_spins
        self.row_bytes = hidden * 2

    def _exchange(self, seq, offsets, block, layer, step):
        slot = seq & 1
        rows = self._local_rows(slot)
        lo, hi = offsets[self.rank], offsets[self.rank + 1]
        if hi > lo:
            rows[lo:hi].copy_(block)
            src = rows[lo:hi].view(torch.uint8).reshape(-1)
        for k in range(1, self.size):  # start with the next rank so senders spread over receivers
            peer = (self.rank + k) % self.size
            for rail, (start, n) in enumerate(split_rails((hi - lo) * self.row_bytes, self.rails, self.split_min)):
                self._put(peer, rail, slot, lo * self.row_bytes + start, src[start:start + n])
            for rail in range(self.rails):
                self._ring(peer, rail, seq)
        self._flush()
        self._wait_all(seq, offsets, layer, step)
        return rows[:offsets[-1]]

    def _wait_all(self, seq, offsets, layer, step):
        deadline = None
        for k in range(1, self.size):
            peer = (self.rank - k) % self.size
            for rail in range(self.rails):
                spins = 0
                while self._doorbell(peer, rail) < seq:
                    spins += 1
                    if spins > self.poll_spins:
                        now = time.monotonic()
                        if deadline is None:
                            deadline = now + self.timeout
                        elif now > deadline:
                            raise self.timeout_error(peer, layer, step, seq)
                        time.sleep(0 if spins < 4 * self.poll_spins else 20e-6)
                        self._progress()

    def _flush(self):
        """Wait for local completion of posted writes where the transport needs it (verbs)."""

    def _progress(self):
        """Called while polling: reap completions (verbs)."""

    # -- to be provided by a backend -------------------------------------------------
    def _local_rows(self, slot: int) -> torch.Tensor:
        raise NotImplementedError

    def _put(self, peer: int, rail: int, slot: int, byte_offset: int, src: torch.Tensor) -> None:
        raise NotImplementedError

    def _ring(self, peer: int, rail: int, seq: int) -> None:
        raise NotImplementedError

    def _doorbell(self, peer: int, rail: int) -> int:
        raise NotImplementedError
