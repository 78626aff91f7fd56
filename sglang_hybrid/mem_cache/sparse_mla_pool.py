"""KV pool for the sparse MLA layers: SGLang's MLA latent cache plus an index-K cache.

Each token slot holds, per sparse layer, the MLA latent row [kv_lora_rank + rope]
(SGLang's MLATokenToKVPool, unchanged) and the indexer key [index_head_dim]:
in the serving dtype, or MXFP8 (e4m3 data plus one e8m0 scale byte per group,
kernels.mxfp8) when index_group is set. Both live at the same slot index, so the
radix cache, the allocator and eviction treat them as one: a prefix that keeps
its KV keeps its index keys.
"""

from __future__ import annotations

import torch

from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

from sglang_hybrid.kernels import mxfp8


class SparseMLATokenToKVPool(MLATokenToKVPool):
    def __init__(self, *args, index_head_dim: int, index_dtype: torch.dtype, index_group: int | None = None, **kwargs):
        self.index_head_dim = index_head_dim
        self.index_dtype = index_dtype
        self.index_group = index_group
        super().__init__(*args, **kwargs)
        self._store_mxfp8 = mxfp8.store_mxfp8 if str(self.device).startswith("cuda") else mxfp8.store_mxfp8_torch

    def _create_buffers(self):
        super()._create_buffers()
        rows, D = self.size + self.page_size, self.index_head_dim  # slot 0 and the pad take padded tokens' writes
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            if self.index_group:
                self.index_k_buffer = [torch.zeros((rows, D), dtype=mxfp8.FP8, device=self.device)
                                       for _ in range(self.layer_num)]
                self.index_scale_buffer = [torch.zeros((rows, D // self.index_group), dtype=torch.uint8,
                                                       device=self.device) for _ in range(self.layer_num)]
            else:
                self.index_k_buffer = [torch.zeros((rows, D), dtype=self.index_dtype, device=self.device)
                                       for _ in range(self.layer_num)]
                self.index_scale_buffer = []

    def _clear_buffers(self):
        super()._clear_buffers()
        del self.index_k_buffer, self.index_scale_buffer

    def get_kv_size_bytes(self):
        return super().get_kv_size_bytes() + sum(
            b.numel() * b.element_size() for b in self.index_k_buffer + self.index_scale_buffer)

    def get_index_k_buffer(self, pool_layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(index keys [slots, D], their MXFP8 scale bytes [slots, D // group] or None)."""
        scale = self.index_scale_buffer[pool_layer] if self.index_group else None
        return self.index_k_buffer[pool_layer], scale

    def set_index_k(self, pool_layer: int, loc: torch.Tensor, index_k: torch.Tensor) -> None:
        if self.index_group:
            self._store_mxfp8(index_k, loc, self.index_k_buffer[pool_layer], self.index_scale_buffer[pool_layer])
        else:
            self.index_k_buffer[pool_layer][loc] = index_k.to(self.index_dtype)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        super().move_kv_cache(tgt_loc, src_loc)
        if tgt_loc.numel():
            tgt, src = tgt_loc.view(-1).long(), src_loc.view(-1).long()
            for buf in self.index_k_buffer + self.index_scale_buffer:
                buf[tgt] = buf[src]
