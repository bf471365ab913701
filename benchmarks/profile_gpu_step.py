"""Where a GPU decode step's device time goes: the device path (same kernels as the graph, launched eagerly)
under torch.profiler, kernels summed per step.

    python benchmarks/profile_gpu_step.py preset:air8:nvfp4 [M]
    mpirun -n 2 python benchmarks/profile_gpu_step.py preset:air8 [M] [fabric]    # one table per rank, one GPU each
    python benchmarks/profile_gpu_step.py preset:glm5-flash-4l:nvfp4 1 --capacity 4096   # a long run's cache
    python benchmarks/profile_gpu_step.py preset:glm5-flash-4l:nvfp4 1 \
        --ranges rocket_mpi.model.glm5_next_mla:mla_decode,_pool_decode,_absorbed    # device time per function
    python benchmarks/profile_gpu_step.py preset:glm5-flash-4l:nvfp4-all 1 --sequence   # one step, kernel by kernel

--ranges MODULE:FN[,FN...] (repeatable) wraps those module-level functions in profiler ranges for the profiled steps
and prints each one's calls, kernels and device time per step: the kernels of the torch ops it runs, those of the
ranges it calls included (the profiler does not link the extension's launches to a range; they are in the kernel
table). A function is wrapped where it is looked up when called: in the module that calls it.

Under mpirun each rank loads its share of the experts and exchanges rows over the fabric (default cuda-ipc),
as `rocket_mpi decode` does; a rank's exchange kernel time includes its wait for the slower rank.

A programmatic dependent launch (the expert kernels' down GEMM, csrc/nvfp4_experts.cu) starts before the kernel
ahead of it ends and waits; its duration would then count that wait too. So the expert and MLP kernels launch
without it here (--pdl 0) unless asked for, and the per-kernel times add up to the step's device time. Steps
launched ahead of the host's reads (Engine.steps_ahead) would put the next step's launches inside the profiled
steps' window: one step at a time here.
"""
import argparse
import functools
import importlib
import json
import os
import re
import tempfile
from contextlib import ExitStack

from torch.profiler import ProfilerActivity, profile, record_function

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
    ap.add_argument("--ranges", action="append", default=[], metavar="MODULE:FN[,FN...]",
                    help="functions timed as profiler ranges (repeatable)")
    ap.add_argument("--sequence", action="store_true",
                    help="also list one step's kernels in launch order: device time, grid, block, name")
    a = ap.parse_args()
    targets = resolve(a.ranges)
    comm = world()
    rank, size = (comm.rank, comm.size) if comm else (0, 1)
    dev = pick_device("cuda", comm)
    reader = SyntheticReader(a.checkpoint, str(dev))
    eng = Engine(a.checkpoint, rank, size, Placement.contiguous(reader.config, size), reader, device=str(dev))
    prompts = default_prompts(a.m, eng.cfg.vocab_size)
    if size > 1:
        eng.fabric = make_fabric(a.fabric, comm, eng.max_rows([prompts]), eng.cfg.hidden_size, 60.0, device=dev)
    eng.set_decode_path("device", a.fabric if size > 1 else "local")
    # the ranges are CPU events whose kernels the profiler links to them
    prof = profile(activities=[ProfilerActivity.CUDA] + [ProfilerActivity.CPU] * bool(a.ranges))

    def on_step(step, logits):  # decode steps 2..STEPS+1 only: no prefill, no first-step warm-up
        if step == 1:
            prof.start()
        elif step == STEPS + 1:
            prof.stop()

    with applied(eng, {"experts_pdl": a.pdl, "mlp_pdl": a.pdl, "steps_ahead": 0}), ExitStack() as undo:
        names = ranged(targets, undo)
        eng.generate(prompts, 4, capacity=a.capacity)
        eng.generate(prompts, STEPS + 2, on_step=on_step, capacity=a.capacity)
    rows = sorted(((getattr(e, "self_device_time_total", 0), e.count, e.key) for e in prof.key_averages()
                   if e.device_type.name != "CPU" and e.key not in names), reverse=True)  # kernels, not the ranges
    total = sum(r[0] for r in rows)
    cap = f", cache capacity {a.capacity}" if a.capacity else ""
    lines = [f"rank {rank} of {size}, M={a.m}{cap}: device kernel time {total / STEPS / 1e3:.3f} ms per step "
             f"{sum(r[1] for r in rows) / STEPS:.0f} kernels per step",
             "(decode steps only, launched eagerly: the graph replays the same kernels without the launch gaps; "
             f"expert and MLP kernels' pdl {a.pdl}, no steps launched ahead)",
             f"{'us/step':>9} {'calls/step':>10}  kernel"]
    lines += [f"{t / STEPS:>9.1f} {c / STEPS:>10.1f}  {k[:110]}" for t, c, k in rows[:a.rows]]
    if a.sequence:
        lines += ["", *sequence(prof)]
    if names:
        lines += ["", f"{'us/step':>9} {'calls/step':>10} {'kernels/step':>12}  range"]
        for e in prof.events():
            if e.name in names and e.device_type.name == "CPU":
                names[e.name][0] += 1
                names[e.name][1] += _kernels(e)
                names[e.name][2] += e.device_time_total
        lines += [f"{t / STEPS:>9.1f} {n / STEPS:>10.1f} {k / STEPS:>12.1f}  {name}"
                  for name, (n, k, t) in names.items()]
    out = comm.gather("\n".join(lines), root=0) if comm else ["\n".join(lines)]
    if rank == 0:
        print("\n\n".join(out))
    if size > 1:
        eng.fabric.close()
    return 0


def sequence(prof) -> list[str]:
    """The profiled steps' last one, kernel by kernel in launch order (from the profiler's trace: grid and block)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    step = kernels[len(kernels) - len(kernels) // STEPS:]
    out = [f"one step, {len(step)} kernels in launch order; us, gap to the previous kernel's end, grid, block",
           f"{'#':>4} {'us':>7} {'gap':>6} {'grid':>14} {'block':>12}  kernel"]
    end = None
    for i, e in enumerate(step):
        args = e.get("args", {})
        gap = "" if end is None else f"{e['ts'] - end:.1f}"
        end = e["ts"] + e["dur"]
        grid = "x".join(map(str, args.get("grid", [])))
        block = "x".join(map(str, args.get("block", [])))
        out.append(f"{i:>4} {e['dur']:>7.1f} {gap:>6} {grid:>14} {block:>12}  {_short(e['name'])}")
    return out


def _short(name: str) -> str:
    """A kernel's name without its namespace and argument list (template arguments kept, cut to 100 characters)."""
    name = re.sub(r"\(.*\)$", "", name.replace("(anonymous namespace)::", ""))
    return name.removeprefix("void ").removeprefix("rocket::")[:100]


def resolve(specs: list[str]) -> list[tuple]:
    """--ranges' MODULE:FN[,FN...] -> (module, function name, range name) each; one line and exit 2 where a module or
    function is not there (checked before the model loads)."""
    out = []
    for spec in specs:
        mod_name, _, fns = spec.partition(":")
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            raise SystemExit(f"profile_gpu_step: --ranges {spec}: no module {mod_name!r} ({e})") from None
        for fn_name in filter(None, fns.split(",")):
            if not callable(getattr(mod, fn_name, None)):
                raise SystemExit(f"profile_gpu_step: --ranges {spec}: {mod_name} has no function {fn_name!r}")
            out.append((mod, fn_name, f"{mod_name.rsplit('.', 1)[-1]}.{fn_name}"))
    return out


def ranged(targets: list[tuple], undo: ExitStack) -> dict[str, list]:
    """Wrap each resolved function in a profiler range of its name until undo closes -> {name: [calls, kernels, us]}."""
    names = {}
    for mod, fn_name, name in targets:
        fn = getattr(mod, fn_name)

        @functools.wraps(fn)
        def wrapper(*args, _fn=fn, _name=name, **kw):
            with record_function(_name):
                return _fn(*args, **kw)
        setattr(mod, fn_name, wrapper)
        undo.callback(setattr, mod, fn_name, fn)
        names[name] = [0, 0, 0.0]
    return names


def _kernels(event) -> int:
    """Device kernels launched under a profiler event, its children's included."""
    return len(event.kernels) + sum(_kernels(c) for c in event.cpu_children)


if __name__ == "__main__":
    raise SystemExit(main())
