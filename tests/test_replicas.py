"""Replicated experts and live rebalancing: the placement format with replicas and its one-line errors, experts moving
between slots bit for bit, and the split decoding the one-rank tokens under replica placements and under placements
that change mid-run (--rebalance-every), on 2, 3 and 4 ranks, shm and mpi, host and fixed-shape paths, with and
without a bounded expert cache."""
import json
import threading
import time

import numpy as np
import pytest
import torch

from conftest import rocket, rocket_mpi
from helpers import gpu, make_experts, segments_for
from rocket_mpi import ops
from rocket_mpi.checkpoint.make import make_checkpoint
from rocket_mpi.cli import main
from rocket_mpi.errors import ConfigError
from rocket_mpi.moe.experts import ExpertStore
from rocket_mpi.moe.placement import Placement
from rocket_mpi.moe.rebalance import Rebalancer, decay_factor, fixed_slots

TOKENS = "8"


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """tiny with a few hot experts per layer: contiguous halves are unbalanced, so rebalancing moves experts."""
    d = str(tmp_path_factory.mktemp("skewed_rb"))
    make_checkpoint("tiny", d, seed=5, skew=1.5)
    return d


@pytest.fixture(scope="module")
def reference(skewed, tmp_path_factory):
    """The one-rank run of 8 streams (the split runs below compare their tokens and every step's row checksum with
    it: the checksum runs over the rows in (token, expert) order, the same under any placement)."""
    out = tmp_path_factory.mktemp("ref") / "ref.json"
    r = rocket("decode", "--checkpoint", skewed, "--streams", "8", "--tokens", TOKENS, "--fabric", "local",
               "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    run = json.loads(out.read_text())["runs"][0]
    return run["tokens"], run["row_checksums"]["0"]


def write(tmp_path, owners, name="pl.json"):
    p = tmp_path / name
    p.write_text(json.dumps(owners))
    return str(p)


def hot_replicas(n_experts, ranks):
    """Contiguous ranges, the first experts (the hot ones under skew) on every rank, the next on two."""
    owners = [e * ranks // n_experts for e in range(n_experts)]
    owners[0] = list(range(ranks))
    owners[1] = sorted({owners[1], ranks - 1})
    owners[5] = [0, ranks - 1]
    return {"default": [o if isinstance(o, int) or len(o) > 1 else o[0] for o in owners]}


# -- the placement format -------------------------------------------------------------------------------------------

def test_placement_with_replicas(tiny_ckpt, tmp_path):
    from rocket_mpi.checkpoint.reader import CheckpointReader
    cfg = CheckpointReader(tiny_ckpt).config
    layers = list(cfg.moe_layers)
    pl = Placement.from_file(write(tmp_path, {"default": [0] * 12 + [[1, 0], 1, [0, 1], 1]}), cfg, 2)
    assert pl.owners[layers[0]][12] == (0, 1)              # sorted
    assert pl.owned(layers[0], 1) == [12, 13, 14, 15] and pl.owned(layers[0], 0) == list(range(13)) + [14]
    assert pl.replicas(layers[0]) == 2 and pl.most_owned() == 14
    assert pl.to_json()[str(layers[0])] == [0] * 12 + [[0, 1], 1, [0, 1], 1]
    again = Placement({int(k): v for k, v in pl.to_json().items()}, 2)
    assert again == pl and again.digest() == pl.digest()
    plain = Placement.from_file(write(tmp_path, {"default": [0] * 12 + [0, 1, 0, 1]}, "b.json"), cfg, 2)
    assert plain.digest() != pl.digest() and plain.replicas(layers[0]) == 0
    assert pl.first_owners(layers)[0].tolist() == [0] * 12 + [0, 1, 0, 1]
    assert torch.equal(pl.table(layers[0]).pair0[-1], torch.tensor(18))


@pytest.mark.parametrize("entry,needle", [([], "expert 3 is owned by no rank ([])"),
                                          (None, "expert 3 is owned by no rank (null)"),
                                          ([0, 0], "expert 3: the replica list [0, 0] names rank 0 twice"),
                                          ([0, 1], "expert 3 -> rank 1, not in 0..0"),
                                          (True, "expert 3 -> rank true, not in 0..0")])
def test_bad_placement_is_one_line(entry, needle, tiny_ckpt, tmp_path, capsys):
    """decode alone is one rank: the placement may name rank 0 only."""
    path = write(tmp_path, {"default": [0, 0, [0], entry] + [0] * 12})
    try:
        code = main(["decode", "--checkpoint", tiny_ckpt, "--streams", "2", "--tokens", "2", "--quiet",
                     "--placement", path])
    except SystemExit as e:
        code = e.code
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code not in (0, None) and len(err) == 1, err
    assert path in err[0] and "layer 1" in err[0] and needle in err[0], err[0]


def test_replicas_flag_needs_rebalancing(tiny_ckpt, capsys):
    try:
        code = main(["decode", "--checkpoint", tiny_ckpt, "--streams", "2", "--tokens", "2", "--quiet",
                     "--replicas", "2"])
    except SystemExit as e:
        code = e.code
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code not in (0, None) and len(err) == 1 and "--replicas 2" in err[0] and "--rebalance-every" in err[0]


def test_placement_errors_name_the_source():
    with pytest.raises(ConfigError, match=r"placement x: layer 1 expert 0: the replica list \[0, 0\] names rank 0"):
        Placement({1: [[0, 0]]}, 2, source="x")


# -- moving experts between slots ----------------------------------------------------------------------------------

class _Source:
    """ExpertSource's part a move uses: expert e alone, packed (the checkpoint stands in by random NVFP4 experts)."""

    def __init__(self, experts, h, i, dev):
        self.experts, self.h, self.i, self.dev = experts, h, i, dev

    def packed(self, e, bf16):
        return ops.pack_experts({e: self.experts[e]}, self.h, self.i, device=self.dev)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("near", [6, 3])
def test_packed_rehome_is_bitwise(device, near):
    """A layer's packed experts with fixed slots (some spare, some far when near < slots) after experts leave, arrive
    and move from far to device slots: the expert kernel (its torch reference on a CPU) gives the bits of a fresh
    pack of the new experts, and the slots never grew."""
    h, i, ids = 128, 64, list(range(10))
    ex = make_experts(ids, h, i, seed=2)
    dev = torch.device(device)
    packer = ops.ExpertPacker([0, 1, 2, 3, 4], h, i, bf16=False, device=dev,
                              resident=None if near == 6 else [0, 1, 2], slots=6, near_slots=near)
    for e in range(5):
        packer.add(e, *ex[e])
    store = ExpertStore(1, [0, 1, 2, 3, 4], {}, {}, torch.ones(10), 0)
    store.packed, store.source, store.capacity = packer.done(), _Source(ex, h, i, dev), near
    assert store.packed.n_slots == 6 and store.packed.free_slots() == [near - 1 if near == 6 else 5]
    for owned in ([1, 3, 5, 7], [1, 3, 5, 7, 8, 9], [0, 9]):
        arrived, left, moved = store.rehome(owned)
        assert store.owned == owned and sorted(store.packed.slot) == owned and store.packed.n_slots == 6
        assert moved >= len(arrived) * store.packed.bytes_per_expert
        assert len(store.resident()) == min(near, len(owned))  # device slots filled first
        counts = {e: 3 + 5 * k for k, e in enumerate(owned)}
        x = torch.randn(sum(counts.values()), h, device=dev).to(torch.bfloat16)
        want = ops.nvfp4_experts(x, segments_for(counts), ops.pack_experts({e: ex[e] for e in owned}, h, i, device=dev))
        assert torch.equal(ops.nvfp4_experts(x, segments_for(counts), store.packed), want), owned


def test_dense_rehome_and_the_cache(skewed):
    """CPU experts (dense, the torch reference) with a bounded cache: after a rehome the resident ones fill the
    capacity, the others come from the checkpoint, and the rows are the bits of a store loaded with the new experts."""
    from rocket_mpi.checkpoint.reader import CheckpointReader
    from rocket_mpi.moe.cache import ExpertCache
    reader = CheckpointReader(skewed)
    layer = reader.config.moe_layers[0]
    store = ExpertStore.load(reader, layer, [0, 1, 2, 3], resident=[0, 1, 2], slots=6, near=3)
    assert store.capacity == 3 and store.resident() == [0, 1, 2]
    cache = ExpertCache({layer: store}, [layer], 16)
    store.rehome([2, 5, 9, 11, 12])
    cache.rebuild(layer)
    assert store.resident() == [2, 5, 9] and cache.policies[layer].owned == [2, 5, 9, 11, 12]  # 2 stays, 5 and 9 read
    fresh = ExpertStore.load(reader, layer, [2, 5, 9, 11, 12])
    counts = {2: 3, 5: 1, 9: 4, 11: 2, 12: 5}
    tokens = torch.arange(15) % 6
    x = torch.randn(6, reader.config.hidden_size).to(torch.bfloat16)
    segs = segments_for(counts)
    assert torch.equal(store.compute(x, tokens, segs, 0), fresh.compute(x, tokens, segs, 0))
    with pytest.raises(KeyError, match="expert 0 is not on this rank"):
        store.compute(x, tokens, [(0, 0, 2)], 0)


def test_decayed_counts():
    """The decayed mean rows per step: a steady count gives that count whatever the intervals; DECAY ** n by
    multiplication alone."""
    assert decay_factor(0) == 1.0 and decay_factor(3) == 0.95 * 0.95 * 0.95

    class Cfg:
        moe_layers, n_routed_experts = [1, 2], 4

    class Eng:
        cfg = Cfg()

    rb = Rebalancer(Eng(), 4, 0, 1000, 4, 4)
    steady = np.array([[3, 0, 1, 0], [8, 8, 0, 0]])
    for steps in (1, 3, 8):
        delta = np.stack([steady * steps, (steady > 0) * steps], axis=1)
        rb.observe(delta, steps)
    np.testing.assert_allclose(rb.rows / rb.weight, steady, rtol=1e-12)
    np.testing.assert_allclose(rb.active / rb.weight, steady > 0, rtol=1e-12)
    assert [rb.wants(s) for s in (0, 3, 4)] == [False, False, True]


def test_rebalance_moves_experts_and_rewrites_the_tables(skewed, monkeypatch):
    """Rank 0 of 2 with rebalancing, balance() stood in for by a fixed answer (moe/balance.py's algorithm has its own
    tests): the placement becomes the engine's, rank 0 holds its new experts, the fixed-shape step's tables are
    rewritten in place to the new placement's, and an answer past the fixed slots is one error naming rank, step and
    layer."""
    from rocket_mpi.errors import RocketError
    from rocket_mpi.moe import rebalance
    from rocket_mpi.moe.step import DeviceMoE
    from rocket_mpi.ops import plan as kplan
    from rocket_mpi.runtime.engine import Engine
    torch.set_num_threads(1)
    eng = Engine(skewed, 0, 2, rebalance_every=2, replicas=2)
    rb, layers = eng.rebalancer, list(eng.cfg.moe_layers)
    assert rb.slots == 9 and eng.pair_capacity == 18 and eng.experts[layers[0]].owned == list(range(8))
    moe = DeviceMoE(eng, 4)
    tables = {la: [t.data_ptr() for t in moe.tables[la]] for la in layers}
    seen = []
    rb.on_change["test"] = seen.append
    answer = [[0, 1], [0, 1]] + [e % 2 for e in range(2, 16)]
    monkeypatch.setattr(rebalance, "balance", lambda *a, **k: answer)
    rb.observe(np.zeros((len(layers), 2, 16), dtype=np.int64), 1)
    rb.rebalance(2)
    mine = [0, 1] + list(range(2, 16, 2))
    assert eng.placement.owned(layers[0], 0) == mine and seen == layers
    st = rb.stats.as_dict()
    assert (st["changed"], st["arrived"], st["left"], st["replicas"]) == (1, 2 * 4, 2 * 3, 2 * 2), st
    for la in layers:
        assert eng.experts[la].owned == mine and sorted(eng.experts[la].gate_up) == mine
        want = kplan.device_tables(eng.placement.table(la), eng.pair_capacity)
        assert [t.data_ptr() for t in moe.tables[la]] == tables[la]  # in place: a capture stays valid
        for got, w in zip((moe.tables[la][0], moe.tables[la][1], moe.tables[la][3]), want):
            assert torch.equal(got, w)
        assert moe.tables[la][2].tolist() == [mine.index(e) if e in mine else -1 for e in range(16)]
    monkeypatch.setattr(rebalance, "balance", lambda *a, **k: [0] * 16)
    with pytest.raises(RocketError, match=f"rank 0: live rebalancing at decode step 4 gave rank 0 16 experts of MoE "
                                          f"layer {layers[0]}, more than its 9 slots"):
        rb.rebalance(4)


def test_rebalance_in_the_background(skewed, monkeypatch):
    """--rebalance-every 4: the snapshot at step 4 starts the placement and the arriving experts' reads in a worker
    thread, the steps go on under the old placement, and at step 6 (lag 2) the engine moves to it: the same owners and
    weights as at once; a worker that does not finish within WAIT is one error naming the rank and step."""
    from rocket_mpi.errors import RocketError
    from rocket_mpi.moe import rebalance
    from rocket_mpi.runtime.engine import Engine
    torch.set_num_threads(1)
    eng = Engine(skewed, 0, 2, rebalance_every=4, replicas=2)
    rb, layers = eng.rebalancer, list(eng.cfg.moe_layers)
    assert rb.lag == 2 and [rb.wants(s) for s in (1, 3, 4)] == [False, False, True]
    answer = [[0, 1], [0, 1]] + [e % 2 for e in range(2, 16)]
    threads = []

    def fake_balance(*a, **k):
        threads.append(threading.current_thread().name)
        return answer
    monkeypatch.setattr(rebalance, "balance", fake_balance)
    rb.observe(np.ones((len(layers), 2, 16), dtype=np.int64), 1)
    rb.at_step(4)
    assert rb.pending is not None and eng.placement.owned(layers[0], 0) == list(range(8))  # not moved yet
    assert not rb.wants(5) and rb.wants(6)
    rb.at_step(6)
    mine = [0, 1] + list(range(2, 16, 2))
    assert rb.pending is None and eng.placement.owned(layers[0], 0) == mine
    assert threads and all(t.startswith("rebalance") for t in threads), threads
    st = rb.stats.as_dict()
    assert (st["rebalances"], st["changed"], st["arrived"], st["left"]) == (1, 1, 2 * 4, 2 * 3), st
    assert st["background_ms"] > 0 and st["last_step"] == 6, st
    for la in layers:  # the experts read in the background are the checkpoint's
        store = eng.experts[la]
        assert store.owned == mine
        for e in (10, 12):
            gu, d = store.source.dense(e)
            assert torch.equal(store.gate_up[e], gu) and torch.equal(store.down[e], d)
    assert rb.wants(8)

    def slow(*a, **k):
        time.sleep(2)
        return answer
    monkeypatch.setattr(rebalance, "balance", slow)
    monkeypatch.setattr(rebalance, "WAIT", 0.05)
    rb.at_step(8)
    with pytest.raises(RocketError, match="rank 0: live rebalancing: the placement computed in the background was "
                                          "not ready within 0 s at decode step 10"):
        rb.at_step(10)


def test_fixed_slots(tiny_ckpt):
    from rocket_mpi.checkpoint.reader import CheckpointReader
    cfg = CheckpointReader(tiny_ckpt).config
    assert fixed_slots(Placement.contiguous(cfg, 3), 16, 2) == 6           # ceil(18 / 3)
    assert fixed_slots(Placement.contiguous(cfg, 3), 16, 0) == 6           # the contiguous 6, 5, 5
    assert fixed_slots(Placement({la: [0] * 15 + [1] for la in cfg.moe_layers}, 2), 16, 4) == 15


# -- parity: the split decodes the one-rank tokens -----------------------------------------------------------------

@pytest.mark.parametrize("ranks,fabric,path,quant", [(2, "shm", "host", "bf16"), (3, "mpi", "device", "nvfp4")])
def test_static_fire_with_replicas(ranks, fabric, path, quant, tiny_ckpt, tiny_nvfp4_ckpt, tmp_path):
    """A placement file with replicated experts (one on every rank): the static fire passes, and the replicas really
    split their rows (every rank owned rows, more than the contiguous split gives the ranks that hold replicas)."""
    ckpt = tiny_ckpt if quant == "bf16" else tiny_nvfp4_ckpt
    r = rocket("static-fire", "--checkpoint", ckpt, "--ranks", str(ranks), "--sweep", "8", "--tokens", TOKENS,
               "--fabric", fabric, "--fabric-timeout", "20", "--decode-path", path, "--workdir", str(tmp_path),
               "--placement", write(tmp_path, hot_replicas(16, ranks)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"STATIC FIRE PASS: 0/8 streams mismatched ({ranks} ranks, fabric {fabric}" in r.stdout, r.stdout
    assert "row checksums: every rank's equal to the reference's at every step" in r.stdout, r.stdout
    per_rank = json.loads((tmp_path / "split.json").read_text())["runs"][0]["per_rank"]
    assert all(s["rows_per_step"] > 0 for s in per_rank), per_rank


def test_static_fire_with_rebalancing(skewed, tmp_path):
    """static-fire --rebalance-every on the fixed-shape path (the device plan's tables rewritten in place): PASS, the
    placement changed mid-run and experts moved; at most --replicas extra copies per MoE layer (2 layers)."""
    r = rocket("static-fire", "--checkpoint", skewed, "--ranks", "2", "--sweep", "8", "--tokens", TOKENS,
               "--fabric", "mpi", "--fabric-timeout", "20", "--decode-path", "device", "--rebalance-every", "3",
               "--replicas", "2", "--workdir", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "STATIC FIRE PASS: 0/8 streams mismatched (2 ranks, fabric mpi" in r.stdout, r.stdout
    assert "row checksums: every rank's equal to the reference's at every step" in r.stdout, r.stdout
    assert "rebalance: rank placements changed" in r.stdout, r.stdout
    stats = [s["rebalance"] for s in json.loads((tmp_path / "split.json").read_text())["runs"][0]["per_rank"]]
    assert all(b["rebalances"] == 2 and b["changed"] >= 1 and b["replicas"] <= 2 * 2 for b in stats), stats
    assert sum(b["arrived"] for b in stats) > 0, stats


@pytest.mark.parametrize("ranks,fabric,extra", [
    (4, "mpi", ["--placement"]),                                 # 4 ranks, from a replica placement
    (3, "shm", ["--expert-cache", "0.00004", "--replicas", "3"]),  # from contiguous thirds, a bounded cache
])
def test_split_with_rebalancing(ranks, fabric, extra, skewed, reference, tmp_path):
    """The split with placements recomputed every 2 steps decodes the one-rank tokens; the ranks agreed on every
    placement without a byte (a disagreement would exchange blocks of other sizes and fail or hang)."""
    if extra[-1] == "--placement":
        extra = extra + [write(tmp_path, hot_replicas(16, ranks))]
    out = tmp_path / "split.json"
    r = rocket_mpi(ranks, "decode", "--checkpoint", skewed, "--streams", "8", "--tokens", TOKENS, "--fabric", fabric,
                   "--fabric-timeout", "20", "--rebalance-every", "2", "--out", str(out), "--quiet", *extra,
                   timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    tokens, crcs = reference
    assert doc["tokens"] == tokens
    assert all(c == crcs for c in doc["runs"][0]["row_checksums"].values()), "rows differ from the one-rank run's"
    stats = [s["rebalance"] for s in doc["runs"][0]["per_rank"]]
    assert all(b["rebalances"] == 3 and b["changed"] >= 1 for b in stats), stats
    assert sum(b["arrived"] for b in stats) > 0 and sum(b["left"] for b in stats) > 0, stats
    if "--expert-cache" in extra:
        cache = [s["expert_cache"] for s in doc["runs"][0]["per_rank"]]
        assert sum(c["miss_rows"] for c in cache) > 0, cache
