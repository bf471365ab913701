"""The fabric interface: exchange(seq, offsets, block) -> the full row set, identical on every rank.

Each rank writes its block of BF16 rows into every peer's row buffer at the offsets the canonical
row order gives it (the same offsets on every rank), then rings a doorbell carrying `seq`. Every wait
has a timeout and a timeout names the rank, peer, layer and step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rocket_mpi.errors import FabricError, FabricTimeout
from rocket_mpi.ops import _ext
from rocket_mpi.ops.plan import META_SEQ


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
        # called now and then while a wait for rows (or for a graphed step) idles: the server hands MPI a moment
        # there, so its control messages move where the transport moves bytes only inside MPI calls (serve)
        self.idle_hook = None

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

    def slot_exchange(self, cap: int, device: torch.device) -> "SlotExchange":
        """The fixed-shape decode step's exchange for blocks of at most `cap` rows (SlotExchange). On a CPU any
        fabric takes it through its own exchange; one rank needs none; a GPU fabric that can run inside a CUDA
        graph overrides this."""
        if device.type == "cpu":
            return HostSlots(self, cap)
        if self.size == 1:
            return LocalSlots(self, cap, device)
        raise FabricError(f"fabric {self.name} has no exchange for the fixed-shape decode step on {device}: it is "
                          f"host-driven (use --decode-path host)")

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def timeout_error(self, peer: int, layer: int, step: int, seq: int, what: str = "rows") -> FabricTimeout:
        return FabricTimeout(f"rank {self.rank}: fabric {self.name} timed out after {self.timeout:g} s waiting for "
                             f"{what} from rank {peer} at layer {layer}, step {step} (seq {seq}): peer dead or stalled")


class SlotExchange:
    """What the fixed-shape decode step (moe/step.py DeviceMoE) needs of a fabric.

    Rank r's block of at most `cap` rows lives at slot-space rows set * set_stride + r * cap on every rank (set =
    seq % n_sets: row buffer sets used in turn where a fabric needs double buffering), a place that does not depend
    on routing, so the step has fixed shapes and can be captured in a CUDA graph.

        out                        [cap, H] bf16: where this rank's expert kernel writes its block
        exchange(meta, layer, step) -> every rank's rows in slot space, as the scatter reads them (meta: the
                                   device plan's, ops/plan.py; its seq word is the doorbell value)
        bytes_sent(rows_mine)      bytes this rank sent for one layer
        err                        device words a timeout inside a captured exchange is recorded in (or None);
                                   check(words, step) raises it after the step, naming peer, layer and step
        host_gil                   True where a thread of this process needs the GIL while the step runs (the
                                   verbs proxy's posts): the host's wait for the step must give it up
    """
    mode = "host"
    n_sets = 1
    err = None
    host_gil = False

    def __init__(self, fabric: "Fabric", cap: int):
        self.fabric, self.cap = fabric, cap
        self.row_bytes = fabric.hidden * 2

    def exchange(self, meta: torch.Tensor, layer: int, step: int) -> torch.Tensor:
        raise NotImplementedError

    def bytes_sent(self, rows_mine: int) -> int:
        return rows_mine * self.row_bytes * (self.fabric.size - 1)

    def check(self, words: list[int], step: int) -> None:
        pass


class HostSlots(SlotExchange):
    """CPU ranks: every rank's cap rows through the fabric's own exchange at fixed offsets."""

    def __init__(self, fabric: "Fabric", cap: int):
        super().__init__(fabric, cap)
        self.set_stride = fabric.size * cap
        self.out = torch.zeros(cap, fabric.hidden, dtype=torch.bfloat16)
        self.offsets = [r * cap for r in range(fabric.size + 1)]

    def exchange(self, meta, layer, step):
        return self.fabric.exchange(int(meta[META_SEQ]), self.offsets, self.out, layer, step)

    def bytes_sent(self, rows_mine):
        return self.cap * self.row_bytes * (self.fabric.size - 1)


class LocalSlots(SlotExchange):
    """One rank: the block is the row set."""
    mode = "local"

    def __init__(self, fabric: "Fabric", cap: int, device: torch.device):
        super().__init__(fabric, cap)
        self.set_stride = cap
        self.out = torch.empty(cap, fabric.hidden, dtype=torch.bfloat16, device=device)

    def exchange(self, meta, layer, step):
        return self.out


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


SEQ_MASK = (1 << 64) - 1  # a doorbell word is 64 bits
PAGE = 4096
READY_BYTES = 128  # the graphed step's two ready records of 64 bytes in a doorbell fabric's header (fabric/slots.py)


def seq_ahead(bell: int, seq: int) -> int:
    """How far doorbell word `bell` is at or past `seq` in 64-bit serial-number order (RFC 1982), else -1.

    Words hold seq mod 2**64, so ordering survives a wrap as long as ranks never drift 2**63 apart
    (a fresh fabric's words read 0: the first seq must be below 2**63).
    """
    d = (bell - seq) & SEQ_MASK
    return d if d < 1 << 63 else -1


class DoorbellFabric(Fabric):
    """Shared logic of the one-sided backends (shm, verbs): a receive region per sender, double-buffered row slots
    selected by seq parity, a rail split per payload, one doorbell word per (peer, rail) holding the last seq.

    Staging on every rank, one region per sender (ours holds our own block, the source of our puts):

        region(p) = [slot 0: max_rows rows][slot 1: max_rows rows]      sender p's block at the start of slot seq & 1

    A peer writes only its own region and its own doorbell words on us (verbs: its key covers exactly those,
    fabric/verbs.py). A block's place in the canonical row set depends on routing, so the receiver gathers the
    blocks into the row set (one local copy); the graphed step's exchange (DoorbellSlots) reads the regions in place.

    Why two slots are enough: a peer writes slot (seq+1)&1 only after it has our doorbell for seq,
    which we ring only after finishing with the rows of seq-1 (same parity as seq+1).
    Only the rails that carry a piece of a payload are rung (rail 0 alone for an empty or small one);
    the receiver knows every block's size from routing, so it waits on exactly those rails. A rail
    skipped for a while keeps an older seq, and the next seq rung on it is larger still.
    Subclasses provide: _region(sender) -> [2, max_rows, H] tensor of this rank's staging where that sender's rows
    land, _put(peer, rail, byte_offset, src) one-sided write of src (in our own region) into our region on `peer`
    at byte_offset (slot * slot_bytes + offset in the block), _ring(peer, rail, seq) with seq < 2**64,
    _doorbell(peer, rail) -> last seq that peer rang here on that rail.
    """

    def __init__(self, rank, size, max_rows, hidden, timeout, rails: int = 1, rail_split_min_bytes: int = 8192,
                 poll_spins: int = 2000):
        super().__init__(rank, size, max_rows, hidden, timeout)
        self.rails = rails
        self.split_min = rail_split_min_bytes
        self.poll_spins = poll_spins
        self.row_bytes = hidden * 2
        self.slot_bytes = max_rows * self.row_bytes
        self.region_bytes = 2 * self.slot_bytes
        self._rows_out: torch.Tensor | None = None  # the gathered row set of the host path (allocated on first use)
        self._slots = None    # the graphed step's exchange in use (fabric/slots.py), its proxy running
        self._mapped: dict[int, int] = {}  # host address -> device address of memory registered with CUDA (our
                                            # staging; shm: the peers' segments too)

    def _pieces(self, nbytes: int, rails: int | None = None) -> list[tuple[int, int]]:
        return split_rails(nbytes, rails or self.rails, self.split_min)

    def _exchange(self, seq, offsets, block, layer, step):
        if self._slots is not None:  # the graphed step's proxy first sends what it has (fabric/slots.py)
            self._slots.drain()
        slot = seq & 1
        lo, hi = offsets[self.rank], offsets[self.rank + 1]
        mine = self._region(self.rank)[slot]
        if hi > lo:
            mine[:hi - lo].copy_(block)
        self.send(seq, (hi - lo) * self.row_bytes)
        self._wait_all(seq, offsets, layer, step)
        if self._rows_out is None:
            self._rows_out = torch.empty(self.max_rows, self.hidden, dtype=torch.bfloat16)
        out = self._rows_out
        for p in range(self.size):  # the blocks, in canonical order
            a, b = offsets[p], offsets[p + 1]
            if b > a:
                out[a:b].copy_(self._region(p)[slot][:b - a])
        return out[:offsets[-1]]

    def send(self, seq: int, nbytes: int, every_rail: bool = False) -> None:
        """Our block of seq (the first nbytes of our region's slot seq & 1) to every peer, then the doorbells: the
        rails that carried a piece, or every rail (every_rail: the graphed step's receivers wait on all of them)."""
        slot = seq & 1
        src = self._region(self.rank)[slot].view(torch.uint8).reshape(-1)
        pieces = self._pieces(nbytes)
        ring = self.rails if every_rail else max(1, len(pieces))
        for k in range(1, self.size):  # start with the next rank so senders spread over receivers
            peer = (self.rank + k) % self.size
            for rail, (start, n) in enumerate(pieces):
                self._put(peer, rail, slot * self.slot_bytes + start, src[start:start + n])
            for rail in range(ring):
                self._ring(peer, rail, seq & SEQ_MASK)
        self._flush()

    def _wait_all(self, seq, offsets, layer, step):
        wait = _Patience(self)
        for k in range(1, self.size):
            peer = (self.rank - k) % self.size
            used = max(1, len(self._pieces((offsets[peer + 1] - offsets[peer]) * self.row_bytes)))
            for rail in range(used):
                while seq_ahead(self._doorbell(peer, rail), seq) < 0:
                    if wait.idle():
                        raise self.timeout_error(peer, layer, step, seq)

    # -- the graphed step (fabric/slots.py DoorbellSlots) --------------------------------------
    # A backend sets header (byte offset of region 0 in its staging) and ready_offset (the two ready records).
    def staging(self) -> tuple[int, int]:
        """(address, bytes) of this rank's staging: doorbell words at 0, ready records, regions from `header`."""
        raise NotImplementedError

    def proxy_bells(self) -> list | None:
        """Where the proxy rings natively (per rank: our rail-0 doorbell word there, mapped in this process; None for
        us), or None: the proxy calls send() instead, which puts and rings (verbs)."""
        return None

    def device_puts(self, device: torch.device) -> list[int] | None:
        """Where the graphed step's stage kernel puts our block itself (per peer: our region, slot 0, as the device
        sees it), or None: it stages the block in our own region for the transport to put (verbs)."""
        return None

    def device_address(self, device: torch.device, addr: int, nbytes: int, what: str) -> int:
        """Host memory [addr, addr + nbytes) as the device's kernels see it: registered with CUDA (mapped,
        portable) once, until close_slots."""
        if device.type != "cuda":
            return addr
        if addr not in self._mapped:
            try:
                self._mapped[addr] = int(_ext.require().host_map(addr, nbytes))
            except RuntimeError as e:
                raise FabricError(f"rank {self.rank}: fabric {self.name}: registering {what} ({nbytes} bytes) with "
                                  f"CUDA failed: {e}") from None
        return self._mapped[addr]

    def device_staging(self, device: torch.device) -> int:
        """Our staging's address for the device's kernels."""
        addr, nbytes = self.staging()
        return self.device_address(device, addr, nbytes, "its staging")

    def attach_slots(self, slots) -> None:
        """The graphed step's exchange now in use; a former one (an earlier run's) sends what it has, then stops."""
        if self._slots is not None and self._slots is not slots:
            old, self._slots = self._slots, None
            try:
                old.drain()
            finally:
                old.close()
        self._slots = slots

    def close_slots(self) -> None:
        """Let the proxy send what it has, stop it, drop the CUDA registration: before the staging goes (a
        backend's close). A proxy that cannot drain is stopped anyway: the job is ending."""
        if self._slots is not None:
            slots, self._slots = self._slots, None
            try:
                slots.drain()
            except FabricError:
                pass
            finally:
                slots.close()
        if self._mapped:
            torch.cuda.synchronize()
            for addr in self._mapped:
                _ext.require().host_unmap(addr)
            self._mapped = {}

    # -- streaming, for fabric-bench's oneway and duplex columns -----------------------------
    def stream(self, peer: int, nbytes: int, count: int, send: bool, recv: bool, seq0: int,
               rails: int | None = None, max_depth: int = 64) -> int:
        """Move `count` messages of `nbytes` to `peer` (send), from it (recv), or both ways at once
        (duplex), through the same _put/_ring/_doorbell as exchange(). Both ranks pass the same
        nbytes, count, seq0 and rails (None: all); message i carries seq0+i+1. Returns the last seq.

        Messages ride the sender's region (both slots) as a ring of `depth` positions: the source ring is our own
        region, which no peer writes. The sender writes a position again only once the receiver has seen the
        message that was there:
          oneway: the receiver rings back on rail 0 (the reverse direction is otherwise idle) how many
                  it has seen; at most `depth` messages are unacknowledged.
          duplex: the data doorbells are the acknowledgement. We send j only after the peer has sent
                  j - depth//2, which it did only after seeing our j - 2*(depth//2) >= j - depth.
        """
        if not (send or recv):
            return seq0
        if self._slots is not None:
            self._slots.drain()
        stride, depth = self.stream_depth(nbytes, max_depth)
        window = depth if not recv else depth // 2
        src = self.stream_ring(peer, send=True)
        pieces = self._pieces(nbytes, rails)
        used = max(1, len(pieces))
        ack_every = max(1, depth // 2)
        sent = seen = acked = 0  # acked (oneway): receiver: last count rung back; sender: last count heard
        wait = _Patience(self)
        while (send and sent < count) or (recv and seen < count) or (send and not recv and acked < count):
            progressed = False
            if recv:
                now = min(seq_ahead(self._doorbell(peer, r), seq0) for r in range(used))
                if now > seen:
                    seen, progressed = now, True
                    if not send and (seen - acked >= ack_every or seen == count):
                        self._ring(peer, 0, (seq0 + seen) & SEQ_MASK)
                        self._flush()
                        acked = seen
            if send:
                credit = max(0, seq_ahead(self._doorbell(peer, 0), seq0))  # peer's acks (oneway) or sends (duplex)
                if not recv and credit > acked:
                    acked, progressed = credit, True
                while sent < count and sent - credit < window:
                    pos = (sent % depth) * stride
                    for rail, (start, n) in enumerate(pieces):
                        self._put(peer, rail, pos + start, src[pos + start:pos + start + n])
                    sent += 1
                    for rail in range(used):
                        self._ring(peer, rail, (seq0 + sent) & SEQ_MASK)
                    self._flush()
                    progressed = True
            if progressed:
                wait.progressed()
            elif wait.idle():
                what = f"stream message {min(sent, seen) + 1} of {count} ({nbytes} B)"
                raise FabricTimeout(f"rank {self.rank}: fabric {self.name} timed out after {self.timeout:g} s "
                                    f"waiting for rank {peer} in a {what}: peer dead or stalled")
        return (seq0 + count) & SEQ_MASK

    def stream_depth(self, nbytes: int, max_depth: int = 64) -> tuple[int, int]:
        """(stride, depth): a stream's messages sit `stride` bytes apart in a ring of `depth` positions."""
        stride = -(-nbytes // 64) * 64
        ring_bytes = 2 * self.slot_bytes
        depth = min(max_depth, ring_bytes // stride) if stride else 0
        if depth < 2:
            raise FabricError(f"rank {self.rank}: fabric {self.name}: a stream of {nbytes}-byte messages needs row "
                              f"regions of at least {2 * stride} bytes, these have {ring_bytes}")
        return stride, depth

    def stream_ring(self, peer: int, send: bool) -> torch.Tensor:
        """uint8 view of the region a stream with `peer` sends from (send: ours) or receives into (the peer's)."""
        return self._region(self.rank if send else peer).view(torch.uint8).reshape(-1)

    def _flush(self):
        """After a batch of puts and rings: reap (or wait for) local completions where the transport has them."""

    def _progress(self):
        """Called while polling: reap completions (verbs)."""

    # -- to be provided by a backend -------------------------------------------------
    def _region(self, sender: int) -> torch.Tensor:
        raise NotImplementedError

    def _put(self, peer: int, rail: int, byte_offset: int, src: torch.Tensor) -> None:
        raise NotImplementedError

    def _ring(self, peer: int, rail: int, seq: int) -> None:
        raise NotImplementedError

    def _doorbell(self, peer: int, rail: int) -> int:
        raise NotImplementedError


class _Patience:
    """A poll loop's clock: spin `poll_spins` times, then yield and reap completions between polls;
    idle() is True once `timeout` seconds pass without progress()."""

    def __init__(self, fabric: DoorbellFabric):
        self.fabric = fabric
        self.spins = 0
        self.deadline: float | None = None

    def progressed(self) -> None:
        self.spins, self.deadline = 0, None

    def idle(self) -> bool:
        self.spins += 1
        if self.spins <= self.fabric.poll_spins:
            return False
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.fabric.timeout
        elif now > self.deadline:
            return True
        time.sleep(0 if self.spins < 4 * self.fabric.poll_spins else 20e-6)
        self.fabric._progress()
        if self.fabric.idle_hook is not None:
            self.fabric.idle_hook()
        return False
