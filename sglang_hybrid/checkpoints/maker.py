"""Write a checkpoint folder: config.json, seeded random weights, tokenizer.

Initialisation keeps activations well conditioned through depth: projections
are N(0, 1/fan_in) so they preserve scale, every residual write (o_proj,
down_proj, experts' w2) is further scaled by 1/sqrt(2 * layers), norms and
biases are randomised around their neutral value (so a test catches a weight
that was loaded into the wrong place), and the KDA decay parameters follow
Mamba-style ranges (A in [1, 16], dt in [1e-3, 1e-1]).
"""

from __future__ import annotations

import json
import math
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from sglang_hybrid.checkpoints.presets import WITH_WEIGHTS, preset_config
from sglang_hybrid.checkpoints.tokenizer import train_tokenizer
from sglang_hybrid.configs.hybrid_linear_sparse import HybridLinearSparseConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SHARD_BYTES = 2 << 30


def make_checkpoint(preset: str, out_dir: str, seed: int = 0, with_weights: bool | None = None,
                    near_bigram: float | None = None, logit_scale: float = 1.0) -> str:
    """Write the preset's checkpoint into out_dir and return out_dir. near_bigram and
    logit_scale: see `near_bigram_weights` (a checkpoint whose draft head agrees with it
    at a chosen rate)."""
    if logit_scale != 1.0 and near_bigram is None:  # checked before anything is written
        raise ValueError("logit_scale applies to a near_bigram checkpoint only")
    if not logit_scale > 0:
        raise ValueError(f"logit_scale must be positive, got {logit_scale}")
    fields = preset_config(preset)
    tokenizer = train_tokenizer(fields.pop("tokenizer_vocab_size"))
    fields.setdefault("vocab_size", len(tokenizer))
    fields.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    config = HybridLinearSparseConfig(**fields)  # validates before anything is written

    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(fields, f, indent=2)
    if with_weights if with_weights is not None else preset in WITH_WEIGHTS:
        dtype = _DTYPES[fields["torch_dtype"]]
        weights = random_weights(config, seed)
        if near_bigram is not None:
            weights = near_bigram_weights(config, weights, near_bigram, logit_scale)
        _save_sharded({k: v.to(dtype) for k, v in weights.items()}, out_dir)
    return out_dir


def random_weights(config: HybridLinearSparseConfig, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c = config
    D, L = c.hidden_size, c.num_hidden_layers
    out_scale = 1.0 / math.sqrt(2 * L)
    w: dict[str, torch.Tensor] = {}

    def normal(shape, std):
        return torch.randn(shape, generator=g) * std

    def linear(name, n_out, n_in, scale=1.0):
        w[name] = normal((n_out, n_in), scale / math.sqrt(n_in))

    def norm(name, dim):
        w[name] = 1.0 + normal((dim,), 0.1)

    def mlp(p, inter, names=("gate_proj", "up_proj", "down_proj")):
        linear(p + names[0] + ".weight", inter, D)
        linear(p + names[1] + ".weight", inter, D)
        linear(p + names[2] + ".weight", D, inter, out_scale)

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=g)

    w["model.embed_tokens.weight"] = normal((c.vocab_size, D), 1.0)
    lac = c.linear_attn_config
    H, K = lac["num_heads"], lac["head_dim"]
    def decoder_layer(p, kda: bool, moe: bool, attn_res: bool):
        norm(p + "input_layernorm.weight", D)
        norm(p + "post_attention_layernorm.weight", D)
        if attn_res:
            for s in ("self_attention", "mlp"):
                norm(p + s + "_res_norm.weight", D)
                linear(p + s + "_res_proj.weight", 1, D, 2.0)
        a = p + "self_attn."
        if kda:
            for n in ("q", "k", "v"):
                linear(a + n + "_proj.weight", H * K, D)
                w[a + n + "_conv1d.weight"] = normal((H * K, 1, lac["short_conv_kernel_size"]), 0.5)
            linear(a + "f_a_proj.weight", K, D)
            linear(a + "f_b_proj.weight", H * K, K, 0.5)
            linear(a + "b_proj.weight", H, D)
            linear(a + "g_a_proj.weight", K, D)
            linear(a + "g_b_proj.weight", H * K, K)
            w[a + "A_log"] = uniform((1, 1, H, 1), math.log(1.0), math.log(16.0))
            dt = torch.exp(uniform((H * K,), math.log(1e-3), math.log(1e-1)))
            w[a + "dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
            norm(a + "o_norm.weight", K)
            linear(a + "o_proj.weight", D, H * K, out_scale)
        else:
            Hq = c.num_attention_heads
            linear(a + "q_a_proj.weight", c.q_lora_rank, D)
            norm(a + "q_a_layernorm.weight", c.q_lora_rank)
            linear(a + "q_b_proj.weight", Hq * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.q_lora_rank)
            linear(a + "kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, D)
            norm(a + "kv_a_layernorm.weight", c.kv_lora_rank)
            linear(a + "kv_b_proj.weight", Hq * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
            linear(a + "o_proj.weight", D, Hq * c.v_head_dim, out_scale)
            linear(a + "indexer.wq_b.weight", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
            linear(a + "indexer.wk.weight", c.index_head_dim, D)
            norm(a + "indexer.k_norm.weight", c.index_head_dim)
            w[a + "indexer.k_norm.bias"] = normal((c.index_head_dim,), 0.1)
            linear(a + "indexer.weights_proj.weight", c.index_n_heads, D)
        if moe:
            m = p + "block_sparse_moe."
            linear(m + "gate.weight", c.num_experts, D)
            w[m + "gate.e_score_correction_bias"] = normal((c.num_experts,), 0.1)
            for e in range(c.num_experts):
                mlp(f"{m}experts.{e}.", c.moe_intermediate_size, ("w1", "w3", "w2"))
            if c.num_shared_experts:
                mlp(m + "shared_experts.", c.moe_intermediate_size * c.num_shared_experts)
        else:
            mlp(p + "mlp.", c.intermediate_size)

    for i in range(L):
        decoder_layer(f"model.layers.{i}.", c.is_kda_layer(i), c.is_moe_layer(i), c.attn_res_block_size is not None)
    norm("model.norm.weight", D)
    if c.attn_res_block_size is not None:
        norm("model.output_attn_res_norm.weight", D)
        linear("model.output_attn_res_proj.weight", 1, D, 2.0)
    if not c.tie_word_embeddings:
        linear("lm_head.weight", c.vocab_size, D)
    if c.num_nextn_predict_layers:  # last, so the target's weights do not depend on it
        p = f"model.layers.{c.draft_layer_id}."
        norm(p + "enorm.weight", D)
        norm(p + "hnorm.weight", D)
        linear(p + "eh_proj.weight", D, 2 * D)
        decoder_layer(p, kda=False, moe=c.is_moe, attn_res=False)
        norm(p + "shared_head.norm.weight", D)
    return w


# Every write into the residual stream: token mixers' output projections and FFN down projections.
_RESIDUAL_WRITES = ("self_attn.o_proj.weight", "down_proj.weight", ".w2.weight")


def near_bigram_weights(config: HybridLinearSparseConfig, weights: dict[str, torch.Tensor],
                        scale: float, logit_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A speculative-decoding test model: the target is a bigram model (logits from the
    current token's embedding alone) plus `scale` times everything its layers write into
    the residual stream, and so is the draft head (eh_proj passes the token's normed
    embedding through, shared_head.norm is the final norm, its own layer is scaled the
    same way). At scale 0 the draft always agrees with the target; the larger the scale,
    the more often the layers (the target's KDA states and sparse attention, the head's
    own sparse layer over its cache) change a choice and a draft is rejected. Every layer
    still runs and carries its state.

    logit_scale multiplies the final norms (target and head alike), so every logit: greedy
    choices and acceptance stay the same, but the distribution sharpens (on small: top-1
    probability ~0.001 at 1, ~0.6 at 8), which is what a tree draft's cumulative-probability
    node selection needs to grow deeper than two along the likely path."""
    if not config.num_nextn_predict_layers:
        raise ValueError("near_bigram needs a draft head: the preset's num_nextn_predict_layers is 0")
    D, draft = config.hidden_size, f"model.layers.{config.draft_layer_id}."
    w = dict(weights)
    for name, t in weights.items():
        if name.endswith(_RESIDUAL_WRITES):
            w[name] = t * scale
    w[draft + "enorm.weight"] = torch.ones(D)
    w[draft + "eh_proj.weight"] = torch.cat([torch.eye(D), torch.zeros(D, D)], dim=1)
    w["model.norm.weight"] = weights["model.norm.weight"] * logit_scale
    w[draft + "shared_head.norm.weight"] = w["model.norm.weight"].clone()
    return w


def _save_sharded(weights: dict[str, torch.Tensor], out_dir: str) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(weights):
        t = weights[name].contiguous()
        if size and size + t.nbytes > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    index = {}
    for n, shard in enumerate(shards):
        fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        index.update({name: fname for name in shard})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in weights.values())}, "weight_map": index}, f, indent=1)


def load_weights(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's *.safetensors shards (what _save_sharded writes)."""
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(checkpoint_dir)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(checkpoint_dir, name)))
    return weights


def make_dense_draft(target_dir: str, out_dir: str, num_layers: int = 2, seed: int = 0,
                     scale: float = 0.0) -> str:
    """A standalone draft model for SGLang's STANDALONE mode: a small LlamaForCausalLM with
    the target's tokenizer, embedding, final norm and LM head, whose layers write `scale`
    times their output into the residual stream. At 0 its logits are the target's bigram
    logits, so against a near-bigram target it agrees as often as the checkpoint's own draft
    head does; above 0 its attention over the context changes its choices too."""
    from transformers import LlamaConfig

    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    weights = load_weights(target_dir)
    if "lm_head.weight" not in weights:
        raise ValueError(f"{target_dir} has no weights with an lm_head (a config-only preset?)")
    D = target["hidden_size"]
    heads, kv_heads, head_dim, inter = 4, 2, D // 4, 2 * D
    config = LlamaConfig(vocab_size=target["vocab_size"], hidden_size=D, intermediate_size=inter,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=target["max_position_embeddings"],
                         rms_norm_eps=target["rms_norm_eps"], tie_word_embeddings=False,
                         eos_token_id=target.get("eos_token_id"), pad_token_id=target.get("pad_token_id"),
                         bos_token_id=None, torch_dtype=target["torch_dtype"], architectures=["LlamaForCausalLM"])
    g = torch.Generator().manual_seed(seed)
    w = {"model.embed_tokens.weight": weights["model.embed_tokens.weight"],
         "model.norm.weight": weights["model.norm.weight"], "lm_head.weight": weights["lm_head.weight"]}
    shapes = {"self_attn.q_proj": (heads * head_dim, D), "self_attn.k_proj": (kv_heads * head_dim, D),
              "self_attn.v_proj": (kv_heads * head_dim, D), "self_attn.o_proj": (D, heads * head_dim),
              "mlp.gate_proj": (inter, D), "mlp.up_proj": (inter, D), "mlp.down_proj": (D, inter)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for name, shape in shapes.items():
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
            w[p + name + ".weight"] = t * scale if name.endswith(("o_proj", "down_proj")) else t
        w[p + "input_layernorm.weight"] = torch.ones(D)
        w[p + "post_attention_layernorm.weight"] = torch.ones(D)
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    for name in sorted(os.listdir(target_dir)):  # the tokenizer's files, as they are
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(target_dir, name), out_dir)
    dtype = _DTYPES[target["torch_dtype"]]
    _save_sharded({k: v.to(dtype) for k, v in w.items()}, out_dir)
    return out_dir
