"""ExpertStore.load packing a layer's experts for the kernel, run on the CPU: ops.on_gpu is forced on,
so the load takes the GPU's path (ops.ExpertPacker, one expert at a time into stacks allocated once) and
compute() the kernel path's torch reference. Checks the packed layer is the one pack_experts /
pack_experts_bf16 build from the same experts, bit for bit, and that its rows match the dense path's."""
from __future__ import annotations

import pytest
import torch

from rocket_mpi import ops
from rocket_mpi.checkpoint.reader import CheckpointReader
from rocket_mpi.moe import experts as experts_mod
from rocket_mpi.moe.experts import ExpertStore


def _load(ckpt, monkeypatch, owned, kernel: bool):
    monkeypatch.setattr(experts_mod.ops, "on_gpu", lambda device: kernel)
    reader = CheckpointReader(ckpt)
    layer = reader.config.moe_layers[0]
    return reader, layer, ExpertStore.load(reader, layer, owned, device="cpu")


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_load_packs_as_pack_experts_does(fmt, tiny_ckpt, tiny_nvfp4_ckpt, monkeypatch):
    ckpt = tiny_nvfp4_ckpt if fmt == "nvfp4" else tiny_ckpt
    owned = [9, 2, 5, 0]                                   # any order: slots are ascending ids
    reader, layer, store = _load(ckpt, monkeypatch, owned, kernel=True)
    p = store.packed
    assert p is not None and p.bf16 == (fmt == "bf16") and p.experts == [0, 2, 5, 9]
    assert not store.gate_up and not store.down           # nothing kept dense
    cfg = reader.config
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    pre = f"model.layers.{layer}.mlp.experts"
    lin = {e: tuple(reader.linear(f"{pre}.{e}.{w}", *shape) for w, shape in
                    (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)))) for e in owned}
    if fmt == "bf16":
        want = ops.pack_experts_bf16({e: tuple(x.dense() for x in lin[e]) for e in owned}, h, i)
        assert store.read_bytes_per_expert == 3 * h * i * 2
    else:
        want = ops.pack_experts(lin, h, i)
    for name in ("q_gu", "s_gu", "s2_gu", "q_dn", "s_dn", "s2_dn"):
        a, b = getattr(p, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), name

    # the packed layer's rows (the kernel path's reference) against the same experts kept dense
    _, _, dense = _load(ckpt, monkeypatch, owned, kernel=False)
    assert dense.packed is None and sorted(dense.gate_up) == sorted(owned)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, h, generator=gen).to(torch.bfloat16)
    tokens = torch.tensor([0, 3, 1, 4, 5, 2, 0, 1])
    segs = [(0, 0, 2), (2, 2, 3), (5, 3, 6), (9, 6, 8)]
    got, ref = store.compute(x, tokens, segs, 0).float(), dense.compute(x, tokens, segs, 0).float()
    err = float((got - ref).norm() / ref.norm())
    assert err < 2.0 ** -6, f"{fmt}: packed rows vs dense rows: relative error {err:.3g}"


def test_packer_refuses_a_missing_or_repeated_expert():
    g = torch.zeros(32, 64, dtype=torch.bfloat16)
    d = torch.zeros(64, 32, dtype=torch.bfloat16)
    packer = ops.ExpertPacker([4, 6], 64, 32, bf16=True)
    packer.add(4, g, g, d)
    with pytest.raises(ValueError, match="packed twice"):
        packer.add(4, g, g, d)
    with pytest.raises(ValueError, match=r"experts \[6\] were never packed"):
        packer.done()
    with pytest.raises(ValueError, match="expected"):
        packer.add(6, g.float(), g, d)
