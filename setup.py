"""Builds the optional CUDA extension (csrc/) where torch has CUDA; on a CPU torch it installs the
pure-Python package only (the engine then runs its torch reference)."""
import os

from setuptools import setup

ext_modules, cmdclass = [], {}
try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    if torch.version.cuda and CUDA_HOME and os.environ.get("ROCKET_NO_CUDA") != "1" and os.path.exists("csrc/bindings.cpp"):
        archs = os.environ.get("ROCKET_CUDA_ARCHS", "90;121")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs.split(";")]
        ext_modules.append(CUDAExtension(
            "rocket_mpi._C",
            sources=["csrc/bindings.cpp", "csrc/nvfp4_experts.cu", "csrc/scatter.cu"],
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math", *gencode]},
        ))
        cmdclass = {"build_ext": BuildExtension}
except ImportError:
    pass

setup(ext_modules=ext_modules, cmdclass=cmdclass)
