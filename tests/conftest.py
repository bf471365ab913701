import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rocket_mpi.cli import launch  # noqa: E402
from rocket_mpi.checkpoint.make import make_checkpoint  # noqa: E402


@pytest.fixture
def one_thread():
    """Tiny ops on shared cores: one torch thread (two contending ones are many times slower)."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    make_checkpoint("tiny", d, seed=3)
    return d


@pytest.fixture(scope="session")
def tiny_nvfp4_ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_nvfp4"))
    make_checkpoint("tiny", d, seed=3, nvfp4_experts=True)
    return d


@pytest.fixture(scope="session")
def dsa_ckpt(tmp_path_factory):
    """GLM-5 architecture (glm_moe_dsa: MLA + DSA indexer), tiny, NVFP4 experts."""
    d = str(tmp_path_factory.mktemp("dsa_tiny"))
    make_checkpoint("dsa-tiny", d, seed=3, nvfp4_experts=True)
    return d


@pytest.fixture(scope="session")
def glm5_ckpt(tmp_path_factory):
    """GLM-5.3-Flash architecture (glm5_next: KDA + MLA with the k-pool indexer, hyper-connections),
    tiny, NVFP4 experts."""
    d = str(tmp_path_factory.mktemp("glm5_tiny"))
    make_checkpoint("glm5-tiny", d, seed=3, nvfp4_experts=True)
    return d


@pytest.fixture(scope="session")
def dsv3_ckpt(tmp_path_factory):
    """DeepSeek-V3 architecture (deepseek_v3: MLA without the indexer, YaRN rope), tiny, NVFP4 experts."""
    d = str(tmp_path_factory.mktemp("dsv3_tiny"))
    make_checkpoint("dsv3-tiny", d, seed=3, nvfp4_experts=True)
    return d


def rocket(*args, timeout=120, env=None):
    """python -m rocket_mpi ARGS as one process, outside any MPI launch."""
    return subprocess.run([sys.executable, "-m", "rocket_mpi", *args], capture_output=True, text=True,
                          timeout=timeout, env=launch.clean_env(env), cwd=ROOT)


def rocket_mpi(n, *args, timeout=120, env=None):
    """mpiexec -n N python -m rocket_mpi ARGS."""
    cmd = [*launch.launcher(), "-n", str(n), sys.executable, "-m", "rocket_mpi", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=launch.clean_env(env), cwd=ROOT,
                          start_new_session=True)


def mpi_script(n, script, *args, timeout=120, env=None):
    cmd = [*launch.launcher(), "-n", str(n), sys.executable, os.path.join(ROOT, "tests", script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=launch.clean_env(env), cwd=ROOT,
                          start_new_session=True)
