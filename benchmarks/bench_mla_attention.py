"""MLA decode attention over the cached latent rows, forms side by side on one GPU (not a test): one query per
stream and head, 64 heads sharing one key / value head (the absorbed form), 2064 rows (index_topk 2048 + a
pool), at GLM-5.3-Flash's width (keys = values = 512) and GLM-5's (keys 576 = latent + rope, values 512).

    python benchmarks/bench_mla_attention.py

Forms: sdpa_rows (SDPA with the heads as one head's query rows), bmm (two bf16 GEMMs, bf16 scores), bmm32 (the
scores' GEMM writing fp32: layers.latent_attention on a GPU), f32 (fp32 copies, both GEMMs fp32: its CPU form
upcast throughout), math (SDPA's math path). Each is captured in a CUDA graph of 20 calls, best of 5 replays; the
last columns are each form's largest difference from f32.
"""
import argparse

import torch
import torch.nn.functional as F

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
if not torch.cuda.is_available():
    raise SystemExit("bench_mla_attention: needs a CUDA device")
torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"
torch.manual_seed(0)
H, N = 64, 2064
print("torch", torch.__version__)

def v_sdpa_rows(q, k, v, valid, scale):
    return F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=valid[:, None, None, :], scale=scale)[:, 0]

def v_bmm(q, k, v, valid, scale):
    s = torch.bmm(q, k.transpose(1, 2)).float() * scale
    p = s.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)
    return torch.bmm(p.to(v.dtype), v)

def v_bmm32(q, k, v, valid, scale):
    s = torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32) * scale
    p = s.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)
    return torch.bmm(p.to(v.dtype), v)

def v_f32(q, k, v, valid, scale):
    s = torch.bmm(q.float(), k.float().transpose(1, 2)) * scale
    p = s.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)
    return torch.bmm(p.to(v.dtype), v)

def v_math(q, k, v, valid, scale):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return v_sdpa_rows(q, k, v, valid, scale)

def timeit(fn, *args, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn(*args)
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(5):
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) / reps * 1e3)
    return best

FORMS = {"sdpa_rows": v_sdpa_rows, "bmm": v_bmm, "bmm32": v_bmm32, "f32": v_f32, "math": v_math}

for name, d, dv in (("flash", 512, 512), ("glm5", 576, 512)):
    print(f"\n{name}: heads {H}, rows {N}, key dim {d}, value dim {dv}; us per call (CUDA graph, best of 5 x 20)")
    print(f"{'M':>3} " + " ".join(f"{n:>10}" for n in FORMS) + "   max|diff| vs f32: rows bmm bmm32")
    for m in (1, 8, 16):
        q = torch.randn(m, H, d, device=dev, dtype=torch.bfloat16)
        rows = torch.randn(m, N, d, device=dev, dtype=torch.bfloat16)
        valid = torch.rand(m, N, device=dev) < 0.9
        k, v = rows, rows[..., :dv]
        sc = 256 ** -0.5
        ts, outs = [], {}
        for vn, fn in FORMS.items():
            try:
                ts.append(f"{timeit(fn, q, k, v, valid, sc):10.1f}")
                outs[vn] = fn(q, k, v, valid, sc).float()
            except Exception as e:
                ts.append(f"{'ERR':>10}"); print("  ", vn, type(e).__name__, str(e)[:150])
        ref = outs.get("f32")
        diffs = " ".join(f"{(outs[x] - ref).abs().max().item():.2e}" if x in outs and ref is not None else "-" for x in ("sdpa_rows", "bmm", "bmm32"))
        print(f"{m:>3} " + " ".join(ts) + "   " + diffs)
