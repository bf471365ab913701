"""Shared checks of the transformers-oracle tests (one per model family)."""
import torch

from rocket_mpi.ops import nvfp4


def assert_logits_close(ref, ours, tokens, rtol, atol, margin, outliers=0, outlier_factor=1.0) -> float:
    """ref[stream][step] and ours[step][stream] are [V] logits; tokens[stream][step] our greedy choices.
    Every step within atol + rtol * max|ref| (but up to `outliers` steps within outlier_factor times that),
    every choice within margin of the reference's best. Returns the worst error as a fraction of its bound."""
    worst, over = 0.0, []
    for s in range(len(tokens)):
        for step in range(len(tokens[s])):
            r, o = ref[s][step], ours[step][s]
            tol = atol + rtol * r.abs().max().item()
            err = (r - o).abs().max().item()
            worst = max(worst, err / tol)
            if err > tol:
                over.append(f"stream {s} step {step}: max |logit diff| {err:.4f} > {tol:.4f}")
                assert len(over) <= outliers and err <= outlier_factor * tol, "; ".join(over)
            chosen = tokens[s][step]
            gap = (r.max() - r[chosen]).item()
            assert gap <= margin * max(1.0, r.abs().max().item()), \
                f"stream {s} step {step}: chose {chosen}, {gap:.4f} below the reference argmax {int(r.argmax())}"
    print(f"worst logit error / tolerance: {worst:.2f}" + (f" (allowed outlier: {over[0]})" if over else ""))
    return worst


def dequantised_reference(model_bf16, tensors):
    """fp32 transformers model whose Linears hold exactly the dequantised NVFP4 weights (fused experts:
    gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    ref = model_bf16.float().eval()
    sd = ref.state_dict()
    with torch.no_grad():
        for name in list(tensors):
            if not name.endswith(".weight_scale_2"):
                continue
            mod = name[: -len(".weight_scale_2")]
            w = nvfp4.dequantize(tensors[mod + ".weight"], tensors[mod + ".weight_scale"], tensors[name])
            if ".mlp.experts." in mod:
                pre, e, proj = mod.rsplit(".", 2)  # model.layers.L.mlp.experts, E, gate_proj
                e = int(e)
                if proj == "down_proj":
                    sd[pre + ".down_proj"][e].copy_(w)
                else:
                    i = w.shape[0]
                    off = 0 if proj == "gate_proj" else i
                    sd[pre + ".gate_up_proj"][e, off:off + i].copy_(w)
            else:
                sd[mod + ".weight"].copy_(w)
    return ref


def nvfp4_twin(model, path, quant_all: bool) -> dict:
    """The model saved in BF16 under path/bf16, then quantised as make-checkpoint quantises (the routed experts, or
    with quant_all every Linear but lm_head and the routers) and written under path/q -> the quantised tensors."""
    import json
    from safetensors.torch import load_file
    from rocket_mpi.checkpoint.make import exclude_patterns, quantize_tensors, write_checkpoint
    save_bf16(model, path / "bf16")
    tensors = load_file(str(path / "bf16" / "model.safetensors"))
    with open(path / "bf16" / "config.json") as f:
        cfg = json.load(f)
    q = quantize_tensors(tensors, cfg, quant_all)
    write_checkpoint(str(path / "q"), cfg, q, exclude_patterns(cfg, quant_all), tokenizer=False)
    return q


def save_bf16(model, path, shards=False):
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="200KB" if shards else "5GB")


def reference_logits(model, prompts, generated):
    """Teacher-forced fp32 logits at each generation position: [stream][step] -> [V]."""
    out = []
    with torch.no_grad():
        for p, g in zip(prompts, generated):
            ids = torch.tensor([p + g[:-1]])
            logits = model(ids).logits[0].float()
            out.append(logits[len(p) - 1:])
    return out


def like_trained(model, routers: bool = True, unit: tuple[str, ...] = ()) -> None:
    """Random weights closer to a trained model's in what the checks are sensitive to: norms near 1, biases of 0.1,
    unit-scale embeddings (and the parameters whose names end in one of `unit`), and each router's
    e_score_correction_bias spread (0.3) so a router that ignores it routes elsewhere."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith(("embed_tokens.weight", *unit)):
                p.copy_(torch.randn_like(p))
        if routers:
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    bias = layer.mlp.gate.e_score_correction_bias
                    bias.copy_(0.3 * torch.randn(bias.shape[0]))


def median_checked(ref, ours, streams, steps, rtol, atol, typical):
    """The median over every stream and step of |logit error| / (atol + rtol * max|ref|) is at most `typical`."""
    ratios = torch.tensor([[(ref[s][step] - ours[step][s]).abs().max().item()
                            / (atol + rtol * ref[s][step].abs().max().item()) for step in range(steps)]
                           for s in range(streams)])
    print(f"logit error / tolerance: median {ratios.median():.2f}, worst {ratios.max():.2f}")
    assert ratios.median() <= typical, f"median logit error {ratios.median():.2f} of the bound > {typical}"


def engine_against(eng, model, prompts, tokens, rtol, atol, margin, typical):
    """Decode `prompts` greedily for `tokens` tokens with our engine, teacher-force transformers' `model` on our tokens,
    and hold every step and the median to the bounds (median_checked, assert_logits_close) -> our result."""
    ours = []
    res = eng.generate(prompts, tokens, on_step=lambda step, logits: ours.append(logits.clone()))
    ref = reference_logits(model, prompts, res.tokens)
    median_checked(ref, ours, len(prompts), tokens, rtol, atol, typical)
    assert_logits_close(ref, ours, res.tokens, rtol, atol, margin)
    return res
