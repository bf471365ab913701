"""The package as a user installs it: a fresh venv (no system site-packages, so a missing dependency shows),
`pip install .` of a copy of this tree (a plain, isolated build), then the `rocket-mpi` command: --version,
make-checkpoint, and a 2-rank decode under the mpiexec and libmpi that the mpich wheel brought. torch is put
in first at the version this suite runs with (here a CPU wheel on local disk), so the install does not pull a
CUDA torch. Skips, saying why, where no venv or no package index can be had. Also: the Makefile's pins agree
with what setup.cfg declares."""
from __future__ import annotations

import configparser
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IGNORE = shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", ".pytest_cache",
                                "results", "*.so", "slurm-*.out")
NO_INDEX = ("No matching distribution", "Could not find a version", "Failed to establish a new connection",
            "Temporary failure in name resolution", "Network is unreachable", "Max retries exceeded",
            "ProxyError", "ConnectionError")


def _run(cmd, timeout, **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(cmd, 124, str(e.stdout or ""), f"timed out after {timeout} s")


def _tail(text: str, n: int = 20) -> str:
    return "\n".join((text or "").strip().splitlines()[-n:])


def _skip(why: str):
    print(f"test_install: skipped: {why}")
    pytest.skip(why)


def _version() -> str:
    with open(os.path.join(ROOT, "rocket_mpi", "__init__.py")) as f:
        return re.search(r"^__version__ = \"([^\"]+)\"", f.read(), re.M).group(1)


def _clean_env(venv: str) -> dict:
    """No outer MPI / Slurm job, no PYTHONPATH into this tree; the venv's bin first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(
        ("PMI_", "PMIX_", "HYDRA_", "OMPI_", "SLURM_", "MPI4PY_", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"))}
    env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, env, work dir, pip install output, seconds) once `pip install .` has run in a fresh venv."""
    if not sys.platform.startswith("linux"):
        _skip("the MPI runtime (the mpich wheel) is installed on Linux only")
    tmp = tmp_path_factory.mktemp("install")
    venv, src, work = str(tmp / "venv"), str(tmp / "src"), str(tmp / "work")
    os.makedirs(work)
    r = _run([sys.executable, "-m", "venv", venv], 300)
    if r.returncode != 0:
        _skip(f"python -m venv failed (no ensurepip / venv here?): {_tail(r.stdout + r.stderr, 3)}")
    env = _clean_env(venv)
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip"]
    try:
        torch_pin = f"torch=={importlib.metadata.version('torch')}"
    except importlib.metadata.PackageNotFoundError:
        torch_pin = "torch"
    t0 = time.monotonic()
    r = _run([*pip, "install", torch_pin], 900, env=env, cwd=work)
    if r.returncode != 0:
        _skip(f"pip install {torch_pin} (this suite's torch) failed in a fresh venv (no package index or network, "
              f"or a local build the index does not have): {_tail(r.stdout + r.stderr, 3)}")
    t_torch = time.monotonic() - t0
    shutil.copytree(ROOT, src, ignore=IGNORE, symlinks=True)
    t0 = time.monotonic()
    r = _run([*pip, "install", "-v", src], 900, env=env, cwd=work)
    t_pkg = time.monotonic() - t0
    out = r.stdout + r.stderr
    if r.returncode != 0 and any(s in out for s in NO_INDEX):
        _skip(f"pip install . could not reach a package index: {_tail(out, 3)}")
    assert r.returncode == 0, f"pip install . failed:\n{_tail(out, 40)}"
    print(f"test_install: fresh venv: pip install {torch_pin} {t_torch:.0f} s, pip install . {t_pkg:.0f} s")
    return venv, env, work, out, t_pkg


def test_install_pulls_every_dependency(installed):
    venv, env, work, out, _ = installed
    r = _run([os.path.join(venv, "bin", "python"), "-m", "pip", "check"], 120, env=env, cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    probe = ("import os, rocket_mpi, mpi4py, numpy, safetensors, tokenizers, torch\n"
             "from mpi4py import MPI\n"
             "print('PKG', os.path.dirname(rocket_mpi.__file__))\n"
             "print('LIB', MPI.Get_library_version().splitlines()[0])\n"
             "print('SO', *sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libmpi' in l}))\n")
    r = _run([os.path.join(venv, "bin", "python"), "-c", probe], 120, env=env, cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = dict(ln.split(" ", 1) for ln in r.stdout.splitlines() if " " in ln)
    assert lines["PKG"].startswith(venv), lines  # the installed package, not this tree
    assert "MPICH" in lines["LIB"], lines
    assert lines.get("SO", "").startswith(venv), f"mpi4py loaded a libmpi from outside the venv: {lines}"


def test_setup_py_says_why_the_cuda_extension_is_skipped(installed):
    out = installed[3]
    assert "rocket_mpi setup.py: torch is not importable in this build environment" in out, _tail(out, 40)
    assert "pip install --no-build-isolation ." in out


def test_console_command_version(installed):
    venv, env, work, _, _ = installed
    r = _run([os.path.join(venv, "bin", "rocket-mpi"), "--version"], 120, env=env, cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _version() in r.stdout + r.stderr and "rocket" in (r.stdout + r.stderr), r.stdout + r.stderr


def test_mpiexec_two_rank_decode(installed):
    venv, env, work, _, _ = installed
    exe = os.path.join(venv, "bin", "rocket-mpi")
    mpiexec = os.path.join(venv, "bin", "mpiexec")
    assert os.path.exists(mpiexec), "the mpich wheel put no mpiexec in the venv"
    ckpt = os.path.join(work, "tiny")
    r = _run([exe, "make-checkpoint", "--preset", "tiny", "--out", ckpt], 300, env=env, cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    out = os.path.join(work, "decode.json")
    r = _run([mpiexec, "-n", "2", exe, "decode", "--checkpoint", ckpt, "--tokens", "3", "--streams", "2",
              "--fabric", "shm", "--out", out], 300, env=env, cwd=work)
    assert r.returncode == 0, f"rc {r.returncode}:\n{_tail(r.stdout + r.stderr, 30)}"
    assert re.search(r"2 rank\(s\), fabric shm", r.stdout), r.stdout
    with open(out) as f:
        tokens = json.load(f)["runs"][0]["tokens"]
    assert len(tokens) == 2 and all(len(t) == 3 for t in tokens), tokens


# -- the pins: one place ---------------------------------------------------------------------------------
def _requirements():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    reqs = [ln.strip() for ln in cfg["options"]["install_requires"].splitlines() if ln.strip()]
    for extra in cfg["options.extras_require"]:
        reqs += [ln.strip() for ln in cfg["options.extras_require"][extra].splitlines() if ln.strip()]
    return reqs


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_makefile_pins_agree_with_setup_cfg():
    from packaging.requirements import Requirement
    from packaging.version import Version
    with open(os.path.join(ROOT, "Makefile")) as f:
        make = f.read()
    recipe = make[make.index(".venv/.ready:"):].split("\n\n", 1)[0]
    declared = {}
    for req in _requirements():
        declared.setdefault(_name(req), []).append(Requirement(req))
    assert "mpich" in declared and "mpi4py" in declared, declared
    pins = []
    for line in recipe.splitlines():
        m = re.search(r"\$\(PIP\) install (.*)", line.split("#")[0])
        if m:
            pins += [w.strip("'\"") for w in m.group(1).split() if not w.startswith("-") and not w.startswith("'.")
                     and w not in ("pip", "setuptools", "wheel", ".")]
    assert pins, recipe
    for pin in pins:
        req = Requirement(pin)
        name = req.name.lower()
        assert name in declared, f"the Makefile installs {pin}, which setup.cfg does not declare"
        exact = [s.version for s in req.specifier if s.operator == "=="]
        assert exact, f"{pin}: the Makefile installs only exact pins; ranges belong in setup.cfg"
        for r in declared[name]:
            assert r.specifier.contains(Version(exact[0]), prereleases=True), \
                f"the Makefile pins {pin}, outside setup.cfg's {r}"
    assert ".[test,bench]" in recipe, "the Makefile should install the package with its extras from setup.cfg"
    for line in recipe.splitlines():  # pip's and apt-get's output shows (command -v ... >/dev/null is a test)
        if re.search(r"\$\(PIP\) install|apt-get (install|update)", line):
            assert not re.search(r"\s-qq?\b|--quiet|(?<!command -v apt-get )>\s*/dev/null", line), line
