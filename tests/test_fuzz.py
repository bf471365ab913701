"""Mutated checkpoints never end in a traceback: a malformed safetensors header or config.json value either loads
and decodes, or is one RocketError (one line naming the file). hypothesis draws the mutations (derandomized, so a
run is the same every time); each example loads the tiny preset's checkpoint in this process and decodes a step."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocket_mpi.errors import RocketError
from rocket_mpi.runtime.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")

FUZZ = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# any JSON value, small
JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=False)
                    | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)


def load_and_step(d: str) -> None:
    """What decode does with a checkpoint before and during its first steps: RocketError or nothing."""
    try:
        e = Engine(d)
        e.generate([[1, 2, 3]], 2)
    except RocketError:
        pass


def header_of(path: str) -> tuple[dict, bytes]:
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


@st.composite
def header_mutation(draw, names: list[str]):
    """(how, args) for mutate_header: one field of one entry, a whole entry, an extra key, or raw bytes."""
    how = draw(st.sampled_from(["field", "drop", "entry", "extra", "offsets", "bytes", "length"]))
    name = draw(st.sampled_from(names + ["__metadata__"]))
    if how in ("field", "drop"):
        return how, (name, draw(st.sampled_from(["dtype", "shape", "data_offsets"])), draw(JSON))
    if how in ("entry", "extra"):
        return how, (name if how == "entry" else draw(st.text(max_size=8)), draw(JSON))
    if how == "offsets":
        return how, (name, draw(st.integers(-3, 3)), draw(st.integers(-3, 3)))
    if how == "bytes":
        return how, draw(st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255)), min_size=1, max_size=4))
    return how, draw(st.integers(-64, 64))


def mutate_header(path: str, how: str, args) -> None:
    header, data = header_of(path)
    text = None
    if how in ("field", "drop"):
        name, key, value = args
        if isinstance(header.get(name), dict):
            if how == "drop":
                header[name].pop(key, None)
            else:
                header[name][key] = value
    elif how in ("entry", "extra"):
        header[args[0]] = args[1]
    elif how == "offsets" and isinstance(header.get(args[0]), dict) and "data_offsets" in header[args[0]]:
        a, b = header[args[0]]["data_offsets"]
        header[args[0]]["data_offsets"] = [a + args[1], b + args[2]]
    text = json.dumps(header).encode()
    if how == "bytes":
        text = bytearray(text)
        for at, byte in args:
            text[at % len(text)] = byte
        text = bytes(text)
    n = len(text) + (args if how == "length" else 0)
    with open(path, "wb") as f:
        f.write(max(n, 0).to_bytes(8, "little") + text + data)


@FUZZ
@given(data=st.data())
def test_mutated_safetensors_header_is_never_a_traceback(tiny_ckpt, data):
    names = sorted(header_of(os.path.join(tiny_ckpt, "model.safetensors"))[0])
    how, args = data.draw(header_mutation([n for n in names if n != "__metadata__"]))
    with tempfile.TemporaryDirectory() as d:
        shutil.copytree(tiny_ckpt, d, dirs_exist_ok=True)
        mutate_header(os.path.join(d, "model.safetensors"), how, args)
        load_and_step(d)


CONFIG_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
               "tie_word_embeddings", "attention_bias", "use_qk_norm", "moe_intermediate_size", "num_experts_per_tok",
               "n_routed_experts", "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group",
               "first_k_dense_replace", "norm_topk_prob", "dtype", "eos_token_id", "rope_parameters", "rope_scaling",
               "rope_theta", "partial_rotary_factor", "swiglu_limit", "quantization_config", "model_type"]


@FUZZ
@given(key=st.sampled_from(CONFIG_KEYS), value=JSON | st.integers(0, 600))
def test_config_value_of_any_type_is_never_a_traceback(tiny_ckpt, key, value):
    with tempfile.TemporaryDirectory() as d:
        shutil.copytree(tiny_ckpt, d, dirs_exist_ok=True)
        path = os.path.join(d, "config.json")
        cfg = json.load(open(path))
        cfg[key] = value
        json.dump(cfg, open(path, "w"))
        load_and_step(d)

