"""jobs/*.sbatch on a real Slurm: Debian's slurm-wlm and munge (apt-get installed where they are missing and we
are root) started by hand as a throw-away cluster on this machine: munged, slurmctld -D and two slurmd -D
(node names n1 and n2 on 127.0.0.1, each with this machine's CPUs as `slurmd -C` reports them and two
stand-in "GPUs" (gres.conf File=/dev/null,/dev/zero: nothing opens them) so the GPU scripts' allocations can be
granted; Debian builds Slurm with multiple-slurmd support), everything (conf, munge key and socket, state, spool, logs) in a temporary folder, on free ports.

Every script is submitted with plain `sbatch` from the repo root, unedited: the CPU ones on one node
(-N 1 --ntasks-per-node=2) and with their own defaults (a node pair); the GPU ones with their defaults and
`--device cpu` appended (their Slurm side: allocation, task counts, srun's MPI type, the launcher). Each must
end COMPLETED with exit code 0:0 and print its PASS line / table; `srun` launched directly is checked too.
Where Slurm cannot be installed or started the tests skip, saying why. Every wait is bounded; every daemon
(and any job process left) is stopped by its PID at the end, also when a test fails."""
from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_PY = os.path.join(ROOT, ".venv", "bin", "python")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "sinfo", "squeue", "scontrol", "scancel")
JOB_TIMEOUT = 240        # seconds for all the submitted jobs together
_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])


def _bin(name: str) -> str | None:
    return shutil.which(name, path=_PATH)


def _run(cmd, timeout, env=None, cwd=None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(cmd, 124, e.stdout or "", f"timed out after {timeout} s")


def _tail(text: str, n: int = 15) -> str:
    return "\n".join((text or "").strip().splitlines()[-n:])


# -- install -------------------------------------------------------------------------------------------------
def _install() -> str | None:
    """None when Slurm and munge are here (installing them with apt-get where they are not), else why not."""
    missing = [b for b in DAEMONS + CLIENTS if _bin(b) is None]
    if not missing:
        return None
    if not sys.platform.startswith("linux"):
        return f"Slurm is not installed ({', '.join(missing)} missing) and this is not Linux"
    if os.geteuid() != 0:
        return f"Slurm is not installed ({', '.join(missing)} missing) and we are not root: cannot apt-get it"
    if _bin("apt-get") is None:
        return f"Slurm is not installed ({', '.join(missing)} missing) and there is no apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "munge"]
    r = _run(cmd, 900, env)
    if r.returncode != 0:  # an old or empty package list: update it once, then again
        _run(["apt-get", "update", "-q"], 300, env)
        r = _run(cmd, 900, env)
    if r.returncode != 0:
        return f"apt-get install slurm-wlm munge failed (rc {r.returncode}): {_tail(r.stdout + r.stderr, 3)}"
    missing = [b for b in DAEMONS + CLIENTS if _bin(b) is None]
    return f"apt-get installed slurm-wlm and munge but {', '.join(missing)} are missing" if missing else None


# -- the cluster ---------------------------------------------------------------------------------------------
def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _hardware() -> str:
    """The node line's hardware fields as slurmd -C reports them (CPUs=... RealMemory=...)."""
    r = _run([_bin("slurmd"), "-C"], 60)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("NodeName=")), "")
    fields = [f for f in line.split()[1:] if f.split("=")[0] in
              ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")]
    return " ".join(fields) or f"CPUs={os.cpu_count() or 1}"


def _host() -> str:
    """This machine's short name: slurmctld starts only where SlurmctldHost names the host it runs on."""
    return socket.gethostname().split(".")[0]


def _conf(d: str, nodes: list[str], ctld_port: int, node_ports: list[int]) -> str:
    hw, host = _hardware(), _host()
    node_lines = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} {hw} Gres=gpu:2 "
                           f"State=UNKNOWN" for n, p in zip(nodes, node_ports))
    return f"""# a throw-away cluster of tests/test_slurm.py
ClusterName=rockettest
# job ids unlike any earlier throw-away cluster's: MPICH names its shared-memory segment after the PMI job name
# (the job and step ids), and a segment left by a killed job of an earlier run with the same ids hangs MPI_Init
FirstJobId={1000 + os.getpid() % 100000 * 10 + time.time_ns() % 10}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=pmi2
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
GresTypes=gpu
{node_lines}
PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    def __init__(self, d: str):
        self.dir = d
        self.conf = os.path.join(d, "slurm.conf")
        self.marker = f"rocket-test-slurm-{os.getpid()}-{time.time_ns()}"
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.nodes = ["n1", "n2"]
        self.jobs: list[str] = []
        self.stopped = False

    def env(self, **extra) -> dict:
        """This machine's environment less any outer Slurm / MPI job's, pointed at this cluster."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SRUN_", "SBATCH_", "SALLOC_", "PMI_", "PMIX_", "HYDRA_", "OMPI_"))}
        # FI_TCP_IFACE: MPICH's OFI netmod (rocket-env.sh's choice under pmi2) talks over loopback only
        env.update(SLURM_CONF=self.conf, ROCKET_TEST_SLURM=self.marker, PATH=_PATH, PYTHONUNBUFFERED="1",
                   FI_TCP_IFACE="lo")
        env.update(extra)
        return env

    def start(self, name: str, cmd: list[str]) -> None:
        log = open(os.path.join(self.dir, "log", f"{name}.out"), "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env(),
                             cwd=self.dir, start_new_session=True)
        log.close()
        self.procs.append((name, p))

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(os.path.join(self.dir, "log"))):
            with open(os.path.join(self.dir, "log", name), errors="replace") as f:
                out.append(f"--- {name}\n{_tail(f.read(), 8)}")
        return "\n".join(out)

    def check_alive(self) -> None:
        dead = [f"{n} (rc {p.returncode})" for n, p in self.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited:\n{self.logs()}")

    def up(self, timeout: float = 60) -> None:
        d = self.dir
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        os.makedirs(os.path.join(d, "munge", "key"), mode=0o700)
        key = os.path.join(d, "munge", "key", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        ports = _free_ports(1 + len(self.nodes))
        with open(self.conf, "w") as f:
            f.write(_conf(d, self.nodes, ports[0], ports[1:]))
        with open(os.path.join(d, "gres.conf"), "w") as f:  # stand-in GPUs: slurmd wants a character device
            f.write(f"NodeName={','.join(self.nodes)} Name=gpu File=/dev/null,/dev/zero\n")  # for each
        # munged refuses root unless forced; everything it opens is ours, in d/munge
        self.start("munged", [_bin("munged"), "--foreground", "--force", f"--socket={d}/munge/munge.socket",
                              f"--key-file={key}", f"--log-file={d}/log/munged.log",
                              f"--pid-file={d}/munge/munged.pid", f"--seed-file={d}/munge/munged.seed"])
        self._wait(lambda: os.path.exists(f"{d}/munge/munge.socket"), 20, "munged's socket")
        self.start("slurmctld", [_bin("slurmctld"), "-D", "-f", self.conf])
        self._wait(lambda: _run([_bin("scontrol"), "ping"], 10, self.env()).stdout.count("UP") > 0, 30,
                   "slurmctld to answer scontrol ping")
        for n in self.nodes:
            self.start(f"slurmd-{n}", [_bin("slurmd"), "-D", "-f", self.conf, "-N", n])
        self._wait(self._idle, timeout, "sinfo to show every node idle")

    def _idle(self) -> bool:
        r = _run([_bin("sinfo"), "-h", "-N", "-o", "%N %t"], 10, self.env())
        states = dict(ln.split() for ln in r.stdout.splitlines() if len(ln.split()) == 2)
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, ready, timeout: float, what: str) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            self.check_alive()
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"no {what} within {timeout:g} s:\n{self.logs()}")

    def down(self) -> None:
        """scancel whatever is left, stop the daemons (TERM, then KILL) and any process that carries this
        cluster's marker in its environment (slurmstepd, job steps), each by its PID."""
        if self.stopped:
            return
        self.stopped = True
        if self.procs and all(p.poll() is None for n, p in self.procs if n == "slurmctld"):
            if self.jobs:
                _run([_bin("scancel"), *self.jobs], 20, self.env())
            t0 = time.monotonic()
            while time.monotonic() - t0 < 20 and _run([_bin("squeue"), "-h"], 10, self.env()).stdout.strip():
                time.sleep(0.5)
        for name, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        for pid in self._marked():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _marked(self) -> list[int]:
        mark = f"ROCKET_TEST_SLURM={self.marker}".encode()
        pids = []
        for e in os.listdir("/proc"):
            if e.isdigit() and int(e) != os.getpid():
                try:
                    with open(f"/proc/{e}/environ", "rb") as f:
                        if mark in f.read().split(b"\0"):
                            pids.append(int(e))
                except OSError:
                    pass
        return pids

    # -- jobs ---------------------------------------------------------------------------------------------
    def sbatch(self, script: str, opts: list[str], args: list[str], out_dir: str, runs: str) -> str:
        r = _run([_bin("sbatch"), "--parsable", f"--chdir={out_dir}", *opts, os.path.join("jobs", script), *args],
                 30, self.env(ROCKET_RUNS=runs), cwd=ROOT)
        assert r.returncode == 0, f"sbatch {script} failed: {r.stdout}{r.stderr}"
        job = r.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job_info(self, job: str) -> dict:
        r = _run([_bin("scontrol"), "show", "job", "-o", job], 10, self.env())
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout))

    def wait_jobs(self, jobs: list[str], timeout: float) -> dict[str, dict]:
        t0, done = time.monotonic(), {}
        while time.monotonic() - t0 < timeout and len(done) < len(jobs):
            self.check_alive()
            for j in jobs:
                if j not in done:
                    info = self.job_info(j)
                    if info.get("JobState") not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                        done[j] = info
            time.sleep(1)
        for j in jobs:
            if j not in done:
                info = self.job_info(j)
                _run([_bin("scancel"), j], 10, self.env())
                done[j] = dict(info, JobState=f"TIMEOUT-IN-TEST (was {info.get('JobState')} after {timeout} s)")
        return done


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    why = _install()
    if why:
        print(f"test_slurm: skipped: {why}")
        pytest.skip(why)
    if not os.path.exists(VENV_PY):
        pytest.skip(f"{VENV_PY} not found (make setup): the job scripts run .venv/bin/python")
    c = Cluster(str(tmp_path_factory.mktemp("slurm")))
    atexit.register(c.down)  # also where the session ends without its teardown
    try:
        c.up()
    except Exception as e:  # noqa: BLE001
        c.down()
        why = f"Slurm could not start here: {e}"
        print(f"test_slurm: skipped: {why}")
        pytest.skip(why)
    yield c
    c.down()


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("slurm_ckpt"))
    r = _run([VENV_PY, "-m", "rocket_mpi", "make-checkpoint", "--preset", "default", "--out", d], 300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    return d


# (id, script, sbatch options, script arguments after the checkpoint (None: the script takes none), nodes,
# what its output must show)
ONE_NODE = ["-N", "1", "--ntasks-per-node=2"]
BENCH_ARGS = ["--sizes", "2K,64K", "--reps", "2", "--iters", "200"]
CASES = [
    ("decode-1node", "decode.sbatch", ONE_NODE, [], 1, "decode"),
    ("static-fire-1node", "static-fire.sbatch", ONE_NODE, [], 1, "static-fire"),
    ("fabric-bench-1node", "fabric-bench.sbatch", ONE_NODE, None, 1, "fabric-bench"),
    ("decode-2nodes", "decode.sbatch", [], [], 2, "decode"),
    ("static-fire-2nodes", "static-fire.sbatch", [], [], 2, "static-fire"),
    ("fabric-bench-2nodes", "fabric-bench.sbatch", [], None, 2, "fabric-bench"),
    ("decode-gpus", "decode-gpus.sbatch", [], ["--device", "cpu", "--sweep", "1,2", "--tokens", "6"], 1, "decode"),
    ("decode-gpu-nodes", "decode-gpu-nodes.sbatch", [], ["--device", "cpu", "--sweep", "1,2", "--tokens", "6"], 2,
     "decode"),
    ("static-fire-gpu-nodes", "static-fire-gpu-nodes.sbatch", [], ["--device", "cpu", "--tokens", "8"], 2,
     "static-fire"),
]


@pytest.fixture(scope="session")
def batch(cluster, ckpt, tmp_path_factory):
    """Every case submitted at once (the cluster runs them as its CPUs allow), then waited for together."""
    out = str(tmp_path_factory.mktemp("slurm_out"))
    runs = os.path.join(out, "runs")  # does not exist yet: the scripts must create it
    ids = {}
    t0 = time.monotonic()
    for name, script, opts, args, _, _ in CASES:
        argv = BENCH_ARGS if args is None else [ckpt, *args]
        ids[name] = cluster.sbatch(script, opts, argv, out, runs)
    infos = cluster.wait_jobs(list(ids.values()), JOB_TIMEOUT)
    print(f"test_slurm: {len(ids)} sbatch jobs done in {time.monotonic() - t0:.0f} s")
    return {name: (ids[name], infos[ids[name]], out, runs) for name in ids}


def _output(out_dir: str, script: str, job: str) -> str:
    name = "rocket-" + script.removesuffix(".sbatch")
    path = os.path.join(out_dir, f"slurm-{name}-{job}.out")  # the scripts' --output, in the submit --chdir
    assert os.path.exists(path), f"no {path}; {os.listdir(out_dir)}"
    with open(path, errors="replace") as f:
        return f.read()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sbatch_job_completes(batch, case):
    name, script, _, _, nodes, kind = case
    job, info, out_dir, runs = batch[name]
    text = _output(out_dir, script, job)
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", \
        f"job {job} ({script}): {info.get('JobState')} exit {info.get('ExitCode')} {info.get('Reason')}\n{_tail(text, 30)}"
    assert f"{nodes} node(s)" in text and "2 task(s)" in text, text[:500]
    assert "srun --mpi=pmi2 (MPICH netmod ofi)" in text, text[:500]  # found by rocket-env.sh, not written in
    if kind == "decode":
        assert re.search(r"rocket_mpi decode: .*; 2 rank\(s\), fabric shm", text), _tail(text, 30)
        assert re.search(r"^rank +M +ms/step", text, re.M) and "stream 0 tokens:" in text, _tail(text, 30)
        base = script.removesuffix(".sbatch")
        with open(os.path.join(runs, f"{base}-{job}.json")) as f:
            doc = json.load(f)
        assert doc["runs"] and all(len(t) > 0 for r in doc["runs"] for t in r["tokens"]), doc.keys()
    elif kind == "static-fire":
        assert re.search(r"^STATIC FIRE PASS: 0/\d+ streams mismatched \(2 ranks", text, re.M), _tail(text, 30)
    else:
        assert "no --perftest comparison" in text or "ib_write_bw" in text, text[:800]
        assert re.search(r"^fabric-bench: fabric shm, 2 ranks", text, re.M), _tail(text, 30)
        assert re.search(r"^ +message +oneway GB/s", text, re.M), _tail(text, 30)
        rows = re.findall(r"^ +(2|64) KiB +[0-9.]+ +[0-9.]+ +[0-9.]+$", text, re.M)
        assert rows == ["2", "64"], _tail(text, 30)


@pytest.mark.parametrize("nodes", [1, 2])
def test_srun_direct(cluster, ckpt, tmp_path, nodes):
    """srun as a user types it. Across nodes MPICH needs its OFI netmod under srun's pmi2 plugin (see
    jobs/rocket-env.sh): the UCX netmod's address lines can overrun the plugin's 1024-byte read."""
    out = str(tmp_path / "d.json")
    cmd = [_bin("srun"), f"-N{nodes}", "-n2", "--mpi=pmi2", "--time=5", VENV_PY, "-m", "rocket_mpi", "decode",
           "--checkpoint", ckpt, "--streams", "2", "--tokens", "3", "--fabric", "auto", "--out", out]
    extra = {"MPIR_CVAR_CH4_NETMOD": "ofi"} if nodes > 1 else {}
    r = _run(cmd, 180, cluster.env(**extra), cwd=ROOT)
    assert r.returncode == 0, f"rc {r.returncode}: {_tail(r.stdout + r.stderr, 30)}"
    assert re.search(r"rocket_mpi decode: .*; 2 rank\(s\)", r.stdout) and "stream 0 tokens:" in r.stdout, r.stdout
    with open(out) as f:
        assert len(json.load(f)["runs"][0]["tokens"]) == 2


def test_serve_job(cluster, ckpt, tmp_path):
    """jobs/serve-gpu-nodes.sbatch as submitted, with --device cpu: the log names the node rank 0 runs on, the server
    comes up there on the allocation's 2 nodes, answers a completion, and scancel ends the job (bounded waits)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, runs = str(tmp_path), str(tmp_path / "runs")
    job = cluster.sbatch("serve-gpu-nodes.sbatch", [], [ckpt, "--device", "cpu", "--host", "127.0.0.1", "--port",
                                                        str(port), "--max-streams", "2"], out, runs)
    log = os.path.join(out, f"slurm-rocket-serve-gpu-nodes-{job}.out")
    t0, text = time.monotonic(), ""
    try:
        while "rocket_mpi: serving on" not in text:
            state = cluster.job_info(job).get("JobState")
            assert state in (None, "PENDING", "RUNNING", "CONFIGURING"), f"job {job}: {state}\n{_tail(text, 30)}"
            assert time.monotonic() - t0 < JOB_TIMEOUT, f"no URL within {JOB_TIMEOUT} s:\n{_tail(text, 30)}"
            time.sleep(1)
            text = open(log, errors="replace").read() if os.path.exists(log) else ""
        assert "rocket_mpi serve: rank 0 runs on n1" in text and "2 node(s)" in text, text[:800]
        body = json.dumps({"prompt": [5, 17, 99], "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                done = json.load(r)
        except OSError as e:
            time.sleep(2)
            raise AssertionError(f"{e}:\n{_tail(open(log, errors='replace').read(), 40)}") from None
        assert done["usage"]["completion_tokens"] == 4, done
    finally:
        _run([_bin("scancel"), job], 20, cluster.env())
    t0 = time.monotonic()
    while job in _run([_bin("squeue"), "-h", "-o", "%i"], 10, cluster.env()).stdout.split():
        assert time.monotonic() - t0 < 90, f"job {job} still queued 90 s after scancel"
        time.sleep(1)
