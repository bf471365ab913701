"""jobs/*.sbatch: each is valid bash, and every rocket_mpi command in it parses with the CLI as written
(a renamed or removed flag breaks the job before Slurm ever runs it)."""
import glob
import os
import re
import shlex
import subprocess

import pytest

from rocket_mpi.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = sorted(glob.glob(os.path.join(ROOT, "jobs", "*.sbatch")))


def commands(path):
    """The rocket_mpi argument lists of a job script: continuation lines joined, shell variables stubbed."""
    text = open(path).read().replace("\\\n", " ")
    for line in text.splitlines():
        m = re.search(r"-m rocket_mpi (.*)", line)
        if m:
            args = m.group(1).replace('"$@"', "")
            args = re.sub(r'"?\$\{?[A-Za-z_][A-Za-z_0-9]*(:-[^}]*)?\}?"?', "1", args)  # $CKPT, ${RAILS:-2}
            yield shlex.split(args)


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
