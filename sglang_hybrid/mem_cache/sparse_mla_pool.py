"""KV pool for the sparse MLA layers: SGLang's MLA latent cache plus an index-K cache.

Each token slot holds, per sparse layer, the MLA latent row [kv_lora_rank + rope]
(SGLang's MLATokenToKVPool, unchanged) and the indexer key [index_head_dim].
Both live at the same slot index, so the radix cache, the allocator and
eviction treat them as one: a prefix that keeps its KV keeps its index keys.
"""

from __future__ import annotations

import torch

from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool


class SparseMLATokenToKVPool(MLATokenToKVPool):
    def __init__(self, *args, index_head_dim: int, index_dtype: torch.dtype, **kwargs):
        self.index_head_dim = index_head_dim
        self.index_dtype = index_dtype
        super().__init__(*args, **kwargs)

    def _create_buffers(self):
        super()._create_buffers()
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            # Slot 0 (and the page-size pad) receives padded tokens' writes, as for KV.
            self.index_k_buffer = [
                torch.zeros((self.size + self.page_size, self.index_head_dim), dtype=self.index_dtype, device=self.device)
                for _ in range(self.layer_num)
            ]

    def _clear_buffers(self):
        super()._clear_buffers()
        del self.index_k_buffer

    def get_kv_size_bytes(self):
        return super().get_kv_size_bytes() + sum(b.numel() * b.element_size() for b in self.index_k_buffer)

    def get_index_k_buffer(self, pool_layer: int) -> torch.Tensor:
        return self.index_k_buffer[pool_layer]

    def set_index_k(self, pool_layer: int, loc: torch.Tensor, index_k: torch.Tensor) -> None:
        self.index_k_buffer[pool_layer][loc] = index_k.to(self.index_dtype)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        super().move_kv_cache(tgt_loc, src_loc)
        if tgt_loc.numel():
            tgt, src = tgt_loc.view(-1).long(), src_loc.view(-1).long()
            for buf in self.index_k_buffer:
                buf[tgt] = buf[src]
