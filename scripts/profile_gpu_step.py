"""Where a GPU decode step's device time goes: the device path (same kernels as the graph, launched eagerly)
under torch.profiler, kernels summed per step. python scripts/profile_gpu_step.py preset:air8:nvfp4 [M]"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from rocket_mpi.checkpoint.synthetic import SyntheticReader  # noqa: E402
from rocket_mpi.engine import Engine  # noqa: E402
from rocket_mpi.prompts import default_prompts  # noqa: E402
from rocket_mpi.run import _pick_device  # noqa: E402

ckpt = sys.argv[1]
m = int(sys.argv[2]) if len(sys.argv) > 2 else 8
dev = _pick_device("cuda", None)
eng = Engine(ckpt, reader=SyntheticReader(ckpt, str(dev)), device=str(dev))
eng.set_decode_path("device", "local")
prompts = default_prompts(m, eng.cfg.vocab_size)
eng.generate(prompts, 4)
steps = 6
prof = profile(activities=[ProfilerActivity.CUDA])


def on_step(step, logits):  # decode steps 2..steps+1 only: no prefill, no first-step warm-up
    if step == 1:
        prof.start()
    elif step == steps + 1:
        prof.stop()


eng.generate(prompts, steps + 2, on_step=on_step)
rows = sorted(((getattr(e, "self_device_time_total", 0), e.count, e.key) for e in prof.key_averages()), reverse=True)
total = sum(r[0] for r in rows)
print(f"M={m}: device kernel time {total / steps / 1e3:.3f} ms per step "
      f"{sum(r[1] for r in rows) / steps:.0f} kernels per step")
print("(decode steps only, launched eagerly: the graph replays the same kernels without the launch gaps)")
print(f"{'us/step':>9} {'calls/step':>10}  kernel")
for t, c, k in rows[:int(os.environ.get("ROCKET_PROFILE_ROWS", "30"))]:
    print(f"{t / steps:>9.1f} {c / steps:>10.1f}  {k[:110]}")
