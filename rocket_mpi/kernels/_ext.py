"""Finds the compiled extension (rocket_mpi._C, built by setup.py from csrc/) without ever failing
the import of the package: on a CPU-only torch, or before a build, the ops fall back or explain."""
from __future__ import annotations

import os

import torch

_C = None
_reason: str | None = None
_tried = False

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "csrc")
SOURCES = ("bindings.cpp", "nvfp4_experts.cu", "scatter.cu", "moe_plan.cu", "ipc_bells.cu", "decode_ops.cu")


def load():
    """The extension module, or None (reason in reason())."""
    global _C, _reason, _tried
    if _tried:
        return _C
    _tried = True
    try:
        from rocket_mpi import _C as mod  # type: ignore[attr-defined]
        _C = mod
    except ImportError as e:
        _reason = (f"the CUDA extension rocket_mpi._C is not built ({e}); build it on a machine with nvcc and "
                   f"a CUDA torch: pip install --no-deps --no-build-isolation -e . (or python setup.py "
                   f"build_ext --inplace)")
    return _C


def build_jit(verbose: bool = False):
    """Compile csrc/ with torch.utils.cpp_extension.load (the fallback when setup.py was not run)."""
    global _C, _reason, _tried
    from torch.utils.cpp_extension import load as jit_load
    archs = os.environ.get("ROCKET_CUDA_ARCHS", "90")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs.replace(",", ";").split(";") if a]
    _C = jit_load(name="rocket_mpi_C", sources=[os.path.join(CSRC, s) for s in SOURCES],
                  extra_cflags=["-O3"], extra_cuda_cflags=["-O3", *gencode], verbose=verbose)
    _tried, _reason = True, None
    return _C


def reason() -> str:
    load()
    if _C is None:
        return _reason or "the CUDA extension is not available"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    return ""


def require():
    """The extension, or a RuntimeError that says why it cannot be used."""
    mod = load()
    why = reason()
    if mod is None or why:
        raise RuntimeError(f"rocket_mpi.kernels: {why}")
    return mod
