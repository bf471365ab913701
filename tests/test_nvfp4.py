"""NVFP4 on hand-computed values: nibble order, E2M1 rounding, block and global scales."""
import torch

from rocket_mpi.ops import nvfp4


def test_pack_puts_element_2j_in_the_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    packed = nvfp4.pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert nvfp4.unpack_e2m1(packed).tolist() == codes.tolist()


def test_e2m1_values_and_sign_bit():
    assert nvfp4.E2M1_VALUES[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert nvfp4.E2M1_VALUES[8 + 7].item() == -6.0


def test_rounding_to_nearest_ties_to_even():
    x = torch.tensor([0.0, 0.2, 0.25, 0.3, 0.75, 1.25, 1.3, 1.75, 2.5, 2.6, 3.5, 5.0, 5.1, 100.0, -0.75, -0.1])
    # 0.25 ties 0/0.5 -> 0 (even code 0); 0.75 ties 0.5/1 -> 1 (code 2); 1.25 -> 1; 1.75 -> 2; 2.5 -> 2;
    # 3.5 -> 4; 5 -> 4; beyond 6 saturates at 6; a value rounding to zero keeps code 0 (no -0)
    want = [0, 0, 0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 7, 8 | 2, 0]
    assert nvfp4.e2m1_codes(x).tolist() == want


def test_quantize_block_by_hand():
    # one row, one block of 16: amax 6 -> weight_scale_2 = 6 / (6 * 448); block scale = 6/6/s2 = 448
    row = torch.tensor([[6.0, -3.0, 1.5, 0.5] + [0.0] * 12])
    w, s, s2 = nvfp4.quantize(row)
    assert abs(float(s2) - 6.0 / 2688.0) < 1e-9
    assert s.dtype == torch.float8_e4m3fn and float(s[0, 0]) == 448.0
    assert nvfp4.unpack_e2m1(w)[0, :4].tolist() == [7, 8 | 5, 3, 1]
    back = nvfp4.dequantize(w, s, s2)
    assert torch.allclose(back, row, rtol=0, atol=1e-6)


def test_global_scale_left_out_on_request():
    row = torch.tensor([[3.0] * 16])
    w, s, s2 = nvfp4.quantize(row)
    full = nvfp4.dequantize(w, s, s2)
    bare = nvfp4.dequantize(w, s, 1.0)
    assert torch.allclose(full, bare * s2)


def test_roundtrip_error_is_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    wt = torch.randn(64, 128, generator=g) * 0.02
    w, s, s2 = nvfp4.quantize(wt)
    back = nvfp4.dequantize(w, s, s2)
    # E2M1's widest relative gap is between 4 and 6: half a step is 1/6 of a block's amax, plus e4m3 scale error
    blocks_amax = wt.abs().view(64, 8, 16).amax(-1, keepdim=True).expand(64, 8, 16).reshape(64, 128)
    assert ((back - wt).abs() <= blocks_amax / 6 * 1.15 + 1e-7).all()


def test_shared_global_amax_for_gate_and_up():
    a = torch.randn(8, 32)
    w, s, s2 = nvfp4.quantize(a, global_amax=10.0)
    assert abs(float(s2) - 10.0 / 2688.0) < 1e-9


def test_dequantize_in_chunks_is_the_formula_bit_for_bit(monkeypatch):
    """dequantize (a byte's two values looked up, row chunks) against W = E2M1[code] x scale x weight_scale_2 written
    out element by element: every byte value, zero and largest scales, with and without the global scale, fp32 and
    bf16, chunks of 1 row, a few rows and the whole tensor."""
    g = torch.Generator().manual_seed(2)
    w = torch.cat([torch.arange(256, dtype=torch.uint8).view(8, 32),
                   torch.randint(0, 256, (9, 32), dtype=torch.uint8, generator=g)])
    sc = (torch.rand(17, 4, generator=g) * 500).to(torch.float8_e4m3fn)
    sc[0, 0], sc[-1, -1] = 0, 448
    codes = nvfp4.unpack_e2m1(w)
    for s2 in (1.0, torch.tensor(0.0123), torch.tensor(3.7e-5)):
        want = nvfp4.E2M1_VALUES[codes.long()].view(17, 4, 16) * sc.float().unsqueeze(-1)
        want = (want if isinstance(s2, float) else want * s2).view(17, 64)
        for dt in (torch.float32, torch.bfloat16):
            for chunk in (1, 100, 1 << 24):
                monkeypatch.setattr(nvfp4, "DEQUANT_CHUNK", chunk)
                got = nvfp4.dequantize(w, sc, s2, dt)
                assert got.dtype == dt and torch.equal(got, want.to(dt)), (s2, dt, chunk)
