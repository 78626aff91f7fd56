"""The sparse MLA pool's quantized tiers on CPU: what set_* writes is what the kernels'
references produce, the getters hand it to the backend, and moves carry every buffer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_hybrid.kernels import fp8_kv, mxfp8
from sglang_hybrid.mem_cache.sparse_mla_pool import SparseMLATokenToKVPool

RANK, ROPE, D = 32, 8, 32


def _pool(kv_tile, index_group):
    return SparseMLATokenToKVPool(size=16, page_size=1, dtype=torch.float8_e4m3fn if kv_tile else torch.float32,
                                  kv_lora_rank=RANK, qk_rope_head_dim=ROPE, layer_num=2, device="cpu",
                                  enable_memory_saver=False, index_head_dim=D, model_dtype=torch.float32,
                                  index_group=index_group, kv_tile=kv_tile)


@pytest.mark.parametrize("kv_tile, index_group", [(16, 16), (None, None)])
def test_quantized_tiers_store_what_the_references_make_and_move_together(kv_tile, index_group):
    pool = _pool(kv_tile, index_group)
    g = torch.Generator().manual_seed(0)
    loc = torch.tensor([3, 7, 1])
    row = torch.randn(3, 1, RANK + ROPE, generator=g)
    index_k = torch.randn(3, D, generator=g)
    pool.set_kv_buffer(SimpleNamespace(layer_id=1), loc, row, row[..., :RANK])
    pool.set_index_k(1, loc, index_k)

    latent = pool.get_key_buffer(1)[:, 0]
    kv_scale, kv_rope = pool.get_latent_fp8(1)
    ik, k_scale = pool.get_index_k_buffer(1)
    if kv_tile:
        data, scale = fp8_kv.quantize_kv_fp8_torch(row[:, 0, :RANK], kv_tile)
        assert torch.equal(latent[loc].view(torch.uint8), data.view(torch.uint8)) and torch.equal(kv_scale[loc], scale)
        assert torch.equal(kv_rope[loc], row[:, 0, RANK:])
        data, scale = mxfp8.quantize_mxfp8_torch(index_k, index_group)
        assert torch.equal(ik[loc].view(torch.uint8), data.view(torch.uint8)) and torch.equal(k_scale[loc], scale)
    else:
        assert kv_scale is None and kv_rope is None and k_scale is None
        assert torch.equal(latent[loc], row[:, 0]) and torch.equal(ik[loc], index_k)

    before = [b.clone() for b in pool.kv_buffer + pool._side_buffers()]
    pool.move_kv_cache(torch.tensor([10, 11, 12]), loc)
    for old, new in zip(before, pool.kv_buffer + pool._side_buffers()):
        assert torch.equal(new[torch.tensor([10, 11, 12])].view(torch.uint8), old[loc].view(torch.uint8))


def test_per_tile_fp8_latent_needs_the_fp8_kv_cache_dtype():
    with pytest.raises(ValueError, match="kv-cache-dtype fp8_e4m3"):
        SparseMLATokenToKVPool(size=4, page_size=1, dtype=torch.bfloat16, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                               layer_num=1, device="cpu", enable_memory_saver=False, index_head_dim=D,
                               model_dtype=torch.float32, kv_tile=16)
