"""Attention backend for the sparse MLA layers: index-K cache, Top-K, sparse attention.

The layer hands over the absorbed query q = [q_nope W_kc | q_pe] per head, the new
latent row k = [c | k_pe], the indexer query, its head weights (all scales folded
in) and the new index keys. The backend stores the new rows, then works per query
row: row r belongs to request row_req[r] and sees its first row_len[r] positions
(decode: the whole sequence; extend: causal, so position p sees p + 1, which covers
chunked prefill on a cached prefix; a context-parallel extend, parallel.prefill_cp: the
rank's rows only, after every rank's new rows are gathered into its cache). One fused
kernel scores every visible position and keeps the Top-K (reference.ops.topk_positions's set and tie rule, in ascending position); a second
gathers those latent rows from the paged pool and attends over them only. The
output is the latent attention result [T, H * kv_lora_rank]; the layer applies W_vc.
With an MXFP8 index cache (config index_cache_dtype) the queries come quantized to
the same format (layers.sparse_mla.Indexer) and the Top-K kernel dequantizes both on load; with the FP8 latent
cache (--kv-cache-dtype fp8_e4m3) the attention kernel dequantizes c on load.

On a GPU the two are the Triton kernels of sglang_hybrid.kernels; elsewhere their
plain-PyTorch references, which have the same interface. Decode launches depend
only on device tensors, so they capture in a CUDA graph.
"""

from __future__ import annotations

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from sglang_hybrid.kernels import flashmla_sparse, indexer_topk, sparse_mla
from sglang_hybrid.layers.draft_tree import draft_tree_paths

# Extend rows of one request share each index-K tile in blocks of this many rows.
_EXTEND_ROW_BLOCK = 4


def draft_tree_rows(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, step: int, topk: int, num_steps: int,
                    page_size: int = 1):
    """The draft head's step `step` of a tree draft: row (request b, branch k), b-major, wrote
    its token at req_to_token[seq_len + k * stride + step] and sees the prefix and its own
    branch's steps 0..step, none of the positions between (SGLang's draft layout, as its own
    draft backends read it, `generate_draft_decode_kv_indices`). stride: num_steps at page
    size 1; with pages, each branch's page-aligned region, whose first slots hold copies of
    the prefix's partial last page (skipped here: the row reads the originals).
    (row_req, row_len, tree) for indexer_topk."""
    branch = torch.arange(topk, device=seq_lens.device).repeat(seq_lens.numel())
    tail = seq_lens.repeat_interleave(topk).long()
    stride = num_steps if page_size == 1 else (tail % page_size + num_steps + page_size - 1) // page_size * page_size
    skip = branch * stride
    bits = torch.full_like(tail, (1 << (step + 1)) - 1)
    return req_pool_indices.repeat_interleave(topk), tail + skip + step + 1, (tail, bits, skip)


class SparseMLAAttnBackend(AttentionBackend):
    def __init__(self, model_runner, flashmla: bool = False, draft_step: tuple[int, int, int] | None = None):
        """draft_step: (step, topk, num_steps) for the draft head's step `step` of a tree draft."""
        super().__init__()
        self.draft_step = draft_step
        self.page_size = model_runner.page_size
        self._verify_tree = self._tree_links = self._tree_link_bufs = None
        args = model_runner.server_args
        # (topk, draft tokens) of a target that verifies drafts
        self._spec_shape = ((args.speculative_eagle_topk or 1, args.speculative_num_draft_tokens)
                            if args.speculative_algorithm and not model_runner.is_draft_worker else None)
        # Rows read their history length from positions on the device, never from host
        # copies of seq_lens. Saying so spares SGLang's overlap scheduler a wait on the GPU
        # before every speculative step (its FutureMap otherwise pulls seq_lens to the host
        # behind the last verify). The CPU serves without overlap and keeps the host copy.
        self.needs_cpu_seq_lens = not str(model_runner.device).startswith("cuda")
        self.max_context_len = model_runner.model_config.context_len
        # Verify rows take their visibility from positions (and, for trees, SGLang's
        # next-token/sibling links), never from the tree mask: ask for the unread layout,
        # which is draft x draft cells per request, so SGLang need not size a full
        # [draft x context] mask from host seq_lens each step. (Imported here: its module
        # pulls in SGLang's memory pools, which the kernel compile check must not.)
        from sglang.srt.layers.attention.verify_mask import maybe_create_verify_mask
        self._verify_mask = maybe_create_verify_mask(
            is_draft_runner=model_runner.is_draft_worker, skip_prefill=False,
            max_bs=model_runner.req_to_token_pool.size, max_context_len=self.max_context_len,
            num_draft_tokens=model_runner.server_args.speculative_num_draft_tokens,
            device=model_runner.device, is_read=False)
        self.topk = model_runner.model_config.hf_config.index_topk
        self.req_to_token_pool = model_runner.req_to_token_pool  # the hybrid wrapper reads it
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        if str(model_runner.device).startswith("cuda"):
            self.select, self.attend = indexer_topk.indexer_topk, sparse_mla.sparse_mla
        else:
            self.select, self.attend = indexer_topk.indexer_topk_torch, sparse_mla.sparse_mla_torch
        if flashmla:  # sgl-kernel's FlashMLA sparse kernel attends instead (BF16 latent only)
            cfg = model_runner.model_config
            flashmla_sparse.check_supported(torch.device(model_runner.device), model_runner.kv_cache_dtype,
                                            cfg.kv_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            self.attend = flashmla_sparse.sparse_mla_flashmla

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        # A tree verify's links in fixed buffers (a chain until the first copy), so that the
        # paths are computed inside the captured verify graph, as SGLang's KDA backend does.
        spec = self._spec_shape
        if spec is not None and spec[0] > 1:
            n, device = spec[1], self.req_to_token.device
            chain = torch.arange(1, n + 1, device=device)
            chain[-1] = -1
            self._tree_link_bufs = (chain.expand(max_bs, n).contiguous(),
                                    torch.full((max_bs, n), -1, dtype=torch.long, device=device))

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        """Before capture, replay, or an eager step: where a tree verify's links are."""
        spec = forward_batch.spec_info
        self._tree_links = None
        if not (forward_batch.forward_mode.is_target_verify() and spec is not None and (spec.topk or 1) > 1):
            return
        bufs, bs = self._tree_link_bufs, forward_batch.batch_size
        links = (spec.retrieve_next_token, spec.retrieve_next_sibling)
        if bufs is not None and bs <= bufs[0].shape[0]:
            if links[0] is not None:  # None while SGLang captures: the buffers hold a chain
                for buf, link in zip(bufs, links):
                    buf[: link.shape[0]].copy_(link)
            links = tuple(buf[:bs] for buf in bufs)
        self._tree_links = links if links[0] is not None else None

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        # A tree verify: each node's path, once per forward for all sparse layers (recorded
        # in the verify graph when captured).
        self._verify_tree = None
        if self._tree_links is not None:
            self._verify_tree = draft_tree_paths(*self._tree_links, forward_batch.spec_info.spec_steps + 1).flatten()

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    @property
    def verify_mask(self):
        return self._verify_mask

    def support_triton(self):
        return self.select is indexer_topk.indexer_topk

    def _pool_layer(self, layer_id: int) -> int:
        return self.token_to_kv_pool.full_attention_layer_id_mapping[layer_id]

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache, index_q, index_q_scale, index_k, index_weights,
                 row_req, row_len, **select_options):
        pool_layer, pool = self._pool_layer(layer.layer_id), self.token_to_kv_pool.full_kv_pool
        if save_kv_cache:
            loc = forward_batch.out_cache_loc
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
            pool.set_index_k(pool_layer, loc, index_k)
        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)[:, 0]  # [slots, rank + rope], or FP8 c [slots, rank]
        kv_scale, kv_rope = pool.get_latent_fp8(pool_layer)
        ik, k_scale = pool.get_index_k_buffer(pool_layer)
        if (k_scale is None) != (index_q_scale is None):
            raise ValueError("the index queries and the index-K cache must both be MXFP8 or both not")
        if k_scale is not None:
            select_options.update(q_scale=index_q_scale, k_scale=k_scale)
        H, rank = layer.tp_q_head_num, layer.v_head_dim
        selected = self.select(index_q, index_weights, ik, self.req_to_token, row_req, row_len, self.topk,
                               **select_options)
        out = self.attend(q.view(-1, H, layer.qk_head_dim), kv, self.req_to_token, row_req, selected, rank,
                          layer.scaling, kv_scale=kv_scale, kv_rope=kv_rope)
        return out.reshape(-1, H * rank)

    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True, *,
                       index_q, index_q_scale, index_k, index_weights, **kwargs):
        mode = forward_batch.forward_mode
        options = {"block_m": _EXTEND_ROW_BLOCK} if self.select is indexer_topk.indexer_topk else {}
        row_len = forward_batch.positions + 1
        if mode.is_target_verify() or mode.is_draft_extend_v2():
            # The same number of rows per request (the draft chain), each at its own position;
            # fixed row blocks, so verify captures in a CUDA graph.
            per_request = q.shape[0] // forward_batch.batch_size
            row_req = forward_batch.req_pool_indices.repeat_interleave(per_request)
            if options:
                options["rows_per_request"] = per_request
            if mode.is_target_verify() and self._verify_tree is not None:
                # Node j of a request's tree sits at req_to_token[seq_len + j] (SGLang's verify
                # layout, flattened tree order); it sees the prefix and its own path's nodes.
                tail = forward_batch.seq_lens.repeat_interleave(per_request)
                return self._forward(q, k, v, layer, forward_batch, save_kv_cache, index_q, index_q_scale, index_k,
                                     index_weights, row_req, tail + per_request,
                                     tree=(tail, self._verify_tree), **options)
        else:
            cp = forward_batch.hybrid_prefill_cp
            if cp is not None:  # a context-parallel prefill: every rank caches all new rows, selects for its own
                k, v, index_k = cp.gather(k), cp.gather(v), cp.gather(index_k)
            row_req = torch.repeat_interleave(forward_batch.req_pool_indices, forward_batch.extend_seq_lens,
                                              output_size=k.shape[0])
            if cp is not None:
                row_req, row_len = cp.shard(row_req), cp.shard(row_len)
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, index_q, index_q_scale, index_k,
                             index_weights, row_req, row_len, **options)

    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True, *,
                       index_q, index_q_scale, index_k, index_weights, **kwargs):
        # A row sees every position up to its own: the sequence in a decode step (seq_lens),
        # the prefix and the steps so far in the draft head's later steps.
        if self.draft_step is not None and self.draft_step[1] > 1:
            row_req, row_len, tree = draft_tree_rows(forward_batch.req_pool_indices, forward_batch.seq_lens,
                                                     *self.draft_step, self.page_size)
            return self._forward(q, k, v, layer, forward_batch, save_kv_cache, index_q, index_q_scale, index_k,
                                 index_weights, row_req, row_len, tree=tree)
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, index_q, index_q_scale, index_k,
                             index_weights, forward_batch.req_pool_indices, forward_batch.positions + 1)


class SparseMLAMultiStepDraftBackend(AttentionBackend):
    """The draft head's decode steps after its first (SGLang's multi-step draft backend
    interface: one backend per step). A chain draft (--speculative-eagle-topk 1) writes
    step i of a request at position seq_len + i, its slot the one SGLang reserved there in
    req_to_token, so each step is a plain decode over positions + 1 rows of history. Like
    the decode step, it needs no metadata beyond the batch's own tensors, so the steps
    capture in SGLang's draft CUDA graph as they are. A tree draft (topk > 1, page size 1)
    has one row per request and branch; each sees the prefix and its own branch's steps
    (draft_tree_rows)."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int, flashmla: bool = False):
        super().__init__()
        self.attn_backends = [SparseMLAAttnBackend(model_runner, flashmla, (i, topk, speculative_num_steps))
                              for i in range(speculative_num_steps - 1)]
        self.needs_cpu_seq_lens = any(b.needs_cpu_seq_lens for b in self.attn_backends)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        pass
