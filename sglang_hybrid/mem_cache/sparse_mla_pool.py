"""KV pool for the sparse MLA layers: SGLang's MLA latent cache plus an index-K cache.

Each token slot holds, per sparse layer, the MLA latent row and the indexer key.
The latent row [kv_lora_rank + rope] is SGLang's MLATokenToKVPool unchanged; with
kv_tile set (the server's --kv-cache-dtype fp8_e4m3) the buffer keeps only the
latent c as e4m3, with one fp32 scale per tile of kv_tile elements and the rope
key in the serving dtype beside it (kernels.fp8_kv). The indexer key
[index_head_dim] is in the serving dtype, or MXFP8 (e4m3 data plus one e8m0 scale
byte per group, kernels.mxfp8) when index_group is set. All live at the same slot
index, so the radix cache, the allocator and eviction treat them as one: a prefix
that keeps its KV keeps its index keys.
"""

from __future__ import annotations

import torch

from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, unwrap_write_loc

from sglang_hybrid.kernels import fp8_kv, mxfp8


class SparseMLATokenToKVPool(MLATokenToKVPool):
    def __init__(self, *args, index_head_dim: int, model_dtype: torch.dtype, index_group: int | None = None,
                 kv_tile: int | None = None, **kwargs):
        self.index_head_dim = index_head_dim
        self.model_dtype = model_dtype
        self.index_group = index_group
        self.kv_tile = kv_tile
        super().__init__(*args, **kwargs)
        cuda = str(self.device).startswith("cuda")
        self._store_mxfp8 = mxfp8.store_mxfp8 if cuda else mxfp8.store_mxfp8_torch
        self._store_kv_fp8 = fp8_kv.store_kv_fp8 if cuda else fp8_kv.store_kv_fp8_torch

    def _create_buffers(self):
        if self.kv_tile:
            if self.dtype != fp8_kv.FP8:
                raise ValueError(f"the per-tile FP8 latent cache needs --kv-cache-dtype fp8_e4m3, got {self.dtype}")
            self.kv_cache_dim = self.kv_lora_rank  # the base buffer holds c only; rope and scales beside it
        super()._create_buffers()
        rows, D = self.size + self.page_size, self.index_head_dim  # slot 0 and the pad take padded tokens' writes
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            self.kv_scale_buffer, self.kv_rope_buffer = [], []
            if self.kv_tile:
                for _ in range(self.layer_num):
                    self.kv_scale_buffer.append(torch.ones((rows, self.kv_lora_rank // self.kv_tile),
                                                           dtype=torch.float32, device=self.device))
                    self.kv_rope_buffer.append(torch.zeros((rows, self.qk_rope_head_dim), dtype=self.model_dtype,
                                                           device=self.device))
            if self.index_group:
                self.index_k_buffer = [torch.zeros((rows, D), dtype=mxfp8.FP8, device=self.device)
                                       for _ in range(self.layer_num)]
                self.index_scale_buffer = [torch.zeros((rows, D // self.index_group), dtype=torch.uint8,
                                                       device=self.device) for _ in range(self.layer_num)]
            else:
                self.index_k_buffer = [torch.zeros((rows, D), dtype=self.model_dtype, device=self.device)
                                       for _ in range(self.layer_num)]
                self.index_scale_buffer = []

    def _clear_buffers(self):
        super()._clear_buffers()
        del self.index_k_buffer, self.index_scale_buffer, self.kv_scale_buffer, self.kv_rope_buffer

    def _side_buffers(self) -> list[torch.Tensor]:
        return self.index_k_buffer + self.index_scale_buffer + self.kv_scale_buffer + self.kv_rope_buffer

    def get_kv_size_bytes(self):
        return super().get_kv_size_bytes() + sum(b.numel() * b.element_size() for b in self._side_buffers())

    def set_kv_buffer(self, layer, loc_info, cache_k: torch.Tensor, cache_v: torch.Tensor):
        if not self.kv_tile:
            return super().set_kv_buffer(layer, loc_info, cache_k, cache_v)
        loc, _, _ = unwrap_write_loc(loc_info)
        i, rank = layer.layer_id - self.start_layer, self.kv_lora_rank
        row = cache_k.reshape(cache_k.shape[0], -1)
        self._store_kv_fp8(row[:, :rank], loc, self.kv_buffer[i].view(fp8_kv.FP8)[:, 0], self.kv_scale_buffer[i])
        self.kv_rope_buffer[i][loc] = row[:, rank:].to(self.model_dtype)

    def get_latent_fp8(self, pool_layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(latent scales [slots, rank // tile] fp32, rope keys [slots, rope]), or Nones
        when the latent row is kept whole in the serving dtype."""
        if not self.kv_tile:
            return None, None
        return self.kv_scale_buffer[pool_layer], self.kv_rope_buffer[pool_layer]

    def get_index_k_buffer(self, pool_layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(index keys [slots, D], their MXFP8 scale bytes [slots, D // group] or None)."""
        scale = self.index_scale_buffer[pool_layer] if self.index_group else None
        return self.index_k_buffer[pool_layer], scale

    def set_index_k(self, pool_layer: int, loc: torch.Tensor, index_k: torch.Tensor) -> None:
        if self.index_group:
            self._store_mxfp8(index_k, loc, self.index_k_buffer[pool_layer], self.index_scale_buffer[pool_layer])
        else:
            self.index_k_buffer[pool_layer][loc] = index_k.to(self.model_dtype)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        super().move_kv_cache(tgt_loc, src_loc)
        if tgt_loc.numel():
            tgt, src = tgt_loc.view(-1).long(), src_loc.view(-1).long()
            for buf in self._side_buffers():
                buf[tgt] = buf[src]
