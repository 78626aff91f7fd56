"""HybridLinearSparseForCausalLM: KDA + sparse MLA + block attention residuals + MoE.

Built from SGLang's parts: parallel linears, RMSNorm, FusedMoE/TopK, LlamaMLP,
the attention-residual aggregation (Triton on GPU, its torch reference on CPU),
RadixLinearAttention for KDA. The two token mixers live in sglang_hybrid.layers.
Weight names are Kimi-Linear's (KDA, MoE, residual projections) and DeepSeek's
(MLA, indexer); `load_weights` maps them explicitly. The golden model in
sglang_hybrid.reference computes the same function in plain PyTorch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn

from sglang.srt.distributed import get_pp_group, tensor_model_parallel_all_reduce
from sglang.srt.layers.attn_residual import aggregate_stream, aggregate_stream_torch
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.moe.ep_moe.layer import get_moe_impl_class
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
from sglang.srt.layers.moe.topk import TopK, TopKOutputFormat
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.llama import LlamaMLP
from sglang.srt.runtime_context import get_parallel

from sglang_hybrid.configs.hybrid_linear_sparse import HybridLinearSparseConfig
from sglang_hybrid.layers.kda import KDAMixer
from sglang_hybrid.layers.rms_norm import RMSNorm
from sglang_hybrid.layers.sparse_mla import SparseMLAMixer
from sglang_hybrid.parallel.prefill_cp import split_prefill


class HybridMoE(nn.Module):
    """Sigmoid-routed grouped top-k MoE with score bias and shared experts (Kimi / DeepSeek-V3)."""

    def __init__(self, config: HybridLinearSparseConfig, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        c = config
        self.gate = ReplicatedLinear(c.hidden_size, c.num_experts, bias=False, quant_config=None, prefix=f"{prefix}.gate")
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(c.num_experts, dtype=torch.float32))
        self.experts = get_moe_impl_class(quant_config)(
            num_experts=c.num_experts,
            top_k=c.num_experts_per_token,
            hidden_size=c.hidden_size,
            intermediate_size=c.moe_intermediate_size,
            layer_id=layer_id,
            quant_config=quant_config,
            activation=c.hidden_act,
            prefix=f"{prefix}.experts",
        )
        self.topk = TopK(
            top_k=c.num_experts_per_token,
            renormalize=c.moe_renormalize,
            use_grouped_topk=True,
            num_expert_group=c.num_expert_group,
            topk_group=c.topk_group,
            correction_bias=self.gate.e_score_correction_bias,
            quant_config=quant_config,
            output_format=TopKOutputFormat.STANDARD if quant_config is None else None,
        )
        self.shared_experts = None
        if c.num_shared_experts:
            self.shared_experts = LlamaMLP(c.hidden_size, c.moe_intermediate_size * c.num_shared_experts, c.hidden_act,
                                           quant_config=quant_config, reduce_results=False, prefix=f"{prefix}.shared_experts")
        # Applied here, not inside FusedMoE: SGLang's native (CPU) expert path ignores it.
        self.routed_scaling_factor = c.routed_scaling_factor
        self.tp_size = get_parallel().tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Shared experts first: SGLang's Triton expert kernel overwrites its input in place.
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        router_logits, _ = self.gate(x)
        topk_output = self.topk(x, router_logits)
        if x.is_cuda and x.dtype == torch.float32:
            out = _routed_experts_fp32(self.experts, x, topk_output)
        else:
            out = self.experts(x, topk_output)
        out = out * self.routed_scaling_factor
        if shared is not None:
            out = out + shared
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


def _routed_experts_fp32(experts: FusedMoE, x: torch.Tensor, topk_output) -> torch.Tensor:
    """fp32 serving on a GPU: SGLang's Triton expert kernel computes fp32 inputs in fp16
    (its compute_type), so here every local expert runs densely in fp32, weighted by its
    routing weight (zero where not chosen). Exact and graph-capturable; costs E/top-k
    times the expert FLOPs, which is fine for the fp32 verification runs it serves."""
    weights, ids, _ = topk_output
    w13, w2 = experts.w13_weight, experts.w2_weight
    if w13.shape[0] != experts.num_experts:
        raise NotImplementedError("fp32 MoE on a GPU supports no expert parallelism; serve bf16 with EP")
    route = x.new_zeros(x.shape[0], w13.shape[0]).scatter_add_(1, ids.long(), weights.to(x.dtype))
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        gate, up = (x @ w13[e].t()).chunk(2, dim=-1)
        out += ((nn.functional.silu(gate) * up) @ w2[e].t()) * route[:, e : e + 1]
    return out


class BlockAttnResidual:
    """The bank of completed blocks [T, NB, D] for one forward pass.

    `mix` is SGLang's aggregation (softmax over w . RMSNorm(row), weighted sum of
    the banked blocks and the running partial sum): its Triton kernels on GPU,
    its torch reference elsewhere.
    """

    def __init__(self, x: torch.Tensor, num_blocks: int):
        self.bank = x.new_empty(x.shape[0], num_blocks, x.shape[1])
        self.num_valid = 0
        self.aggregate = aggregate_stream if x.is_cuda else aggregate_stream_torch

    def mix(self, partial: torch.Tensor, proj: ReplicatedLinear, norm: RMSNorm) -> torch.Tensor:
        return self.aggregate(partial, self.bank, self.num_valid, proj, norm)

    def push(self, block: torch.Tensor) -> None:
        self.bank[:, self.num_valid] = block
        self.num_valid += 1


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: HybridLinearSparseConfig, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        c = config
        mixer = KDAMixer if c.is_kda_layer(layer_id) else SparseMLAMixer
        self.self_attn = mixer(c, layer_id, quant_config, prefix=f"{prefix}.self_attn")
        self.is_moe = c.is_moe_layer(layer_id)
        if self.is_moe:
            self.block_sparse_moe = HybridMoE(c, layer_id, quant_config, prefix=f"{prefix}.block_sparse_moe")
        else:
            self.mlp = LlamaMLP(c.hidden_size, c.intermediate_size, c.hidden_act, quant_config=quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.starts_block = c.attn_res_block_size is not None and layer_id % c.attn_res_block_size == 0
        if c.attn_res_block_size is not None:
            for name in ("self_attention", "mlp"):
                setattr(self, f"{name}_res_norm", RMSNorm(c.hidden_size, eps=c.rms_norm_eps))
                setattr(self, f"{name}_res_proj", ReplicatedLinear(c.hidden_size, 1, bias=False, prefix=f"{prefix}.{name}_res_proj"))

    def ffn(self, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        cp = forward_batch.hybrid_prefill_cp
        if cp is not None:  # every row of the batch, tensor-parallel as without CP (parallel.prefill_cp)
            return cp.shard(self._ffn(cp.gather(x)))
        return self._ffn(x)

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if self.is_moe else self.mlp(x)

    def forward_residual(self, x, residual, positions, forward_batch):
        """Plain pre-norm residual stream (attn_res_block_size is None)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, forward_batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.ffn(x, forward_batch), residual

    def forward_attn_res(self, partial, res: BlockAttnResidual, positions, forward_batch):
        """Block attention residuals; returns the new running partial sum of the block."""
        x = res.mix(partial, self.self_attention_res_proj, self.self_attention_res_norm)
        if self.starts_block:
            res.push(partial)
            partial = None
        a = self.self_attn(self.input_layernorm(x), positions, forward_batch)
        partial = a if partial is None else partial + a
        x = res.mix(partial, self.mlp_res_proj, self.mlp_res_norm)
        return partial + self.ffn(self.post_attention_layernorm(x), forward_batch)


class HybridLinearSparseModel(nn.Module):
    def __init__(self, config: HybridLinearSparseConfig, quant_config=None, prefix: str = ""):
        super().__init__()
        c = self.config = config
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            HybridDecoderLayer(c, i, quant_config, prefix=f"{prefix}.layers.{i}") for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if c.attn_res_block_size is not None:
            self.num_blocks = -(-c.num_hidden_layers // c.attn_res_block_size)
            self.output_attn_res_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
            self.output_attn_res_proj = ReplicatedLinear(c.hidden_size, 1, bias=False, prefix=f"{prefix}.output_attn_res_proj")

    def forward(self, input_ids, positions, forward_batch: ForwardBatch, inputs_embeds=None) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        forward_batch.hybrid_prefill_cp = cp = split_prefill(forward_batch)
        if cp is not None:
            x, positions = cp.shard(x), cp.shard(positions)
        out = self.layers_forward(x, positions, forward_batch)
        return cp.gather(out) if cp is not None else out

    def layers_forward(self, x, positions, forward_batch: ForwardBatch) -> torch.Tensor:
        if self.config.attn_res_block_size is None:
            residual = None
            for layer in self.layers:
                x, residual = layer.forward_residual(x, residual, positions, forward_batch)
            return self.norm(x, residual)[0] if residual is not None else self.norm(x)
        res = BlockAttnResidual(x, self.num_blocks)
        partial = x
        for layer in self.layers:
            partial = layer.forward_attn_res(partial, res, positions, forward_batch)
        return self.norm(res.mix(partial, self.output_attn_res_proj, self.output_attn_res_norm))


class HybridLinearSparseForCausalLM(nn.Module):
    def __init__(self, config: HybridLinearSparseConfig, quant_config=None, prefix: str = ""):
        super().__init__()
        if get_pp_group().world_size > 1:
            raise NotImplementedError("HybridLinearSparseForCausalLM does not support pipeline parallelism")
        config.validate_parallel(get_parallel().attn_tp_size)
        self.config = config
        self.quant_config = quant_config
        self.model = HybridLinearSparseModel(config, quant_config, prefix="model")
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config, prefix="lm_head")
        self.logits_processor = LogitsProcessor(config)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch: ForwardBatch, inputs_embeds=None, **kwargs):
        hidden_states = self.model(input_ids, positions, forward_batch, inputs_embeds)
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch)

    # ----------------------------------------------------------------- loading
    _STACKED = (
        # (param name, checkpoint name, shard id)
        (".qkv_proj", ".q_proj", 0),
        (".qkv_proj", ".k_proj", 1),
        (".qkv_proj", ".v_proj", 2),
        (".qkv_conv1d", ".q_conv1d", 0),
        (".qkv_conv1d", ".k_conv1d", 1),
        (".qkv_conv1d", ".v_conv1d", 2),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        params = dict(self.named_parameters())
        experts = FusedMoE.make_expert_params_mapping(
            ckpt_gate_proj_name="w1", ckpt_down_proj_name="w2", ckpt_up_proj_name="w3",
            num_experts=self.config.num_experts or 0,
        )
        loaded: set[str] = set()
        for name, tensor in weights:
            name = self.param_name(name)
            if name is None:
                continue
            for param_name, ckpt_name, shard in self._STACKED:
                if ckpt_name in name and ".experts." not in name:
                    if "_conv1d" in ckpt_name:
                        tensor = tensor.squeeze(1)  # [P, 1, W] depthwise conv -> [P, W]
                    name = name.replace(ckpt_name, param_name)
                    params[name].weight_loader(params[name], tensor, shard)
                    break
            else:
                for param_name, ckpt_name, expert_id, shard in experts:
                    if ckpt_name in name:
                        name = name.replace(ckpt_name, param_name)
                        params[name].weight_loader(params[name], tensor, name, shard_id=shard, expert_id=expert_id)
                        break
                else:
                    if name not in params:
                        raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
                    getattr(params[name], "weight_loader", default_weight_loader)(params[name], tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded - self.params_from_target())
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
        self.post_load_weights()
        return loaded

    def param_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into; None for tensors this model does not hold."""
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return None
        if name.startswith(f"model.layers.{self.config.draft_layer_id}."):
            return None  # the draft head's layer (models.hybrid_linear_sparse_nextn)
        return name

    def params_from_target(self) -> set[str]:
        """Parameters set from another model rather than loaded (the draft head's embedding and LM head)."""
        return set()

    def post_load_weights(self):
        """Derive the absorbed MLA weights; the dummy loader calls this too."""
        for module in self.modules():
            if isinstance(module, SparseMLAMixer):
                module.absorb_kv_b()

    def get_embed_and_head(self):
        """For SGLang's EAGLE worker, which hands them to the draft head."""
        return self.model.embed_tokens.weight, self.lm_head.weight


EntryClass = HybridLinearSparseForCausalLM
