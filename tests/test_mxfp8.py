"""MXFP8 quantizer (index Q/K): the reference's properties, and the Triton kernel against
it bit for bit (Triton interpreter on CPU; fp32/fp16/bf16 inputs on a GPU)."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import DEVICE, KERNEL_DTYPES, e4m3_exact_inputs, import_kernels, interpreter  # noqa: F401 (fixture)

_module = import_kernels("sglang_hybrid.kernels.mxfp8")
quantize_mxfp8, quantize_mxfp8_torch, dequantize_mxfp8 = (
    _module.quantize_mxfp8, _module.quantize_mxfp8_torch, _module.dequantize_mxfp8)


def _edge_values() -> torch.Tensor:
    """Groups of 32 that sit on the scale rule's edges."""
    rows = [
        torch.zeros(32),                                   # all zero: exponent -127
        torch.full((32,), 448.0),                          # amax exactly 448 * 2^0
        torch.full((32,), 448.0 * 2.0**-20),               # exactly 448 * 2^k
        torch.full((32,), 448.0 * (1 + 2.0**-20)),         # just above: next exponent
        torch.full((32,), 448.0 * (1 - 2.0**-20)),         # just below
        torch.full((32,), 1.0),                            # a power of two (m = 1)
        torch.full((32,), 1.75 * 2.0**40),                 # m = 1.75 exactly
        torch.full((32,), 1e-40),                          # fp32 subnormal amax
        torch.full((32,), 3e38),                           # near fp32 max
        torch.linspace(-5, 5, 32),                         # signs, a zero inside
    ]
    return torch.stack(rows)


def test_reference_scale_rule_and_error_bound():
    x = torch.cat([_edge_values(), torch.randn(64, 32) * torch.logspace(-6, 6, 64)[:, None]])
    data, scale = quantize_mxfp8_torch(x)
    e = scale.double() - 127
    amax = x.abs().amax(-1).double()
    nonzero = amax > 0
    # The smallest power of two that keeps the group inside e4m3's 448 ...
    assert (amax[nonzero] <= 448 * torch.exp2(e[nonzero, 0])).all()
    assert ((amax > 448 * torch.exp2(e[:, 0] - 1)) | (e[:, 0] == -127))[nonzero].all()
    assert scale[0].item() == 0 and (data[0].float() == 0).all()
    assert e[1, 0] == 0 and e[2, 0] == -20 and e[3, 0] == 1 and e[4, 0] == 0
    # ... and e4m3 rounding is the only error: half an ulp, 2^-4 relative for normals.
    back = dequantize_mxfp8(data, scale)
    s = torch.exp2(e).float()
    err = (back - x).abs()
    assert (err <= torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10)).all()


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("shape, group", [((10, 32), 32), ((3, 4, 128), 32), ((5, 64), 16), ((1, 256), 128),
                                          ((0, 64), 32), ((37, 96), 32)])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_matches_reference_bit_for_bit(shape, group, dtype):
    x = e4m3_exact_inputs(shape, group, torch.Generator().manual_seed(0)).to(dtype).to(DEVICE)
    data, scale = quantize_mxfp8(x, group)
    ref_data, ref_scale = quantize_mxfp8_torch(x, group)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))


@pytest.mark.usefixtures("interpreter")
def test_kernel_scales_on_edge_values():
    x = _edge_values().to(DEVICE)
    data, scale = quantize_mxfp8(x)
    ref_data, ref_scale = quantize_mxfp8_torch(x)
    assert torch.equal(scale, ref_scale)
    if DEVICE == "cuda":
        assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))


@pytest.mark.parametrize("bad, message", [(16, "multiple"), (24, "power of two")])
def test_bad_group_sizes_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        quantize_mxfp8_torch(torch.zeros(2, 40), bad)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("T, D, group", [(1, 32, 32), (13, 64, 16), (40, 128, 32), (0, 64, 32)])
def test_store_into_paged_cache_matches_reference(T, D, group):
    """Quantize-and-scatter into cache slots; untouched slots stay as they were."""
    g = torch.Generator().manual_seed(T)
    x = e4m3_exact_inputs((T, D), group, g).to(DEVICE)
    slots = 3 * T + 5
    loc = torch.randperm(slots, generator=g)[:T].to(DEVICE)
    caches = [(torch.full((slots, D), 0x11, dtype=torch.uint8).view(torch.float8_e4m3fn).to(DEVICE),
               torch.full((slots, D // group), 7, dtype=torch.uint8, device=DEVICE)) for _ in range(2)]
    _module.store_mxfp8(x, loc, *caches[0])
    _module.store_mxfp8_torch(x, loc, *caches[1])
    assert torch.equal(caches[0][0].view(torch.uint8), caches[1][0].view(torch.uint8))
    assert torch.equal(caches[0][1], caches[1][1])


def test_store_rejects_a_cache_of_the_wrong_kind():
    with pytest.raises(ValueError, match="MXFP8 cache"):
        _module.store_mxfp8(torch.zeros(2, 32), torch.arange(2), torch.zeros(4, 32), torch.zeros(4, 1, dtype=torch.uint8))
