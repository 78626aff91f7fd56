"""Attention for a dense standalone draft model on CPU (--speculative-algorithm STANDALONE).

SGLang's EAGLE worker has CPU draft backends only for intel_amx, which needs sgl-kernel's
CPU build. A chain draft needs little: every row it runs (the draft's prefill, each later
draft step, the extend over the verified tokens) attends to its request's positions up to
its own, read through req_to_token. So each row is one decode query over positions + 1
keys, on SGLang's own torch SDPA path. Tree drafts (topk > 1) would need each branch's own
path and are refused before a server starts (plugin._standalone_draft).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend


class DenseDraftAttnBackend(TorchNativeAttnBackend):
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._rows_to_own_position(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._rows_to_own_position(q, k, v, layer, forward_batch, save_kv_cache)

    def _rows_to_own_position(self, q, k, v, layer, forward_batch, save_kv_cache):
        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        rows = q.shape[0]
        mode = forward_batch.forward_mode
        if mode.is_extend() and not mode.is_draft_extend_v2():
            per_request = forward_batch.extend_seq_lens
        else:  # decode steps: one row a request; the extend over verified tokens: a fixed count
            per_request = torch.full_like(forward_batch.req_pool_indices, rows // forward_batch.batch_size)
        row_req = torch.repeat_interleave(forward_batch.req_pool_indices, per_request, output_size=rows)
        q_ = q.reshape(rows, layer.tp_q_head_num, layer.qk_head_dim)
        o = q.new_empty(rows, layer.tp_q_head_num, layer.v_head_dim)
        self._run_sdpa_forward_decode(
            q_, o, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id), self.req_to_token_pool.req_to_token,
            row_req, forward_batch.positions + 1, None, scaling=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num, causal=False)
        return o.reshape(rows, layer.tp_q_head_num * layer.v_head_dim)


class DenseDraftMultiStepBackend(AttentionBackend):
    """SGLang's multi-step draft interface: one backend per draft step after the first."""

    def __init__(self, model_runner, speculative_num_steps: int):
        super().__init__()
        self.attn_backends = [DenseDraftAttnBackend(model_runner) for _ in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch):
        pass

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        pass
