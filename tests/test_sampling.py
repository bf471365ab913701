"""Sampling and stop conditions (runtime/sampling.py), in the engine and through the decode and static-fire commands.

- a draw depends on (logits, seed, position) alone; top-k / top-p keep exactly the tokens they should, and the
  draws follow the kept distribution;
- the engine: a sampled stream decodes the same tokens alone and in a batch; a stream ends at an end-of-text id
  and costs no more compute; stop strings end a stream and are cut from its text;
- static fire with sampling on: PASS at 2 and 3 ranks.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import rocket
from rocket_mpi.runtime.sampling import GREEDY, Sampling, Stop, cut_at_stop, draw, uniform


def test_uniform_depends_on_seed_and_position_only():
    a = [uniform(7, p) for p in range(1000)]
    assert a == [uniform(7, p) for p in range(1000)] and all(0 <= u < 1 for u in a)
    assert a != [uniform(8, p) for p in range(1000)]
    assert abs(sum(a) / len(a) - 0.5) < 0.03  # roughly uniform


def test_greedy_is_argmax_with_ties_to_the_lower_id():
    x = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert draw(x, GREEDY, 0) == 1 and draw(x, Sampling(temperature=5.0, top_k=1), 9) == 1


def test_top_k_and_top_p_keep_the_right_tokens_and_follow_the_distribution():
    logits = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))
    seen = {}
    n = 4000
    for pos in range(n):
        t = draw(logits, Sampling(temperature=1.0, top_p=0.8, seed=3), pos)
        seen[t] = seen.get(t, 0) + 1
    assert set(seen) == {1, 3, 4}  # 0.4 + 0.3 + 0.15 reaches 0.8; 0.1 and 0.05 are cut
    for t, p in ((1, 0.4 / 0.85), (3, 0.3 / 0.85), (4, 0.15 / 0.85)):
        assert abs(seen[t] / n - p) < 4 * math.sqrt(p * (1 - p) / n), (t, seen[t] / n, p)
    kept = {draw(logits, Sampling(temperature=2.0, top_k=2, seed=1), pos) for pos in range(300)}
    assert kept == {1, 3}
    # ties at the top-k boundary go to the lower id, whatever the row's length
    tied = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.5])
    assert {draw(tied, Sampling(temperature=1.0, top_k=2, seed=0), p) for p in range(200)} == {1, 2}


def test_bad_sampling_values_are_named():
    assert "temperature" in Sampling(temperature=-1).problem()
    assert "top_p" in Sampling(temperature=1, top_p=0).problem()
    assert "top_k" in Sampling(top_k=-2).problem()
    assert Sampling(temperature=0.7, top_p=0.9, top_k=40, seed=5).problem() == ""


def test_stop_rule_and_text_cut():
    st = Stop(eos=(1,), strings=("END",))
    assert st.reason([5, 1]) == "stop" and Stop(eos=(1,), ignore_eos=True).reason([5, 1]) == ""
    assert st.reason([5, 6], lambda ids: "abcEN") == "" and st.reason([5, 6], lambda ids: "abENDx") == "stop"
    assert cut_at_stop("hello END world", ("END", "wor")) == "hello "


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    from rocket_mpi.runtime.engine import Engine
    torch.set_num_threads(1)
    return Engine(tiny_ckpt)


def test_a_sampled_stream_draws_the_same_alone_and_in_a_batch(engine):
    p = [[5, 17, 99, 3], [42] * 11, [7, 8]]
    sp = [Sampling(temperature=0.8, top_p=0.9, seed=s) for s in (11, 12, 13)]
    batch = engine.generate(p, 12, sampling=sp)
    alone = engine.generate([p[2]], 12, sampling=[sp[2]])
    assert alone.tokens[0] == batch.tokens[2]
    assert engine.generate(p, 12).tokens != batch.tokens  # sampling changed something


def test_end_of_text_ends_a_stream_and_its_compute(engine, monkeypatch):
    p = [[5, 17, 99, 3], [42] * 11]
    free = engine.generate(p, 10, stop=Stop())
    eos = free.tokens[0][3]  # pretend stream 0's 4th token is the end of text
    calls = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda *a: calls.append(list(a[2])) or forward(*a))
    r = engine.generate(p, 10, stop=Stop(eos=(eos,)))
    first = free.tokens[0].index(eos)
    assert r.tokens[0] == free.tokens[0][:first + 1] and r.finish[0] == "stop"
    n1 = free.tokens[1].index(eos) + 1 if eos in free.tokens[1] else 10
    assert r.tokens[1] == free.tokens[1][:n1]
    assert all(c[0] == 0 for c in calls[first + 1:]), "the ended stream still fed tokens"
    assert r.tokens[1][:first + 1] == free.tokens[1][:first + 1]  # the other stream is not disturbed
    kept = engine.generate(p, 10, stop=Stop(eos=(eos,), ignore_eos=True))
    assert kept.tokens == free.tokens and kept.finish == ["length", "length"]


def test_decode_command_samples_and_stops(tiny_ckpt, tmp_path):
    out = tmp_path / "d.json"
    args = ("decode", "--checkpoint", tiny_ckpt, "--streams", "3", "--tokens", "16", "--temperature", "0.9",
            "--top-k", "40", "--seed", "4", "--out", str(out), "--quiet", "--ignore-eos")
    assert rocket(*args).returncode == 0
    a = json.loads(out.read_text())
    assert rocket(*args).returncode == 0
    assert json.loads(out.read_text())["tokens"] == a["tokens"]  # a seed reproduces the run
    text = a["text"][1].replace("\ufffd", "")
    assert len(text) >= 6, f"too little text to cut a stop string from: {a['text'][1]!r}"
    cut = text[len(text) // 2:len(text) // 2 + 2]  # a piece of its middle
    r = rocket(*args[:-1], "--stop", cut)
    assert r.returncode == 0, r.stderr
    b = json.loads(out.read_text())
    assert b["finish"][1] == "stop" and cut not in b["text"][1] and len(b["tokens"][1]) < 16
    bad = rocket("decode", "--checkpoint", tiny_ckpt, "--top-p", "1.5")
    assert bad.returncode == 2 and "--top-p" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("ranks", [2, 3])
def test_static_fire_with_sampling(tiny_ckpt, ranks):
    r = rocket("static-fire", "--checkpoint", tiny_ckpt, "--ranks", str(ranks), "--sweep", "1,4", "--tokens", "10",
               "--temperature", "0.9", "--top-p", "0.95", "--seed", "7", "--fabric", "shm", timeout=300)
    assert r.returncode == 0 and "STATIC FIRE PASS" in r.stdout, r.stdout + r.stderr
