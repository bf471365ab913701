"""decode --telemetry (routing, per-rank expert and exchange times, the model's identity) and the place command:
a placement planned from a 2-rank trace decodes the same tokens, and bad input is one line."""
import json

import numpy as np
import pytest

from conftest import rocket_mpi
from helpers import gpu
from rocket_mpi.checkpoint.make import make_checkpoint
from rocket_mpi.cli import main
from rocket_mpi.moe.balance import owner_lists
from rocket_mpi.runtime.engine import Engine

TOKENS = 8


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A skewed tiny checkpoint decoded on 2 ranks (shm) with --telemetry: (checkpoint, trace, the run's JSON)."""
    d = tmp_path_factory.mktemp("place")
    ckpt = str(d / "ckpt")
    make_checkpoint("tiny", ckpt, seed=5, skew=1.5)
    trace, out = str(d / "trace.npz"), str(d / "contiguous.json")
    r = rocket_mpi(2, "decode", "--checkpoint", ckpt, "--streams", "4", "--tokens", str(TOKENS), "--fabric", "shm",
                   "--threads", "1", "--telemetry", trace, "--out", out, "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    return ckpt, trace, json.load(open(out))


def test_telemetry_fields(recorded):
    _, trace, doc = recorded
    z = np.load(trace)
    steps = TOKENS - 1
    assert str(z["format"]) == "rocket_mpi telemetry" and int(z["version"]) == 2
    model = json.loads(str(z["model"]))
    assert model["model_type"] == "glm4_moe" and model["n_experts"] == 16 and model["moe_layers"] == [1, 2]
    assert z["rows"].shape == (steps, 2, 16) and int(z["ranks"]) == 2 and int(z["streams"]) == 4
    # every rank's rows add up to the routing's: 4 streams x top-4 x 2 MoE layers per step
    assert (z["rows_owned"].sum(axis=1) == z["rows"].sum(axis=(1, 2))).all()
    assert (z["rows"].sum(axis=(1, 2)) == 4 * 4 * 2).all()
    for k in ("step_s", "expert_s", "wait_s", "expert_cpu_s"):
        assert z[k].shape == (steps, 2) and np.isfinite(z[k]).all() and (z[k] > 0).all(), k
    assert (z["expert_s"] + z["wait_s"] <= z["step_s"]).all()
    assert json.loads(str(z["placement"]))["1"] == [0] * 8 + [1] * 8
    assert int(z["expert_bytes"]) == 3 * 64 * 32 * 2   # one dense BF16 expert of tiny
    per_rank = doc["runs"][-1]["per_rank"]
    assert all(s["expert_ms"] > 0 and s["wait_ms"] > 0 for s in per_rank)


def test_place_plans_a_placement_that_decodes_the_same_tokens(recorded, tmp_path, capsys):
    ckpt, trace, doc = recorded
    out = str(tmp_path / "balanced.json")
    assert main(["place", "--telemetry", trace, "--ranks", "2", "--checkpoint", ckpt, "--out", out]) == 0
    text = capsys.readouterr().out
    assert "busiest rank / mean, before (contiguous) -> after" in text and f"wrote {out}" in text
    placed = json.load(open(out))
    assert sorted(placed) == ["1", "2"] and all(len(v) == 16 for v in placed.values())
    assert placed != {"1": [0] * 8 + [1] * 8, "2": [0] * 8 + [1] * 8}
    r = rocket_mpi(2, "decode", "--checkpoint", ckpt, "--streams", "4", "--tokens", str(TOKENS), "--fabric", "shm",
                   "--threads", "1", "--placement", out, "--out", str(tmp_path / "run.json"), "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.load(open(tmp_path / "run.json"))["tokens"] == doc["tokens"]
    # the "all" line: the balanced rows are closer to the mean than the contiguous ones
    all_line = next(line for line in text.splitlines() if line.strip().startswith("all"))
    before, _, after = all_line.split()[1:4]
    assert float(after) <= float(before), all_line


def test_place_replicas_and_slots(recorded, tmp_path, capsys):
    _, trace, _ = recorded
    out = str(tmp_path / "rep.json")
    assert main(["place", "--telemetry", trace, "--ranks", "3", "--replicas", "2", "--exact", "--out", out]) == 0
    for owners in json.load(open(out)).values():
        lists = owner_lists(owners)
        assert sum(len(o) - 1 for o in lists) == 2 and all(len(set(o)) == len(o) for o in lists)
    assert main(["place", "--telemetry", trace, "--ranks", "3", "--slots", "6", "--out", out]) == 0
    for owners in json.load(open(out)).values():
        assert np.bincount([r for o in owner_lists(owners) for r in o]).tolist() == [6, 6, 6]
    assert "replicas" in capsys.readouterr().out


def one_line_error(capsys, argv, code=1) -> str:
    if code == 2:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    else:
        assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_bad_input_is_one_line(recorded, tmp_path, capsys):
    _, trace, _ = recorded
    assert "file not found" in one_line_error(capsys, ["place", "--telemetry", str(tmp_path / "no.npz"), "--ranks",
                                                       "2"])
    junk = tmp_path / "junk.npz"
    junk.write_text("not a zip")
    assert "not a telemetry file" in one_line_error(capsys, ["place", "--telemetry", str(junk), "--ranks", "2"])
    other = tmp_path / "other.npz"
    np.savez(other, rows=np.zeros((3, 2, 16)))
    assert "not a telemetry file" in one_line_error(capsys, ["place", "--telemetry", str(other), "--ranks", "2"])
    old = tmp_path / "old.npz"
    np.savez(old, format=np.array("rocket_mpi telemetry"), version=np.array(1), rows=np.zeros((3, 2, 16)))
    assert "record it again" in one_line_error(capsys, ["place", "--telemetry", str(old), "--ranks", "2"])
    err = one_line_error(capsys, ["place", "--telemetry", trace, "--ranks", "2", "--checkpoint", "preset:default"])
    assert "was recorded from another model: glm4_moe" in err and "16 experts" in err and "64 experts" in err
    assert "--ranks 0" in one_line_error(capsys, ["place", "--telemetry", trace, "--ranks", "0"])
    assert "--replicas -1" in one_line_error(capsys, ["place", "--telemetry", trace, "--ranks", "2", "--replicas",
                                                      "-1"])
    assert "--replicas 17" in one_line_error(capsys, ["place", "--telemetry", trace, "--ranks", "2", "--replicas",
                                                      "17"])
    assert "--slots 7" in one_line_error(capsys, ["place", "--telemetry", trace, "--ranks", "2", "--slots", "7"])
    assert "--row-cost" in one_line_error(capsys, ["place", "--telemetry", trace, "--ranks", "2", "--row-cost",
                                                   "lots"])
    assert "--out" in one_line_error(capsys, ["place", "--telemetry", trace, "--ranks", "2", "--out",
                                              str(tmp_path / "nowhere" / "p.json")])
    assert "--ranks" in one_line_error(capsys, ["place", "--telemetry", trace], code=2)


@gpu
def test_gpu_host_path_times_experts_and_exchange(recorded):
    """On a GPU the host path times its experts and the exchange with events on the stream: both measured, both
    inside the step; the fixed-shape step times neither."""
    ckpt = recorded[0]
    eng = Engine(ckpt, device="cuda")
    eng.set_decode_path("host", "local")
    s = eng.generate([[1, 2, 3]] * 4, 6).summary(0)
    assert s["expert_ms"] > 0 and s["wait_ms"] >= 0 and s["expert_ms"] + s["wait_ms"] < s["ms_per_step"], s
    assert s["expert_cpu_ms"] is None
    eng.set_decode_path("graph", "local")
    s = eng.generate([[1, 2, 3]] * 4, 6).summary(0)
    assert s["expert_ms"] is None and s["wait_ms"] is None, s
