"""Sparse MLA kernel against its PyTorch reference (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import DEVICE, KERNEL_DTYPES, import_kernels, interpreter  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")

_module = import_kernels("sglang_hybrid.kernels.sparse_mla")
sparse_mla, sparse_mla_torch = _module.sparse_mla, _module.sparse_mla_torch
quantize_kv_fp8_torch = import_kernels("sglang_hybrid.kernels.fp8_kv").quantize_kv_fp8_torch


# (history length of each row's request, selected count per row, topk, heads, rank, rope)
SHAPES = [
    ([1], [1], 4, 4, 32, 8),                 # one token; rope narrower than a dot tile
    ([10, 40], [10, 16], 16, 3, 16, 16),     # K larger than the history (-1 padding), full selection
    ([100, 100, 7], [33, 64, 7], 64, 16, 64, 32),  # several blocks, ragged selections
    ([5], [0], 8, 2, 16, 8),                 # nothing selected: zeros
    ([5, 9], [0, 9], 64, 2, 16, 8),          # split selections: a row with nothing, a row with one split's worth
    ([50, 20], [24, 20], 32, 40, 32, 16),    # heads over three programs of 16, the last partial
]


def _case(hist, counts, topk, H, rank, rope, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    R, max_len = len(hist), max(hist)
    slots = torch.randperm(R * max_len + 3, generator=g)[: R * max_len].reshape(R, max_len).to(torch.int32)
    kv = torch.randn(R * max_len + 3, rank + rope, generator=g).to(dtype)
    q = torch.randn(R, H, rank + rope, generator=g).to(dtype)
    selected = torch.full((R, topk), -1, dtype=torch.int32)
    for r, (n, c) in enumerate(zip(hist, counts)):
        selected[r, :c] = torch.randperm(n, generator=g)[:c].to(torch.int32)
    to = dict(device=DEVICE)
    return q.to(**to), kv.to(**to), slots.to(**to), torch.arange(R, dtype=torch.int32, **to), selected.to(**to)


@pytest.mark.parametrize("hist, counts, topk, H, rank, rope", SHAPES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("programs", [1, 64])  # the whole selection per program, or split and combined
def test_sparse_mla_matches_reference(hist, counts, topk, H, rank, rope, dtype, programs):
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    q, kv, table, rows, selected = _case(hist, counts, topk, H, rank, rope, dtype)
    scale = (rank + rope) ** -0.5
    out = sparse_mla(q, kv, table, rows, selected, rank, scale, block_n=16, block_h=16, programs=programs)
    ref = sparse_mla_torch(q, kv, table, rows, selected, rank, scale)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    if not any(counts):
        assert not out.any()


FP8_SHAPES = [(hist, counts, topk, H, rank, rope) for hist, counts, topk, H, rank, rope in SHAPES if rank >= 32]


@pytest.mark.parametrize("hist, counts, topk, H, rank, rope", FP8_SHAPES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("programs", [1, 64])
def test_sparse_mla_fp8_latent_matches_reference(hist, counts, topk, H, rank, rope, dtype, programs):
    """FP8 latent (tile 16 of the latent width; rope kept in the model dtype), quantized by
    the reference quantizer, dequantized inside the kernel."""
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    q, kv, table, rows, selected = _case(hist, counts, topk, H, rank, rope, dtype)
    data, kv_scale = quantize_kv_fp8_torch(kv[:, :rank].float(), 16)
    kv_rope = kv[:, rank:].contiguous()
    scale = (rank + rope) ** -0.5
    out = sparse_mla(q, data, table, rows, selected, rank, scale, block_n=16, block_h=16, kv_scale=kv_scale,
                     kv_rope=kv_rope, programs=programs)
    ref = sparse_mla_torch(q, data, table, rows, selected, rank, scale, kv_scale=kv_scale, kv_rope=kv_rope)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    # The FP8 latent only rounds the cache: the result stays near the unquantized one.
    exact = sparse_mla_torch(q, kv, table, rows, selected, rank, scale).float()
    assert (out.float() - exact).abs().max() <= 0.1 * exact.abs().max() + tol


def test_fp8_latent_needs_scales_and_rope_together():
    q, kv, table, rows, selected = _case([10], [4], 4, 2, 32, 8, torch.float32)
    data, kv_scale = quantize_kv_fp8_torch(kv[:, :32], 16)
    with pytest.raises(ValueError, match="both"):
        sparse_mla(q, data, table, rows, selected, 32, 0.1, kv_scale=kv_scale)
    with pytest.raises(ValueError, match="do not match"):
        sparse_mla(q, data, table, rows, selected, 32, 0.1, kv_scale=kv_scale, kv_rope=kv[:, :3])


def test_only_selected_positions_matter():
    q, kv, table, rows, selected = _case([50], [8], 8, 2, 16, 16, torch.float32)
    out = sparse_mla(q, kv, table, rows, selected, 16, 0.25, block_n=16)
    others = torch.ones(kv.shape[0], dtype=torch.bool, device=kv.device)
    others[table[0, selected[0].long()].long()] = False
    kv[others] = 1e3  # everything not selected changes wildly
    torch.testing.assert_close(sparse_mla(q, kv, table, rows, selected, 16, 0.25, block_n=16), out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="sgl-kernel's FlashMLA runs on a GPU")
@pytest.mark.parametrize("H, topk", [(128, 128), (16, 100)])  # heads padded to 64; Top-K padded to 128
def test_flashmla_alternative_matches_reference(H, topk):
    """kernels.flashmla_sparse (sgl-kernel's FlashMLA) on the same interface, BF16 latent."""
    from sglang_hybrid.kernels.flashmla_sparse import sparse_mla_flashmla

    q, kv, table, rows, selected = _case([300, 90, 5], [topk, 90, 0], topk, H, 512, 64, torch.bfloat16)
    scale = 192**-0.5
    out = sparse_mla_flashmla(q, kv, table, rows, selected, 512, scale)
    ref = sparse_mla_torch(q, kv, table, rows, selected, 512, scale)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert not out[2].any()  # nothing selected: zeros
