"""The ranks of test_doorbell_gpu.py's graphed exchange test, one process per rank on the GPU of its local rank (ranks
may share one GPU):

    mpiexec -n 2 python tests/doorbell_ranks.py [--exchanges K] [--replays R] [--rails N]

Every rank sets up the shm fabric and the cuda-ipc fabric, captures each one's graphed exchange (fabric/slots.py
DoorbellSlots with its proxy thread; fabric/cuda_ipc.py IpcSlots) K times over in a CUDA graph of its own, and
replays both graphs R times. Each exchange i of a replay moves blocks whose sizes (0 to cap rows) and bits change
with i and with the replay (so a stale slot cannot pass). After every replay each rank checks, bitwise, that every
rank's rows in slot space are the bytes that rank sent, over shm and over cuda-ipc alike, and that no exchange
recorded a timeout. Prints one line `DOORBELL GRAPH OK rank R: ...` per rank, exit 0; else raises.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the tree's package

from mpi4py import MPI  # noqa: E402

from rocket_mpi.fabric import make_fabric  # noqa: E402
from rocket_mpi.runtime.decode import pick_device  # noqa: E402
from thread_ranks import block_for  # noqa: E402

H = 64      # bf16 per row
CAP = 24    # rows a rank's block can hold


def counts_for(i: int, replay: int, size: int) -> list[int]:
    return [(7 * i + 5 * p + 3 * replay) % (CAP + 1) for p in range(size)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exchanges", type=int, default=8)  # even: cuda-ipc's row set follows seq parity
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--rails", type=int, default=2)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    dev = pick_device("cuda", comm)
    k = args.exchanges
    shm = make_fabric("shm", comm, size * CAP, H, 30.0, rails=args.rails, rail_split_min_bytes=1024, device=dev)
    ipc = make_fabric("cuda-ipc", comm, size * CAP, H, 30.0, device=dev)
    xs, xi = shm.slot_exchange(CAP, dev), ipc.slot_exchange(CAP, dev)
    assert xs.mode == "doorbell" and xi.mode == "cuda-ipc", (xs.mode, xi.mode)
    blocks = torch.zeros(k, CAP, H, dtype=torch.bfloat16, device=dev)
    metas = {name: torch.zeros(k, 6 + size, dtype=torch.long, device=dev) for name in ("shm", "ipc")}
    got = {name: torch.zeros(k, size * CAP, H, dtype=torch.bfloat16, device=dev) for name in ("shm", "ipc")}
    seq0 = 0

    def fill(replay: int) -> None:
        for i in range(k):
            c = counts_for(i, replay, size)
            seq = seq0 + i + 1
            blocks[i].zero_()
            blocks[i][:c[rank]] = block_for(rank, c[rank], H, seq).to(dev)
            for name, m in metas.items():
                m[i] = torch.tensor([0, 0, c[rank], seq % 2 if name == "ipc" else 0, seq, 0] + c)

    def body() -> None:
        for i in range(k):
            for name, x in (("shm", xs), ("ipc", xi)):
                x.out.copy_(blocks[i])
                rows = x.exchange(metas[name][i], i, 0)
                at = (seq0 + i + 1) % 2 * xi.set_stride if name == "ipc" else 0  # seq parity at capture
                got[name][i].copy_(rows[at:at + size * CAP])

    def check(replay: int) -> None:
        for name, x in (("shm", xs), ("ipc", xi)):
            x.check(x.err.tolist(), replay)
        for i in range(k):
            c, seq = counts_for(i, replay, size), seq0 + i + 1
            for p in range(size):
                want = block_for(p, c[p], H, seq).view(torch.int16)
                for name in ("shm", "ipc"):
                    rows = got[name][i][p * CAP:p * CAP + c[p]].cpu().view(torch.int16)
                    if not torch.equal(rows, want):
                        raise AssertionError(f"rank {rank}: replay {replay}, exchange {i} (seq {seq}): rank {p}'s "
                                             f"{c[p]} rows over {name} differ from what it sent")

    fill(0)
    body()  # eager: the proxy and the kernels once, outside the graph
    torch.cuda.synchronize(dev)
    check(0)
    seq0 += k
    graph = torch.cuda.CUDAGraph()
    comm.Barrier()
    with torch.cuda.graph(graph):
        body()
    for replay in range(1, args.replays + 1):
        fill(replay)  # fresh sizes and bits, the seqs of this replay
        torch.cuda.synchronize(dev)
        comm.Barrier()
        graph.replay()
        torch.cuda.synchronize(dev)
        check(replay)
        seq0 += k
    handled, count, why = xs.proxy.status()
    if why is not None:
        raise AssertionError(f"rank {rank}: the proxy stopped: {why}")
    comm.Barrier()
    shm.close()
    ipc.close()
    print(f"DOORBELL GRAPH OK rank {rank}: {args.replays} replays x {k} exchanges over shm ({args.rails} rails, proxy "
          f"handled {count}, last seq {handled}) equal to cuda-ipc's", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
