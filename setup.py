"""Builds the optional CUDA extension rocket_mpi._C (csrc/) where the torch of the BUILD environment has CUDA
and nvcc is found; otherwise it installs the pure-Python package only (the engine then runs its torch
reference) and says why on stderr (pip shows it with -v). A plain `pip install .` builds in an isolated
environment that cannot see an installed torch, so it never builds the extension; to build it:
    pip install --no-build-isolation .      # or -e .; a CUDA torch, nvcc, setuptools and wheel installed first
Metadata and dependencies: setup.cfg. ROCKET_NO_CUDA=1 skips the extension; ROCKET_CUDA_ARCHS=90;121 picks
the GPU architectures; ROCKET_PTXAS_VERBOSE=1 adds the register / spill report to the build log."""
import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
HOW = ("to build it: install a CUDA torch and nvcc first, then pip install --no-build-isolation . "
       "(or -e . for a checkout)")
SOURCES = ["csrc/bindings.cpp", "csrc/nvfp4_experts.cu", "csrc/scatter.cu", "csrc/moe_plan.cu", "csrc/ipc_bells.cu",
           "csrc/decode_ops.cu", "csrc/router.cu", "csrc/hc.cu", "csrc/kda.cu", "csrc/proxy_bells.cu", "csrc/proxy.cpp",
           "csrc/decode_attention.cu", "csrc/mla.cu"]


def note(msg: str) -> None:
    print(f"rocket_mpi setup.py: {msg}", file=sys.stderr, flush=True)


def cuda_extension():
    """([the extension], cmdclass), or ([], {}) with a note saying why it is skipped and how to build it."""
    skipped = "the CUDA extension rocket_mpi._C is skipped (the pure-Python package installs and runs its torch " \
              "reference)"
    if os.environ.get("ROCKET_NO_CUDA") == "1":
        note(f"ROCKET_NO_CUDA=1: {skipped}")
        return [], {}
    if not os.path.exists(os.path.join(HERE, "csrc", "bindings.cpp")):
        note(f"csrc/bindings.cpp not found: {skipped}")
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as e:
        note(f"torch is not importable in this build environment ({e}; pip's isolated build never sees an "
             f"installed torch): {skipped}; {HOW}")
        return [], {}
    if not torch.version.cuda:
        note(f"torch {torch.__version__} has no CUDA: {skipped}; {HOW}")
        return [], {}
    if not CUDA_HOME:
        note(f"nvcc not found (no CUDA_HOME) for torch {torch.__version__}: {skipped}; {HOW}")
        return [], {}
    archs = [a for a in os.environ.get("ROCKET_CUDA_ARCHS", "90;121").replace(",", ";").split(";") if a]
    # sm_90 as sm_90a: the NVFP4 expert kernel's warpgroup-mma instance needs it (the cubin runs on sm_90 GPUs only)
    archs = ["90a" if a == "90" else a for a in archs]
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    # No --use_fast_math: the kernels round exactly like the torch references (no ftz, IEEE div/exp).
    nvcc = ["-O3", *gencode]  # the C++ standard is torch's choice (17 or 20; csrc needs 17)
    if os.environ.get("ROCKET_PTXAS_VERBOSE") == "1":
        nvcc.append("-Xptxas=-v")
    note(f"building the CUDA extension rocket_mpi._C with torch {torch.__version__} (CUDA {torch.version.cuda}, "
         f"{CUDA_HOME}) for sm_{', sm_'.join(archs)}")
    ext = CUDAExtension("rocket_mpi._C", sources=SOURCES, extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc})
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
