"""GPU decode benchmark (not a test): transformers on the same BF16 weights, one process, one GPU.

Builds Glm4MoeForCausalLM from a synthetic preset (the same tensors `--checkpoint preset:NAME` draws on
this GPU) and times greedy decode steps with a KV cache: median ms/step at each M. Prints one JSON line
per M (the caller puts it beside rocket_mpi's per-rank table).

python benchmarks/bench_gpu.py --preset air8 --sweep 1,8 [--experts grouped_mm|eager]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rocket_mpi.checkpoint.synthetic import SyntheticReader
from rocket_mpi.runtime.prompts import default_prompts


def build(preset: str, experts_impl: str):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    reader = SyntheticReader(f"preset:{preset}", "cuda")
    raw = {k: v for k, v in reader.config.raw.items() if k not in ("architectures", "model_type")}
    cfg = Glm4MoeConfig(**raw)
    cfg._experts_implementation = experts_impl
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Glm4MoeForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                pre = name[: -len(".gate_up_proj")]
                for x in range(e):
                    p[x, :i].copy_(reader.get(f"{pre}.{x}.gate_proj.weight"))
                    p[x, i:].copy_(reader.get(f"{pre}.{x}.up_proj.weight"))
            elif name.endswith("experts.down_proj"):
                pre = name[: -len(".down_proj")]
                for x in range(e):
                    p[x].copy_(reader.get(f"{pre}.{x}.down_proj.weight"))
            else:
                p.copy_(reader.get(name))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(reader.get(name))
        model.model.rotary_emb.__init__(cfg)  # inv_freq in fp32, as from_pretrained leaves it
        model.model.rotary_emb.to("cuda")
    return model, cfg


def time_decode(model, cfg, m: int, tokens: int) -> float:
    from transformers import DynamicCache
    prompts = default_prompts(m, cfg.vocab_size)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    times = []
    with torch.no_grad():
        cache = DynamicCache(config=cfg)
        out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(tokens):
            mask = torch.cat([mask, torch.ones(m, 1, dtype=mask.dtype, device="cuda")], 1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=nxt, attention_mask=mask, cache=out.cache if hasattr(out, "cache") else cache,
                        use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[3:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="air8")
    ap.add_argument("--sweep", default="1,8")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--experts", default="grouped_mm")
    a = ap.parse_args()
    t0 = time.perf_counter()
    model, cfg = build(a.preset, a.experts)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"what": "build", "seconds": time.perf_counter() - t0, "param_bytes": nbytes,
                      "experts_implementation": getattr(model.config, "_experts_implementation", None)}), flush=True)
    for m in map(int, a.sweep.split(",")):
        ms = time_decode(model, cfg, m, a.tokens)
        print(json.dumps({"what": "transformers", "preset": a.preset, "M": m, "ms_per_step": ms,
                          "experts": a.experts}), flush=True)


if __name__ == "__main__":
    main()
