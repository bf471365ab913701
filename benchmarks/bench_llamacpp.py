"""rocket_mpi beside llama.cpp on the same weights: decode tok/s at batch 1 and 8, weight bytes read per token,
a 64-token run's wall time and one long prompt's prefill, in one markdown table.

Rows: llama.cpp on a BF16 GGUF and on its Q4_K_M quantisation, rocket_mpi on the BF16 checkpoint, on its `:nvfp4`
form (routed experts NVFP4, the rest BF16), on its `:nvfp4-all` form (every Linear but lm_head and the routers
NVFP4, as ModelOpt's export) and on its `:nvfp4-head` form (lm_head NVFP4 too, as Q4_K_M quantises it, to Q6_K).

Same weights, precisely: one GLM-4.x preset (make-checkpoint's, default air8) cut to --layers layers is drawn once on
the CPU from --seed. Every tensor is drawn from its own generator seeded by (seed, tensor name), so the kept layers
hold exactly the tensors `make-checkpoint --preset NAME --seed N` writes for them. The BF16 checkpoint is those
tensors as drawn; the BF16 GGUF is converted from that file (the converter stores the 1-D tensors, norms and
biases, and the FP32 routers in F32), the Q4_K_M GGUF quantised from the BF16 GGUF by llama-quantize; the two NVFP4
checkpoints are the same BF16 tensors quantised by make-checkpoint's own quantize_tensors, tensor for tensor what
`make-checkpoint --nvfp4` / `--nvfp4-all` / `--nvfp4-head` writes. `--checkpoint preset:NAME` is not used: it draws on the decode
device, and CUDA's generator gives other values than the CPU's.

Steps (--steps; each step reuses what an earlier run of it left in --work where the settings match):
  build    (--build) cmake and build llama-bench, llama-batched-bench, llama-quantize, llama-completion (CUDA sm_90;
           --cpu: the CPU backend only)
  weights  the three rocket_mpi checkpoints, and beside them WORK/hf: the BF16 checkpoint as the converter takes it
  gguf     convert_hf_to_gguf.py (BF16), then llama-quantize Q4_K_M
  llama    llama-bench: -p 0 -n TOKENS (batch 1) and -p PREFILL -n 0 (prefill, the best of --prefill-ubatch);
           llama-batched-bench -npp NPP -ntg TOKENS -npl BATCH (batch 8); llama-completion -n TOKENS, timed whole
  rocket   decode --streams 1 --tokens TOKENS (timed whole), --streams BATCH, and a PREFILL-token prompt twice
           (--sweep 1,1 --tokens 1: the second, warm prefill counts)
Every flash-attention switch is on (-fa 1), every layer on the GPU (-ngl 99), EOS ignored on both sides.

Columns:
  tok/s       llama.cpp: llama-bench's tg mean (batch 1), batched-bench's S_TG (batch 8); rocket_mpi: the decode
              report's tok/s (10 timed steps after 3 warm-up steps)
  GB/token    weights read per token at batch 1, each side's own count: llama.cpp from the GGUF's tensor sizes, every
              tensor but token_embd whole and each routed-expert tensor times top-k / experts (the 8 experts a token
              reaches); rocket_mpi the report's weight bytes per step at M=1 (the stack but the embedding, and the
              experts the step ran)
  run s       wall time of the whole process generating TOKENS tokens at batch 1 (model load included)
  prefill     tokens/s of one PREFILL-token prompt: llama-bench's pp; rocket_mpi PREFILL / the report's prefill seconds
  x b1, x b8  rocket_mpi's tok/s over the best llama.cpp row's at that batch

The converter and the presets' tokenizer: make-checkpoint's tokenizer is a byte-level BPE (GPT-2's pre-tokenizer
regex) trained on a fixed paragraph, with [gMASK], <sop>, <|system|>, <|user|>, <|assistant|> appended as special
tokens. The converter's GLM vocabulary also looks up <|endoftext|> and <|observation|>: WORK/hf/tokenizer.json is the
checkpoint's with those appended after the existing ids (which stay as they are). The converter names the
pre-tokenizer from a hash of the tokenizer's ids for a fixed text, and knows only the hashes of published
tokenizers; the script runs it (`bench_llamacpp.py convert ...`) with TextModel.get_vocab_base_pre replaced, at run
time, by one returning "gpt-2": llama.cpp's GPT-2 regex, the one this tokenizer's ByteLevel pre-tokenizer applies.
Nothing in the llama.cpp tree is changed on disk.

Usage (GPU machine, from the repository root with the extension built in place; --llama holds llama.cpp's source
as benchmarks/llamacpp_prepare.sh leaves it, its wheels/ beside it):
  PYTHONPATH=$PWD python3 benchmarks/bench_llamacpp.py --llama .llamacpp/llama.cpp --work .llamacpp/work --build \
      --out FILE.json
  (or in parts: --build --steps weights, then --steps gguf,llama, then --steps rocket; the table shows every
  measurement of the same settings kept in WORK/results/results.json)
  Where the machine is given back between calls and one call cannot hold the build and every step (the GPU machine
  of this project: build 5-8 minutes, 10 minutes a call), build and archive in one call, bring the parts back, and
  carry them with the converter alone (llamacpp_prepare.sh's conv/, 2 MB) into a call that runs every step:
  PYTHONPATH=$PWD python3 benchmarks/bench_llamacpp.py --llama .llamacpp/llama.cpp --work .llamacpp/work --build \
      --steps "" --archive $OUT      (parts llama-build-cuda.tar.xz.00, .01, ...; back here into .llamacpp/build)
  PYTHONPATH=$PWD python3 benchmarks/bench_llamacpp.py --llama .llamacpp/conv --work .llamacpp/work \
      --unpack .llamacpp/build --out FILE.json      (LD_LIBRARY_PATH: bin/, the Python's nvidia-* libraries, the toolkit)
  Or build the same archive where nvcc exists but no GPU (no GPU time spent on it): benchmarks/llamacpp_build_cuda.sh
  .llamacpp (cuBLAS from PyPI, a libcuda stub; .llamacpp/build as above).
CPU check of the pipeline (numbers mean nothing):
  python benchmarks/bench_llamacpp.py --llama DIR --work DIR --build --cpu --preset default --layers 3 \
      --tokens 8 --prefill 64
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import io
import json
import lzma
import os
import platform
import random
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-completion")
STEPS = ("weights", "gguf", "llama", "rocket")
# special tokens the converter's GLM vocabulary (conversion/base.py _set_vocab_glm) looks up, beside the chat markers
GLM_SPECIAL_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|endoftext|>",
                      "<|observation|>")
PRE_TOKENIZER = "gpt-2"  # llama.cpp's name of GPT-2's pre-tokenizer regex (src/llama-vocab.cpp)
ROCKET_VARIANTS = (("BF16", "bf16"), ("NVFP4 experts (:nvfp4)", "nvfp4"), ("NVFP4 all (:nvfp4-all)", "nvfp4-all"),
                   ("NVFP4 all and lm_head (:nvfp4-head)", "nvfp4-head"))
LLAMA_VARIANTS = (("BF16", "bf16"), ("Q4_K_M", "q4_k_m"))


class StepFailed(Exception):
    pass


class Runner:
    """Runs each command with a timeout, keeps its output in WORK/logs/START-TIME, its command line for the report."""

    def __init__(self, work: Path, timeout: float):
        self.logs = work / "logs" / time.strftime("%Y%m%d-%H%M%S")
        self.logs.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout
        self.commands: list[tuple[str, str]] = []  # (step, command line)

    def __call__(self, step: str, cmd: list, env: dict | None = None,
                 timeout: float | None = None) -> tuple[subprocess.CompletedProcess, float]:
        """-> (the finished process, its wall seconds). Raises StepFailed naming the step and the command, with the
        tail of its stderr."""
        cmd = [str(c) for c in cmd]
        line = shlex.join(cmd)
        self.commands.append((step, line))
        log = self.logs / f"{len(self.commands):02d}-{step}.log"
        print(f"== {step}: {line}", flush=True)
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL,
                               timeout=timeout or self.timeout)
        except OSError as e:
            raise StepFailed(f"step {step}: cannot run {line}: {e}") from None
        except subprocess.TimeoutExpired as e:
            out = _text(e.stdout) + _text(e.stderr)
            log.write_text(out)
            raise StepFailed(f"step {step}: timed out after {e.timeout:.0f} s: {line}\n{_tail(out)}\n(log: {log})")
        wall = time.perf_counter() - t0
        log.write_text(f"$ {line}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}")
        if p.returncode != 0:
            raise StepFailed(f"step {step}: exit {p.returncode}: {line}\n{_tail(p.stderr or p.stdout)}\n(log: {log})")
        return p, wall

    def lines(self, step: str) -> list[str]:
        return [line for s, line in self.commands if s == step]


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _tail(text: str, n: int = 25) -> str:
    return "\n".join("    " + s for s in text.rstrip().splitlines()[-n:])


# -- build ------------------------------------------------------------------------------------------------------

def build(args, run: Runner, build_dir: Path) -> None:
    cmake = ["cmake", "-S", args.llama, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
             f"-DGGML_CUDA={'OFF' if args.cpu else 'ON'}", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
    if not args.cpu and not any(a.startswith("-DCMAKE_CUDA_ARCHITECTURES=") for a in args.cmake_arg):
        cmake.append("-DCMAKE_CUDA_ARCHITECTURES=90")
    cmake += args.cmake_arg
    toolkit = {k: os.environ[k] for k in ("CUDAToolkit_ROOT", "CUDACXX") if k in os.environ}
    if toolkit:  # the toolkit the configure found (llamacpp_build_cuda.sh's, on a machine without a GPU)
        run.commands.append(("build", "(environment) " + " ".join(f"{k}={v}" for k, v in toolkit.items())))
    run("build", cmake, timeout=args.build_timeout)
    run("build", ["cmake", "--build", build_dir, "-j", args.jobs, "--target", *TARGETS], timeout=args.build_timeout)


# A build made in one call of a machine that is given back between calls (the GPU machine: build 5-8 minutes, then
# the weights, the GGUFs and both benchmarks do not fit the same call) travels to the next call as an archive: the
# tools and the shared libraries of the build's bin/, xz-compressed, in parts of at most ARCHIVE_PART bytes (the
# device tool brings back files of at most 16 MiB). The binaries find their libraries through the build's absolute
# RPATH, so --work must be the same path in both calls; LD_LIBRARY_PATH is set to bin/ as well.
ARCHIVE_PART = 15 << 20
ARCHIVE_COMMANDS = "build-commands.txt"  # in the archive: the configure and build commands that made it


def archive_name(cpu: bool) -> str:
    return f"llama-build-{'cpu' if cpu else 'cuda'}.tar.xz"


def archive_build(bins: Path, dest: Path, name: str, commands: list[str]) -> list[Path]:
    """bins' tools (TARGETS) and shared libraries, and the commands that built them, -> dest/NAME.00, .01, ... (the
    parts, in order)."""
    missing = [t for t in TARGETS if not (bins / t).is_file()]
    if missing:
        raise StepFailed(f"--archive: {', '.join(missing)} not built in {bins}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for f in sorted(bins.iterdir()):
            if f.name in TARGETS or ".so" in f.name:
                tar.add(f, arcname=f.name)
        text = "".join(c + "\n" for c in commands).encode()
        info = tarfile.TarInfo(ARCHIVE_COMMANDS)
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(f"{name}.[0-9][0-9]"):
        old.unlink()
    data = buf.getvalue()
    parts = []
    for i in range(0, max(len(data), 1), ARCHIVE_PART):
        part = dest / f"{name}.{i // ARCHIVE_PART:02d}"
        part.write_bytes(data[i:i + ARCHIVE_PART])
        parts.append(part)
    return parts


def cuda_library_dirs() -> list[str]:
    """Folders that hold the CUDA runtime and cuBLAS here: those of the Python's nvidia-* wheels (torch's CUDA
    libraries, e.g. nvidia/cu13/lib), then the toolkit's (CUDA_HOME, /usr/local/cuda). A build archived on another
    machine (llamacpp_build_cuda.sh, without a GPU) carries no RPATH to them."""
    dirs = []
    for entry in sys.path:
        root = Path(entry or ".") / "nvidia"
        if root.is_dir():
            dirs += [str(d) for d in sorted(root.glob("*/lib")) if any(d.glob("libcu*.so*"))]
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and Path(home, "lib64").is_dir():
            dirs.append(str(Path(home, "lib64")))
    return list(dict.fromkeys(dirs))


def missing_libraries(tool: Path) -> list[str]:
    """The shared libraries ldd cannot find for tool ([] where ldd is missing)."""
    try:
        out = subprocess.run(["ldd", str(tool)], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split()[0] for line in out.splitlines() if "not found" in line]


def unpack_build(src: Path, name: str, bins: Path) -> tuple[list[Path], list[str]]:
    """src/NAME.NN parts (archive_build's) -> bins; -> (the parts read, the commands that built them). Raises
    StepFailed naming what is missing."""
    parts = sorted(src.glob(f"{name}.[0-9][0-9]"))
    if not parts:
        raise StepFailed(f"--unpack {src}: no {name}.00, .01, ... there (written by --archive)")
    numbers = [int(p.name[-2:]) for p in parts]
    if numbers != list(range(len(parts))):
        raise StepFailed(f"--unpack {src}: parts {numbers} of {name}, expected 00 to {len(parts) - 1:02d} in a row")
    bins.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts)), mode="r:xz") as tar:
            tar.extractall(bins, filter="data")
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as e:
        raise StepFailed(f"--unpack {src}: {name} parts do not unpack: {e}") from None
    missing = [t for t in TARGETS if not (bins / t).is_file()]
    if missing:
        raise StepFailed(f"--unpack {src}: the archive has no {', '.join(missing)}")
    made = bins / ARCHIVE_COMMANDS
    return parts, made.read_text().splitlines() if made.is_file() else []


# -- weights ----------------------------------------------------------------------------------------------------

def preset_config(preset: str, layers: int) -> dict:
    from rocket_mpi.checkpoint import make
    if make._family_for_preset(preset) is not None or preset not in make.PRESETS:
        raise StepFailed(f"step weights: --preset {preset}: llama.cpp's converter takes the GLM-4.x presets "
                         f"({', '.join(make.PRESETS)})")
    cfg = make.config_dict(preset)
    if not cfg["first_k_dense_replace"] < layers <= cfg["num_hidden_layers"]:
        raise StepFailed(f"step weights: --layers {layers}: {preset} has {cfg['num_hidden_layers']} layers, the first "
                         f"{cfg['first_k_dense_replace']} dense; keep at least one MoE layer")
    cfg["num_hidden_layers"] = layers
    return cfg


def write_weights(args, ckpt: dict[str, Path], hf: Path) -> None:
    """The BF16 tensors drawn once; the three checkpoints written from them (make.py's writer and quantiser)."""
    from rocket_mpi.checkpoint import make
    from rocket_mpi.checkpoint.specs import make_tensor, tensor_specs
    cfg = preset_config(args.preset, args.layers)
    specs = list(tensor_specs(cfg))
    print(f"== weights: drawing {args.preset} cut to {args.layers} layers, seed {args.seed} "
          f"({sum(2 * _numel(s) for _, s, _ in specs) / 1e9:.2f} GB in BF16)", flush=True)
    # each tensor has its own generator: drawing them on several threads gives the same values
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        drawn = pool.map(lambda s: (s[0], make_tensor(args.seed, s[0], s[1], s[2])), specs)
        tensors = dict(drawn)
    for d in ckpt.values():
        shutil.rmtree(d, ignore_errors=True)
    make.write_checkpoint(str(ckpt["bf16"]), cfg, tensors, None)
    # :nvfp4 quantises the routed experts; :nvfp4-all also the stack, the routed experts the same way (one module's
    # quantisation depends on that module alone), so they are quantised once
    experts_q = make.quantize_tensors(tensors, cfg, quant_all=False)
    make.write_checkpoint(str(ckpt["nvfp4"]), cfg, experts_q, make.exclude_patterns(cfg, False))
    stack = {n: t for n, t in tensors.items() if ".mlp.experts." not in n}
    all_q = {**{n: t for n, t in experts_q.items() if ".mlp.experts." in n}, **make.quantize_tensors(stack, cfg, True)}
    make.write_checkpoint(str(ckpt["nvfp4-all"]), cfg, all_q, make.exclude_patterns(cfg, True))
    # :nvfp4-head: the same, with lm_head's weight replaced by its NVFP4 parts
    head_q = {**all_q, **make.quantize_tensors({"lm_head.weight": tensors["lm_head.weight"]}, cfg, True, head=True)}
    make.write_checkpoint(str(ckpt["nvfp4-head"]), cfg, head_q, make.exclude_patterns(cfg, True, head=True))
    converter_dir(ckpt["bf16"], hf, cfg["vocab_size"])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def converter_dir(src: Path, hf: Path, vocab_size: int) -> None:
    """WORK/hf: the BF16 checkpoint's weights and config linked, its tokenizer with the GLM special tokens the
    converter looks up appended (the checkpoint's own tokenizer.json stays as make-checkpoint wrote it)."""
    from tokenizers import AddedToken, Tokenizer
    shutil.rmtree(hf, ignore_errors=True)
    hf.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer_config.json", "generation_config.json"):
        (hf / name).symlink_to(src.resolve() / name)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    missing = [t for t in GLM_SPECIAL_TOKENS if t not in vocab]
    if tok.get_vocab_size(with_added_tokens=True) + len(missing) > vocab_size:
        raise StepFailed(f"step weights: the tokenizer has no room below vocab_size {vocab_size} for {missing}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    tok.save(str(hf / "tokenizer.json"))


# -- gguf -------------------------------------------------------------------------------------------------------

def python_env(args, run: Runner, work: Path) -> dict:
    """The environment the converter (this Python) runs in: its imports beyond torch, numpy and safetensors
    (transformers; yaml and tqdm for gguf-py) checked, yaml and tqdm installed from --wheels into WORK/pydeps where
    they are missing."""
    import importlib.util
    env = dict(os.environ)
    missing = [m for m in ("yaml", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        pydeps = work / "pydeps"
        run("gguf", [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", args.wheels, "--target",
                     pydeps, *[{"yaml": "pyyaml"}.get(m, m) for m in missing]])
        env["PYTHONPATH"] = os.pathsep.join([str(pydeps), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    try:
        import transformers  # noqa: F401  (the converter reads the config and the vocabulary through it)
    except ImportError:
        raise StepFailed("step gguf: the converter needs transformers (AutoConfig, AutoTokenizer)") from None
    return env


def make_ggufs(args, run: Runner, work: Path, hf: Path, gguf: dict[str, Path], bins: Path) -> None:
    env = python_env(args, run, work)
    tmp = gguf["bf16"].with_suffix(".part")
    run("gguf", [sys.executable, Path(__file__).resolve(), "convert", args.llama, PRE_TOKENIZER, hf,
                 "--outtype", "bf16", "--outfile", tmp], env=env)
    tmp.replace(gguf["bf16"])
    tmp = gguf["q4_k_m"].with_suffix(".part")
    run("gguf", [bins / "llama-quantize", gguf["bf16"], tmp, "Q4_K_M", str(os.cpu_count())])
    tmp.replace(gguf["q4_k_m"])


def gguf_bytes_per_token(path: Path, llama: Path) -> float:
    """Weight bytes a batch-1 token reads: every tensor but token_embd, routed-expert tensors (the *_exps) scaled by
    top-k / experts."""
    if str(llama / "gguf-py") not in sys.path:
        sys.path.insert(0, str(llama / "gguf-py"))
    import gguf
    r = gguf.GGUFReader(str(path))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    top_k = int(r.fields[f"{arch}.expert_used_count"].parts[-1][0])
    n_exp = int(r.fields[f"{arch}.expert_count"].parts[-1][0])
    total = 0.0
    for t in r.tensors:
        if t.name == "token_embd.weight":
            continue
        total += int(t.n_bytes) * (top_k / n_exp if "_exps." in t.name else 1.0)
    return total


# -- llama.cpp --------------------------------------------------------------------------------------------------

def bench_llama(args, run: Runner, gguf: dict[str, Path], bins: Path) -> dict:
    out = {}
    ngl = ["-ngl", "99"]
    for _, key in LLAMA_VARIANTS:
        m = gguf[key]
        res = {"gguf": str(m), "gguf_bytes": m.stat().st_size,
               "bytes_per_token": gguf_bytes_per_token(m, args.llama)}
        p, _ = run("llama", [bins / "llama-bench", "-m", m, "-p", "0", "-n", args.tokens, "-fa", "1", *ngl,
                             "-o", "json"])
        tg = [r for r in json.loads(p.stdout) if r["n_gen"] == args.tokens and r["n_prompt"] == 0]
        res["b1_tok_s"] = tg[0]["avg_ts"]
        p, _ = run("llama", [bins / "llama-bench", "-m", m, "-p", args.prefill, "-n", "0", "-fa", "1", *ngl,
                             "-b", max(args.prefill, 2048), "-ub", args.prefill_ubatch, "-o", "json"])
        pp = [r for r in json.loads(p.stdout) if r["n_prompt"] == args.prefill and r["n_gen"] == 0]
        best = max(pp, key=lambda r: r["avg_ts"])
        res["prefill_tok_s"], res["prefill_ubatch"] = best["avg_ts"], best["n_ubatch"]
        res["bN_tok_s"] = batched_bench(args, run, m, bins)
        ctx = _round256(args.tokens + 64)
        p, res["run_s"] = run("llama", [bins / "llama-completion", "-m", m, "-c", ctx, "-p", "Hello, world!",
                                        "-n", args.tokens, "--ignore-eos", "-no-cnv", "--temp", "0", "-fa", "on", *ngl])
        # the first token comes from the prompt's evaluation, each other one from one eval run; the count can be lost
        # with the logger's last lines (batched_bench), then it stays unchecked
        runs = re.findall(r"\beval time =.*?/\s*(\d+) runs", p.stderr)
        if runs and int(runs[-1]) != args.tokens - 1:
            raise StepFailed(f"step llama: llama-completion ran {runs[-1]} evals, not {args.tokens - 1}:\n"
                             f"{_tail(p.stderr)}")
        res["run_evals_checked"] = bool(runs)
        out[key] = res
    return out


def batched_bench(args, run: Runner, m: Path, bins: Path, attempts: int = 6) -> float:
    """llama-batched-bench's S_TG (generated tokens/s over all streams) at --batch streams. Its rows go through
    llama.cpp's asynchronous logger, which this version does not flush before exiting: a run can end with its row
    unprinted, and is then run again."""
    # each stream gets n_ctx / streams cells rounded to 256 (a batch that does not fit is skipped silently)
    ctx = args.batch * _round256(args.npp + args.tokens)
    for _ in range(attempts):
        p, _ = run("llama", [bins / "llama-batched-bench", "-m", m, "-c", ctx, "-npp", args.npp, "-ntg", args.tokens,
                             "-npl", args.batch, "-fa", "on", "-ngl", "99", "--output-format", "jsonl"])
        rows = [json.loads(s) for s in p.stdout.splitlines() if s.startswith("{")]
        bn = [r for r in rows if r.get("pl") == args.batch and r.get("tg") == args.tokens]
        if bn:
            return bn[0]["speed_tg"]
    raise StepFailed(f"step llama: llama-batched-bench printed no row for batch {args.batch} in {attempts} runs:\n"
                     f"{_tail(p.stdout + p.stderr)}")


def _round256(n: int) -> int:
    return -(-n // 256) * 256


# -- rocket_mpi -------------------------------------------------------------------------------------------------

def bench_rocket(args, run: Runner, work: Path, ckpt: dict[str, Path], keep) -> None:
    """Each ROCKET_VARIANTS checkpoint: batch 1, batch BATCH and the prefill; keep(key, row) after each."""
    cfg = json.loads((ckpt["bf16"] / "config.json").read_text())
    rng = random.Random(args.prefill)
    prompt = work / f"prompt-{args.prefill}.json"
    prompt.write_text(json.dumps([[rng.randrange(2, cfg["vocab_size"]) for _ in range(args.prefill)]]))
    device = ["--device", "cpu"] if args.cpu else ["--device", "cuda", "--decode-path", "graph"]
    res_dir = work / "results"

    def decode(key: str, name: str, *flags) -> dict:
        """One decode process; -> the last run of its --out document, with the process's wall seconds."""
        path = res_dir / f"rocket-{key}-{name}.json"
        _, wall = run("rocket", [sys.executable, "-m", "rocket_mpi", "decode", "--checkpoint", ckpt[key], *device,
                                 *flags, "--out", path])
        doc = json.loads(path.read_text())
        r = doc["runs"][-1]
        want = 1 if name == "prefill" else args.tokens
        if any(len(t) != want for t in r["tokens"]):
            raise StepFailed(f"step rocket: {path}: streams of {[len(t) for t in r['tokens']]} tokens, not {want}")
        return dict(r, wall_s=wall, load_s=doc["load"][0]["load_s"], parts_s=doc["load"][0].get("wall_s"))

    for _, key in ROCKET_VARIANTS:
        b1 = decode(key, "b1", "--streams", "1", "--tokens", args.tokens, "--ignore-eos")
        bn = decode(key, f"b{args.batch}", "--streams", args.batch, "--tokens", args.tokens, "--ignore-eos")
        pre = decode(key, "prefill", "--prompts", prompt, "--sweep", "1,1", "--tokens", "1")
        s1, sn = b1["per_rank"][0], bn["per_rank"][0]
        keep(key, {"checkpoint": str(ckpt[key]), "b1_tok_s": s1["tok_per_s"], "bN_tok_s": sn["tok_per_s"],
                    "bytes_per_token": s1["weight_bytes_per_step"], "run_s": b1["wall_s"],
                    # where the batch-1 run's wall time went, as the decode's report splits it (load[0].wall_s:
                    # the process's start, set-up, load, fabric, bandwidth probes, steps, captures); what is left is
                    # the report and the process's exit
                    "run_parts_s": b1["parts_s"] or {"load": b1["load_s"], "prefill and decode steps":
                                                     s1["prefill_s"] + s1["decode_s"]},
                    "prefill_tok_s": pre["prefill"]["tokens"] / pre["per_rank"][0]["prefill_s"],
                    "paths": [b1["path"], bn["path"]], "notes": [n for n in (b1["note"], bn["note"]) if n]})


# -- the table --------------------------------------------------------------------------------------------------

def table(args, results: dict) -> tuple[str, list[dict]]:
    llama, rocket = results.get("llama", {}), results.get("rocket", {})
    rows = [dict(engine="llama.cpp", weights=label, **llama[k]) for label, k in LLAMA_VARIANTS if k in llama]
    rows += [dict(engine="rocket_mpi", weights=label, **rocket[k]) for label, k in ROCKET_VARIANTS if k in rocket]
    best = {b: max((r[f"{b}_tok_s"] for r in rows if r["engine"] == "llama.cpp"), default=None) for b in ("b1", "bN")}
    for r in rows:
        if r["engine"] == "rocket_mpi":
            for b in ("b1", "bN"):
                r[f"x_{b}"] = r[f"{b}_tok_s"] / best[b] if best[b] else None
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lines = [f"| engine | weights | batch 1 tok/s | batch {args.batch} tok/s | GB/token at batch 1 | "
             f"{args.tokens}-token run s | prefill {args.prefill} tok/s | x best llama.cpp b1 | b{args.batch} |",
             "|:--|:--|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['weights']} | {r['b1_tok_s']:.1f} | {r['bN_tok_s']:.1f} | "
                     f"{r['bytes_per_token'] / 1e9:.3f} | {r['run_s']:.2f} | {r['prefill_tok_s']:.0f} | "
                     f"{f(r.get('x_b1'), '.2f')} | {f(r.get('x_bN'), '.2f')} |")
    parts = [r for r in rows if r.get("run_parts_s")]
    if parts:
        names = list(dict.fromkeys(k for r in parts for k in r["run_parts_s"]))
        lines += ["", f"rocket_mpi's {args.tokens}-token run at batch 1, seconds:", "",
                  "| weights | whole run | " + " | ".join(names) + " | report and exit |",
                  "|:--|--:|" + "--:|" * (len(names) + 1)]
        for r in parts:
            p = r["run_parts_s"]
            lines.append(f"| {r['weights']} | {r['run_s']:.2f} | " + " | ".join(f"{p.get(k, 0.0):.2f}" for k in names)
                         + f" | {r['run_s'] - sum(p.values()):.2f} |")
    # rocket_mpi's decode path as it ran (graph on a GPU), and why a graph did not capture if it did not
    for r in rows:
        if r["engine"] == "rocket_mpi" and (r["notes"] or set(r["paths"]) != {"host" if args.cpu else "graph"}):
            lines.append(f"\nrocket_mpi {r['weights']}: decode paths {r['paths']} {'; '.join(r['notes'])}".rstrip())
    return "\n".join(lines), rows


def machine(cpu: bool) -> str:
    if not cpu and shutil.which("nvidia-smi"):
        p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=60)
        if p.returncode == 0 and p.stdout.strip():
            return ", ".join(p.stdout.split("\n")[:1]).strip() + f" ({platform.node()})"
    model = next((s.split(":", 1)[1].strip() for s in Path("/proc/cpuinfo").read_text().splitlines()
                  if s.startswith("model name")), platform.processor())
    return f"{model}, {os.cpu_count()} CPUs ({platform.node()})"


def commit() -> str:
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")  # read the tree without refreshing the index
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True, timeout=60, env=env).stdout.strip()
    return (head or "unknown") + ("+dirty" if dirty else "")


def convert(llama: str, pre: str, argv: list[str]) -> None:
    """`bench_llamacpp.py convert LLAMA_DIR PRE ARGS...`: LLAMA_DIR/convert_hf_to_gguf.py ARGS with the
    pre-tokenizer's name PRE instead of the one the converter looks up by hash (the module docstring says why)."""
    import runpy
    sys.path[:0] = [llama, os.path.join(llama, "gguf-py")]
    import conversion.base
    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    sys.argv = [os.path.join(llama, "convert_hf_to_gguf.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


# -- main -------------------------------------------------------------------------------------------------------

def stamp_ok(path: Path, spec: dict) -> bool:
    return path.exists() and json.loads(path.read_text()) == spec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--llama", required=True, type=Path, help="llama.cpp's source (benchmarks/llamacpp_prepare.sh)")
    ap.add_argument("--work", required=True, type=Path, help="checkpoints, GGUFs, builds, logs and results")
    ap.add_argument("--wheels", type=Path, help="the converter's fallback wheels; unset: wheels/ beside --llama")
    ap.add_argument("--build", action="store_true", help="configure and build llama.cpp's tools first")
    ap.add_argument("--archive", type=Path, metavar="DIR",
                    help="after the build (or with the one WORK holds): its tools and libraries as DIR/"
                         f"{archive_name(False)}.NN, parts of at most {ARCHIVE_PART >> 20} MiB")
    ap.add_argument("--unpack", type=Path, metavar="DIR",
                    help="before the steps: the tools and libraries from DIR's parts (--archive), instead of --build")
    ap.add_argument("--cpu", action="store_true", help="CPU only: llama.cpp without CUDA, rocket_mpi --device cpu")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="build jobs")
    ap.add_argument("--cmake-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for the configure (repeatable)")
    ap.add_argument("--steps", default=",".join(STEPS),
                    help=f"comma-separated, of {', '.join(STEPS)} (empty: none, e.g. with --build alone)")
    ap.add_argument("--preset", default="air8", help="a GLM-4.x make-checkpoint preset")
    ap.add_argument("--layers", type=int, default=3, help="the preset cut to its first LAYERS layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per stream")
    ap.add_argument("--batch", type=int, default=8, help="streams of the batched run")
    ap.add_argument("--npp", type=int, default=8, help="prompt tokens per stream of llama-batched-bench")
    ap.add_argument("--prefill", type=int, default=4096, help="tokens of the prefill prompt")
    ap.add_argument("--prefill-ubatch", default="512,4096",
                    help="llama-bench -ub values tried for the prefill (the best counts)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds any one command may take")
    ap.add_argument("--build-timeout", type=float, default=3600, help="seconds the configure or the build may take")
    ap.add_argument("--out", type=Path, help="JSON with the table's rows, the commands, date, commit and machine")
    args = ap.parse_args()
    steps = [s for s in args.steps.split(",") if s]
    if bad := [s for s in steps if s not in STEPS]:
        ap.error(f"--steps: unknown {bad} (choose from {', '.join(STEPS)})")
    args.llama = args.llama.resolve()
    args.wheels = (args.wheels or args.llama.parent / "wheels").resolve()
    if not (args.llama / "convert_hf_to_gguf.py").exists():
        ap.error(f"--llama {args.llama}: no convert_hf_to_gguf.py (run benchmarks/llamacpp_prepare.sh)")
    if args.build and not (args.llama / "CMakeLists.txt").exists():
        ap.error(f"--build: {args.llama} holds no CMakeLists.txt (the converter alone? --unpack a build instead)")
    if args.build and args.unpack:
        ap.error("--build and --unpack: one or the other")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    work = args.work.resolve()
    (work / "results").mkdir(parents=True, exist_ok=True)
    build_dir = work / ("build-cpu" if args.cpu else "build-cuda")
    bins = build_dir / "bin"
    ckpt = {k: work / "ckpt" / k for _, k in ROCKET_VARIANTS}
    hf = work / "hf"
    gguf = {k: work / "gguf" / f"model-{k}.gguf" for _, k in LLAMA_VARIANTS}
    run = Runner(work, args.timeout)
    weights_spec = {"preset": args.preset, "layers": args.layers, "seed": args.seed}
    spec = {**weights_spec, "cpu": args.cpu, "tokens": args.tokens, "batch": args.batch, "npp": args.npp,
            "prefill": args.prefill, "prefill_ubatch": args.prefill_ubatch}
    weights_stamp, gguf_stamp = work / "ckpt" / "weights.json", work / "gguf" / "weights.json"
    # the measurements so far of these settings (the steps may run in separate calls), and each step's commands
    results_file = work / "results" / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    if results.get("spec") != spec:
        results = {"spec": spec, "commands": {}}
    if args.unpack:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(bins), os.environ.get("LD_LIBRARY_PATH"), *([] if args.cpu else cuda_library_dirs())]))
    try:
        if args.unpack:
            parts, made = unpack_build(args.unpack.resolve(), archive_name(args.cpu), bins)
            print(f"== build: unpacked {len(parts)} parts from {args.unpack} into {bins}", flush=True)
            if lost := missing_libraries(bins / TARGETS[0]):
                raise StepFailed(f"--unpack: {TARGETS[0]} cannot find {', '.join(lost)} (LD_LIBRARY_PATH "
                                 f"{os.environ['LD_LIBRARY_PATH']})")
            results["commands"]["build"] = [*made, f"(this script) --unpack {args.unpack}: that build, archived"]
        if args.build:
            build(args, run, build_dir)
            results["commands"]["build"] = run.lines("build")
        if args.archive:
            parts = archive_build(bins, args.archive.resolve(), archive_name(args.cpu),
                                  results["commands"].get("build", []))
            print(f"== build: archived into {', '.join(p.name for p in parts)} in {args.archive} "
                  f"({sum(p.stat().st_size for p in parts) / 2**20:.1f} MiB)", flush=True)
        if "weights" in steps and not stamp_ok(weights_stamp, weights_spec):
            weights_stamp.unlink(missing_ok=True)
            write_weights(args, ckpt, hf)
            weights_stamp.write_text(json.dumps(weights_spec))
            results["commands"]["weights"] = [
                f"(this script, in process) rocket_mpi.checkpoint.make: preset {args.preset} cut to {args.layers} "
                f"layers, seed {args.seed} -> {work / 'ckpt'}/{{bf16,nvfp4,nvfp4-all,nvfp4-head}} and {hf}"]
        if "gguf" in steps and not stamp_ok(gguf_stamp, weights_spec):
            if not stamp_ok(weights_stamp, weights_spec):
                raise StepFailed("step gguf: no checkpoint of these settings in --work (run the weights step)")
            gguf_stamp.parent.mkdir(parents=True, exist_ok=True)
            gguf_stamp.unlink(missing_ok=True)
            make_ggufs(args, run, work, hf, gguf, bins)
            gguf_stamp.write_text(json.dumps(weights_spec))
            results["commands"]["gguf"] = run.lines("gguf")
        if "llama" in steps:
            if not stamp_ok(gguf_stamp, weights_spec):
                raise StepFailed("step llama: no GGUFs of these settings in --work (run the gguf step)")
            results["llama"] = bench_llama(args, run, gguf, bins)
            results["commands"]["llama"] = run.lines("llama")
        if "rocket" in steps:
            if not stamp_ok(weights_stamp, weights_spec):
                raise StepFailed("step rocket: no checkpoint of these settings in --work (run the weights step)")
            results["rocket"] = {}

            def keep(key: str, row: dict) -> None:  # each variant's row kept as it comes (a call may run out)
                results["rocket"][key] = row
                results["commands"]["rocket"] = run.lines("rocket")
                results_file.write_text(json.dumps(results, indent=1))
            bench_rocket(args, run, work, ckpt, keep)
    except StepFailed as e:
        print(f"\nFAILED {e}", file=sys.stderr)
        return 1
    finally:
        results_file.write_text(json.dumps(results, indent=1))
    md, rows = table(args, results)
    date = datetime.date.today().isoformat()
    where = machine(args.cpu)
    rev = commit()
    commands = [c for step in ("build", *STEPS) for c in results["commands"].get(step, [])]
    print(f"\n{args.preset} cut to {args.layers} layers, seed {args.seed}; {date}, commit {rev}, {where}\n")
    print(md)
    print(f"\ncommands (logs in {run.logs}):")
    for c in commands:
        print(f"  {c}")
    if args.out:
        args.out.write_text(json.dumps({"date": date, "commit": rev, "machine": where,
                                        "command": shlex.join(sys.argv), "settings": spec, "rows": rows,
                                        "commands": commands}, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["convert"]:
        convert(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        sys.exit(main())
