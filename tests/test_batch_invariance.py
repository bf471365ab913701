"""A stream's tokens must not depend on the other streams in its batch.

The same prompt decoded alone and in another slot of a batch whose other prompts are longer: its logits are
bitwise equal at every step, the prefill (step 0) included, for every model family. A decode step's attention
runs over the longest stream's span (positions past a stream's own masked), so the length of every row it scores
is set by the batch. The DSA indexers' top-k over those rows is where this broke: index scores are sums of ReLUs,
often exactly 0, and torch.topk broke such ties differently at different row lengths (dsa-tiny alone vs in a
batch of 8 differed from step 4 on). ops.topk_first breaks them toward the lower index, whatever the row's length.

The prompts are decoded well past index_topk, so the selection chooses: test_selection_chooses checks that, and
with torch.topk in place of ops.topk_first the dsa-tiny and glm5 two-head cases here fail. glm5-tiny's eight index
heads seldom score a pool exactly 0; the two-head variant (several pools, two of them chosen) has many ties.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import gpu
from rocket_mpi import ops
from rocket_mpi.checkpoint import make, make_glm5
from rocket_mpi.checkpoint.synthetic import SyntheticReader
from rocket_mpi.ops import select, topk_first
from rocket_mpi.runtime.engine import Engine
from rocket_mpi.runtime.prompts import default_prompts
from rocket_mpi.runtime.sampling import Sampling, Stop

pytestmark = pytest.mark.usefixtures("one_thread")

# glm5-tiny with two index heads: a pool's score is 0 wherever both heads' ReLUs are, so ties are common
GLM5_IX2 = {**make_glm5.PRESETS["glm5-tiny"], "index_n_heads": 2}

# (preset, its config or None for the stock one, the target's prompt, the batch's other prompts, the target's slot,
# tokens). default_prompts(8) has lengths 3, 8, 13, 7, 12, 6, 11, 5.
CASES = {
    "tiny": ("tiny", None, 5, [2, 4, 6], 2, 8),
    "default": ("default", None, 5, [2, 4], 1, 6),
    "dsa-tiny": ("dsa-tiny", None, 5, [2, 4, 6, 1, 3, 0, 7], 5, 14),
    "glm5-tiny": ("glm5-tiny", None, 5, [2, 4, 6], 2, 14),
    "glm5-ix2": ("glm5-ix2", GLM5_IX2, 3, [2, 4, 6], 2, 14),
}


def _engine(monkeypatch, preset: str, cfg: dict | None) -> Engine:
    if cfg is not None:
        monkeypatch.setitem(make_glm5.PRESETS, preset, cfg)
    reader = SyntheticReader(f"preset:{preset}")
    return Engine(reader.dir, reader=reader)


def _logits(engine: Engine, prompts: list[list[int]], n: int, slot: int) -> list[torch.Tensor]:
    out = []
    engine.generate(prompts, n, on_step=lambda step, logits: out.append(logits[slot].clone()))
    assert len(out) == n
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_alone_equals_batched(monkeypatch, case):
    preset, cfg, target, others, slot, n = CASES[case]
    e = _engine(monkeypatch, preset, cfg)
    prompts = default_prompts(8, e.cfg.vocab_size)
    batch = [prompts[i] for i in others]
    assert all(len(p) > len(prompts[target]) for p in batch[:slot])
    batch.insert(slot, prompts[target])
    alone, batched = _logits(e, [prompts[target]], n, 0), _logits(e, batch, n, slot)
    differ = [s for s in range(n) if not torch.equal(alone[s], batched[s])]
    assert not differ, f"{case}: stream alone vs in slot {slot} of {len(batch)}: logits differ at steps {differ}"


@pytest.mark.parametrize("case", ["tiny", "dsa-tiny", "glm5-tiny", "glm5-ix2"])
def test_every_stream_alone_equals_batched_and_ended_streams_change_nothing(monkeypatch, case):
    """Each of 6 streams (one of them 12x longer, so spans and row counts vary) decoded alone has the logits it has
    in the batch, and the same when other streams of the batch end early (an end-of-text id: they leave the
    forwards, and the decode steps run over fewer rows). Beyond the top-k ties this checks the CPU GEMMs' row
    and column classes (model/layers.py linear_rows, matmul_fp32) and the decode step of a subset of streams."""
    preset, cfg, *_ = CASES[case]
    e = _engine(monkeypatch, preset, cfg)
    p = default_prompts(6, e.cfg.vocab_size)
    p[1] = p[1] * 12
    n = 12
    assert_alone_equals_batched(e, p, n, 2, f"{case}: ")


@pytest.mark.parametrize("case", ["tiny", "dsa-tiny", "glm5-tiny"])
def test_cpu_linears_see_the_row_class(monkeypatch, case):
    """A CPU GEMM may round a row differently in a call of 1-3 rows than in one of 4 or more (MKL and oneDNN pick
    kernels by the row count, and which counts differ varies by CPU), so every linear of a CPU forward pads its rows
    to ops.stack.ROW_CLASS (linear_rows): a stream decoded alone then meets the kernels a batch does. Every F.linear
    call of one stream's prefill and decode has at least ROW_CLASS rows."""
    from rocket_mpi.ops.stack import ROW_CLASS
    preset, cfg, *_ = CASES[case]
    e = _engine(monkeypatch, preset, cfg)
    real, small = torch.nn.functional.linear, []

    def linear(x, w, b=None):
        if not x.is_cuda and x.dim() == 2 and x.shape[0] < ROW_CLASS:
            small.append((tuple(x.shape), tuple(w.shape)))
        return real(x, w, b)
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    e.generate([default_prompts(1, e.cfg.vocab_size)[0]], 4)
    assert not small, f"{case}: CPU linears of fewer than {ROW_CLASS} rows (x, w shapes): {sorted(set(small))}"


def assert_alone_equals_batched(e, p: list[list[int]], n: int, eos_at: int, label: str = "") -> None:
    """Each stream of `p` decoded alone for n steps has the logits it has in the batch, and beside streams that end
    early (stream 0's token at step eos_at made an end-of-text id)."""
    batch, ended = [], []
    free = e.generate(p, n, on_step=lambda step, lg: batch.append(lg.clone()))
    stopped = e.generate(p, n, on_step=lambda step, lg: ended.append(lg.clone()),
                         stop=Stop(eos=(free.tokens[0][eos_at],)))
    assert len(stopped.tokens[0]) < n and any(len(t) == n for t in stopped.tokens)
    for s in range(len(p)):
        alone = []
        e.generate([p[s]], n, on_step=lambda step, lg: alone.append(lg[0].clone()))
        differ = [t for t in range(n) if not torch.equal(alone[t], batch[t][s])]
        assert not differ, f"{label}stream {s} alone vs batched differs at steps {differ}"
        differ = [t for t in range(len(stopped.tokens[s])) if not torch.equal(alone[t], ended[t][s])]
        assert not differ, f"{label}stream {s} alone vs beside streams that ended differs at steps {differ}"


def glm4_prompts(m: int, vocab: int) -> list[list[int]]:
    """default_prompts(m) but for stream 1 of 300 tokens (its decode attention over two chunks of positions),
    stream 3 of one token (its prefill is a decode step's attention) and stream 5 of 40 (its prefill rows in
    GEMMs of their own beside the short prompts' packed rows, on a GPU)."""
    p = default_prompts(m, vocab)
    p[1], p[3], p[5] = (p[1] * 40)[:300], p[3][:1], (p[5] * 7)[:40]
    return p


def test_glm4_moe_gpu_branches_on_the_cpu(monkeypatch, one_thread):
    """glm4_moe's forward as it runs on a GPU (norms in the per-row kernel, decode steps and one-token prompts in
    ops.decode_attention over the streams that go on), on the CPU with the torch references in the kernels'
    place: each stream alone gets its batched logits, bitwise, beside streams that end early too (the decode
    attention then reads a subset of the cache's rows)."""
    e = _engine(monkeypatch, "tiny", None)
    monkeypatch.setattr(ops, "on_gpu", lambda device: True)       # after the engine: its MoE stays on the CPU's
    monkeypatch.setattr(ops, "rms_norm", ops.rms_norm_ref)
    calls = []
    monkeypatch.setattr(ops, "decode_attention", lambda *a, **k: calls.append(a[0].shape[0]) or
                        ops.decode_attention_ref(*a, **k))
    p = glm4_prompts(6, e.cfg.vocab_size)
    n = 6
    e.generate(p, n)
    assert len(calls) == e.cfg.num_hidden_layers * n, calls                 # one prefill (the 1-token prompt), 5 steps
    assert_alone_equals_batched(e, p, n, 1)


@pytest.mark.parametrize("case", [c for c, v in CASES.items() if v[0] != "tiny" and v[0] != "default"])
def test_selection_chooses(case):
    """The target's context passes index_topk (in whole pools where the model pools keys) within its tokens."""
    preset, cfg, target, _, _, n = CASES[case]
    raw = cfg or make.config_dict(preset)
    length = len(default_prompts(8, raw["vocab_size"])[target]) + n - 1      # the last step's context
    pool = raw.get("index_kpool", 1)
    assert length // pool > raw["index_topk"] // pool + 1


# -- topk_first --------------------------------------------------------------------------------------------------
def _reference(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices by (value descending, index ascending), -0.0 == +0.0: a stable descending sort (no NaN in x)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def _both_ways(x: torch.Tensor, k: int) -> torch.Tensor:
    """topk_first's indices, after checking that its CUDA way (a stable sort) gives the same on the CPU."""
    v, i = topk_first(x, k)
    torch.testing.assert_close(v, x.gather(-1, i), rtol=0, atol=0, equal_nan=True)    # the values are the scores'
    assert i.dtype == torch.int64
    assert torch.equal(select.by_sort(select._canonical(x), k), i)
    return i


@pytest.mark.parametrize("pad", [float("-inf"), torch.finfo(torch.float32).min])
def test_topk_first_ignores_padding(pad):
    """Rows of exact ties (zeros, as ReLU sums give) padded to other lengths choose the same, lowest, indices."""
    k, real = 5, 9
    for n in (real, real + 1, 16, 17, 100, 1000):
        x = torch.full((3, n), pad)
        x[:, :real] = 0.0
        x[1, 6] = 0.5                       # one larger value first, then the ties in index order
        x[2, :real:2] = -0.0                # -0.0 ties with +0.0
        assert _both_ways(x, k).tolist() == [[0, 1, 2, 3, 4], [6, 0, 1, 2, 3], [0, 1, 2, 3, 4]], n


def test_topk_first_matches_stable_sort():
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([float("-inf"), torch.finfo(torch.float32).min, -0.0, 0.0, float("inf"),
                            torch.finfo(torch.float32).tiny / 4, -torch.finfo(torch.float32).tiny / 4])
    for trial in range(50):
        n = int(torch.randint(1, 200, (1,), generator=g))
        k = int(torch.randint(0, n + 1, (1,), generator=g))
        x = (torch.randint(-4, 5, (4, n), generator=g) * 0.25).float()       # many exact ties
        pick = torch.randint(0, 4 * special.numel(), (4, n), generator=g)
        x = torch.where(pick < special.numel(), special[pick.clamp(max=special.numel() - 1)], x)
        assert torch.equal(_both_ways(x, k), _reference(x, k)), trial
        b = x.bfloat16()                                                     # bf16 scores: exact in fp32
        assert torch.equal(_both_ways(b, k), _reference(b.float(), k)), trial


def test_topk_first_batched_dims_and_nan():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[[1.0, nan, 1.0, 2.0], [0.0, 0.0, 0.0, 0.0]], [[inf, nan, -inf, nan], [-1, -2, -1, -2]]])
    i = _both_ways(x, 3)                                                     # [2, 2, 4]: NaN counts as +inf
    assert i.tolist() == [[[1, 3, 0], [0, 1, 2]], [[0, 1, 3], [0, 2, 1]]]
    x = torch.zeros(2, 8)[:, ::2]                                            # a non-contiguous row
    assert _both_ways(x, 2).tolist() == [[0, 1], [0, 1]]
    with pytest.raises(TypeError):
        topk_first(torch.zeros(2, 3, dtype=torch.float64), 1)
    with pytest.raises(ValueError):
        topk_first(torch.zeros(2, 3), 4)


@gpu
@pytest.mark.parametrize("preset", ["default", "dsa-tiny", "glm5-tiny"])
@pytest.mark.parametrize("path", ["host", "graph"])
def test_gpu_every_stream_alone_equals_batched(preset, path):
    """On a GPU, host path and graphed step: each of 6 streams (one 12x longer) alone gets the logits (bitwise, every
    step) and tokens it gets in the batch, greedy, and the tokens sampled (the graphed step attends over a span set
    by the longest stream: this is where a span-dependent sum would show; the lm_head takes the packed kernel, whose
    row sums do not depend on the row count, as cuBLAS's do)."""
    ckpt = f"preset:{preset}:nvfp4"
    e = Engine(ckpt, reader=SyntheticReader(ckpt, "cuda"), device="cuda")
    assert e.set_decode_path(path, "local") == path
    assert e.model.head_packed is not None
    p = default_prompts(6, e.cfg.vocab_size)
    p[1] = p[1] * 12
    sp = [Sampling(temperature=0.9, top_p=0.95, seed=40 + s) for s in range(6)]
    n = 12
    batch = []
    greedy = e.generate(p, n, on_step=lambda step, lg: batch.append(lg.clone()))
    sampled = e.generate(p, n, sampling=sp)
    assert greedy.path == path and not greedy.note, greedy.note
    for s in range(6):
        alone = []
        assert e.generate([p[s]], n, on_step=lambda step, lg: alone.append(lg[0].clone())).tokens[0] == \
            greedy.tokens[s], f"{preset} {path}: stream {s} greedy"
        differ = [t for t in range(n) if not torch.equal(alone[t], batch[t][s])]
        assert not differ, f"{preset} {path}: stream {s} alone vs in 6: logits differ at steps {differ}"
        assert e.generate([p[s]], n, sampling=[sp[s]]).tokens[0] == sampled.tokens[s], f"{preset} {path}: stream {s}"


@gpu
@pytest.mark.parametrize("preset", ["default", "tiny"])
@pytest.mark.parametrize("path", ["host", "graph"])
def test_gpu_glm4_moe_logits_alone_equal_batched(preset, path):
    """glm4_moe on a GPU: a stream's logits alone equal its logits in a batch of 18 streams, bitwise at every step,
    greedy and sampled, on the host path and the graphed step, whose spans start at 16 (so a run crosses several).
    18 streams is past ops.STACK_KERNEL_MAX_ROWS (every decode row through the packed linears); the batch holds a
    300-token prompt (two chunks of decode attention), a one-token one and a 40-token one (glm4_prompts)."""
    ckpt = f"preset:{preset}:nvfp4"
    e = Engine(ckpt, reader=SyntheticReader(ckpt, "cuda"), device="cuda")
    e.settings = dataclasses.replace(e.settings, graph_span_min=16)
    assert e.set_decode_path(path, "local") == path
    p = glm4_prompts(18, e.cfg.vocab_size)
    n = 10
    for sampling in (None, [Sampling(temperature=0.9, top_p=0.95, seed=40 + s) for s in range(len(p))]):
        batch = []
        res = e.generate(p, n, on_step=lambda step, lg: batch.append(lg.clone()), sampling=sampling)
        assert res.path == path and not res.note, res.note
        for s in (0, 1, 3, 5, 17):
            alone = []
            one = e.generate([p[s]], n, on_step=lambda step, lg: alone.append(lg[0].clone()),
                             sampling=None if sampling is None else [sampling[s]])
            differ = [t for t in range(n) if not torch.equal(alone[t], batch[t][s])]
            what = "greedy" if sampling is None else "sampled"
            assert not differ, f"{preset} {path} {what}: stream {s} alone vs in 18: logits differ at steps {differ}"
            assert one.tokens[0] == res.tokens[s], f"{preset} {path} {what}: stream {s}"


@pytest.mark.parametrize("preset", ["tiny", "glm5-tiny"])
def test_any_batch_and_prefill_chunk_leave_a_streams_tokens_alone(preset):
    """Property over random batches (hypothesis): 1-4 prompts of 1-40 tokens, a prefill chunk of 4-16 tokens;
    every stream's greedy tokens in the batch are the tokens it gets alone with the same chunk (a prompt is cut at
    its own offsets either way; a chunked prefill is not one forward's bits, test_prefill.py). A batch where a
    forward takes a later stream's piece beside an earlier one that did not fit fed streams each other's prompt
    tokens until the chunked prefill took each piece from its own stream (Engine._forward)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    reader = SyntheticReader(f"preset:{preset}")
    e = Engine(reader.dir, reader=reader)
    vocab, alone = e.cfg.vocab_size, {}

    def tokens_alone(p, chunk):
        key = (tuple(p), chunk)
        if key not in alone:
            e.prefill_chunk = chunk
            alone[key] = e.generate([p], 3).tokens[0]
        return alone[key]

    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(4, 16), st.integers(0, 2 ** 16))
    def check(lens, chunk, seed):
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]
        want = [tokens_alone(p, chunk) for p in prompts]
        e.prefill_chunk = chunk
        assert e.generate(prompts, 3).tokens == want, (lens, chunk)

    check()


@pytest.mark.parametrize("preset", ["tiny", "glm5-tiny"])
def test_the_servers_scheduler_gives_each_request_its_tokens_alone(preset, monkeypatch):
    """Property over random arrivals (hypothesis) at the server's scheduler, in process on one rank (host path, 4
    slots): 1-6 requests of 1-30 prompt tokens and 1-8 new ones, each arriving at one of the first 3 iterations (so
    several join one prefill, some wait for a slot, some join a running batch), a prefill chunk of 2-12 tokens; every
    request gets the greedy tokens its prompt gets alone with the same chunk. (A prefill that sliced each forward's
    tokens from the packed prompts in order fails here: prompts of 1, 2 and 1 tokens joining with a chunk of 2.)"""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from rocket_mpi.serve import scheduler as sch
    monkeypatch.setattr(sch, "HEARTBEAT", 0.001)  # an idle iteration waits this long for a request
    reader = SyntheticReader(f"preset:{preset}")
    e = Engine(reader.dir, reader=reader)
    alone = {}

    def tokens_alone(p, chunk, n):
        key = (tuple(p), chunk)
        if key not in alone:
            e.prefill_chunk = chunk
            alone[key] = e.generate([p], 8).tokens[0]
        return alone[key][:n]

    @settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 8), st.integers(0, 2)), min_size=1, max_size=6),
           st.integers(2, 12), st.integers(0, 2 ** 16))
    def check(reqs, chunk, seed):
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(2, e.cfg.vocab_size, (n,), generator=g).tolist() for n, _, _ in reqs]
        want = [tokens_alone(p, chunk, k) for p, (_, k, _) in zip(prompts, reqs)]
        e.prefill_chunk = chunk
        sched = sch.Scheduler(None, sch.Slots(e, 4, 64, "host"), 10.0)
        done = set()
        made = [sch.Request(p, k, Sampling(), Stop(), lambda ev, i=i: ev[0] == "done" and done.add(i))
                for i, (p, (_, k, _)) in enumerate(zip(prompts, reqs))]
        for it in range(200):
            for i, (_, _, at) in enumerate(reqs):
                if at == it:
                    sched.submit(made[i])
            if len(done) == len(made):
                break
            sched._iterate()
        assert [r.generated for r in made] == want, (reqs, chunk)

    check()
