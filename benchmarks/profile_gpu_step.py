"""Where a GPU decode step's device time goes: the device path (same kernels as the graph, launched eagerly)
under torch.profiler, kernels summed per step.

    python benchmarks/profile_gpu_step.py preset:air8:nvfp4 [M]
    mpirun -n 2 python benchmarks/profile_gpu_step.py preset:air8 [M] [fabric]    # one table per rank, one GPU each
    python benchmarks/profile_gpu_step.py preset:glm5-flash-4l:nvfp4 1 --capacity 4096   # a long run's cache

Under mpirun each rank loads its share of the experts and exchanges rows over the fabric (default cuda-ipc),
as `rocket_mpi decode` does; a rank's exchange kernel time includes its wait for the slower rank.

A programmatic dependent launch (the expert kernels' down GEMM, csrc/nvfp4_experts.cu) starts before the kernel
ahead of it ends and waits; its duration would then count that wait too. So the expert and MLP kernels launch
without it here (--pdl 0) unless asked for, and the per-kernel times add up to the step's device time. Steps
launched ahead of the host's reads (Engine.steps_ahead) would put the next step's launches inside the profiled
steps' window: one step at a time here.
"""
import argparse

from torch.profiler import ProfilerActivity, profile

from rocket_mpi.checkpoint.synthetic import SyntheticReader
from rocket_mpi.fabric import make_fabric
from rocket_mpi.moe.placement import Placement
from rocket_mpi.runtime.decode import pick_device
from rocket_mpi.runtime.dist import world
from rocket_mpi.runtime.engine import Engine
from rocket_mpi.runtime.prompts import default_prompts

from ab_decode import PDL, applied  # beside this file

STEPS = 6  # profiled decode steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("m", nargs="?", type=int, default=8, help="streams (default 8)")
    ap.add_argument("fabric", nargs="?", default="cuda-ipc", help="under mpirun: the fabric (default cuda-ipc)")
    ap.add_argument("--capacity", type=int, default=0, help="cache positions per stream (the fixed step spans them)")
    ap.add_argument("--pdl", type=int, default=0, choices=PDL, help="the expert and MLP kernels' pdl (default 0: off)")
    ap.add_argument("--rows", type=int, default=30, help="kernels listed (default 30)")
    a = ap.parse_args()
    comm = world()
    rank, size = (comm.rank, comm.size) if comm else (0, 1)
    dev = pick_device("cuda", comm)
    reader = SyntheticReader(a.checkpoint, str(dev))
    eng = Engine(a.checkpoint, rank, size, Placement.contiguous(reader.config, size), reader, device=str(dev))
    prompts = default_prompts(a.m, eng.cfg.vocab_size)
    if size > 1:
        eng.fabric = make_fabric(a.fabric, comm, eng.max_rows([prompts]), eng.cfg.hidden_size, 60.0, device=dev)
    eng.set_decode_path("device", a.fabric if size > 1 else "local")
    prof = profile(activities=[ProfilerActivity.CUDA])

    def on_step(step, logits):  # decode steps 2..STEPS+1 only: no prefill, no first-step warm-up
        if step == 1:
            prof.start()
        elif step == STEPS + 1:
            prof.stop()

    with applied(eng, {"experts_pdl": a.pdl, "mlp_pdl": a.pdl, "steps_ahead": 0}):
        eng.generate(prompts, 4, capacity=a.capacity)
        eng.generate(prompts, STEPS + 2, on_step=on_step, capacity=a.capacity)
    rows = sorted(((getattr(e, "self_device_time_total", 0), e.count, e.key) for e in prof.key_averages()),
                  reverse=True)
    total = sum(r[0] for r in rows)
    cap = f", cache capacity {a.capacity}" if a.capacity else ""
    lines = [f"rank {rank} of {size}, M={a.m}{cap}: device kernel time {total / STEPS / 1e3:.3f} ms per step "
             f"{sum(r[1] for r in rows) / STEPS:.0f} kernels per step",
             "(decode steps only, launched eagerly: the graph replays the same kernels without the launch gaps; "
             f"expert and MLP kernels' pdl {a.pdl}, no steps launched ahead)",
             f"{'us/step':>9} {'calls/step':>10}  kernel"]
    lines += [f"{t / STEPS:>9.1f} {c / STEPS:>10.1f}  {k[:110]}" for t, c, k in rows[:a.rows]]
    out = comm.gather("\n".join(lines), root=0) if comm else ["\n".join(lines)]
    if rank == 0:
        print("\n\n".join(out))
    if size > 1:
        eng.fabric.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
