"""cuda-ipc: GPUs of one host (NVLink or PCIe). Each rank owns one device allocation

    [doorbells: size int64][seq ring: 64 int64][flags: 64 x 32 int64][slot 0 rows][slot 1 rows]
    (doorbells and ring in the first KiB; the flags are the graphed step's, csrc/ipc_bells.cu)

opened by every peer through a CUDA IPC handle swapped over mpi4py. A sender enqueues, on its stream,
a peer copy of its block into each peer's slot, then an 8-byte copy of seq into that peer's doorbell
word for this sender. cuStreamWriteValue64 refuses a peer's address (CUDA_ERROR_INVALID_VALUE on
H200, driver 580), so seq is first written into our own ring slot seq % 64 by cuStreamWriteValue64
and then copied to the peer: all of it stream-ordered after the payload copy. The receiver's stream
waits on its own doorbell words (cuStreamWaitValue64, GEQ): no host round trip on the data path. The double-buffer argument is the
shm/verbs one (fabric/base.py): stream order puts our doorbell for seq after our scatter of seq-1.
The host bounds the wait with a timeout by polling an event (fabric/nccl.py:_wait_event).
"""
from __future__ import annotations

import torch

from rocket_mpi.errors import FabricError
from rocket_mpi import ops
from rocket_mpi.fabric.base import Fabric, SlotExchange
from rocket_mpi.fabric.nccl import _wait_event

RING = 64
RING_OFFSET = 512  # bytes: doorbells of up to 64 ranks come first
FLAGS_OFFSET = 1024
IPC_MAX_BLOCKS = 32  # flag words per sender (csrc/rocket.h kIpcMaxBlocks): one per block of the push kernel
MAX_RANKS = RING_OFFSET // 8
BELL_BYTES = FLAGS_OFFSET + 8 * MAX_RANKS * IPC_MAX_BLOCKS  # the header; rows start here
PUSH_BLOCKS = 32  # blocks of the graphed step's exchange kernel: one flag word each (at most IPC_MAX_BLOCKS)


def _check(res, what: str):
    err = res[0]
    if int(err) != 0:
        raise FabricError(f"cuda-ipc: {what} failed: {err}")
    return res[1:] if len(res) > 2 else (res[1] if len(res) == 2 else None)


class CudaIpcFabric(Fabric):
    name = "cuda-ipc"

    def __init__(self, comm, max_rows: int, hidden: int, timeout: float, device: torch.device):
        super().__init__(comm.rank, comm.size, max_rows, hidden, timeout)
        if comm.size * 8 > RING_OFFSET:
            raise FabricError(f"fabric cuda-ipc: at most {RING_OFFSET // 8} ranks, got {comm.size}")
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise FabricError(f"fabric cuda-ipc needs cuda-bindings (pip install cuda-bindings): {e}") from None
        self.drv = driver
        self.device = device
        self.slot_bytes = max(max_rows, 1) * hidden * 2
        nbytes = BELL_BYTES + 2 * self.slot_bytes
        # one torch allocation of our own; peers open it through its IPC handle
        self.buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        storage = self.buf.untyped_storage()
        handles = comm.allgather(storage._share_cuda_())
        self.peer_storages = {}
        self.peer_devices = {r: int(h[0]) for r, h in enumerate(handles)}  # (device, handle, ...) as torch shares
        self.base = [0] * self.size
        for r, h in enumerate(handles):
            if r == self.rank:
                self.base[r] = self.buf.data_ptr()
            else:
                # opened on OUR device: cudaIpcOpenMemHandle maps into the current device's address space and
                # its lazy peer access then covers our kernels (the graphed step's push stores into it)
                st = torch.UntypedStorage._new_shared_cuda(device.index, *h[1:])
                self.peer_storages[r] = st  # keep the mapping alive
                self.base[r] = st.data_ptr()
        comm.Barrier()
        self.bells = self.buf[:8 * self.size].view(torch.int64)
        # the graphed step's flag words: [sender][block] (fabric/cuda_ipc.py IpcSlots, ipc_exchange_flags)
        self.flags = self.buf[FLAGS_OFFSET:FLAGS_OFFSET + 8 * IPC_MAX_BLOCKS * self.size].view(torch.int64).view(
            self.size, IPC_MAX_BLOCKS)
        self.rows = [self.buf[BELL_BYTES + k * self.slot_bytes: BELL_BYTES + (k + 1) * self.slot_bytes]
                     .view(torch.bfloat16).view(max(max_rows, 1), hidden) for k in (0, 1)]
        self.done = torch.cuda.Event()
        self.row_bytes = hidden * 2

    def enable_peer_access(self) -> None:
        """Let kernels on our GPU load and store peers' buffers (the graphed step's push kernel does). Copies
        need no such thing, so the eager path never asks. torch opens a peer's IPC handle on the peer's device,
        and its lazy peer access covers that device, not ours: enable ours -> theirs here."""
        from cuda.bindings import runtime as rt
        mine = self.device.index
        for r, dev in self.peer_devices.items():
            if r == self.rank or dev == mine:
                continue
            if not torch.cuda.can_device_access_peer(mine, dev):
                raise FabricError(f"cuda-ipc: rank {self.rank}: GPU {mine} cannot access GPU {dev} (rank {r}) as a "
                                  f"peer (no NVLink/PCIe P2P): use --decode-path host or --fabric nccl")
            with torch.cuda.device(mine):
                err, = rt.cudaDeviceEnablePeerAccess(dev, 0)
            if err not in (rt.cudaError_t.cudaSuccess, rt.cudaError_t.cudaErrorPeerAccessAlreadyEnabled):
                raise FabricError(f"cuda-ipc: rank {self.rank}: enabling peer access GPU {mine} -> {dev} failed: {err}")
            rt.cudaGetLastError()  # an 'already enabled' leaves a sticky-free error behind: clear it

    def _stream(self):
        return self.drv.CUstream(torch.cuda.current_stream(self.device).cuda_stream)

    def _exchange(self, seq, offsets, block, layer, step):
        drv = self.drv
        slot = seq & 1
        rows = self.rows[slot]
        lo, hi = offsets[self.rank], offsets[self.rank + 1]
        if hi > lo:
            rows[lo:hi].copy_(block)
        stream = self._stream()
        nbytes = (hi - lo) * self.row_bytes
        src = rows.data_ptr() + lo * self.row_bytes
        ring = self.base[self.rank] + RING_OFFSET + 8 * (seq % RING)
        _check(drv.cuStreamWriteValue64(stream, drv.CUdeviceptr(ring), seq,
                                        drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT), "seq write")
        for k in range(1, self.size):
            peer = (self.rank + k) % self.size
            dst = self.base[peer] + BELL_BYTES + slot * self.slot_bytes + lo * self.row_bytes
            if nbytes:
                _check(drv.cuMemcpyDtoDAsync(drv.CUdeviceptr(dst), drv.CUdeviceptr(src), nbytes, stream),
                       "peer copy")
            _check(drv.cuMemcpyDtoDAsync(drv.CUdeviceptr(self.base[peer] + 8 * self.rank), drv.CUdeviceptr(ring),
                                         8, stream), "doorbell copy")
        for k in range(1, self.size):
            peer = (self.rank - k) % self.size
            own_bell = self.base[self.rank] + 8 * peer
            _check(drv.cuStreamWaitValue64(stream, drv.CUdeviceptr(own_bell), seq,
                                           drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ), "doorbell wait")
        self.done.record()
        try:
            _wait_event(self, self.done, layer, step, seq)
        except FabricError:
            with torch.cuda.stream(torch.cuda.Stream(self.device)):  # our own stream is stuck in the wait
                bells = self.bells.cpu().tolist()
            late = [p for p in range(self.size) if p != self.rank and bells[p] < seq]
            raise self.timeout_error(",".join(map(str, late)) or "?", layer, step, seq) from None
        return rows[:offsets[-1]]

    def slot_exchange(self, cap, device):
        if device.type == "cpu" or self.size == 1:
            return super().slot_exchange(cap, device)
        return IpcSlots(self, cap)

    def close(self):
        torch.cuda.synchronize(self.device)
        self.peer_storages.clear()


class IpcSlots(SlotExchange):
    """ipc_exchange_flags, one kernel (csrc/ipc_bells.cu): block rows into every peer's buffer over NVLink, each
    block then writes its own flag word (seq) on every peer, and block 0 spins on ours with a timeout (recorded in
    `err` on the device, raised by the host after the step). The fabric's two row slots are the two sets."""
    mode = "cuda-ipc"
    n_sets = 2

    def __init__(self, fab: CudaIpcFabric, cap: int):
        super().__init__(fab, cap)
        self.set_stride = fab.slot_bytes // fab.row_bytes
        if self.set_stride < fab.size * cap:
            raise FabricError(f"cuda-ipc: row buffers of {self.set_stride} rows, the graphed step needs "
                              f"{fab.size * cap}")
        fab.enable_peer_access()
        dev = fab.device
        self.rows = fab.buf[BELL_BYTES:BELL_BYTES + 2 * fab.slot_bytes].view(torch.bfloat16).view(-1, fab.hidden)
        self.out = torch.empty(cap, fab.hidden, dtype=torch.bfloat16, device=dev)
        self.dst = [fab.base[r] + BELL_BYTES for r in range(fab.size)]
        self.peer_flags = [fab.base[r] + FLAGS_OFFSET + 8 * IPC_MAX_BLOCKS * fab.rank for r in range(fab.size)]
        self.err = torch.zeros(4, dtype=torch.long, device=dev)

    def exchange(self, meta, layer, step):
        f = self.fabric
        ops._ext.require().ipc_exchange_flags(self.out, meta, self.dst, self.peer_flags, self.cap, self.set_stride,
                                              f.rank, PUSH_BLOCKS, f.flags, self.err, f.timeout, layer)
        return self.rows

    def check(self, words, step):
        if words[0]:
            raise self.fabric.timeout_error(int(words[1]), int(words[3]), step, int(words[2]))
