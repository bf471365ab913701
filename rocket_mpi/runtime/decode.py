"""The decode command: bootstrap over MPI, load this rank's share, decode, report."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from dataclasses import dataclass

import torch

from rocket_mpi import __version__, ops
from rocket_mpi.checkpoint.fingerprint import ContentLog, first_difference
from rocket_mpi.checkpoint.reader import CheckpointReader
from rocket_mpi.checkpoint.synthetic import SyntheticReader, is_synthetic
from rocket_mpi.errors import RocketError
from rocket_mpi.fabric import choose_why, fabric_precheck, make_fabric
from rocket_mpi.moe.cache import parse_budget
from rocket_mpi.moe.placement import Placement
from rocket_mpi.runtime.dist import collective as _collective
from rocket_mpi.runtime.dist import (handshake, local_rank, remember_ranks, run_guarded, verdict, wait_all,
                                     watchdog, world)
from rocket_mpi.runtime.engine import Engine
from rocket_mpi.runtime.progress import Timeline, log, setup_logging
from rocket_mpi.runtime.chat import read_chat_prompts, stop_ids
from rocket_mpi.runtime.prompts import default_prompts, load_tokenizer, read_prompts
from rocket_mpi.runtime.sampling import Sampling, Stop, cut_at_stop
from rocket_mpi.runtime.telemetry import (cache_start, config_digest, model_identity, shares_digest, step_telemetry,
                                          write_telemetry)
from rocket_mpi.settings import RunSettings, Settings


def decode(args: RunSettings, settings: Settings, report=None) -> int:
    """Run one decode (alone, or as one rank under mpirun): bootstrap, load this rank's share, decode, gather.
    Rank 0 writes args.out and calls report(doc, cfg) with the run's document (cli/report.py prints it)."""
    comm = world(args.startup_timeout)
    return run_guarded(comm, "rocket_mpi", lambda: _decode(args, settings, comm, report))


@dataclass
class Booted:
    """A rank ready to decode: its engine (share loaded, fabric up, decode path agreed) and what set-up found."""
    engine: Engine
    reader: CheckpointReader
    fabric_name: str
    path: str
    runs: list            # the prompts of each run of the sweep (decode), [] for the server
    text: bool            # were the prompts text
    stop: Stop            # when streams end (stop_rule)
    detok: object         # the tokenizer's decode where stop strings need it, else None
    timeline: Timeline    # where the wall time went: start, set-up, load, fabric (decode adds its parts)


def boot(args: RunSettings, settings: Settings, comm, sweep: list[int], facts_extra: dict | None = None,
         rows_for=None, want_path: str | None = None) -> Booted:
    """Everything before the first step, shared by decode and serve: logging, device, checkpoint and placement,
    prompts (one run per M of `sweep`), fabric choice, the handshake (the ranks agree on the checkpoint's
    fingerprint, flags and `facts_extra`), this rank's share, the fabric with row buffers for `rows_for(engine,
    runs)` rows (default: the runs' largest prefill chunk or decode step) and the decode path (`want_path`, default
    args.decode_path). Every wait is bounded by args.startup_timeout."""
    rank, size = (comm.rank, comm.size) if comm else (0, 1)
    timeline = Timeline()
    fab = args.fabric
    setup_logging(rank, args.log_level)
    log.info(f"rocket_mpi {__version__}: {size} rank(s), device {args.device}, checkpoint {args.checkpoint}")
    torch.set_num_threads(args.threads)
    device = pick_device(args.device, comm)
    share = 1  # ranks on this rank's GPU (or host, for CPU ranks): the expert cache's auto budget splits its memory
    if device.type == "cuda" and size > 1:
        with watchdog(comm, args.startup_timeout, "comparing the ranks' GPUs"):
            ids = comm.allgather(gpu_identity(device))
        shared = gpu_sharing(ids)
        share = sum(1 for i in ids if i[:2] == ids[rank][:2])
        if shared and rank == 0:
            print(f"warning: {shared}", file=sys.stderr, flush=True)

    def setup():
        if is_synthetic(args.checkpoint):
            reader = SyntheticReader(args.checkpoint, str(device))
        else:
            reader = CheckpointReader(args.checkpoint)
        cfg = reader.config
        placement = (Placement.from_file(args.placement, cfg, size) if args.placement
                     else Placement.contiguous(cfg, size))
        if args.replicas is not None and not args.rebalance_every:
            raise RocketError(f"--replicas {args.replicas}: replicas placed by live rebalancing need --rebalance-every "
                              f"STEPS (fixed replicas come in a --placement file)")
        runs, text = [], False
        if args.chat and args.prompts:
            raise RocketError("--chat and --prompts: give one of them")
        for m in sweep:
            if args.chat:
                p, text = read_chat_prompts(args.chat, args.checkpoint, m), True
            elif args.prompts:
                p, text = read_prompts(args.prompts, args.checkpoint, m)
            else:
                p = default_prompts(m, cfg.vocab_size)
            runs.append(p)
        start = (cache_start(args.expert_cache_from, cfg, f"--checkpoint {args.checkpoint}")
                 if args.expert_cache_from else None)
        return reader, placement, runs, text, stop_rule(args, cfg), start

    # no collective may run inside a _collective step: a rank that failed earlier would never join it
    reader, placement, runs, text, (stop, detok), cache_from = _collective(comm, args.startup_timeout, "set-up",
                                                                           setup)
    log.info(f"{reader.config.model_type}: {reader.config.num_hidden_layers} layers, {reader.config.n_routed_experts} "
             f"routed experts" + (f"; streams {sweep}, {args.tokens} tokens each" if sweep else ""))
    with watchdog(comm, args.startup_timeout, "choosing the fabric"):
        fabric_name, fabric_why = choose_why(fab.name, comm, args.device, settings.hostname)
    _collective(comm, args.startup_timeout, "fabric checks", lambda: fabric_precheck(fabric_name, args.device))
    cfg = reader.config
    facts = {"version": __version__, "model_type": cfg.model_type, "config": config_digest(cfg),
             "checkpoint fingerprint": _collective(comm, args.startup_timeout, "fingerprint", reader.fingerprint),
             "streams": sweep, "tokens": args.tokens, "threads": args.threads, "device": args.device,
             "fabric": fabric_name, "placement": placement.digest(), "decode path": want_path or args.decode_path,
             "prefill chunk": args.prefill_chunk, "sampling": (args.temperature, args.top_p, args.top_k, args.seed),
             "stop": (args.stop, args.ignore_eos), "rebalance": (args.rebalance_every, args.replicas),
             "prompts": hashlib.sha256(json.dumps(runs).encode()).hexdigest()[:16],
             "expert cache from": shares_digest(cache_from),
             "settings": settings.bits(), **(facts_extra or {})}
    log.info(f"fabric {fabric_name}" + (f" (--fabric auto: {fabric_why})" if fab.name == "auto" else "") + "; loading "
             "this rank's share of the checkpoint")
    handshake(comm, facts, args.startup_timeout)
    if comm is not None:  # a launcher names a dead rank by its PID alone: which rank that is, once
        with watchdog(comm, args.startup_timeout, "naming the ranks"):
            where = comm.allgather((socket.gethostname(), os.getpid()))
        remember_ranks(where)
        log.info("ranks: " + ", ".join(f"{r} = pid {pid} on {host}" for r, (host, pid) in enumerate(where)))
        if device.type == "cpu":
            share = sum(1 for host, _ in where if host == where[rank][0])

    # what each rank loads, digested as it loads (checkpoint/fingerprint.py): compared once all have loaded
    content = ContentLog.record(reader) if size > 1 and not is_synthetic(args.checkpoint) else None
    timeline.mark("set-up")
    try:
        engine = _collective(comm, args.startup_timeout, "checkpoint loading",
                             lambda: Engine(args.checkpoint, rank, size, placement, reader, device, settings,
                                            progress=args.progress and rank == 0,
                                            expert_cache=parse_budget(args.expert_cache), share=share,
                                            host_memory=parse_budget(args.host_memory),
                                            telemetry=bool(args.telemetry), cache_from=cache_from,
                                            rebalance_every=args.rebalance_every, replicas=args.replicas))
    finally:
        if content is not None:
            content.finish()
    if content is not None:
        verdict(comm, content.summary(), first_difference, args.startup_timeout, "comparing the checkpoint's contents")
        log.info(f"checkpoint contents agree: {len(content.entries)} tensors, {content.nbytes() / 2**30:.2f} GiB "
                 f"digested on this rank in {content.seconds:.1f} s")
    log.info(f"loaded in {engine.load_seconds:.1f} s: {engine.owned_experts()} expert slots, "
             f"{engine.resident_bytes() / 2**30:.2f} GiB resident; expert cache: {engine.cache_plan.reason}")
    if cache_from is not None:
        log.info(f"expert cache: started from {args.expert_cache_from}" if engine.expert_cache is not None else
                 f"--expert-cache-from {args.expert_cache_from}: every expert of this rank is resident, nothing to "
                 f"start")
    timeline.mark("load")
    for p in runs:
        _collective(comm, args.startup_timeout, "prompt checks", lambda p=p: engine.check_prompts(p, args.tokens))
    engine.prefill_chunk = args.prefill_chunk
    max_rows = max(rows_for(engine, runs) if rows_for else engine.max_rows(runs), 1)
    # the fabric's endpoint exchange is collective: a watchdog, not _collective, bounds it
    with watchdog(comm, args.startup_timeout, f"setting up fabric {fabric_name}"):
        engine.fabric = make_fabric(fabric_name, comm, max_rows, cfg.hidden_size, fab.timeout,
                                    fab.rail_spec(fabric_name), fab.rail_split_min_bytes, fab.gid_index, device,
                                    settings.hostname)
    path = _collective(comm, args.startup_timeout, "decode path",
                       lambda: engine.set_decode_path(want_path or args.decode_path, fabric_name))
    with watchdog(comm, args.startup_timeout, "agreeing on the decode path"):
        paths = comm.allgather(path) if comm else [path]
    if len(set(paths)) > 1:  # every rank must take the same path (parity); all ranks see the same list
        raise RocketError(f"the ranks chose different decode paths: {paths}")
    timeline.mark("fabric")
    return Booted(engine, reader, fabric_name, path, runs, text, stop, detok, timeline)


def check_out_folders(rank: int, *flags: tuple[str, str | None]) -> None:
    """Rank 0 writes these (flag, path) files at the end: their folders must exist before the run, not after it."""
    for flag, path in flags:
        out_dir = os.path.dirname(os.path.abspath(path)) if path else None
        if rank == 0 and out_dir and not os.path.isdir(out_dir):
            raise RocketError(f"{flag} {path}: the folder {out_dir} does not exist")


def _decode(args: RunSettings, settings: Settings, comm, report) -> int:
    rank, size = (comm.rank, comm.size) if comm else (0, 1)
    check_out_folders(rank, ("--out", args.out), ("--telemetry", args.telemetry))
    sweep = list(args.streams)
    b = boot(args, settings, comm, sweep)
    engine, reader, fabric_name, path, runs = b.engine, b.reader, b.fabric_name, b.path, b.runs
    cfg, device = reader.config, engine.device
    wait_all(comm, args.startup_timeout, "the start of decoding")
    log.info(f"decode path {path}; decoding")

    timeline = b.timeline
    timeline.mark("set-up")
    copy_bw, h2d_bw = measure_copy_bandwidth(device), measure_h2d_bandwidth(device)
    timeline.mark("bandwidth probes")
    load = {"rank": rank, "load_s": engine.load_seconds, "copy_gbps": copy_bw, "h2d_gbps": h2d_bw,
            "expert_cache_plan": engine.cache_plan.as_dict(), "expert_cache_from": args.expert_cache_from,
            "resident_gib": engine.resident_bytes() / 2**30,
            "peak_rss_gib": engine.peak_rss_bytes() / 2**30, "experts": engine.owned_experts(),
            "stack_bytes": engine.stack_read_bytes(),
            "expert_read_bytes": max((s.read_bytes_per_expert for s in engine.experts.values()), default=0)}
    base = Sampling(args.temperature, args.top_p, args.top_k, args.seed).check()
    stop, detok = b.stop, b.detok
    results = []
    try:
        for p in runs:
            r = engine.generate(p, args.tokens, sampling=[base.for_stream(s) for s in range(len(p))], stop=stop,
                                detok=detok)
            results.append(r)
    finally:
        engine.fabric.close()
    timeline.mark("runs")
    stepped = sum(s.seconds for r in results for s in r.steps)  # the prefills and decode steps, as each timed them
    runs_s = timeline.parts.pop("runs")
    timeline.parts["prefill and decode steps"] = stepped
    timeline.parts["captures and the rest"] = max(runs_s - stepped, 0.0)
    load["wall_s"] = dict(timeline.parts)
    summaries = [dict(r.summary(rank), expert_cache=r.expert_cache) for r in results]
    trace = engine.expert_cache.trace_array() if args.telemetry and engine.expert_cache else None
    crcs = [[f"{s.row_crc:08x}" for s in r.steps] for r in results]
    steps = step_telemetry(results[-1]) if args.telemetry and results else None
    with watchdog(comm, args.startup_timeout, "gathering results"):
        gathered = comm.gather((load, summaries, crcs, steps), root=0) if comm else [(load, summaries, crcs, steps)]
    if rank != 0:
        return 0
    if args.telemetry:
        write_telemetry(args.telemetry, trace, cfg, [g[1][-1] for g in gathered], engine.placement,
                        [g[3] for g in gathered], model_identity(cfg, args.checkpoint),
                        max(g[0]["expert_read_bytes"] for g in gathered), results[-1].path, args.device)
    tok = load_tokenizer(args.checkpoint)
    out_runs = []
    for i, r in enumerate(results):
        run = {"streams": r.streams, "tokens": r.tokens, "finish": r.finish, "path": r.path, "note": r.note,
               "spans": r.spans,
               "prefill": {"tokens": r.prefill[0], "forwards": r.prefill[1], "chunk": args.prefill_chunk},
               "row_checksums": {str(g[0]["rank"]): g[2][i] for g in gathered},
               "per_rank": [g[1][i] for g in gathered]}
        run.update(split_ceiling(run["per_rank"], [g[0]["stack_bytes"] for g in gathered]))
        if tok is not None:
            run["text"] = [cut_at_stop(tok.decode(t), stop.strings) for t in r.tokens]
        out_runs.append(run)
    doc = {"ranks": size, "fabric": fabric_name, "checkpoint": args.checkpoint, "model_type": cfg.model_type,
           "tokens": out_runs[-1]["tokens"], "finish": out_runs[-1]["finish"], "runs": out_runs, "load": [g[0] for g in gathered]}
    if "text" in out_runs[-1]:
        doc["text"] = out_runs[-1]["text"]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f)
    if report is not None:
        report(doc, cfg)
    return 0


def stop_rule(args: RunSettings, cfg) -> tuple[Stop, object]:
    """(when streams end, the decoder that finds stop strings): the checkpoint's end-of-text ids (config.json and
    generation_config.json) unless --ignore-eos, and --stop strings, which need the checkpoint's tokenizer."""
    eos = () if is_synthetic(args.checkpoint) else stop_ids(args.checkpoint, cfg.eos_token_id)
    stop = Stop(eos or tuple(cfg.eos_token_id), tuple(args.stop), args.ignore_eos)
    detok = None
    if stop.strings:
        tok = None if is_synthetic(args.checkpoint) else load_tokenizer(args.checkpoint)
        if tok is None:
            raise RocketError(f"--stop needs the checkpoint's tokenizer.json, and {args.checkpoint} has none")
        detok = tok.decode
    return stop, detok


def split_ceiling(per_rank: list[dict], stack_bytes: list[int]) -> dict:
    """What the split can gain at best, from the bytes each rank read per step: one rank alone would read the
    replicated stack once plus every expert any rank ran (each expert has one owner), the busiest rank reads
    the stack plus its own experts; a bandwidth-bound step is at most their ratio faster split. Empty for
    one rank."""
    if len(per_rank) < 2:
        return {}
    experts = [s["weight_bytes_per_step"] - b for s, b in zip(per_rank, stack_bytes)]
    one = stack_bytes[0] + sum(experts)
    busiest = max(s["weight_bytes_per_step"] for s in per_rank)
    return {"one_rank_bytes_per_step": one, "busiest_rank_bytes_per_step": busiest,
            "split_ceiling": one / busiest if busiest else 0.0}


def measure_h2d_bandwidth(device) -> float | None:
    """Pinned host-to-device copy GB/s (256 MiB): what an expert-cache miss reads at, at best. GPU only."""
    if device.type != "cuda":
        return None
    n = 1 << 28
    a = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    b = torch.empty(n, dtype=torch.uint8, device=device)
    b.copy_(a, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        b.copy_(a, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del a, b
    return n / (sorted(times)[1] * 1e-3) / 1e9


def measure_copy_bandwidth(device) -> float | None:
    """Device-to-device copy GB/s (read + write), the roofline of a bandwidth-bound decode step. GPU only:
    on a CPU the number would mostly measure the other ranks sharing the memory bus."""
    if device.type != "cuda":
        return None
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del a, b
    return 2 * n / (sorted(times)[2] * 1e-3) / 1e9


def pick_device(name: str, comm):
    """cpu, or the GPU of this rank's local rank (one rank per GPU), with deterministic kernels."""
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RocketError("--device cuda: torch sees no CUDA device (a CPU build of torch, or no GPU here)")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    ops.set_deterministic(True, warn_only=True)
    # deterministic mode would also fill every torch.empty with NaN: a kernel per allocation, on the hot
    # path and in the captured graph; every buffer here is written before it is read
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    dev = torch.device("cuda", local_rank(comm) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def gpu_identity(device) -> tuple[str, str, int]:
    """(host, the GPU's UUID, its index here): the same physical GPU reads the same whatever
    CUDA_VISIBLE_DEVICES each rank was given."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return socket.gethostname(), str(uuid) if uuid is not None else f"index {device.index}", device.index


def gpu_sharing(ids: list[tuple[str, str, int]]) -> str:
    """'' when every rank has a GPU of its own, else one line naming the ranks that share one. Not an error
    (the tests put 3 ranks on 2 GPUs on purpose), but slow: ranks on one GPU take turns with its SMs, and the
    graphed cuda-ipc exchange spins while it waits (an order of magnitude slower per step)."""
    by_gpu: dict[tuple[str, str], list[int]] = {}
    for rank, (host, uuid, _) in enumerate(ids):
        by_gpu.setdefault((host, uuid), []).append(rank)
    shared = [(ranks, ids[ranks[0]]) for ranks in by_gpu.values() if len(ranks) > 1]
    if not shared:
        return ""
    where = "; ".join(f"ranks {', '.join(map(str, ranks))} share GPU {index} of {host}"
                      for ranks, (host, _, index) in shared)
    return (f"{where}: ranks on one GPU take turns with it and run many times slower; start one rank per GPU "
            f"(mpirun -np <GPUs per node x nodes>, or Slurm --ntasks-per-node = --gpus-per-node)")
