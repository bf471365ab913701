"""The package's layers (.importlinter): imports run one way, cli -> serve -> runtime -> moe -> model | fabric -> checkpoint
-> ops -> config | settings -> errors. A back-edge fails here, naming the import chain."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_imports_run_one_way():
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (pip install import-linter): the layers contract was not checked")
    r = subprocess.run([exe, "--config", os.path.join(ROOT, ".importlinter")], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "1 kept, 0 broken" in r.stdout, r.stdout[-2000:]


def test_no_import_inside_a_function_dodges_a_cycle():
    """Function-level imports of the package's own modules would hide a cycle from the contract: the package has
    none (optional third-party modules such as pyverbs, mpi4py, cuda-bindings, matplotlib may still load late)."""
    offenders = []
    for folder, _, files in os.walk(os.path.join(ROOT, "rocket_mpi")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for n, line in enumerate(open(path), 1):
                stripped = line.lstrip()
                if line != stripped and stripped.startswith(("from rocket_mpi", "import rocket_mpi")):
                    if "rocket_mpi import _C" not in stripped:  # the compiled extension, optional by design
                        offenders.append(f"{os.path.relpath(path, ROOT)}:{n}: {stripped.strip()}")
    assert not offenders, "\n".join(offenders)
