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


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_load_with_host_memory_short_reads_the_rest_from_the_checkpoint(fmt, tiny_ckpt, tiny_nvfp4_ckpt,
                                                                         monkeypatch):
    """The GPU's load with 2 device slots and 1 far slot for 6 experts (host memory short, far_slots): the 3 experts
    past the far slot are never read at load and stay in the checkpoint; compute() reads them into the far slot run
    by run, and an expert cache upkeep swaps experts in from there. Every launch's rows are bitwise those of the layer
    loaded with every expert in a slot, and the accounting adds up."""
    from rocket_mpi.moe.cache import ExpertCache
    ckpt = tiny_nvfp4_ckpt if fmt == "nvfp4" else tiny_ckpt
    owned = [0, 2, 5, 7, 9, 11]
    monkeypatch.setattr(experts_mod.ops, "on_gpu", lambda device: True)
    reader = CheckpointReader(ckpt)
    layer = reader.config.moe_layers[0]
    full = ExpertStore.load(reader, layer, owned, device="cpu")
    reads = []
    real = experts_mod.ExpertSource.read
    monkeypatch.setattr(experts_mod.ExpertSource, "read", lambda self, e: reads.append(e) or real(self, e))
    store = ExpertStore.load(reader, layer, owned, device="cpu", resident=[0, 2], slots=6, near=2, far_slots=1)
    assert store.unslotted == {7, 9, 11} and sorted(reads) == [0, 2, 5]   # only the slotted experts were read
    assert store.packed.n_slots == 3 and store.packed.near == 2 and store.capacity == 2
    assert store.packed_bytes == full.packed_bytes and store.read_bytes_per_expert == full.read_bytes_per_expert
    h = reader.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, h, generator=gen).to(torch.bfloat16)
    tokens = torch.tensor([0, 3, 1, 4, 5, 2, 0, 1, 9, 8, 7, 6])
    every = [(0, 0, 2), (2, 2, 3), (5, 3, 5), (7, 5, 6), (9, 6, 9), (11, 9, 12)]
    cold = [(0, 0, 0), (2, 0, 0), (5, 0, 2), (7, 2, 3), (9, 3, 6), (11, 6, 12)]  # the resident experts idle
    cache = ExpertCache({layer: store}, [layer], reader.config.n_routed_experts)
    counter = cache.counter("host", "cpu")
    cache.begin()
    rows = 0
    for step, segs in enumerate((cold, cold, every, cold, every)):
        want = full.compute(x, tokens, segs, 0)
        got = store.compute(x, tokens, segs, 0)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"step {step}"
        for e, s, t in segs:  # the step's firings, as HostMoE counts them
            counter[0, 0, e] += t - s
            counter[0, 1, e] += int(t > s)
            rows += t - s
        cache.maintain(1)
    summary = cache.summary()
    assert summary["swaps"] > 0 and not {0, 2} <= set(store.resident())   # promotions from far and file experts
    assert store.file_reads >= 3 and summary["file_reads"] == store.file_reads
    assert summary["unslotted_experts"] == 3 and len(set(store.packed.slot) | store.unslotted) == 6
    assert summary["hit_rows"] + summary["miss_rows"] == rows


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


@pytest.mark.parametrize("resident", [None, [2, 9, 11]])
def test_load_packs_the_same_in_any_batch(resident, tiny_nvfp4_ckpt, monkeypatch):
    """Loading packs NVFP4 experts in batches (LOAD_BATCH_MAX at a time): batches of 1, 3 and 16 give the same
    packed layer bit for bit, with every expert on the device and with some in far slots (host memory), where a
    batch's slots do not run on."""
    monkeypatch.setattr(experts_mod.ops, "on_gpu", lambda device: True)
    reader = CheckpointReader(tiny_nvfp4_ckpt)
    layer = reader.config.moe_layers[0]
    owned = [0, 2, 5, 7, 9, 11, 12]
    packed = {}
    for n in (1, 3, 16):
        monkeypatch.setattr(experts_mod, "LOAD_BATCH_MAX", n)
        packed[n] = ExpertStore.load(reader, layer, owned, device="cpu", resident=resident).packed
    for n in (3, 16):
        assert packed[n].slot == packed[1].slot
        for name in ("q_gu", "s_gu", "s2_gu", "q_dn", "s_dn", "s2_dn"):
            assert torch.equal(getattr(packed[n], name), getattr(packed[1], name)), (n, name)
        if resident is not None:
            for name in packed[1].far:
                assert torch.equal(packed[n].far[name], packed[1].far[name]), (n, name)
