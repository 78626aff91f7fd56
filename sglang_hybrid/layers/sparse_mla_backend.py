"""Attention backend for the sparse MLA layers: index-K cache, Top-K, sparse attention.

The layer hands over the absorbed query q = [q_nope W_kc | q_pe] per head, the new
latent row k = [c | k_pe], the indexer query, its head weights (all scales folded
in) and the new index keys. Per query row the backend scores every visible history
position, keeps the Top-K (reference.ops.topk_positions's order and tie rule),
gathers those latent rows from the paged pool and attends over them only. The
output is the latent attention result [T, H * kv_lora_rank]; the layer applies W_vc.

This is the simple, correct torch version that the fused Triton kernels of the
sparse-path issue replace. Extend runs per request (ragged, chunked prefill with a
cached prefix); decode is batched over a padded history so it captures in a CUDA
graph (the padded length is the req_to_token width while capturing).
"""

from __future__ import annotations

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from sglang_hybrid.kernels.sparse_mla import sparse_mla_torch
from sglang_hybrid.reference.ops import indexer_scores, topk_positions

# Scratch budget for one extend block of indexer logits [rows, heads, history] (fp32).
_EXTEND_SCORE_BYTES = 256 << 20


class SparseMLAAttnBackend(AttentionBackend):
    needs_cpu_seq_lens = True

    def __init__(self, model_runner):
        super().__init__()
        config = model_runner.model_config.hf_config
        self.device = model_runner.device
        self.topk = config.index_topk
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.max_context_len = self.req_to_token.shape[1]
        self.decode_history_len = self.max_context_len

    # --------------------------------------------------------------- metadata
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        if forward_batch.seq_lens_cpu is not None and forward_batch.seq_lens_cpu.numel():
            self.decode_history_len = int(forward_batch.seq_lens_cpu.max())
        else:
            self.decode_history_len = self.max_context_len

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        # Captured graphs replay with whatever history length they were recorded with.
        self.decode_history_len = self.max_context_len

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        pass

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def support_triton(self):
        return str(self.device).startswith("cuda")

    # ----------------------------------------------------------------- caches
    def _pool_layer(self, layer_id: int) -> int:
        return self.token_to_kv_pool.full_attention_layer_id_mapping[layer_id]

    def _store(self, layer, forward_batch, k, v, index_k, save_kv_cache):
        if save_kv_cache:
            loc = forward_batch.out_cache_loc
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
            self.token_to_kv_pool.full_kv_pool.set_index_k(self._pool_layer(layer.layer_id), loc, index_k)
        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)[:, 0]  # [slots, rank + rope]
        ik = self.token_to_kv_pool.full_kv_pool.get_index_k_buffer(self._pool_layer(layer.layer_id))
        return kv, ik

    # ----------------------------------------------------------------- extend
    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True, *,
                       index_q, index_k, index_weights, **kwargs):
        kv, ik = self._store(layer, forward_batch, k, v, index_k, save_kv_cache)
        H, rank = layer.tp_q_head_num, layer.v_head_dim
        q = q.view(-1, H, layer.qk_head_dim)
        out = q.new_zeros(q.shape[0], H, rank)
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        extend_lens = forward_batch.extend_seq_lens_cpu
        req_rows = forward_batch.req_pool_indices.tolist()
        start = 0
        for req, prefix, n in zip(req_rows, prefix_lens, extend_lens):
            if n == 0:
                continue
            L = prefix + n
            hist_ik = ik[self.req_to_token[req, :L].long()]
            block = max(1, _EXTEND_SCORE_BYTES // (4 * index_q.shape[1] * L))
            for r0 in range(0, n, block):
                rows = slice(start + r0, start + min(n, r0 + block))
                positions = torch.arange(prefix + r0, prefix + min(n, r0 + block), device=q.device)
                scores = indexer_scores(index_q[rows].float(), index_weights[rows].float(), hist_ik.float(), positions)
                selected = topk_positions(scores, self.topk)
                row_req = torch.full((len(positions),), req, dtype=torch.long, device=q.device)
                out[rows] = sparse_mla_torch(q[rows], kv, self.req_to_token, row_req, selected, rank, layer.scaling)
            start += n
        return out.reshape(-1, H * rank)

    # ----------------------------------------------------------------- decode
    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True, *,
                       index_q, index_k, index_weights, **kwargs):
        kv, ik = self._store(layer, forward_batch, k, v, index_k, save_kv_cache)
        H, rank = layer.tp_q_head_num, layer.v_head_dim
        B, L = q.shape[0], self.decode_history_len
        q = q.view(B, H, layer.qk_head_dim)
        locs = self.req_to_token[forward_batch.req_pool_indices, :L].long()  # [B, L]
        scores = torch.einsum("bhd,bld->bhl", index_q.float(), ik[locs].float()).relu_()
        scores = torch.einsum("bh,bhl->bl", index_weights.float(), scores)
        visible = torch.arange(L, device=q.device)[None, :] < forward_batch.seq_lens[:, None]
        selected = topk_positions(scores.masked_fill(~visible, float("-inf")), self.topk)  # [B, topk]
        out = sparse_mla_torch(q, kv, self.req_to_token, forward_batch.req_pool_indices, selected, rank, layer.scaling)
        return out.reshape(B, H * rank)

