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
def test_gpu_bell_stage_puts_into_the_peers():
    """shm's puts: rank 1 of 3 stages its 21 rows into its region's slot 0 (seq 6) on both peers' segments (host
    memory registered apart, as each peer's segment is), not on its own staging; gather then takes the rows ranks 0
    and 2 put on ours. More puts than peers is refused."""
    C = ops._ext.require()
    dev = torch.device("cuda")
    cap, h, n = 24, 64, 3
    row = 2 * h
    slot = cap * row
    region, header, ready = 2 * slot, PAGE, 64
    segs = [aligned(header + n * region) for _ in range(n)]
    dptrs = [C.host_map(m.ctypes.data, m.nbytes) for _, m in segs]
    try:
        regions = [m[header:].view(np.int16).reshape(n, 2, cap, h) for _, m in segs]  # [sender][slot][rows][h]
        rows = torch.zeros(n * cap, h, dtype=torch.bfloat16, device=dev)
        out = rows[cap:2 * cap]
        out[:21] = torch.randn(21, h, device=dev).to(torch.bfloat16)
        ours = segs[1][1]
        ours[:24].view(np.uint64)[:] = 6  # every peer rang seq 6 (one rail)
        sent = {p: block_for(p, 5 + p, h, 6) for p in (0, 2)}
        for p, blk in sent.items():
            regions[1][p, 0, :5 + p] = blk.view(torch.int16).numpy()
        sync = torch.zeros(2, dtype=torch.long, device=dev)
        err = torch.zeros(4, dtype=torch.long, device=dev)
        meta = torch.tensor([0, 0, 21, 0, 6, 0, 5, 21, 7], device=dev)
        puts = [dptrs[p] + header + 1 * region for p in (2, 0)]
        C.bell_exchange(out, rows, meta, dptrs[1], header, region, slot, ready, sync, err, 1, 1, 5.0, 0, 16, 3, puts)
        torch.cuda.synchronize()
        assert err.tolist() == [0, 0, 0, 0]
        mine = out[:21].cpu().view(torch.int16).numpy()
        for p in (0, 2):
            assert np.array_equal(regions[p][1, 0, :21], mine) and not regions[p][1, 0, 21:].any()
            assert not regions[p][1, 1].any()
            assert torch.equal(rows[p * cap:p * cap + 5 + p].cpu().view(torch.int16), sent[p].view(torch.int16))
        assert not regions[1][1].any()  # our own region: nothing staged there
        assert ours[ready:ready + 16].view(np.uint64).tolist() == [6, 21]
        with pytest.raises(RuntimeError, match="3 puts for 3 ranks"):
            C.bell_exchange(out, rows, meta, dptrs[1], header, region, slot, ready, sync, err, 1, 1, 5.0, 0, 16, 3,
                            puts + [puts[0]])
    finally:
        torch.cuda.synchronize()
        for _, m in segs:
            C.host_unmap(m.ctypes.data)
    del segs


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
