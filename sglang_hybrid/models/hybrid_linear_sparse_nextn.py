"""HybridLinearSparseForCausalLMNextN: the family's MTP draft head, for SGLang's EAGLE / NEXTN.

    x_{t+1}, h_t -> eh_proj([enorm(embed(x_{t+1})) | hnorm(h_t)]) -> one decoder layer
                 -> shared_head.norm -> LM head -> logits for x_{t+2}

h_t is the target's final hidden state (what its LM head reads), and for later draft
steps the head's own normed output. The decoder layer is a sparse MLA layer (the
indexer included; MoE FFN when the model has experts) on a plain residual stream, with
its own latent KV and index-K cache in the draft worker's pool. Embedding and LM head
are the target's: SGLang's EAGLE worker hands them over (set_embed_and_head).

Checkpoint names follow DeepSeek-V3's MTP layer: everything under
model.layers.{num_hidden_layers}. (enorm, hnorm, eh_proj, shared_head.norm and the
decoder layer's usual names). `load_weights` is the target's, over that prefix.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from sglang_hybrid.configs.hybrid_linear_sparse import HybridLinearSparseConfig
from sglang_hybrid.layers.rms_norm import RMSNorm
from sglang_hybrid.models.hybrid_linear_sparse import HybridDecoderLayer, HybridLinearSparseForCausalLM


class HybridLinearSparseDraftModel(nn.Module):
    def __init__(self, config: HybridLinearSparseConfig, quant_config=None, prefix: str = ""):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, D, prefix=f"{prefix}.embed_tokens")
        self.enorm = RMSNorm(D, eps=eps)
        self.hnorm = RMSNorm(D, eps=eps)
        self.eh_proj = ReplicatedLinear(2 * D, D, bias=False, quant_config=quant_config, prefix=f"{prefix}.eh_proj")
        self.decoder = HybridDecoderLayer(config.draft_head_config(), 0, quant_config, prefix=f"{prefix}.decoder")
        self.shared_head_norm = RMSNorm(D, eps=eps)

    def forward(self, input_ids, positions, forward_batch: ForwardBatch, inputs_embeds=None) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        h = forward_batch.spec_info.hidden_states
        forward_batch.hybrid_prefill_cp = None  # the draft head's forwards are never split
        x = self.eh_proj(torch.cat([self.enorm(x), self.hnorm(h)], dim=-1))[0]
        x, residual = self.decoder.forward_residual(x, None, positions, forward_batch)
        return self.shared_head_norm(x, residual)[0]


class HybridLinearSparseForCausalLMNextN(HybridLinearSparseForCausalLM):
    def __init__(self, config: HybridLinearSparseConfig, quant_config=None, prefix: str = ""):
        nn.Module.__init__(self)
        if not config.num_nextn_predict_layers:
            raise ValueError("the checkpoint has no draft head (config num_nextn_predict_layers is 0); "
                             "serve it without --speculative-algorithm NEXTN/EAGLE, or give a draft model")
        self.config = config
        self.quant_config = quant_config
        self.model = HybridLinearSparseDraftModel(config, quant_config, prefix="model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                      prefix="lm_head")
        self.logits_processor = LogitsProcessor(config)

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        del self.model.embed_tokens.weight
        del self.lm_head.weight
        self.model.embed_tokens.weight = embed
        self.lm_head.weight = head

    _HEAD_NAMES = {"enorm.weight": "model.enorm.weight", "hnorm.weight": "model.hnorm.weight",
                   "eh_proj.weight": "model.eh_proj.weight", "shared_head.norm.weight": "model.shared_head_norm.weight"}

    def param_name(self, name: str) -> str | None:
        prefix = f"model.layers.{self.config.draft_layer_id}."
        if not name.startswith(prefix):
            return None  # the target's tensors
        name = name[len(prefix):]
        if name in ("embed_tokens.weight", "shared_head.head.weight"):
            return None  # DeepSeek-style copies of the target's: the target's are used
        return self._HEAD_NAMES.get(name, "model.decoder." + name)

    def params_from_target(self) -> set[str]:
        return {"model.embed_tokens.weight", "lm_head.weight"}


EntryClass = HybridLinearSparseForCausalLMNextN
