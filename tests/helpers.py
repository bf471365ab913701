"""What several test files share: the GPU marker, random NVFP4 experts as a checkpoint holds them with the
expert kernels' tolerances, and a stand-in for the little of pytest the kernel tests use, so that
`python tests/test_<name>.py` runs such a file on a bare GPU box without pytest (scripts/gpu_check.sh does).

Imported as `from helpers import ...`, as oracle.py is: tests/ is on sys.path under pytest (a test folder without
__init__.py) and when a test file runs as a script.

Tolerances, stated (relative to the reference's scale; errors are ||out - ref|| / ||ref|| and
max|out - ref| / max|ref|):
  TOL_KERNEL (kernel or emulation vs nvfp4_experts_ref): the same math, only the fp32 summation order
    differs, so gate/up/h can flip by one bf16 ulp (2^-8 relative) and the output by one ulp more:
    norm 2^-8, max 2^-6.
  TOL_STORE (vs ExpertStore.compute): that path also rounds each weight to bf16 after multiplying by
    weight_scale_2 (2^-9 relative per weight) and runs a bf16 GEMM: norm 2^-6, max 2^-4.
A layout or decode bug gives errors of order 1.
"""
from __future__ import annotations

import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the tree's package, run as a script

try:
    import pytest
except ImportError:  # a bare GPU box: `python tests/test_<name>.py` runs its tests with the stand-in below
    pytest = None

from rocket_mpi import ops  # noqa: E402
from rocket_mpi.ops import nvfp4  # noqa: E402


class _Skipped(Exception):
    pass


class _MiniPytest:
    """The little of pytest these tests use, for a machine without pytest (see run_without_pytest below)."""

    class mark:  # noqa: N801
        @staticmethod
        def parametrize(names, values):
            def deco(f):
                f.params = ([n.strip() for n in names.split(",")], values)
                return f
            return deco

        @staticmethod
        def skipif(cond, reason=""):
            def deco(f):
                if cond:
                    f.skip_reason = reason
                return f
            return deco

    class raises:  # noqa: N801
        def __init__(self, exc, match=None):
            self.exc, self.match = exc, match

        def __enter__(self):
            return self

        def __exit__(self, typ, val, tb):
            if typ is None:
                raise AssertionError(f"did not raise {self.exc.__name__}")
            if not issubclass(typ, self.exc) or (self.match and not re.search(self.match, str(val))):
                return False
            return True

    @staticmethod
    def fail(msg):
        raise AssertionError(msg)

    @staticmethod
    def skip(msg):
        raise _Skipped(msg)


if pytest is None:
    pytest = _MiniPytest


# ----------------------------------------------------------------------------------------------------
# GPU: the marker of the tests that need a CUDA device and the extension


def gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__})"
    if not ops.available():
        return ops.unavailable_reason()
    return None


GPU_SKIP = gpu_skip_reason()
if GPU_SKIP:
    print(f"\n[tests] GPU tests skipped: {GPU_SKIP}")
gpu = pytest.mark.skipif(GPU_SKIP is not None, reason=f"GPU tests need a CUDA device and the extension: {GPU_SKIP}")


# ----------------------------------------------------------------------------------------------------
# random NVFP4 experts as a checkpoint holds them


def expert_store_class():
    """rocket_mpi.moe.experts.ExpertStore, or None where its imports (safetensors) are missing."""
    try:
        from rocket_mpi.moe.experts import ExpertStore
    except ImportError as e:
        print(f"\n[tests] ExpertStore comparisons skipped: {e}")
        return None
    return ExpertStore


TOL_KERNEL = (2.0 ** -8, 2.0 ** -6)
TOL_STORE = (2.0 ** -6, 2.0 ** -4)


def make_experts(ids, hidden, inter, seed=0, zero_block=True):
    """{e: ((gw, gs, g2), (uw, us, u2), (dw, ds, d2))} quantised like ModelOpt (gate/up share s2)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for e in ids:
        g = torch.randn(inter, hidden, generator=gen) * 0.05
        u = torch.randn(inter, hidden, generator=gen) * 0.05
        d = torch.randn(hidden, inter, generator=gen) * 0.05
        if zero_block:  # a zero block: scale 0, its codes must decode to 0
            g[0, :16] = 0
        amax = float(torch.cat((g, u)).abs().max())
        gq = nvfp4.quantize(g, amax)
        uq = nvfp4.quantize(u, amax)
        dq = nvfp4.quantize(d)
        out[e] = tuple((w, s, float(s2)) for w, s, s2 in (gq, uq, dq))
    return out


def store_for(experts, hidden, inter, limit=None):
    """ExpertStore (rocket_mpi/moe/experts.py) holding the same experts, dequantised as its load() does;
    None where it cannot be imported."""
    store_cls = expert_store_class()
    if store_cls is None:
        return None
    gate_up, down = {}, {}
    s2 = torch.ones(max(experts) + 1)
    for e, ((gw, gs, g2), (uw, us, u2), (dw, ds, d2)) in experts.items():
        gate_up[e] = torch.cat((nvfp4.dequantize(gw, gs, torch.tensor(g2), torch.bfloat16),
                                nvfp4.dequantize(uw, us, torch.tensor(u2), torch.bfloat16)))
        down[e] = nvfp4.dequantize(dw, ds, 1.0, torch.bfloat16)
        s2[e] = d2
    return store_cls(0, sorted(experts), gate_up, down, s2, 0, limit)


def segments_for(counts: dict[int, int], base=0):
    segs, start = [], base
    for e in sorted(counts):
        segs.append((e, start, start + counts[e]))
        start += counts[e]
    return segs


def rel_err(out, ref):
    """(||out - ref|| / ||ref||, max|out - ref| / max|ref|)"""
    d, r = out.float() - ref.float(), ref.float()
    return float(d.norm() / r.norm().clamp_min(1e-30)), float(d.abs().max() / r.abs().max().clamp_min(1e-30))


def assert_close(out, ref, tol, what):
    norm, mx = rel_err(out, ref)
    assert torch.isfinite(out.float()).all(), f"{what}: non-finite output"
    assert norm <= tol[0] and mx <= tol[1], f"{what}: relative error norm {norm:.3g} (bound {tol[0]:.3g}), " \
                                            f"max {mx:.3g} (bound {tol[1]:.3g})"
    return norm, mx


# ----------------------------------------------------------------------------------------------------
# a test file run as a script


def run_without_pytest(namespace: dict, path: str) -> int:
    """python tests/test_<name>.py: every test of that file (its globals(), its __file__), with pytest when it
    is installed, else a plain loop."""
    if pytest is not _MiniPytest:
        return pytest.main([path, "-v", "-s", "-rs"])
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for name, fn in list(namespace.items()):
        if not name.startswith("test_") or not callable(fn):
            continue
        names, values = getattr(fn, "params", ([], [()]))
        for vals in values:
            vals = vals if isinstance(vals, tuple) else (vals,)
            label = f"{name}[{'-'.join(map(str, vals))}]" if names else name
            if getattr(fn, "skip_reason", None):
                print(f"SKIPPED {label}: {fn.skip_reason}")
                counts["skipped"] += 1
                continue
            try:
                fn(**dict(zip(names, vals)))
                print(f"PASSED {label}")
                counts["passed"] += 1
            except _Skipped as e:
                print(f"SKIPPED {label}: {e}")
                counts["skipped"] += 1
            except Exception as e:  # noqa: BLE001  (report every failure, go on)
                print(f"FAILED {label}: {type(e).__name__}: {e}")
                counts["failed"] += 1
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return 1 if counts["failed"] else 0
