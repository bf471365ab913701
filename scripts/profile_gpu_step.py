"""Where a GPU decode step's device time goes: the device path (same kernels as the graph, launched eagerly)
under torch.profiler, kernels summed per step.

    python scripts/profile_gpu_step.py preset:air8:nvfp4 [M]
    mpirun -n 2 python scripts/profile_gpu_step.py preset:air8 [M] [fabric]    # one table per rank, one GPU each
    ROCKET_PROFILE_CAPACITY=4096 python scripts/profile_gpu_step.py preset:glm5-flash-4l:nvfp4 1   # a long run's cache

Under mpirun each rank loads its share of the experts and exchanges rows over the fabric (default cuda-ipc),
as `rocket_mpi decode` does; a rank's exchange kernel time includes its wait for the slower rank."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from rocket_mpi.checkpoint.synthetic import SyntheticReader  # noqa: E402
from rocket_mpi.dist import world  # noqa: E402
from rocket_mpi.engine import Engine  # noqa: E402
from rocket_mpi.fabric import make_fabric  # noqa: E402
from rocket_mpi.placement import Placement  # noqa: E402
from rocket_mpi.prompts import default_prompts  # noqa: E402
from rocket_mpi.run import _pick_device  # noqa: E402

# A programmatic dependent launch (the expert kernels' down GEMM, csrc/nvfp4_experts.cu) starts before the kernel
# ahead of it ends and waits; its duration would then count that wait too. Off here unless asked for, so that the
# per-kernel times add up to the step's device time.
os.environ.setdefault("ROCKET_EXPERTS_PDL", "0")
# Steps launched ahead of the host's reads (graph.steps_ahead) would put the next step's launches inside the profiled
# steps' window: one step at a time here.
os.environ.setdefault("ROCKET_STEPS_AHEAD", "0")

ckpt = sys.argv[1]
m = int(sys.argv[2]) if len(sys.argv) > 2 else 8
fabric = sys.argv[3] if len(sys.argv) > 3 else "cuda-ipc"
comm = world()
rank, size = (comm.rank, comm.size) if comm else (0, 1)
dev = _pick_device("cuda", comm)
reader = SyntheticReader(ckpt, str(dev))
eng = Engine(ckpt, rank, size, Placement.contiguous(reader.config, size), reader, device=str(dev))
prompts = default_prompts(m, eng.cfg.vocab_size)
if size > 1:
    eng.fabric = make_fabric(fabric, comm, eng.max_rows([prompts]), eng.cfg.hidden_size, 60.0, device=dev)
eng.set_decode_path("device", fabric if size > 1 else "local")
capacity = int(os.environ.get("ROCKET_PROFILE_CAPACITY", "0"))  # cache positions (the fixed step spans them all)
eng.generate(prompts, 4, capacity=capacity)
steps = 6
prof = profile(activities=[ProfilerActivity.CUDA])


def on_step(step, logits):  # decode steps 2..steps+1 only: no prefill, no first-step warm-up
    if step == 1:
        prof.start()
    elif step == steps + 1:
        prof.stop()


eng.generate(prompts, steps + 2, on_step=on_step, capacity=capacity)
rows = sorted(((getattr(e, "self_device_time_total", 0), e.count, e.key) for e in prof.key_averages()), reverse=True)
total = sum(r[0] for r in rows)
cap = f", cache capacity {capacity}" if capacity else ""
lines = [f"rank {rank} of {size}, M={m}{cap}: device kernel time {total / steps / 1e3:.3f} ms per step "
         f"{sum(r[1] for r in rows) / steps:.0f} kernels per step",
         "(decode steps only, launched eagerly: the graph replays the same kernels without the launch gaps; "
         f"ROCKET_EXPERTS_PDL={os.environ['ROCKET_EXPERTS_PDL']})",
         f"{'us/step':>9} {'calls/step':>10}  kernel"]
lines += [f"{t / steps:>9.1f} {c / steps:>10.1f}  {k[:110]}" for t, c, k in rows[:int(os.environ.get("ROCKET_PROFILE_ROWS", "30"))]]
out = comm.gather("\n".join(lines), root=0) if comm else ["\n".join(lines)]
if rank == 0:
    print("\n\n".join(out))
if size > 1:
    eng.fabric.close()
