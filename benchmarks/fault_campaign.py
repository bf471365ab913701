"""The reliability campaign on CPU: faults, stalls, mismatched and broken checkpoints, bad input, and a memory soak;
prints one table of counts (and the soak's RSS) for the code that `rocket_mpi` imports (PYTHONPATH picks the tree).

    python benchmarks/fault_campaign.py [--trials 64] [--mutations 500] [--soak-tokens 3000] [--seed 1]
    PYTHONPATH=/path/to/other/checkout python benchmarks/fault_campaign.py ...   # the same campaign, other code

Everything runs through the command line (`python -m rocket_mpi` under the MPI launcher beside this Python), so
any version of the package takes the same campaign. Each case is one of:

    planted     ROCKET_FAULT die / stall on a random rank at a random decode step; shm and mpi, 2-4 ranks
    external    kill -9 / kill -STOP of a random rank's PID (from rank 0's log) at a random moment of decoding
    start-up    a rank that never reaches MPI_Init; one that stops after it; --fabric-timeout inf
    checkpoint  two ranks given different copies (another seed; one flipped bit of a replicated weight, or of an
                expert only its owner reads, where the start-up fingerprint's samples do not look); a NaN in one
                BF16 expert weight; a norm weight whose activations overflow BF16
    bad input   the 11 cases that once ended in a traceback (config values of the wrong type, a file as
                --checkpoint, --out into a missing folder, a malformed ROCKET_FAULT, 4 malformed header entries)
    headers     N random mutations of a safetensors header (fields, entries, offsets, bytes, the length), one
                in-process decode each (the same N for every tree: seeded)
    soak        2 ranks (shm), preset default, 4 streams x T tokens: each rank's RSS at 100 / 1000 / T tokens

Columns: cases; ended (non-zero exit, no traceback, at least one `rocket_mpi: error` line); named (that line names
what was wrong: the rank for a fault, the tensor or key for a checkpoint); tracebacks; hangs (killed at the case's
time limit); wrong (exit 0 with tokens other than the reference's, or a fault that went unseen); leftovers
(processes of the case still alive a second after it ended; they are killed). Header mutations that still load
are counted as accepted, not wrong.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
TAG = "ROCKET_CAMPAIGN_CASE"


@dataclass
class Row:
    cases: int = 0
    ended: int = 0
    named: int = 0
    tracebacks: int = 0
    hangs: int = 0
    wrong: int = 0
    leftovers: int = 0
    accepted: int = 0
    notes: list = field(default_factory=list)


def env(case: str, extra: dict | None = None) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_COMM_WORLD", "HYDRA_"))}
    e.update({TAG: case, "PYTHONUNBUFFERED": "1"}, **(extra or {}))
    return e


def leftovers(case: str) -> int:
    """Processes of `case` (its tag in their environment) still alive: counted, then killed."""
    time.sleep(1.0)
    n = 0
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                if f"{TAG}={case}\0".encode() not in f.read():
                    continue
            os.kill(int(p), signal.SIGKILL)
            n += 1
        except OSError:
            pass
    return n


def run(cmd: list[str], case: str, limit: float, extra_env: dict | None = None, stdin=None):
    """-> (returncode or None on a hang, stderr, stdout)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(case, extra_env),
                         start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        out, err = p.communicate(timeout=limit)
        return p.returncode, err, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return None, err, out


def judge(row: Row, code, err: str, name_re: str | None, left: int, wrong: bool = False) -> None:
    row.cases += 1
    row.leftovers += left
    lines = [ln for ln in err.splitlines() if "rocket_mpi: error" in ln or "rocket_mpi decode: error" in ln]
    if code is None:
        row.hangs += 1
        return
    if "Traceback" in err:
        row.tracebacks += 1
    if code == 0:
        row.wrong += 1 if wrong or name_re is not None else 0
        return
    if "Traceback" not in err and lines:
        row.ended += 1
        if name_re is None or any(re.search(name_re, ln) for ln in lines):
            row.named += 1
        elif len(row.notes) < 3:
            row.notes.append(lines[0][:160])


def decode_cmd(n: int, ckpt: str, fabric: str, *extra: str) -> list[str]:
    return [MPIEXEC, "-n", str(n), sys.executable, "-m", "rocket_mpi", "decode", "--checkpoint", ckpt, "--fabric",
            fabric, "--fabric-timeout", "3", "--startup-timeout", "20", *extra]


def mpmd(parts: list[list[str]]) -> list[str]:
    cmd = [MPIEXEC]
    for i, part in enumerate(parts):
        cmd += ([":"] if i else []) + ["-n", "1", *part]
    return cmd


def rocket(*args: str) -> list[str]:
    return [sys.executable, "-m", "rocket_mpi", *args]


# -- the cases ---------------------------------------------------------------------------------------------------
def planted(rng: random.Random, tiny: str, trials: int) -> Row:
    row = Row()
    for i in range(trials):
        kind, fabric, n = rng.choice(["die", "stall"]), rng.choice(["shm", "mpi"]), rng.choice([2, 3, 4])
        rank, step = rng.randrange(n), rng.randint(1, 6)
        case = f"planted{i}"
        code, err, _ = run(decode_cmd(n, tiny, fabric, "--streams", "4", "--tokens", "8", "--quiet", "--ignore-eos"),
                           case, 90,
                           {"ROCKET_FAULT": f"{kind}:rank={rank},step={step}"})
        judge(row, code, err, rf"\brank {rank}\b(?!: ROCKET_FAULT)", leftovers(case))
    return row


def external(rng: random.Random, tiny: str, trials: int) -> Row:
    row = Row()
    for i in range(trials):
        sig, fabric, n = rng.choice([signal.SIGKILL, signal.SIGSTOP]), rng.choice(["shm", "mpi"]), rng.choice([2, 3, 4])
        rank = rng.randrange(1, n)  # rank 0's log says where the others are
        case = f"external{i}"
        cmd = decode_cmd(n, tiny, fabric, "--streams", "2", "--tokens", "490", "--log-level", "info", "--ignore-eos")
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env(case),
                             start_new_session=True, stdin=subprocess.DEVNULL)
        err, pid, code, t0 = [], None, None, time.monotonic()
        try:
            for line in p.stderr:
                err.append(line)
                m = re.search(r"ranks: (.*)", line)
                if m:
                    pid = int(re.search(rf"\b{rank} = pid (\d+)", m.group(1)).group(1))
                if "decoding" in line and pid:
                    time.sleep(rng.uniform(0.0, 1.5))
                    os.kill(pid, sig)
                    break
            err += p.stderr.readlines()
            code = p.wait(timeout=max(1.0, 90 - (time.monotonic() - t0)))
        except (subprocess.TimeoutExpired, ProcessLookupError):
            code = None if p.poll() is None else p.returncode
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        judge(row, code, "".join(err), rf"\brank {rank}\b", leftovers(case))
    return row


def startup(tiny: str) -> Row:
    row = Row()
    args = ["decode", "--checkpoint", tiny, "--streams", "2", "--tokens", "4", "--quiet", "--fabric", "shm",
            "--startup-timeout", "5"]
    cases = [
        ("never reaches MPI_Init", mpmd([rocket(*args), [sys.executable, "-c", "import time; time.sleep(60)"]]),
         r"\brank 1\b"),
        ("stops after MPI_Init", mpmd([rocket(*args), [sys.executable, "-c",
                                                       "import rocket_mpi.runtime.dist as d, time; d.world(); "
                                                       "time.sleep(60)"]]), r"\brank 1\b"),
        ("never reaches MPI_Init, 3 ranks", mpmd([rocket(*args), rocket(*args),
                                                  [sys.executable, "-c", "import time; time.sleep(60)"]]),
         r"\brank 2\b"),
        ("--fabric-timeout inf", decode_cmd(2, tiny, "shm", "--streams", "2", "--tokens", "4", "--fabric-timeout",
                                            "inf"), r"--fabric-timeout"),  # the last of a repeated flag counts
        ("--startup-timeout 0", decode_cmd(2, tiny, "shm", "--streams", "2", "--tokens", "4", "--startup-timeout",
                                           "0"), r"--startup-timeout"),
    ]
    for i, (what, cmd, name_re) in enumerate(cases):
        case = f"startup{i}"
        code, err, _ = run(cmd, case, 60)
        judge(row, code, err, name_re, leftovers(case))
        if code is not None and not any(re.search(name_re, ln) for ln in err.splitlines() if "error" in ln):
            row.notes.append(f"{what}: " + next((ln for ln in err.splitlines() if "error" in ln), "-")[:140])
    return row


def _header(path: str):
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), n, raw


def _unsampled(path: str, lo: int, hi: int, samples: int = 32):
    size = os.path.getsize(path)
    _, n, _ = _header(path)
    start, span = 8 + n, size - 8 - n
    wins = [(start + span * i // samples, start + span * i // samples + (1 << 16)) for i in range(samples)]
    return next((b for b in range(lo, hi, 2) if not any(a <= b < e for a, e in wins)), None)


def _flip_between_samples(src: str, dst: str, experts: bool, owner_range: tuple[int, int] | None = None) -> str:
    """dst: a copy of src with one bit of one BF16 tensor flipped where the fingerprint's samples do not read
    (experts: a routed expert's weight in owner_range of expert ids, else a weight every rank reads) -> its name."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    header, n, raw = _header(path)
    raw = bytearray(raw)
    for name, v in sorted(header.items()):
        if name == "__metadata__" or v["dtype"] != "BF16" or (".experts." in name) != experts:
            continue
        if experts and not owner_range[0] <= int(name.split(".experts.")[1].split(".")[0]) < owner_range[1]:
            continue
        at = _unsampled(path, 8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
        if at is not None:
            raw[at + 1] ^= 0x10  # a bit of the exponent's high byte: finite, and far from the old value
            open(path, "wb").write(bytes(raw))
            return name
    raise SystemExit(f"no unsampled byte in {path}")


def _tokens(out: str):
    try:
        return json.load(open(out))["tokens"]
    except (OSError, ValueError, KeyError):
        return None


def checkpoints(work: str, tiny_padded: str) -> Row:
    row = Row()
    ref_out = os.path.join(work, "ref.json")
    args = ["--streams", "4", "--tokens", "8", "--quiet", "--ignore-eos"]
    run(decode_cmd(2, tiny_padded, "shm", *args, "--out", ref_out), "ref", 120)
    ref = _tokens(ref_out)
    other = os.path.join(work, "seed4")
    subprocess.run(rocket("make-checkpoint", "--preset", "tiny", "--out", other, "--seed", "4"), check=True,
                   capture_output=True, env=env("make"))
    _pad(other)
    stack = os.path.join(work, "flip_stack")
    stack_name = _flip_between_samples(tiny_padded, stack, experts=False)
    expert = os.path.join(work, "flip_expert")
    expert_name = _flip_between_samples(tiny_padded, expert, experts=True, owner_range=(8, 16))  # rank 1's of 2
    nan = os.path.join(work, "nan")
    shutil.copytree(tiny_padded, nan)
    _edit(nan, "model.layers.1.mlp.experts.3.down_proj.weight", "nan")
    over = os.path.join(work, "overflow")
    shutil.copytree(tiny_padded, over)
    _edit(over, "model.layers.1.post_attention_layernorm.weight", 3e38)
    cases = [("another seed on rank 1", [tiny_padded, other], r"rank 1 differs"),
             ("a flipped bit in a replicated weight on rank 1", [tiny_padded, stack], re.escape(stack_name)),
             ("a flipped bit in an expert only rank 1 reads", [tiny_padded, expert], re.escape(expert_name)),
             ("NaN in a BF16 expert weight", [nan, nan], r"experts\.3\.down_proj"),
             ("activations overflow BF16", [over, over], r"step 0.*(NaN|Inf)")]
    for i, (what, (a, b), name_re) in enumerate(cases):
        case, out = f"ckpt{i}", os.path.join(work, f"out{i}.json")
        cmd = mpmd([rocket("decode", "--checkpoint", a, "--fabric", "shm", *args, "--out", out),
                    rocket("decode", "--checkpoint", b, "--fabric", "shm", *args, "--out", out)])
        code, err, _ = run(cmd, case, 90)
        wrong = code == 0 and _tokens(out) != ref
        judge(row, code, err, name_re, leftovers(case), wrong=wrong)
        if code == 0:
            row.notes.append(f"{what}: exit 0, tokens {'differ from' if wrong else 'equal'} the reference's")
    return row


def _pad(d: str) -> None:
    """Pad a tiny checkpoint's file with an unused 4 MiB tensor: the fingerprint's 32 samples of 64 KiB then read
    a fraction of it, as of a real checkpoint's files (a tiny file is read whole)."""
    from safetensors.torch import load_file, save_file
    import torch
    path = os.path.join(d, "model.safetensors")
    t = load_file(path)
    t["0.padding"] = torch.zeros(4 << 20, dtype=torch.uint8)
    save_file(t, path)


def _edit(d: str, name: str, value) -> None:
    from safetensors.torch import load_file, save_file
    path = os.path.join(d, "model.safetensors")
    t = load_file(path)
    if value == "nan":
        t[name][0, 0] = float("nan")
    else:
        t[name][:] = value
    save_file(t, path)


def bad_input(tiny: str, work: str) -> Row:
    row = Row()

    def cfg(key, value):
        d = tempfile.mkdtemp(dir=work)
        shutil.copytree(tiny, d, dirs_exist_ok=True)
        p = os.path.join(d, "config.json")
        c = json.load(open(p))
        c[key] = value
        json.dump(c, open(p, "w"))
        return d

    def entry(value):
        d = tempfile.mkdtemp(dir=work)
        shutil.copytree(tiny, d, dirs_exist_ok=True)
        path = os.path.join(d, "model.safetensors")
        header, n, raw = _header(path)
        name = next(k for k in sorted(header) if k != "__metadata__")
        header[name] = value
        new = json.dumps(header).encode()
        new += b" " * max(0, n - len(new))
        open(path, "wb").write(len(new).to_bytes(8, "little") + new + raw[8 + n:])
        return d

    base = ["decode", "--streams", "2", "--tokens", "2", "--quiet"]
    cases = [
        ("rms_norm_eps as a string", base + ["--checkpoint", cfg("rms_norm_eps", "1e-5")], {}, "rms_norm_eps"),
        ("routed_scaling_factor as a string", base + ["--checkpoint", cfg("routed_scaling_factor", "2.5")], {},
         "routed_scaling_factor"),
        ("eos_token_id: x", base + ["--checkpoint", cfg("eos_token_id", "x")], {}, "eos_token_id"),
        ("rope_parameters as a list", base + ["--checkpoint", cfg("rope_parameters", [1, 2])], {}, "rope_parameters"),
        ("a file as --checkpoint", base + ["--checkpoint", os.path.join(tiny, "config.json")], {}, "--checkpoint"),
        ("--out into a missing folder", base + ["--checkpoint", tiny, "--out", os.path.join(work, "no", "o.json")],
         {}, "--out"),
        ("a malformed ROCKET_FAULT", base + ["--checkpoint", tiny], {"ROCKET_FAULT": "die:rank=one"}, "ROCKET_FAULT"),
        ("a header entry without data_offsets", base + ["--checkpoint", entry({"dtype": "BF16", "shape": [1]})], {},
         "model.safetensors"),
        ("a header entry that is a list", base + ["--checkpoint", entry([1, 2])], {}, "model.safetensors"),
        ("data_offsets of one number", base + ["--checkpoint", entry({"dtype": "BF16", "shape": [1],
                                                                      "data_offsets": [4]})], {}, "model.safetensors"),
        ("a header entry that is a number", base + ["--checkpoint", entry(7)], {}, "model.safetensors"),
    ]
    for i, (what, argv, extra, needle) in enumerate(cases):
        case = f"bad{i}"
        t0 = time.monotonic()
        code, err, _ = run(rocket(*argv), case, 60, extra)
        judge(row, code, err, re.escape(needle), leftovers(case))
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if "Traceback" in err or len(lines) != 1:
            row.notes.append(f"{what}: {len(lines)} lines, last {lines[-1][:120] if lines else '-'}")
        elif what.startswith("--out") and time.monotonic() - t0 > 30:
            row.notes.append(f"{what}: took {time.monotonic() - t0:.0f} s")
    return row


def headers(tiny: str, work: str, n: int, seed: int) -> Row:
    """n seeded mutations of tiny's header, each decoded in this process through the command line's main()."""
    from rocket_mpi.cli import main
    row = Row()
    rng = random.Random(seed)
    header, hn, raw = _header(os.path.join(tiny, "model.safetensors"))
    names = [k for k in header if k != "__metadata__"]

    def value():
        return rng.choice([None, True, -1, 0, 7, 2 ** 65, 1.5, "", "BF16", "F8_E4M3", [], [1], [0, 0], [4, 2],
                           [-1, 3], ["a", 1], {}, {"a": 1}, [[1]], "x" * 40])
    d = os.path.join(work, "mut")
    for i in range(n):
        h = json.loads(json.dumps(header))
        how = rng.choice(["field", "drop", "entry", "extra", "offsets", "bytes", "length", "metadata"])
        name = rng.choice(names)
        if how == "field":
            h[name][rng.choice(["dtype", "shape", "data_offsets"])] = value()
        elif how == "drop":
            h[name].pop(rng.choice(["dtype", "shape", "data_offsets"]))
        elif how == "entry":
            h[name] = value()
        elif how == "extra":
            h[rng.choice(["x", "__metadata__", name + "x"])] = value()
        elif how == "offsets":
            a, b = h[name]["data_offsets"]
            h[name]["data_offsets"] = [a + rng.randint(-3, 3), b + rng.randint(-3, 3)]
        elif how == "metadata":
            h["__metadata__"] = value()
        text = json.dumps(h).encode()
        if how == "bytes":
            text = bytearray(text)
            for _ in range(rng.randint(1, 4)):
                text[rng.randrange(len(text))] = rng.randrange(256)
            text = bytes(text)
        length = len(text) + (rng.randint(-64, 64) if how == "length" else 0)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(tiny, d)
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            f.write(max(length, 0).to_bytes(8, "little") + text + raw[8 + hn:])
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(["decode", "--checkpoint", d, "--streams", "1", "--tokens", "1", "--quiet"])
            except SystemExit as e:
                code = e.code
            except BaseException as e:  # an exception main() let through: the command line shows its traceback
                code = 3
                err.write(f"Traceback (uncaught): {e!r}\n")
        text_err = err.getvalue()
        row.cases += 1
        if "Traceback" in text_err or code == 3:
            row.tracebacks += 1
            if len(row.notes) < 3:
                row.notes.append(f"{how}: " + text_err.strip().splitlines()[-1][:140])
        elif code in (0, None):
            row.accepted += 1
        else:
            lines = [ln for ln in text_err.splitlines() if ln.strip()]
            row.ended += 1
            row.named += int(len(lines) == 1 and "model.safetensors" in lines[0])
    return row


def soak(default: str, tokens: int) -> dict:
    """2 ranks (shm), 4 streams x tokens: each rank's RSS (its PID from rank 0's log, /proc) when rank 0's progress
    bar passes 100, 1000 and `tokens` steps (the last sample before it ends)."""
    cmd = decode_cmd(2, default, "shm", "--streams", "4", "--tokens", str(tokens), "--log-level", "info",
                     "--ignore-eos")
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env("soak"),
                         start_new_session=True, stdin=subprocess.DEVNULL)
    pids, marks, got, buf, t0 = None, [100, 1000, tokens], {}, b"", time.monotonic()

    def rss(pid):
        try:
            return int(re.search(rb"VmRSS:\s+(\d+)", open(f"/proc/{pid}/status", "rb").read()).group(1)) / 2**20
        except (OSError, AttributeError):
            return None
    last = {}
    while True:
        chunk = os.read(p.stderr.fileno(), 4096)
        if not chunk:
            break
        buf += chunk
        *parts, buf = re.split(rb"[\r\n]", buf)
        for part in parts:
            line = part.decode(errors="replace")
            m = re.search(r"ranks: 0 = pid (\d+) on \S+, 1 = pid (\d+)", line)
            if m:
                pids = [int(m.group(1)), int(m.group(2))]
            m = re.search(rf"decoding 4 stream\(s\).*?\b(\d+)/{tokens}\b", line)
            if m and pids:
                step = int(m.group(1))
                now = [rss(pid) for pid in pids]
                if None not in now:
                    last = {"step": step, "rss": now}
                for target in marks:
                    if step >= min(target, tokens - 10) and target not in got and None not in now:
                        got[target] = (step, now)
    p.wait()
    return {"tokens": tokens, "rss": got, "last": last, "seconds": time.monotonic() - t0, "code": p.returncode}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=64, help="planted + external fault trials (planted: 5/8 of them)")
    ap.add_argument("--mutations", type=int, default=500, help="safetensors header mutations")
    ap.add_argument("--soak-tokens", type=int, default=3000, help="tokens per stream of the soak (0: no soak)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated sections to run (planted,external,startup,"
                                               "checkpoint,bad,headers,soak)")
    a = ap.parse_args()
    import rocket_mpi
    only = set(a.only.split(",")) - {""}
    want = lambda s: not only or s in only  # noqa: E731
    rng = random.Random(a.seed)
    work = tempfile.mkdtemp(prefix="rocket-campaign-")
    t_start = time.monotonic()
    print(f"rocket_mpi from {os.path.dirname(rocket_mpi.__file__)}; host {socket.gethostname()}, "
          f"{os.cpu_count()} CPUs; seed {a.seed}", flush=True)
    try:
        tiny, default, padded = (os.path.join(work, x) for x in ("tiny", "default", "padded"))
        for preset, d in (("tiny", tiny), ("default", default)):
            if preset == "default" and not (want("soak") and a.soak_tokens):
                continue
            subprocess.run(rocket("make-checkpoint", "--preset", preset, "--out", d, "--seed", "3"), check=True,
                           capture_output=True, env=env("make"))
        shutil.copytree(tiny, padded)
        _pad(padded)
        rows, n_planted = {}, a.trials * 5 // 8
        sections = [("planted", lambda: planted(rng, tiny, n_planted)),
                    ("external", lambda: external(rng, tiny, a.trials - n_planted)),
                    ("startup", lambda: startup(tiny)), ("checkpoint", lambda: checkpoints(work, padded)),
                    ("bad", lambda: bad_input(tiny, work)),
                    ("headers", lambda: headers(tiny, work, a.mutations, a.seed))]
        for name, fn in sections:
            if want(name):
                t0 = time.monotonic()
                rows[name] = fn()
                print(f"  {name}: {time.monotonic() - t0:.0f} s", flush=True)
        soaked = soak(default, a.soak_tokens) if want("soak") and a.soak_tokens else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'case':<12}{'cases':>6}{'ended':>7}{'named':>7}{'traceb.':>8}{'hangs':>6}{'wrong':>6}{'leftover':>9}"
          f"{'accepted':>9}")
    total = Row()
    for name, r in rows.items():
        print(f"{name:<12}{r.cases:>6}{r.ended:>7}{r.named:>7}{r.tracebacks:>8}{r.hangs:>6}{r.wrong:>6}"
              f"{r.leftovers:>9}{r.accepted:>9}")
        for k in ("cases", "ended", "named", "tracebacks", "hangs", "wrong", "leftovers", "accepted"):
            setattr(total, k, getattr(total, k) + getattr(r, k))
    print(f"{'all':<12}{total.cases:>6}{total.ended:>7}{total.named:>7}{total.tracebacks:>8}{total.hangs:>6}"
          f"{total.wrong:>6}{total.leftovers:>9}{total.accepted:>9}")
    for name, r in rows.items():
        for note in r.notes:
            print(f"  {name}: {note}")
    if soaked:
        rss = soaked["rss"]
        print(f"\nsoak: 2 ranks shm, preset default, 4 streams x {soaked['tokens']} tokens, exit {soaked['code']}, "
              f"{soaked['seconds']:.0f} s; RSS GiB per rank at (step):")
        for target, (step, vals) in sorted(rss.items()):
            print(f"  {target:>5} tokens (step {step:>5}): " + "  ".join(f"rank {i} {v:.3f}" for i, v in enumerate(vals)))
        if 100 in rss and rss:
            hi = max(rss)
            growth = [100 * (b / a0 - 1) for a0, b in zip(rss[100][1], rss[hi][1])]
            print(f"  growth from 100 to {hi} tokens: " + ", ".join(f"rank {i} {g:+.1f} %" for i, g in enumerate(growth)))
    print(f"\ncampaign: {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
