"""Starting rocket_mpi under an MPI launcher from Python (static fire, benchmarks, tests)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from rocket_mpi.settings import Settings
from rocket_mpi.errors import RocketError

_STRIP_PREFIXES = ("PMI_", "PMIX_", "OMPI_COMM_WORLD", "OMPI_MCA_orte", "HYDRA_", "MPI_LOCAL", "MV2_COMM_WORLD")


def clean_env(extra: dict | None = None) -> dict:
    """The environment without the variables that would make a child think it is an MPI rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIP_PREFIXES)}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def launcher(cmd: str | None = None) -> list[str]:
    """mpiexec beside this Python (the mpich wheel puts one in the venv), else on PATH; Open MPI gets the
    flags it needs to run as root and oversubscribed, and no binding (it binds each rank to one core, which the
    graphed step's proxy thread would share with the rank's main thread: fabric/slots.py)."""
    cmd = cmd or Settings.from_env().mpiexec
    if cmd:
        return cmd.split()
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    exe = here if os.path.exists(here) else shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        raise RocketError("no MPI launcher found (pip install mpich, or pass --launcher 'mpirun ...')")
    try:
        ver = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        ver = ""
    out = [exe]
    if "Open MPI" in ver or "OpenRTE" in ver:
        out += ["--oversubscribe", "--bind-to", "none"]
        if os.geteuid() == 0:
            out += ["--allow-run-as-root"]
    return out


def mpirun(n: int, args: list[str], timeout: float, env: dict | None = None, launcher_cmd: str | None = None,
           capture: bool = True) -> subprocess.CompletedProcess:
    cmd = [*launcher(launcher_cmd), "-n", str(n), sys.executable, "-m", "rocket_mpi", *args]
    return run(cmd, timeout, env, capture)


def single(args: list[str], timeout: float, env: dict | None = None, capture: bool = True):
    return run([sys.executable, "-m", "rocket_mpi", *args], timeout, env, capture)


def run(cmd: list[str], timeout: float, env: dict | None, capture: bool) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, env=clean_env(env), timeout=timeout, text=True,
                              capture_output=capture, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        raise RocketError(f"'{' '.join(cmd[:6])} ...' did not finish within {timeout:g} s") from e
