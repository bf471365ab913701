"""Builds the optional CUDA extension (csrc/) where torch has CUDA; on a CPU torch it installs the
pure-Python package only (the engine then runs its torch reference)."""
import os

from setuptools import setup

ext_modules, cmdclass = [], {}
try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    if torch.version.cuda and CUDA_HOME and os.environ.get("ROCKET_NO_CUDA") != "1" and os.path.exists("csrc/bindings.cpp"):
        archs = os.environ.get("ROCKET_CUDA_ARCHS", "90;121").replace(",", ";")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs.split(";") if a]
        # No --use_fast_math: the kernels round exactly like the torch references (no ftz, IEEE div/exp).
        nvcc = ["-O3", *gencode]  # the C++ standard is torch's choice (17 or 20; csrc needs 17)
        if os.environ.get("ROCKET_PTXAS_VERBOSE") == "1":  # register / spill report in the build log
            nvcc.append("-Xptxas=-v")
        ext_modules.append(CUDAExtension(
            "rocket_mpi._C",
            sources=["csrc/bindings.cpp", "csrc/nvfp4_experts.cu", "csrc/scatter.cu", "csrc/moe_plan.cu",
                     "csrc/ipc_bells.cu", "csrc/decode_ops.cu", "csrc/router.cu", "csrc/hc.cu", "csrc/kda.cu"],
            extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc},
        ))
        cmdclass = {"build_ext": BuildExtension}
except ImportError:
    pass

setup(ext_modules=ext_modules, cmdclass=cmdclass)
