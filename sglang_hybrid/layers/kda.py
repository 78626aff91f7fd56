"""Kimi Delta Attention mixer for the SGLang model.

Projections follow Kimi-Linear (q/k/v, f_a/f_b forget gate, b beta, g_a/g_b output
gate, A_log, dt_bias, depthwise short conv, o_norm, o_proj) and are TP-sharded by
head. The token mixing itself (short conv + gated delta rule, with the state in
SGLang's pool) is the attention backend's job: SGLang's KDA backend on GPU,
sglang_hybrid.layers.kda_backend on CPU; in SGLang's breakable prefill CUDA graph it is
an eager break (layers.prefill_graph). The gate/beta convention is SGLang's: extend
passes raw gates [1, T, H, K] and sigmoid(beta); decode passes both raw.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.kernels.ops.attention.fla.fused_norm_gate import FusedRMSNormGated
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.srt.layers.radix_linear_attention import RadixLinearAttention
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_attn_backend
from sglang.srt.model_loader.weight_utils import sharded_weight_loader
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils.common import set_weight_attrs

from sglang_hybrid.configs.hybrid_linear_sparse import HybridLinearSparseConfig
from sglang_hybrid.layers import prefill_graph
from sglang_hybrid.layers.kda_backend import extend_context_parallel
from sglang_hybrid.reference.ops import rms_norm


class GatedRMSNorm(FusedRMSNormGated):
    """rmsnorm(x) * w * sigmoid(gate): fla's fused kernel on GPU, the reference op elsewhere."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return super().forward(x, gate)
        y = rms_norm(x.float(), self.weight.float(), self.eps) * gate.reshape(x.shape).float().sigmoid()
        return y.to(x.dtype)


class KDAMixer(nn.Module):
    def __init__(self, config: HybridLinearSparseConfig, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        lac = config.linear_attn_config
        ps = get_parallel()
        tp = ps.attn_tp_size
        # Sharded over the attention TP group (the whole TP group unless CP or DP attention splits it).
        shard = dict(tp_rank=ps.attn_tp_rank, tp_size=tp)
        self.head_dim = K = lac["head_dim"]
        self.num_heads = H = lac["num_heads"]
        self.local_heads = H // tp
        P = H * K
        width = lac["short_conv_kernel_size"]
        D = config.hidden_size

        self.qkv_proj = MergedColumnParallelLinear(D, [P, P, P], bias=False, quant_config=quant_config,
                                                   prefix=f"{prefix}.qkv_proj", **shard)
        self.qkv_conv1d = MergedColumnParallelLinear(
            width, [P, P, P], bias=False, params_dtype=torch.float32, prefix=f"{prefix}.qkv_conv1d", **shard
        )
        self.f_a_proj = ReplicatedLinear(D, K, bias=False, quant_config=quant_config, prefix=f"{prefix}.f_a_proj")
        self.f_b_proj = ColumnParallelLinear(K, P, bias=False, quant_config=quant_config, prefix=f"{prefix}.f_b_proj",
                                             **shard)
        self.b_proj = ColumnParallelLinear(D, H, bias=False, quant_config=quant_config, prefix=f"{prefix}.b_proj", **shard)
        self.g_a_proj = ReplicatedLinear(D, K, bias=False, quant_config=quant_config, prefix=f"{prefix}.g_a_proj")
        self.g_b_proj = ColumnParallelLinear(K, P, bias=False, quant_config=quant_config, prefix=f"{prefix}.g_b_proj",
                                             **shard)
        self.A_log = nn.Parameter(torch.empty(1, 1, self.local_heads, 1, dtype=torch.float32))
        set_weight_attrs(self.A_log, {"weight_loader": sharded_weight_loader(2)})
        self.dt_bias = nn.Parameter(torch.empty(self.local_heads * K, dtype=torch.float32))
        set_weight_attrs(self.dt_bias, {"weight_loader": sharded_weight_loader(0)})
        self.o_norm = GatedRMSNorm(K, eps=config.rms_norm_eps, activation="sigmoid")
        self.o_proj = RowParallelLinear(P, D, bias=False, quant_config=quant_config, prefix=f"{prefix}.o_proj",
                                        use_dp_attention_reduce=True, **shard)

        self.attn = RadixLinearAttention(
            layer_id=layer_id,
            num_q_heads=self.local_heads,
            num_k_heads=self.local_heads,
            num_v_heads=self.local_heads,
            head_q_dim=K,
            head_k_dim=K,
            head_v_dim=K,
            conv_weights=self.qkv_conv1d.weight,
            bias=None,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
        )

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        mixed_qkv, _ = self.qkv_proj(hidden_states)
        beta, _ = self.b_proj(hidden_states)
        forget, _ = self.f_b_proj(self.f_a_proj(hidden_states)[0])
        gate, _ = self.g_b_proj(self.g_a_proj(hidden_states)[0])
        mode = forward_batch.forward_mode
        if not mode.is_decode() and not mode.is_target_verify():
            forget = forget.unflatten(-1, (-1, self.head_dim)).unsqueeze(0)
            beta = beta.float().sigmoid()
        cp = forward_batch.hybrid_prefill_cp
        if cp is not None:
            out = extend_context_parallel(get_attn_backend().linear_attn_backend, self.attn, forward_batch, cp,
                                          mixed_qkv, forget, beta.unsqueeze(0))
        elif prefill_graph.in_prefill_graph():
            out = mixed_qkv.new_empty(hidden_states.shape[0], self.local_heads, self.head_dim)
            prefill_graph.live_rows_break(kda_attention, out, self.attn.layer_id, mixed_qkv, forget[0], beta)
        else:
            out = self.attn(forward_batch, mixed_qkv=mixed_qkv, a=forget, b=beta.unsqueeze(0))
        out = self.o_norm(out, gate.unflatten(-1, (-1, self.head_dim)))
        return self.o_proj(out.reshape(hidden_states.shape[0], -1))[0]


def kda_attention(layer: RadixLinearAttention, forward_batch: ForwardBatch, mixed_qkv: torch.Tensor,
                  forget: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """An extend's conv and delta rule over the pool's states, gates [T, H, K] and beta [T, H]."""
    return get_attn_backend().forward(layer=layer, forward_batch=forward_batch, mixed_qkv=mixed_qkv,
                                      a=forget.unsqueeze(0), b=beta.unsqueeze(0))
