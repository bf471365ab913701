"""A dead or stalled peer, a mismatched rank, or a rank whose share does not fit its memory: the job ends
non-zero with a line naming it, no hang."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file, save_file

from conftest import ROOT, rocket_mpi
from rocket_mpi.cli import launch


def _hydra() -> bool:
    """Whether the launcher is MPICH's mpiexec (hydra), under which each rank has a sentinel (runtime/dist.py)."""
    cmd = launch.launcher()
    out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=30)
    return "hydra" in (out.stdout + out.stderr).lower()


HYDRA = _hydra()
NO_SENTINEL = "the sentinel runs under MPICH's mpiexec (hydra) only; this launcher names a dead rank itself"


def decode_args(ckpt, fabric, *extra):
    return ["decode", "--checkpoint", ckpt, "--streams", "4", "--tokens", "6", "--quiet", "--fabric", fabric,
            "--fabric-timeout", "3", *extra]


@pytest.mark.parametrize("fabric,path", [("shm", "host"), ("mpi", "host"), ("shm", "device")])
def test_stalled_peer_times_out_naming_it(tiny_ckpt, fabric, path):
    """path device: the fixed-shape step (graph.py) the GPU captures, run on the CPU: the stalled rank
    never starts step 2, the others' exchange of layer 1 times out."""
    t0 = time.monotonic()
    r = rocket_mpi(3, *decode_args(tiny_ckpt, fabric, "--decode-path", path),
                   env={"ROCKET_FAULT": "stall:rank=1,step=2"}, timeout=90)
    took = time.monotonic() - t0
    assert r.returncode != 0
    assert f"fabric {fabric} timed out after 3 s waiting for rows from rank 1 at layer 1, step 2" in r.stderr, r.stderr
    assert took < 60, f"took {took:.0f} s"


@pytest.mark.parametrize("fabric,path", [("shm", "host"), ("mpi", "host"), ("shm", "device")])
def test_killed_peer_ends_the_job(tiny_ckpt, fabric, path):
    """The launcher ends the job on the dead rank's exit; the others' fabric timeout is 15 s here (not decode_args'
    3 s), so that a launcher slowed by a loaded machine still ends them before their own timeout adds a line."""
    t0 = time.monotonic()
    r = rocket_mpi(2, *decode_args(tiny_ckpt, fabric, "--decode-path", path, "--fabric-timeout", "15"),
                   env={"ROCKET_FAULT": "die:rank=1,step=1"}, timeout=90)
    assert r.returncode != 0
    assert "rank 1: ROCKET_FAULT injecting 'die' at step 1" in r.stderr
    if HYDRA:  # the dead rank's sentinel names it (rank, host, step, layer) before the launcher ends the job
        lines = [ln for ln in r.stderr.splitlines() if "rocket_mpi: error" in ln]
        assert len(lines) == 1 and "rank 1 (pid " in lines[0] and \
            f" on {socket.gethostname()}) died at decode step 1" in lines[0] and "exited with status 9" in lines[0], \
            r.stderr
    assert time.monotonic() - t0 < 60


def _mpmd(parts, timeout=90, envs=None):
    """One rank per part; envs[i]: extra environment of rank i (through env(1), whatever the launcher)."""
    cmd = launch.launcher()
    for i, args in enumerate(parts):
        if i:
            cmd.append(":")
        extra = [f"{k}={v}" for k, v in ((envs or {}).get(i) or {}).items()]
        cmd += ["-n", "1", *(["env", *extra] if extra else []), sys.executable, "-m", "rocket_mpi", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=launch.clean_env(), cwd=ROOT,
                          start_new_session=True)


def test_mismatched_checkpoint_refuses_to_start(tiny_ckpt, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_ckpt, other)
    path = other / "model.safetensors"
    t = load_file(str(path))
    t["model.norm.weight"] = t["model.norm.weight"] * 2
    t["extra.weight"] = t["model.norm.weight"].clone()  # header differs too
    save_file(t, str(path))
    r = _mpmd([decode_args(tiny_ckpt, "shm"), decode_args(str(other), "shm")])
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if "rocket_mpi: error" in ln]
    assert len(lines) == 1, r.stderr
    assert "rank 1 differs from rank 0 in checkpoint fingerprint" in lines[0]


def test_mismatched_flags_refuse_to_start(tiny_ckpt):
    a = decode_args(tiny_ckpt, "shm")
    b = decode_args(tiny_ckpt, "shm")
    b[b.index("--tokens") + 1] = "7"
    r = _mpmd([a, b])
    assert r.returncode != 0
    assert "rank 1 differs from rank 0 in tokens: 7 vs 6" in r.stderr, r.stderr


def test_mismatched_setting_refuses_to_start(tiny_ckpt):
    """A setting that changes what a rank computes (ROCKET_GRAPH_SPANS: the graphed step's attention spans) set on
    one rank only would break parity silently: the start-up handshake names it, on any device."""
    a = decode_args(tiny_ckpt, "shm")
    r = _mpmd([a, a], envs={1: {"ROCKET_GRAPH_SPANS": "64"}})
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if "rocket_mpi: error" in ln]
    assert len(lines) == 1, r.stderr
    assert "rank 1 differs from rank 0 in settings" in lines[0] and "graph_span_min" in lines[0], lines


def test_error_on_one_rank_is_reported_once_with_its_rank(tiny_ckpt, tmp_path):
    r = _mpmd([decode_args(tiny_ckpt, "shm"), decode_args(str(tmp_path / "missing"), "shm")])
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if "rocket_mpi: error" in ln]
    assert len(lines) == 1 and "(rank 1): " in lines[0] and "missing" in lines[0], r.stderr


def test_rank_out_of_memory_while_loading_is_one_line(tiny_ckpt):
    """A rank that runs out of memory loading its experts (injected: MoE layer 2 on rank 1) ends the job with
    one line naming the rank, the layer and what would make it fit; no traceback, no hang."""
    r = rocket_mpi(2, *decode_args(tiny_ckpt, "shm"), env={"ROCKET_FAULT": "oom:rank=1,step=2"}, timeout=90)
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "rocket_mpi: error" in ln]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("rocket_mpi: error: rank 1 of 2: out of host memory while loading MoE layer 2's "
                               "experts"), lines[0]
    assert "use more ranks, NVFP4 experts, or a --placement" in lines[0]


def _mpmd_env(parts, timeout=90):
    """MPICH MPMD launch with per-rank environment: parts = [(env dict, args), ...]."""
    cmd = launch.launcher()
    for i, (env, args) in enumerate(parts):
        if i:
            cmd.append(":")
        cmd += ["-n", "1"]
        for k, v in env.items():
            cmd += ["-env", k, v]
        cmd += [sys.executable, "-m", "rocket_mpi", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=launch.clean_env(), cwd=ROOT,
                          start_new_session=True)


def test_ranks_on_two_hosts_choose_mpi_and_refuse_shm(tiny_ckpt, tmp_path):
    """Ranks that report different hosts: auto picks mpi (no RDMA device here), shm says why it cannot."""
    if "mpich" not in " ".join(launch.launcher()).lower() and "hydra" not in subprocess.run(
            [*launch.launcher(), "--version"], capture_output=True, text=True).stdout.lower():
        pytest.skip("per-rank -env needs MPICH's mpiexec (hydra)")
    out = tmp_path / "o.json"
    args = ["decode", "--checkpoint", tiny_ckpt, "--streams", "2", "--tokens", "3", "--quiet", "--out", str(out)]
    r = _mpmd_env([({"ROCKET_HOSTNAME": "nodeA"}, args), ({"ROCKET_HOSTNAME": "nodeB"}, args)])
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["fabric"] == "mpi"
    r = _mpmd_env([({"ROCKET_HOSTNAME": "nodeA"}, args + ["--fabric", "shm"]),
                   ({"ROCKET_HOSTNAME": "nodeB"}, args + ["--fabric", "shm"])])
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if "rocket_mpi: error" in ln]
    assert len(lines) == 1 and "fabric shm needs all ranks on one host, these span 2 hosts" in lines[0], r.stderr


def _beside_a_rank_that_only(tiny_ckpt, code: str):
    """A 2-rank job: rank 0 decodes (--startup-timeout 4), rank 1 is a Python process running `code` -> (rank 0's
    error lines, the result); the job must fail."""
    cmd = launch.launcher() + ["-n", "1", sys.executable, "-m", "rocket_mpi", *decode_args(tiny_ckpt, "shm"),
                               "--startup-timeout", "4", ":", "-n", "1", sys.executable, "-c", code]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=50, env=launch.clean_env(), cwd=ROOT,
                       start_new_session=True)
    assert r.returncode != 0
    return [ln for ln in r.stderr.splitlines() if "rocket_mpi: error" in ln], r


def test_rank_that_never_starts_ends_mpi_init_with_one_line(tiny_ckpt):
    """A rank of the job that never reaches MPI_Init (here: a process that only sleeps) would hold the others in
    MPI_Init for ever: they give up after --startup-timeout with one line naming the rank."""
    lines, r = _beside_a_rank_that_only(tiny_ckpt, "import time; time.sleep(60)")
    assert len(lines) == 1 and "rank 0: MPI_Init did not complete in 4 s" in lines[0], r.stderr
    if HYDRA:  # the sentinel names the rank of this host that never got there
        assert "rank 1 (pid " in lines[0] and "of this host never reached it" in lines[0], lines[0]


def test_same_shapes_other_weights_refuse_to_start(tmp_path):
    """A rank given a checkpoint of the same shapes and headers but other weights (another seed) would decode
    wrong tokens with exit 0: the fingerprint samples each file's data, so the handshake names it."""
    from rocket_mpi.checkpoint.make import make_checkpoint
    a, b = tmp_path / "a", tmp_path / "b"
    make_checkpoint("tiny", str(a), 0, False, False, 1)
    make_checkpoint("tiny", str(b), 1, False, False, 1)
    assert os.path.getsize(a / "model.safetensors") == os.path.getsize(b / "model.safetensors")
    r = _mpmd([decode_args(str(a), "shm"), decode_args(str(b), "shm")])
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if "rocket_mpi: error" in ln]
    assert len(lines) == 1 and "rank 1 differs from rank 0 in checkpoint fingerprint" in lines[0], r.stderr


def _unsampled_offset(path, lo, hi):
    """A byte of [lo, hi) in `path` that the start-up fingerprint's samples of the data do not read."""
    from rocket_mpi.checkpoint.reader import FINGERPRINT_SAMPLES
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    start, span = 8 + n, size - 8 - n
    windows = [(start + span * i // FINGERPRINT_SAMPLES, start + span * i // FINGERPRINT_SAMPLES + (1 << 16))
               for i in range(FINGERPRINT_SAMPLES)]
    return next((b for b in range(lo, hi, 2) if not any(a <= b < e for a, e in windows)), None)


def test_one_flipped_byte_between_the_samples_refuses_to_start(tiny_ckpt, tmp_path):
    """Rank 1's copy differs from rank 0's in one bit of one replicated weight, at a byte the fingerprint's samples
    do not read (the file is padded past their reach): decoding would give wrong tokens with exit 0. The digests
    of what each rank loaded (checkpoint/fingerprint.py) differ, and one line names the tensor and the rank."""
    import torch
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(tiny_ckpt, a)
    t = load_file(str(a / "model.safetensors"))
    t["0.padding"] = torch.zeros(4 << 20, dtype=torch.uint8)  # unused; makes the file far larger than the samples
    save_file(t, str(a / "model.safetensors"))
    shutil.copytree(a, b)
    path = b / "model.safetensors"
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    # a BF16 weight of the replicated stack (every rank reads it) with a byte the samples miss
    name, at = next((k, at) for k, v in sorted(header.items()) if k != "__metadata__" and ".experts." not in k
                    and v["dtype"] == "BF16" and (at := _unsampled_offset(str(path), 8 + n + v["data_offsets"][0],
                                                                         8 + n + v["data_offsets"][1])) is not None)
    raw[at] ^= 1  # the low bit of a BF16 mantissa: still finite
    path.write_bytes(bytes(raw))
    r = _mpmd([decode_args(str(a), "shm"), decode_args(str(b), "shm")])
    assert r.returncode != 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "rocket_mpi: error" in ln]
    assert len(lines) == 1, r.stderr
    assert f"rank 1 differs from rank 0 in the contents of tensor '{name}'" in lines[0], lines[0]


def test_first_difference_names_the_lowest_tensor_and_rank():
    from rocket_mpi.checkpoint.fingerprint import first_difference
    same = {"a": (1, 4, "f"), "b": (2, 4, "f")}
    assert first_difference([same, dict(same), None]) is None
    assert first_difference([{"x": (1, 4, "f")}, {"y": (2, 4, "f")}]) is None  # read by one rank each: no comparison
    line = first_difference([same, dict(same), {"b": (3, 4, "g"), "a": (9, 4, "f")}])
    assert line.startswith("rank 2 differs from rank 0 in the contents of tensor 'a'") and "1 more" in line


def _start_and_signal(ckpt, fabric, sig, timeout=90):
    """A 2-rank decode long enough to be hit while decoding; once rank 0 logs the ranks' PIDs and starts decoding,
    send `sig` to rank 1's PID from outside (kill -9 / kill -STOP) -> (returncode, stderr, rank 1's pid)."""
    cmd = [*launch.launcher(), "-n", "2", sys.executable, "-m", "rocket_mpi", "decode", "--checkpoint", ckpt,
           "--streams", "2", "--tokens", "490", "--fabric", "shm" if fabric == "shm" else fabric,
           "--fabric-timeout", "3", "--log-level", "info"]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=launch.clean_env(),
                         cwd=ROOT, start_new_session=True)
    err, pid, t0 = [], None, time.monotonic()
    try:
        for line in p.stderr:
            err.append(line)
            if "ranks: 0 = pid" in line:
                pid = int(line.split("1 = pid ")[1].split()[0])
            if "decoding" in line and pid:
                time.sleep(0.3)
                os.kill(pid, sig)
                break
        err += p.stderr.readlines()
        p.wait(timeout=max(1, timeout - (time.monotonic() - t0)))
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        if pid and sig == signal.SIGSTOP:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return p.returncode, "".join(err), pid


@pytest.mark.parametrize("fabric", ["shm", "mpi"])
def test_rank_killed_from_outside_is_named(tiny_ckpt, fabric):
    """kill -9 of a rank while it decodes: one line names the rank, its PID and host, the step and the signal
    (its sentinel says it before the launcher ends the job), not only the launcher's BAD TERMINATION."""
    if not HYDRA:
        pytest.skip(NO_SENTINEL)
    code, err, pid = _start_and_signal(tiny_ckpt, fabric, signal.SIGKILL)
    assert code != 0 and pid, err
    lines = [ln for ln in err.splitlines() if "rocket_mpi: error" in ln]
    assert len(lines) == 1, err
    assert f"rank 1 (pid {pid} on {socket.gethostname()}) died at decode step" in lines[0], lines[0]
    assert "killed by signal 9 (SIGKILL)" in lines[0], lines[0]


def test_rank_stopped_from_outside_is_named_with_its_state(tiny_ckpt):
    """kill -STOP of a rank: the others' fabric timeout names it, its host and that it is stopped."""
    code, err, pid = _start_and_signal(tiny_ckpt, "shm", signal.SIGSTOP)
    assert code != 0 and pid, err
    lines = [ln for ln in err.splitlines() if "rocket_mpi: error" in ln]
    assert lines and all("waiting for rows from rank 1" in ln for ln in lines), err
    assert f"(rank 1 is pid {pid} on {socket.gethostname()}, stopped (SIGSTOP?))" in lines[0], lines[0]


def test_rank_stalled_after_mpi_init_is_named(tiny_ckpt):
    """A rank that got through MPI_Init but never reaches the first set-up step: rank 0 gives up after
    --startup-timeout and names the rank that never arrived, with its PID and state on this host (the others give
    rank 0 a grace period, so its line is the one printed)."""
    lines, r = _beside_a_rank_that_only(tiny_ckpt,
                                        "import rocket_mpi.runtime.dist as d, time; d.world(); time.sleep(60)")
    assert len(lines) == 1 and "rank 0: timed out after 4 s" in lines[0], r.stderr
    assert "(never arrived: rank 1" in lines[0], lines[0]
    if HYDRA:  # its PID and state: found through the sentinels
        assert "(never arrived: rank 1, pid " in lines[0] and "on this host, alive but not answering)" in lines[0], \
            lines[0]
