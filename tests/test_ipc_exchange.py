"""The cuda-ipc exchange kernels (csrc) in one process, two or three row buffers of one GPU standing for the ranks:
the graphed step's exchange kernel ipc_exchange_flags, and the wait's timeout record.

GPU tests (skip, saying why, without a GPU or the extension): every test here.
"""
import pytest
import torch

from helpers import gpu
from rocket_mpi import ops


@gpu
@pytest.mark.parametrize("blocks", [1, 3, 32])
def test_gpu_ipc_exchange_flags_one_process(blocks):
    """The graphed step's exchange (a flag word per sender and block): rank 0 of 3 stores its rows into
    every buffer and writes its flag words, block b's into word b, on ranks 1 and 2; it returns once ranks
    1 and 2 have written all of theirs for this seq, and records (1, peer, seq, layer) when one block's word
    is missing instead of hanging."""
    dev = torch.device("cuda")
    C = ops._ext.require()
    cap, h, ranks, stride, nmax = 40, 64, 3, 128, 32
    bufs = [torch.zeros(2 * stride, h, dtype=torch.bfloat16, device=dev) for _ in range(ranks)]
    flags = [torch.zeros(ranks, nmax, dtype=torch.long, device=dev) for _ in range(ranks)]
    src = torch.randn(cap, h, device=dev).to(torch.bfloat16)
    meta = torch.tensor([0, 0, 37, 1, 11, 0, 37, 2, 1], device=dev)    # 37 rows of rank 0, set 1, seq 11
    err = torch.zeros(4, dtype=torch.long, device=dev)
    peer_flags = [flags[r][0].data_ptr() for r in range(ranks)]        # each rank's words for sender 0
    flags[0][1:, :blocks] = 11                                          # ranks 1 and 2 have sent seq 11
    C.ipc_exchange_flags(src, meta, [b.data_ptr() for b in bufs], peer_flags, cap, stride, 0, blocks, flags[0], err,
                         5.0, 4)
    torch.cuda.synchronize()
    assert err.tolist() == [0, 0, 0, 0]
    for r in range(ranks):
        assert torch.equal(bufs[r][stride:stride + 37], src[:37])
        assert not bufs[r][:stride].any() and not bufs[r][stride + 37:].any()
        if r:
            assert flags[r][0, :blocks].tolist() == [11] * blocks and not flags[r][0, blocks:].any()
            assert not flags[r][1:].any()
    assert not flags[0][0].any()                                        # no flags to ourselves
    meta[4] = 12
    flags[0][1:, :blocks] = 12
    flags[0][2, blocks - 1] = 11                                        # rank 2's last block has not arrived
    C.ipc_exchange_flags(src, meta, [b.data_ptr() for b in bufs], peer_flags, cap, stride, 0, blocks, flags[0], err,
                         0.05, 6)
    torch.cuda.synchronize()
    assert err.tolist() == [1, 2, 12, 6]
    with pytest.raises(RuntimeError, match="blocks 33"):
        C.ipc_exchange_flags(src, meta, [b.data_ptr() for b in bufs], peer_flags, cap, stride, 0, 33, flags[0], err,
                             0.05, 6)
