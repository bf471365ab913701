"""jobs/*.sbatch: each is valid bash, and every rocket_mpi command in it parses with the CLI as written
(a renamed or removed flag breaks the job before Slurm ever runs it); each says how to submit it, takes its
node and task counts from the allocation and writes nowhere that may not exist. jobs/rocket-env.sh picks
srun's MPI type. (tests/test_slurm.py runs them on a real Slurm.)"""
import glob
import os
import re
import shlex
import subprocess

import pytest

from rocket_mpi.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = sorted(glob.glob(os.path.join(ROOT, "jobs", "*.sbatch")))
ENV_SH = os.path.join(ROOT, "jobs", "rocket-env.sh")
VAR = r'"?\$\{?[A-Za-z_][A-Za-z_0-9]*(:[-+][^}]*)?\}?"?'  # $CKPT, "$RUNS/x", ${RAILS:-2}, ${RAILS:+--rails ..}


def _text(path):
    with open(path) as f:
        return f.read().replace("\\\n", " ")


def commands(path):
    """The rocket_mpi argument lists of a job script: continuation lines joined, shell variables stubbed; the
    flags a `set -- FLAGS "$@"` line puts in front of the script's arguments are parsed with each."""
    text = _text(path)
    extra = []
    for line in text.splitlines():
        m = re.search(r"\bset -- (.*)\"\$@\"", line)
        if m:
            extra += shlex.split(re.sub(r"\$\{[A-Za-z_0-9]+:\+[^}]*\}", "", m.group(1)))
    for line in text.splitlines():
        m = re.search(r"-m rocket_mpi (.*)", line)
        if m:
            args = m.group(1).replace('"$@"', "")
            args = re.sub(r'"[^"]*\$[^"]*"', "1", args)  # "$RUNS/decode-$SLURM_JOB_ID.json": one word
            args = re.sub(VAR, "1", args)
            yield shlex.split(args) + extra


def test_there_are_jobs():
    assert len(JOBS) >= 4, JOBS


@pytest.mark.parametrize("path", JOBS, ids=os.path.basename)
def test_job_is_valid_bash_and_its_commands_parse(path):
    subprocess.run(["bash", "-n", path], check=True)
    cmds = list(commands(path))
    assert cmds, f"{path} runs no rocket_mpi command"
    for argv in cmds:
        args = build_parser().parse_args(argv)  # SystemExit (a failure) on an unknown flag or bad value
        assert args.cmd == argv[0]


@pytest.mark.parametrize("path", JOBS, ids=os.path.basename)
def test_job_runs_anywhere_the_allocation_says(path):
    name = os.path.basename(path)
    text = _text(path)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    header = []
    for ln in lines[1:]:
        if not ln.startswith("#") or ln.startswith("#SBATCH"):
            break
        header.append(ln)
    assert any(f"sbatch jobs/{name}" in ln or re.search(rf"sbatch .*jobs/{re.escape(name)}", ln) for ln in header[:4]), \
        f"{name}: the header comment's first lines must say how to submit it"
    for ln in lines:
        if ln.startswith("#SBATCH --output") or ln.startswith("#SBATCH -o"):
            assert "/" not in ln.split("=", 1)[-1], f"{name}: {ln}: a folder that may not exist when Slurm opens it"
    code = [ln for ln in lines if not ln.lstrip().startswith("#")]
    assert any("jobs/rocket-env.sh" in ln for ln in code), f"{name} does not source jobs/rocket-env.sh"
    for ln in code:
        if re.search(r"\bsrun\b", ln):
            assert not re.search(r"--mpi=|(\s|^)(-N|-n|--nodes|--ntasks|--ntasks-per-node)[ =]\S", ln), \
                f"{name}: {ln.strip()}: counts and the MPI type come from the allocation and rocket-env.sh"
    assert "runs/" not in "\n".join(code), f"{name}: write under $RUNS (rocket-env.sh creates it)"


def _env_sh(tmp_path, srun_list, **env):
    """Source jobs/rocket-env.sh as a job would, with a stand-in srun whose --mpi=list prints srun_list."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nprintf '%s\\n' 'MPI plugin types are...' " +
                               " ".join(f"'\t{t}'" for t in srun_list) + "\n")
    (fake / "srun").chmod(0o755)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_", "ROCKET_", "MPIR_CVAR_"))}
    e.update(PATH=f"{fake}:{os.environ['PATH']}", ROCKET_RUNS=str(tmp_path / "runs"), **env)
    script = f'set -euo pipefail; . "{ENV_SH}"; ' \
             'echo "MPI=${SLURM_MPI_TYPE:-} NETMOD=${MPIR_CVAR_CH4_NETMOD:-} RUNS=$RUNS PWD=$PWD"; ' \
             'rdma_ready && echo RDMA=yes || echo RDMA=no'
    return subprocess.run(["bash", "-c", script], env=e, capture_output=True, text=True, timeout=60)


def _venv_mpi():
    py = os.path.join(ROOT, ".venv", "bin", "python")
    r = subprocess.run([py, "-c", "import mpi4py; mpi4py.rc.initialize = False\nfrom mpi4py import MPI; "
                        "print(MPI.Get_library_version())"], capture_output=True, text=True, timeout=60)
    return r.stdout if r.returncode == 0 else ""


def test_env_sh_picks_the_srun_mpi_type(tmp_path):
    if "MPICH" not in _venv_mpi():
        pytest.skip(".venv's mpi4py does not load MPICH (make setup installs the mpich wheel)")
    r = _env_sh(tmp_path, ["pmix", "none", "cray_shasta", "pmi2"])
    assert r.returncode == 0, r.stderr
    # MPICH under srun's pmi2 plugin: the OFI netmod (UCX's address lines overrun the plugin's 1024-byte read)
    assert f"MPI=pmi2 NETMOD=ofi RUNS={tmp_path}/runs PWD={ROOT}" in r.stdout, r.stdout
    assert "srun --mpi=pmi2 (MPICH netmod ofi)" in r.stdout, r.stdout
    assert os.path.isdir(tmp_path / "runs")
    if not glob.glob("/sys/class/infiniband/*"):
        assert "RDMA=no" in r.stdout


def test_env_sh_without_the_mpi_type_leaves_mpidefault_and_says_so(tmp_path):
    if "MPICH" not in _venv_mpi():
        pytest.skip(".venv's mpi4py does not load MPICH (make setup installs the mpich wheel)")
    r = _env_sh(tmp_path, ["pmix", "none"])
    assert r.returncode == 0, r.stderr
    assert "MPI= NETMOD= " in r.stdout and "srun --mpi=list does not offer" in r.stderr, (r.stdout, r.stderr)


def test_env_sh_override(tmp_path):
    r = _env_sh(tmp_path, ["none"], ROCKET_SRUN_MPI="pmix")
    assert r.returncode == 0, r.stderr
    assert "MPI=pmix NETMOD= " in r.stdout, r.stdout


def test_env_sh_keeps_a_chosen_netmod(tmp_path):
    r = _env_sh(tmp_path, ["pmi2"], MPIR_CVAR_CH4_NETMOD="ucx")
    assert r.returncode == 0, r.stderr
    assert "NETMOD=ucx " in r.stdout, r.stdout
