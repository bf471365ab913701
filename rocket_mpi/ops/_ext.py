"""Finds the compiled extension (rocket_mpi._C, built by setup.py from csrc/) without ever failing
the import of the package: on a CPU-only torch, or before a build, the ops fall back or explain."""
from __future__ import annotations

import torch

_C = None
_reason: str | None = None
_tried = False



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
        raise RuntimeError(f"rocket_mpi.ops: {why}")
    return mod
