"""The parity gate: the N-rank split decodes exactly the one-rank tokens, for 2 and 3 ranks, both CPU
fabrics, contiguous and scrambled placements, BF16 and NVFP4 experts."""
import json
import random

import pytest

from conftest import rocket

TOKENS = "8"


def scrambled(path, n_experts, ranks, seed):
    rng = random.Random(seed)
    owners = [e % ranks for e in range(n_experts)]
    rng.shuffle(owners)
    owners[0] = ranks - 1  # expert 0 not on rank 0: the canonical order is not (expert, token) here
    path.write_text(json.dumps({"default": owners}))
    return str(path)


# 2 ranks: every fabric x placement x experts; 3 ranks: the half of them in which each fabric meets each placement and
# each experts' type once (the quant is fabric xor placement), so 3 ranks still run on both fabrics, placements, types
FIRES = [(2, f, p, q) for f in ("shm", "mpi") for p in ("contiguous", "scrambled") for q in ("bf16", "nvfp4")] + \
        [(3, f, p, ("bf16", "nvfp4")[(f == "mpi") ^ (p == "scrambled")])
         for f in ("shm", "mpi") for p in ("contiguous", "scrambled")]


@pytest.mark.parametrize("ranks,fabric,placement,quant", FIRES)
def test_static_fire_passes(ranks, fabric, placement, quant, tiny_ckpt, tiny_nvfp4_ckpt, tmp_path):
    ckpt = tiny_ckpt if quant == "bf16" else tiny_nvfp4_ckpt
    extra = []
    if placement == "scrambled":
        extra = ["--placement", scrambled(tmp_path / "pl.json", 16, ranks, seed=ranks)]
    r = rocket("static-fire", "--checkpoint", ckpt, "--ranks", str(ranks), "--sweep", "1,8", "--tokens", TOKENS,
               "--fabric", fabric, "--fabric-timeout", "20", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"STATIC FIRE PASS: 0/8 streams mismatched ({ranks} ranks, fabric {fabric}" in r.stdout
    assert_really_split(r.stdout, ranks)


def assert_really_split(stdout: str, ranks: int) -> None:
    """The split's per-rank table at M=8: a row per rank, each rank owned rows."""
    rows = [ln.split() for ln in stdout.splitlines()]
    rows = [c for c in rows if len(c) == 11 and c[0].isdigit() and c[1] == "8"]
    assert sorted(int(c[0]) for c in rows) == list(range(ranks)), stdout
    assert all(float(c[7]) > 0 for c in rows), stdout


@pytest.mark.parametrize("ranks,fabric,placement,ckpt_name", [(2, "shm", "contiguous", "tiny_ckpt"),
                                                               (3, "mpi", "scrambled", "tiny_nvfp4_ckpt"),
                                                               (3, "shm", "contiguous", "dsa_ckpt"),
                                                               (2, "mpi", "contiguous", "glm5_ckpt")])
def test_static_fire_fixed_shape_path(ranks, fabric, placement, ckpt_name, tmp_path, request):
    """--decode-path device on CPU: the GPU step's plan, slot layout and checksum through the torch
    references, rows through the CPU fabric at fixed offsets: the split still decodes the one-rank tokens.
    dsa_ckpt: GLM-5's architecture (MLA + DSA indexer over the step's span of the cache); glm5_ckpt:
    GLM-5.3-Flash's (KDA + MLA with the k-pool indexer). ROCKET_GRAPH_SPANS=4: the runs cross spans mid-run (the
    report names them), the reference and the split at the same steps. --prefill-chunk 16: M=8's 65 prompt tokens
    are prefilled in 5 forwards, cut the same on every rank."""
    ckpt = request.getfixturevalue(ckpt_name)
    extra = ["--placement", scrambled(tmp_path / "pl.json", 16, ranks, seed=5)] if placement == "scrambled" else []
    r = rocket("static-fire", "--checkpoint", ckpt, "--ranks", str(ranks), "--sweep", "1,8", "--tokens", TOKENS,
               "--fabric", fabric, "--fabric-timeout", "20", "--decode-path", "device", "--prefill-chunk", "16",
               *extra, env={"ROCKET_GRAPH_SPANS": "4"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "attention spans: 4 from step 1, 8 from step 2" in r.stdout, r.stdout
    assert "prefill: 65 prompt tokens in 5 forwards of at most 16 (--prefill-chunk)" in r.stdout, r.stdout
    assert f"STATIC FIRE PASS: 0/8 streams mismatched ({ranks} ranks, fabric {fabric}" in r.stdout
    assert "decode path device" in r.stdout
    assert_really_split(r.stdout, ranks)


def test_static_fire_nvfp4_all_stack():
    """`preset:tiny:nvfp4-all` (attention, dense MLP and shared experts NVFP4 too, as ModelOpt's all-Linears recipe):
    2 ranks over shm decode the one-rank tokens (the CPU dequantises the stack at load; a GPU holds it as stored,
    ops/stack.py, each rank with the same kernels)."""
    r = rocket("static-fire", "--checkpoint", "preset:tiny:nvfp4-all", "--ranks", "2", "--sweep", "1,8", "--tokens",
               TOKENS, "--fabric", "shm", "--fabric-timeout", "20")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "STATIC FIRE PASS: 0/8 streams mismatched (2 ranks, fabric shm" in r.stdout
    assert_really_split(r.stdout, 2)


def test_static_fire_catches_a_wrong_row(tiny_ckpt):
    """One corrupted row on rank 1 at step 2 must fail the gate, name the step and show the checksums."""
    r = rocket("static-fire", "--checkpoint", tiny_ckpt, "--ranks", "2", "--sweep", "8", "--tokens", TOKENS,
               "--fabric", "shm", env={"ROCKET_FAULT": "corrupt:rank=1,step=2"})
    assert r.returncode == 1, r.stdout + r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("STATIC FIRE")][-1]
    assert line.startswith("STATIC FIRE FAIL: "), line
    assert "step 2" in line and "row checksums at that step" in line and "rank1=" in line


def test_rows_that_differ_fail_the_gate_even_with_equal_tokens():
    """The row checksums are placement-independent, so the gate compares them too: one rank's checksum at one step
    differs -> FAIL naming the step and the rank, though every token matches."""
    from rocket_mpi.cli.static_fire import report
    run = {"streams": 2, "tokens": [[1, 2, 3], [4, 5, 6]], "row_checksums": {"0": ["a", "b", "c"]}}
    ref = {"fabric": "local", "runs": [run]}
    split = {"fabric": "shm", "runs": [dict(run, row_checksums={"0": ["a", "b", "c"], "1": ["a", "b", "c"]})]}
    assert report(ref, split, 2) == 0
    split["runs"][0]["row_checksums"]["1"][1] = "x"
    assert report(ref, split, 2) == 1


def test_the_gate_says_when_the_two_sides_took_different_paths(capsys):
    """--decode-path auto may put the reference on the host path (host memory short: experts read from the files) and
    the split on the graphed one: the report says so, with the way to compare one path with itself."""
    from rocket_mpi.cli.static_fire import report
    run = {"streams": 1, "tokens": [[1, 2]], "row_checksums": {"0": ["a", "b"]}, "path": "host"}
    ref = {"fabric": "local", "runs": [run]}
    split = {"fabric": "cuda-ipc", "runs": [dict(run, path="graph")]}
    assert report(ref, split, 2) == 0
    out = capsys.readouterr().out
    assert "note: at M=1 the reference decoded on the host path and the split on the graph path" in out
    report(ref, {"fabric": "cuda-ipc", "runs": [run]}, 2)
    assert "note:" not in capsys.readouterr().out


def test_uneven_contiguous_placement():
    from rocket_mpi.moe.placement import contiguous
    owners = contiguous(37, 3)
    assert [owners.count(r) for r in range(3)] == [13, 12, 12]
    assert owners == sorted(owners)


def test_placement_with_an_idle_rank(tiny_ckpt, tmp_path):
    """A rank that owns no expert still takes part (rings its doorbell with an empty block)."""
    p = tmp_path / "pl.json"
    p.write_text(json.dumps({"default": [0] * 8 + [2] * 8}))
    r = rocket("static-fire", "--checkpoint", tiny_ckpt, "--ranks", "3", "--sweep", "4", "--tokens", "4",
               "--fabric", "shm", "--placement", str(p))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "STATIC FIRE PASS: 0/4 streams mismatched" in r.stdout


@pytest.mark.parametrize("ranks,fabric", [(5, "mpi"), (8, "shm")])
def test_many_ranks_on_one_host(ranks, fabric, tiny_ckpt):
    """Up to 8 ranks (16 experts: 2 to 4 per rank), still the one-rank tokens."""
    r = rocket("static-fire", "--checkpoint", tiny_ckpt, "--ranks", str(ranks), "--sweep", "4", "--tokens", "4",
               "--fabric", fabric, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"STATIC FIRE PASS: 0/4 streams mismatched ({ranks} ranks" in r.stdout
