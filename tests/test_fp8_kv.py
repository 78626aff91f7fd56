"""FP8 latent KV (per token, fp32 scale per tile): the reference's properties, and the
store kernel against it bit for bit (Triton interpreter on CPU, natively on a GPU)."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import DEVICE, e4m3_exact_inputs, import_kernels, interpreter  # noqa: F401 (fixture)

_module = import_kernels("sglang_hybrid.kernels.fp8_kv")


def test_reference_error_bound_and_zero_tiles():
    g = torch.Generator().manual_seed(0)
    c = torch.randn(20, 256, generator=g) * torch.logspace(-4, 4, 20)[:, None]
    c[3, :128] = 0
    data, scale = _module.quantize_kv_fp8_torch(c)
    assert scale.shape == (20, 2) and scale[3, 0] == 1 and (data[3, :128].float() == 0).all()
    back = _module.dequantize_kv_fp8(data, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative, plus subnormals near 0.
    bound = torch.maximum(c.abs() * 2.0**-4, scale.repeat_interleave(128, 1) * 2.0**-9)
    assert ((back - c).abs() <= bound).all()


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("T, rank, tile", [(1, 128, 128), (17, 256, 128), (9, 64, 32), (0, 128, 128)])
def test_store_matches_reference_bit_for_bit(T, rank, tile):
    g = torch.Generator().manual_seed(T)
    c = e4m3_exact_inputs((T, rank), tile, g).to(DEVICE)
    slots = 2 * T + 3
    loc = torch.randperm(slots, generator=g)[:T].to(DEVICE)
    caches = [(torch.full((slots, rank), 0x22, dtype=torch.uint8).view(torch.float8_e4m3fn).to(DEVICE),
               torch.full((slots, rank // tile), -1.0, device=DEVICE)) for _ in range(2)]
    _module.store_kv_fp8(c, loc, *caches[0])
    _module.store_kv_fp8_torch(c, loc, *caches[1])
    assert torch.equal(caches[0][0].view(torch.uint8), caches[1][0].view(torch.uint8))
    assert torch.equal(caches[0][1], caches[1][1])


def test_bad_tiles_and_caches_are_named():
    with pytest.raises(ValueError, match="multiple"):
        _module.quantize_kv_fp8_torch(torch.zeros(2, 100), 64)
    with pytest.raises(ValueError, match="FP8 KV cache"):
        _module.store_kv_fp8(torch.zeros(2, 128), torch.arange(2), torch.zeros(4, 128), torch.zeros(4, 1))
