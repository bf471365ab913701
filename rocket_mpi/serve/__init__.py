"""`python -m rocket_mpi serve`: the split model behind an OpenAI-compatible HTTP API.

Under mpirun every rank boots as `decode` does (runtime/decode.py boot); rank 0 then listens on HTTP
(api.py) and plans each step, the other ranks follow its plans (scheduler.py).
"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

from rocket_mpi.errors import RocketError
from rocket_mpi.runtime.chat import generation_config, load_chat_template, special_tokens, stop_ids
from rocket_mpi.runtime.decode import boot, check_out_folders
from rocket_mpi.runtime.dist import collective as _collective
from rocket_mpi.runtime.dist import run_guarded, wait_all, world
from rocket_mpi.runtime.progress import log
from rocket_mpi.runtime.prompts import load_tokenizer
from rocket_mpi.runtime.telemetry import model_identity, write_telemetry
from rocket_mpi.serve.api import Api, make_app
from rocket_mpi.serve.scheduler import Scheduler, Slots, follow
from rocket_mpi.settings import RunSettings, Settings

READY_TIMEOUT = 30.0  # seconds the HTTP server may take to start listening once the model is loaded


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    max_streams: int = 8          # M: the stream slots decoded together
    max_model_len: int = 0        # positions per slot (prompt + completion); 0: the model's, at most 8192
    model_name: str | None = None  # what /v1/models lists (default: the checkpoint folder's name)
    reasoning_parser: str | None = None  # "glm": chat completions' <think> ... </think> as reasoning_content


def serve(args: RunSettings, opts: ServeSettings, settings: Settings) -> int:
    comm = world(args.startup_timeout)
    return run_guarded(comm, "rocket_mpi", lambda: _serve(args, opts, settings, comm))


def _listen(host: str, port: int) -> socket.socket:
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(256)
    except OSError as e:
        raise RocketError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    return sock


def _serve(args: RunSettings, opts: ServeSettings, settings: Settings, comm) -> int:
    import uvicorn
    rank = comm.rank if comm else 0
    check_out_folders(rank, ("--telemetry", args.telemetry))  # before the load, not at shutdown
    sock = _listen(opts.host, opts.port) if rank == 0 else None  # a port in use fails before the model loads
    facts = {"serve": (opts.max_streams, opts.max_model_len)}
    m = opts.max_streams

    def rows_for(engine, _runs):  # a prefill forward (at most a chunk), or a decode step of every slot
        return max(min(engine.prefill_chunk, m * cap(engine)), m * engine.size) * engine.cfg.num_experts_per_tok

    def cap(engine):
        limit = engine.cfg.max_position_embeddings
        return min(opts.max_model_len or min(limit, 8192), limit)

    b = boot(args, settings, comm, [], facts, rows_for)
    engine = b.engine
    if comm is not None and comm.size > 1:
        # rank 0's step plans (runtime/dist.py bcast) may still be in flight when a rank starts waiting for rows:
        # some transports (MPICH's OFI netmod between nodes) move them only while both ends call into MPI
        engine.fabric.idle_hook = comm.Iprobe
    path = _collective(comm, args.startup_timeout, "the slots' decode path", lambda: engine.path_for(m))
    slots = Slots(engine, m, cap(engine), path)
    _collective(comm, args.startup_timeout, "warming up the decode step", slots.warm)
    wait_all(comm, args.startup_timeout, "the start of serving")
    timeout = args.fabric.timeout
    if rank != 0:  # rank 0 ends the job (a launcher passes ^C to every rank): the others wait for its word
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        try:
            follow(comm, slots, timeout)
        finally:
            engine.fabric.close()
        return 0

    cfg = engine.cfg
    ckpt = args.checkpoint
    real = os.path.isdir(ckpt)
    tok = load_tokenizer(ckpt) if real else None
    gen = generation_config(ckpt) if real else {}
    eos = stop_ids(ckpt, cfg.eos_token_id) if real else tuple(cfg.eos_token_id)
    sched = Scheduler(comm, slots, timeout, detok=tok.decode if tok is not None else None)
    name = opts.model_name or (os.path.basename(os.path.normpath(ckpt)) if real else ckpt)
    template = load_chat_template(ckpt) if real else None
    api = Api(sched, tok, template, special_tokens(ckpt) if real else {}, name, cfg.vocab_size, eos,
              {k: gen[k] for k in ("temperature", "top_p", "top_k") if k in gen}, opts.reasoning_parser == "glm")
    server = uvicorn.Server(uvicorn.Config(make_app(api), log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="http")
    thread.start()
    deadline = time.monotonic() + READY_TIMEOUT
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RocketError(f"the HTTP server on {opts.host}:{opts.port} did not start")
        time.sleep(0.01)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sched.stop())
    host = f"[{opts.host}]" if ":" in opts.host else opts.host
    log.info(f"serving {name} on http://{host}:{opts.port}/v1 ({m} stream slots of {slots.capacity} positions, "
             f"{b.fabric_name} fabric, {engine.size} rank(s), decode path {path})")
    print(f"rocket_mpi: serving on http://{host}:{opts.port}/v1", flush=True)
    try:
        sched.run()
    finally:
        server.should_exit = True
        thread.join(5)
        engine.fabric.close()
    if args.telemetry:
        _write_telemetry(args, engine, slots, path)
    log.info("shut down")
    return 0


def _write_telemetry(args: RunSettings, engine, slots: Slots, path: str) -> None:
    """--telemetry: the routing of every decode step served (rank 0's count: every rank routes the same rows), the
    placement at shutdown and the model's identity, as decode --telemetry writes them; no per-rank step times (a
    server's steps differ in their slots), so `place --row-cost fit` has nothing to fit."""
    xc = engine.expert_cache
    trace = xc.trace_array() if xc is not None else None
    per_expert = next((s.read_bytes_per_expert for s in engine.experts.values() if s.owned), 0)
    summary = {"rank": engine.rank, "M": slots.m, "expert_cache": xc.summary() if xc is not None else None}
    write_telemetry(args.telemetry, trace, engine.cfg, [summary], engine.placement, [],
                    model_identity(engine.cfg, args.checkpoint), per_expert, path, args.device, engine.size)
    steps = 0 if trace is None else trace.shape[0]
    log.info(f"telemetry: {steps} decode steps' routing written to {args.telemetry}")
