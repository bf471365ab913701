"""The doorbell fabrics' graphed exchange on a GPU (skips, saying why, without a GPU or the extension):

- the two kernels (csrc/proxy_bells.cu) in one process on host memory mapped with host_map, one rank's view, the
  test standing in for the peer and its proxy: the staged block and ready record, the gather of the peer's rows, the
  timeout record of a missing doorbell, argument checks;
- the extension carries the proxy's native code (csrc/proxy.cpp) with the ProxyArgs layout of fabric/proxy.py;
- 2 and 3 ranks under mpiexec (tests/doorbell_ranks.py), sharing the GPU: the shm exchange with its proxy thread,
  captured in a CUDA graph and replayed, moves the same bits as cuda-ipc's captured exchange.
The proxy and the staging logic on the CPU: test_proxy.py.
"""
import numpy as np
import pytest
import torch

from conftest import mpi_script
from helpers import gpu
from rocket_mpi import ops
from rocket_mpi.fabric import proxy
from thread_ranks import block_for

PAGE = 4096


def aligned(nbytes):
    raw = np.zeros(nbytes + PAGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % PAGE
    return raw, raw[off:off + nbytes]


@gpu
def test_gpu_bell_kernels_one_process():
    """Rank 0 of 2, two rails, cap 40 rows of 128 B: stage puts our 37 rows into our region's slot 1 (seq 11) and
    writes ready record 1 = (11, 37); gather copies the peer's 29 rows from its region once both rails rang 11.
    Then seq 12 with one rail short: (1, peer 1, seq 12, layer 6) within the 50 ms timeout, rows not copied."""
    C = ops._ext.require()
    dev = torch.device("cuda")
    cap, h, rails = 40, 64, 2
    row = 2 * h
    slot = 48 * row
    region, header, ready = 2 * slot, PAGE, 64
    raw, mem = aligned(header + 2 * region)
    base = mem.ctypes.data
    dptr = C.host_map(base, mem.nbytes)
    try:
        bells = mem[:32].view(np.uint64).reshape(2, rails)
        rec = mem[ready:ready + 128].view(np.uint64).reshape(2, 8)
        regions = mem[header:].view(np.int16).reshape(2, 2, 48, h)  # [sender][slot][rows][h]
        rows = torch.zeros(2 * cap, h, dtype=torch.bfloat16, device=dev)
        out = rows[:cap]
        out[:37] = torch.randn(37, h, device=dev).to(torch.bfloat16)
        peer = block_for(1, 29, h, 11)
        regions[1, 1, :29] = peer.view(torch.int16).numpy()
        bells[1, :] = 11
        sync = torch.zeros(2, dtype=torch.long, device=dev)
        err = torch.zeros(4, dtype=torch.long, device=dev)
        meta = torch.tensor([0, 0, 37, 0, 11, 0, 37, 29], device=dev)
        C.bell_exchange(out, rows, meta, dptr, header, region, slot, ready, sync, err, 0, rails, 5.0, 4, 16, 16)
        torch.cuda.synchronize()
        assert err.tolist() == [0, 0, 0, 0] and sync.tolist() == [0, 11]  # block 0 told the others 11
        assert rec[1, :2].tolist() == [11, 37] and not rec[0].any()
        assert np.array_equal(regions[0, 1, :37], out[:37].cpu().view(torch.int16).numpy())
        assert not regions[0, 0].any() and not regions[0, 1, 37:].any()
        assert torch.equal(rows[cap:cap + 29].cpu().view(torch.int16), peer.view(torch.int16))
        assert not rows[cap + 29:].any()
        meta[4], meta[7] = 12, 5
        bells[1, 0] = 12  # rail 1 still at 11
        C.bell_exchange(out, rows, meta, dptr, header, region, slot, ready, sync, err, 0, rails, 0.05, 6, 16, 16)
        torch.cuda.synchronize()
        assert err.tolist() == [1, 1, 12, 6] and rec[0, :2].tolist() == [12, 37] and sync.tolist() == [0, 12]
        assert torch.equal(rows[cap:cap + 29].cpu().view(torch.int16), peer.view(torch.int16))  # untouched
        with pytest.raises(RuntimeError, match="out must be rank 0's block of rows"):
            C.bell_exchange(rows[1:cap + 1], rows, meta, dptr, header, region, slot, ready, sync, err, 0, rails,
                            1.0, 0, 16, 16)
        with pytest.raises(RuntimeError, match="staging layout"):
            C.bell_exchange(out, rows, meta, dptr, header, slot, slot, ready, sync, err, 0, rails, 1.0, 0, 16, 16)
    finally:
        torch.cuda.synchronize()
        C.host_unmap(base)
    del raw


@gpu
def test_gpu_extension_carries_the_proxy():
    lib = proxy.library()  # binds and checks the ProxyArgs layout against the native code's
    assert lib.rocket_proxy_args_size() > 0


@gpu
@pytest.mark.parametrize("ranks", [2, 3])
def test_gpu_shm_graph_exchange_equals_cuda_ipc(ranks):
    r = mpi_script(ranks, "doorbell_ranks.py", "--exchanges", "8", "--replays", "3", timeout=600)
    ok = [ln for ln in r.stdout.splitlines() if ln.startswith("DOORBELL GRAPH OK")]
    assert r.returncode == 0 and len(ok) == ranks, r.stdout + r.stderr
