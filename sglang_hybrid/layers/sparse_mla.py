"""Sparse MLA mixer: NoPE multi-head latent attention with a DSA lightning indexer.

MLA projections use DeepSeek names and TP sharding by head (q_b_proj, kv_b_proj
column-parallel, o_proj row-parallel); attention runs in the absorbed form, so the
cache holds one latent row [c | k_pe] per token. The indexer (wq_b from the q
latent, wk + LayerNorm from the hidden state, weights_proj) is replicated on every
rank, so all ranks select the same Top-K. Its optional RoPE covers the first
index_rope_head_dim dims; the optional Hadamard rotation follows it. The rotation
is orthogonal and applied to both q and k, so exact scores would not change; it
spreads outliers across each vector before the MXFP8 index cache rounds it.

Under SGLang's breakable prefill CUDA graph the backend call is an eager break
(layers.prefill_graph); the projections, norms and the indexer's inputs are captured.

The indexer's inputs are prepared on three CUDA streams (index q projection, rotation
and MXFP8 quantization on the current one; index k with its norm on a second; the
head weights on a third), joined once before the backend runs the indexer. The side
streams first wait on the current one, so this is capturable in a CUDA graph; on
CPU everything runs in order.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from sglang.srt.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_attn_backend
from sglang.srt.runtime_context import get_parallel

from sglang_hybrid.configs.hybrid_linear_sparse import HybridLinearSparseConfig
from sglang_hybrid.kernels import mxfp8
from sglang_hybrid.layers import prefill_graph
from sglang_hybrid.layers.rms_norm import RMSNorm
from sglang_hybrid.reference.ops import hadamard_matrix


class IndexerRope(nn.Module):
    """Rotate-half RoPE on the leading `dim` channels (reference.ops.rope_neox)."""

    def __init__(self, dim: int, theta: float, max_positions: int):
        super().__init__()
        self.dim = dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.dim == 0:
            return x
        half = self.dim // 2
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
        cos = self.cos[positions].reshape(shape).to(x.dtype)
        sin = self.sin[positions].reshape(shape).to(x.dtype)
        x1, x2, rest = x[..., :half], x[..., half : self.dim], x[..., self.dim :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


@functools.cache
def _side_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """Two streams per device, shared by every indexer: each layer forks onto them and
    joins back, so no tensor made on them outlives the current stream's reads unordered."""
    return torch.cuda.Stream(device), torch.cuda.Stream(device)


class Indexer(nn.Module):
    def __init__(self, config: HybridLinearSparseConfig, quant_config=None, prefix: str = ""):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        D = config.hidden_size
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False,
                                     quant_config=quant_config, prefix=f"{prefix}.wq_b")
        self.wk = ReplicatedLinear(D, self.head_dim, bias=False, quant_config=quant_config, prefix=f"{prefix}.wk")
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=torch.float32)
        self.weights_proj = ReplicatedLinear(D, self.n_heads, bias=False, quant_config=None, prefix=f"{prefix}.weights_proj")
        self.rope = IndexerRope(config.index_rope_head_dim, config.rope_theta, config.max_position_embeddings)
        self.weight_scale = (self.n_heads * self.head_dim) ** -0.5
        self.q_group = config.index_mxfp8_group  # queries take the index cache's format
        self.use_hadamard = config.index_use_hadamard
        if self.use_hadamard:
            self.register_buffer("hadamard", hadamard_matrix(self.head_dim, torch.float32), persistent=False)

    def _rotate(self, t, positions):
        t = self.rope(t, positions)
        return (t.float() @ self.hadamard).to(t.dtype) if self.use_hadamard else t

    def _q(self, q_latent, positions):
        q = self._rotate(self.wq_b(q_latent)[0].view(-1, self.n_heads, self.head_dim), positions)
        if self.q_group is None:
            return q, None
        quantize = mxfp8.quantize_mxfp8 if q.is_cuda else mxfp8.quantize_mxfp8_torch
        return quantize(q, self.q_group)

    def _k(self, x, positions):
        return self._rotate(self.k_norm(self.wk(x)[0].float()).to(x.dtype), positions)

    def _weights(self, x):
        return self.weights_proj(x)[0].float() * self.weight_scale

    def forward(self, x, q_latent, positions):
        """(index q [T, Hi, D], its MXFP8 scales [T, Hi, D // group] or None, head weights
        [T, Hi] with all scales folded in, index k [T, D] (quantized by the cache store))."""
        if not x.is_cuda:
            return *self._q(q_latent, positions), self._weights(x), self._k(x, positions)
        main = torch.cuda.current_stream()
        k_stream, w_stream = _side_streams(x.device)
        k_stream.wait_stream(main)
        w_stream.wait_stream(main)
        with torch.cuda.stream(k_stream):
            k = self._k(x, positions)
        with torch.cuda.stream(w_stream):
            weights = self._weights(x)
        q, q_scale = self._q(q_latent, positions)
        main.wait_stream(k_stream)  # the one synchronization point before the indexer
        main.wait_stream(w_stream)
        return q, q_scale, weights, k


class SparseMLAMixer(nn.Module):
    def __init__(self, config: HybridLinearSparseConfig, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        c = config
        D = c.hidden_size
        ps = get_parallel()
        self.num_local_heads = c.num_attention_heads // ps.attn_tp_size
        # Sharded over the attention TP group (the whole TP group unless CP or DP attention splits it).
        shard = dict(tp_rank=ps.attn_tp_rank, tp_size=ps.attn_tp_size)
        self.nope, self.rope_dim, self.v_dim, self.rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        self.q_a_proj = ReplicatedLinear(D, c.q_lora_rank, bias=False, quant_config=quant_config, prefix=f"{prefix}.q_a_proj")
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=c.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, c.num_attention_heads * (self.nope + self.rope_dim),
                                             bias=False, quant_config=quant_config, prefix=f"{prefix}.q_b_proj", **shard)
        self.kv_a_proj_with_mqa = ReplicatedLinear(D, self.rank + self.rope_dim, bias=False,
                                                   quant_config=quant_config, prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.rank, eps=c.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.rank, c.num_attention_heads * (self.nope + self.v_dim), bias=False,
                                              quant_config=quant_config, prefix=f"{prefix}.kv_b_proj", **shard)
        self.o_proj = RowParallelLinear(c.num_attention_heads * self.v_dim, D, bias=False, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj", use_dp_attention_reduce=True, **shard)
        self.indexer = Indexer(c, quant_config, prefix=f"{prefix}.indexer")
        self.attn = RadixAttention(
            num_heads=self.num_local_heads,
            head_dim=self.rank + self.rope_dim,
            scaling=(self.nope + self.rope_dim) ** -0.5,
            num_kv_heads=1,
            layer_id=layer_id,
            v_head_dim=self.rank,
            prefix=f"{prefix}.attn",
        )
        self.w_kc: torch.Tensor | None = None  # [H, nope, rank], from kv_b_proj after loading
        self.w_vc: torch.Tensor | None = None  # [H, rank, v]

    def absorb_kv_b(self) -> None:
        """Split kv_b_proj into the per-head key/value up-projections used in absorbed form."""
        w = self.kv_b_proj.weight.unflatten(0, (-1, self.nope + self.v_dim))  # [H, nope + v, rank]
        w_k, w_v = w.split([self.nope, self.v_dim], dim=1)
        self.w_kc = w_k.contiguous()
        self.w_vc = w_v.transpose(1, 2).contiguous()

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        T, H = hidden_states.shape[0], self.num_local_heads
        q_latent = self.q_a_layernorm(self.q_a_proj(hidden_states)[0])
        q = self.q_b_proj(q_latent)[0].view(T, H, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        q_absorbed = torch.cat([torch.einsum("thn,hnr->thr", q_nope, self.w_kc), q_pe], dim=-1)
        kv = self.kv_a_proj_with_mqa(hidden_states)[0]
        latent = self.kv_a_layernorm(kv[:, : self.rank].contiguous())
        k = torch.cat([latent, kv[:, self.rank :]], dim=-1).unsqueeze(1)
        index = self.indexer(hidden_states, q_latent, positions)
        if prefill_graph.in_prefill_graph():
            out = q_absorbed.new_empty(T, H * self.rank)
            prefill_graph.live_rows_break(sparse_attention, out, self.attn.layer_id, q_absorbed, k,
                                          latent.unsqueeze(1), *index)
        else:
            out = sparse_attention(self.attn, forward_batch, q_absorbed, k, latent.unsqueeze(1), *index)
        out = torch.einsum("thr,hrv->thv", out.view(T, H, self.rank), self.w_vc)
        return self.o_proj(out.reshape(T, H * self.v_dim))[0]


def sparse_attention(layer: RadixAttention, forward_batch: ForwardBatch, q, k, v, index_q, index_q_scale,
                     index_weights, index_k) -> torch.Tensor:
    """Store the new rows, select each row's Top-K, attend there (layers.sparse_mla_backend)."""
    return get_attn_backend().forward(q, k, v, layer, forward_batch, True, index_q=index_q,
                                      index_q_scale=index_q_scale, index_k=index_k, index_weights=index_weights)
