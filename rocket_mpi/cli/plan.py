"""plan: whether a checkpoint fits N ranks, and how, from its headers alone (nothing is loaded).

    python -m rocket_mpi plan --checkpoint DIR --ranks 2 --device-memory 128 --host-memory 0

Prints the architecture, the replicated stack's bytes as the ranks hold it (NVFP4 linears outside the routed experts:
held as stored on GPU ranks, model/layers.py, all but MLA's kv_b, which the absorbed attention reads dense, and shapes
that are not whole tiles of 16; decoded to BF16 at load on CPU ranks), the routed experts' bytes (packed for the GPU
kernel, or dense BF16 on CPU ranks), and per rank: the experts it owns, how many of them the expert cache
(moe/cache.py) keeps in device memory under --expert-cache, the rest in host memory (where that is short, as many far
slots per layer as fit, the other experts read from the checkpoint files when a step needs them), and the bytes one
decode step reads from each memory (M streams, uniform routing: each expert read at most once per layer; the stack but
the embedding's rows, as the decode report counts it). The verdict: fits all-resident, fits with a cache, fits with a
cache and the checkpoint files, or does not fit.
"""
from __future__ import annotations

import argparse
import re

from rocket_mpi.checkpoint.reader import CheckpointReader
from rocket_mpi.checkpoint.synthetic import SyntheticReader, is_synthetic
from rocket_mpi.cli.flags import cache_budget, nonneg_float, pos_float, pos_int
from rocket_mpi.errors import RocketError
from rocket_mpi.moe.cache import GIB, RESERVE_FRACTION, RESERVE_MIN, expert_bytes, parse_budget, plan_capacity
from rocket_mpi.moe.placement import Placement


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_NOT_TEXT = ("visual.", "vision_tower.", "model.visual.", "model.vision_tower.", "mtp.", "model.mtp.")


def read_by_the_model(name: str, num_hidden_layers: int) -> bool:
    """Whether text decode loads the tensor: not a layer past the last (the MTP layers a GLM checkpoint stores as
    layers.{num_hidden_layers}, ...), not the vision tower."""
    m = _LAYER.search(name)
    return not (m and int(m.group(1)) >= num_hidden_layers) and not name.startswith(_NOT_TEXT)


def tensor_shapes(reader) -> dict[str, tuple[int, ...]]:
    """Every stored tensor's shape that text decode loads, from the safetensors headers (or a preset's specs, its NVFP4
    modules as a checkpoint stores them: weight [N, K/2] uint8, weight_scale [N, K/16], weight_scale_2 [])."""
    if isinstance(reader, SyntheticReader):
        out = {}
        for name, (shape, _) in reader.specs.items():
            mod = name[:-len(".weight")]
            if name.endswith(".weight") and mod + ".weight_scale_2" in reader.where:
                n, k = shape
                out.update({name: (n, k // 2), mod + ".weight_scale": (n, k // 16), mod + ".weight_scale_2": ()})
            else:
                out[name] = tuple(shape)
        return out
    from safetensors import safe_open
    out, by_file = {}, {}
    for name, path in reader.where.items():
        if read_by_the_model(name, reader.config.num_hidden_layers):
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                out[name] = tuple(f.get_slice(reader.stored_name(name)).get_shape())
    return out


# NVFP4 linears of the stack that GPU ranks keep dense all the same: MLA's kv_b (the absorbed attention reads its key
# and value halves per head)
DENSE_ON_GPU = ("kv_b_proj",)


def stack_bytes(shapes: dict[str, tuple[int, ...]], as_stored: bool = False) -> int:
    """The replicated stack as loaded: every tensor but the routed experts', in BF16 (an NVFP4 weight [N, K/2] holds
    N x K elements); as_stored (GPU ranks): an NVFP4 linear held as stored (model/layers.py: shapes of whole tiles of
    16, not DENSE_ON_GPU) counts its stored bytes, codes, block scales and weight_scale_2, instead."""
    total = 0
    for name, shape in shapes.items():
        if ".mlp.experts." in name or name.endswith((".weight_scale", ".weight_scale_2", ".input_scale",
                                                     ".input_global_scale", ".weight_scale_inv")):
            continue
        n = 1
        for d in shape:
            n *= d
        mod = name[:-len(".weight")]
        packed = name.endswith(".weight") and mod + ".weight_scale_2" in shapes   # NVFP4 (FP8 loads as BF16)
        if packed and as_stored and shape[0] % 16 == 0 and (2 * shape[1]) % 16 == 0 and \
                not any(p in name for p in DENSE_ON_GPU):
            total += n + n // 8 + 4   # codes (2 per byte), one e4m3 scale per 16, the fp32 weight_scale_2
        else:
            total += n * (4 if packed else 2)
    return total


def fp8_note(cfg, nvfp4: bool) -> str:
    """What the counts below mean for a checkpoint with FP8 weights: decoded to BF16 at load (ops/fp8.py)."""
    q = cfg.quant
    if q is None or not q.fp8:
        return ""
    return "; FP8 weights " + ("outside them " if nvfp4 else "") + "decoded to BF16 at load, counted as BF16 below"


def add_parser(sub, formatter) -> None:
    p = sub.add_parser("plan", help="whether a checkpoint fits N ranks, from its headers", formatter_class=formatter,
                       description=__doc__)
    p.add_argument("--checkpoint", required=True, help="checkpoint folder, or preset:NAME[:nvfp4|:nvfp4-all|:nvfp4-head]")
    p.add_argument("--ranks", type=pos_int, default=1)
    p.add_argument("--placement", help="JSON placement (default: contiguous halves, thirds, ...)")
    p.add_argument("--device-memory", type=pos_float, help="GiB of device memory per rank (default: this machine's GPU; "
                                                        "GB10's unified memory: 128 and --host-memory 0)")
    p.add_argument("--host-memory", type=nonneg_float, help="GiB of host memory per rank for far experts (default: 0 "
                                                      "where --device-memory is given, else this machine's)")
    p.add_argument("--expert-cache", type=cache_budget, default="auto", metavar="GIB|auto", help="as decode's")
    p.add_argument("--cpu", action="store_true", help="CPU ranks: dense BF16 experts, misses read from the checkpoint")
    p.add_argument("--streams", type=pos_int, default=1, help="M, for the bytes a decode step reads")


def plan(args) -> int:
    reader = SyntheticReader(args.checkpoint) if is_synthetic(args.checkpoint) else CheckpointReader(args.checkpoint)
    cfg = reader.config
    shapes = tensor_shapes(reader)
    layers = list(cfg.moe_layers)
    pre = "mlp.experts"
    nvfp4 = any(".mlp.experts." in n and n.endswith(".0.down_proj.weight_scale_2") and
                n.replace(".down_proj.", ".gate_proj.") in shapes for n in shapes) or (
        isinstance(reader, SyntheticReader) and reader.quant_mode is not None)
    bpe = expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size, nvfp4, packed=not args.cpu)
    stack = stack_bytes(shapes, as_stored=not args.cpu)
    # a step reads the stack whole but for the embedding (M rows of it; all of it where the lm_head is tied to it)
    emb = 0 if cfg.tie_word_embeddings else sum(2 * shapes[n][0] * shapes[n][1] for n in shapes
                                                 if n.endswith("embed_tokens.weight") and len(shapes[n]) == 2)
    placement = Placement.from_file(args.placement, cfg, args.ranks) if args.placement else \
        Placement.contiguous(cfg, args.ranks)
    if args.device_memory is None:
        import torch
        if not torch.cuda.is_available():
            raise RocketError("plan: no GPU here; give --device-memory GIB (and --host-memory GIB)")
        dev_total = torch.cuda.get_device_properties(0).total_memory
    else:
        dev_total = int(args.device_memory * GIB)
    host = int((args.host_memory if args.host_memory is not None else 0.0) * GIB)
    budget = parse_budget(args.expert_cache)
    print(f"{args.checkpoint}: {cfg.model_type}, {cfg.num_hidden_layers} layers ({len(layers)} MoE), "
          f"{cfg.n_routed_experts} routed experts top-{cfg.num_experts_per_tok}, hidden {cfg.hidden_size}, "
          f"{'NVFP4' if nvfp4 else 'BF16'} experts ({pre}){fp8_note(cfg, nvfp4)}")
    print(f"replicated stack {stack / GIB:.2f} GiB per rank; routed experts {len(layers) * cfg.n_routed_experts * bpe / GIB:.2f}"
          f" GiB ({bpe / 2**20:.2f} MiB each, {'dense BF16' if args.cpu else 'packed for the kernel'})")
    reserve = max(RESERVE_MIN, int(RESERVE_FRACTION * dev_total))
    print(f"per rank: {dev_total / GIB:.1f} GiB device memory ({reserve / GIB:.1f} GiB kept for the KV cache and "
          f"workspaces), {host / GIB:.1f} GiB host memory for far experts")
    print(f"{'rank':>4} {'experts':>8} {'owned GiB':>9} {'resident':>9} {'res GiB':>8} {'far GiB':>8} "
          f"{'device GiB':>10} {'GB/step dev':>11} {'GB/step host':>12}  verdict")
    worst = "fits all-resident"
    for r in range(args.ranks):
        owned = {la: placement.owned(la, r) for la in layers}
        n_owned = sum(len(v) for v in owned.values())
        free = dev_total - stack - reserve
        try:
            cp = plan_capacity(owned, bpe, budget, free, host, not args.cpu, r, f"{dev_total / GIB:.0f} GiB")
            far = cp.owned_bytes - cp.resident_bytes
            verdict = "fits all-resident" if not far else "fits with the expert cache"
            if cp.far_slots is not None:
                verdict = (f"fits with the expert cache and the checkpoint files ({cp.far_slots} far slots per layer "
                           f"in host memory, the other far experts read from the files; host decode path)")
        except RocketError as e:
            cp, far, verdict = None, 0, f"does not fit: {e}"
        if cp is not None and far and args.cpu:
            verdict += " (misses read from the checkpoint)"
        if verdict.startswith("does not"):
            worst = verdict
        elif far and worst == "fits all-resident":
            worst = "fits with the expert cache"
        if cp is not None and cp.far_slots is not None and not worst.startswith("does not"):
            worst = "fits with the expert cache and the checkpoint files"
        # a step reads each expert with rows once: M x top-k rows over E experts, uniform routing
        per_layer = min(args.streams * cfg.num_experts_per_tok, cfg.n_routed_experts) / cfg.n_routed_experts
        if cp is None:
            print(f"{r:>4} {n_owned:>8} {n_owned * bpe / GIB:>9.2f} {'-':>9} {'-':>8} {'-':>8} {'-':>10} {'-':>11} "
                  f"{'-':>12}  {verdict}")
            continue
        res_frac = cp.resident_bytes / cp.owned_bytes if cp.owned_bytes else 1.0
        read = n_owned * per_layer * bpe
        print(f"{r:>4} {n_owned:>8} {cp.owned_bytes / GIB:>9.2f} {cp.capacity:>9} {cp.resident_bytes / GIB:>8.2f} "
              f"{far / GIB:>8.2f} {(stack + cp.resident_bytes) / GIB:>10.2f} "
              f"{(stack - emb + read * res_frac) / 1e9:>11.2f} {read * (1 - res_frac) / 1e9:>12.2f}  {verdict}")
    print(f"verdict: {worst}")
    return 0 if not worst.startswith("does not") else 1
