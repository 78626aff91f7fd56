"""Checkpoint presets: config fields per preset, and the tokenizer size each one gets.

tiny  - CPU tests: seconds to build and serve, every code path on (KDA, sparse MLA
        with an indexer that really drops positions, indexer RoPE, attention
        residuals over several blocks, dense and MoE FFNs).
small - GPU correctness: a few hundred M parameters with realistic head dims.
bench - config only, a 48B-A3B-class model (Kimi-Linear-48B dims plus a
        DeepSeek-V3.2-sized indexer) for `--load-format dummy`.
"""

from __future__ import annotations

import copy

from sglang_hybrid.configs.hybrid_linear_sparse import ARCHITECTURE, MODEL_TYPE

_COMMON = dict(
    architectures=[ARCHITECTURE],
    model_type=MODEL_TYPE,
    hidden_act="silu",
    rope_theta=10000.0,
    mla_use_nope=True,
    index_use_hadamard=True,
    moe_router_activation_func="sigmoid",
    moe_renormalize=True,
    use_grouped_topk=True,
    topk_method="noaux_tc",
    moe_layer_freq=1,
    tie_word_embeddings=False,
)


def _layers(num_layers: int, full: list[int]) -> dict:
    return {"kda_layers": [i for i in range(1, num_layers + 1) if i not in full], "full_attn_layers": full}


PRESETS: dict[str, dict] = {
    "tiny": dict(
        _COMMON,
        torch_dtype="float32",
        tokenizer_vocab_size=2048,
        hidden_size=128,
        num_hidden_layers=6,
        intermediate_size=256,
        rms_norm_eps=1e-6,
        max_position_embeddings=1024,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=16,
        index_rope_head_dim=8,
        # The exact golden tests serve the index cache unquantized; the MXFP8 tier (two
        # groups per row here) is tested with its own bound (tests/test_engine.py).
        index_cache_dtype="auto",
        index_quant_group_size=16,
        kv_cache_quant_tile=16,  # two FP8 tiles per latent row (kv_lora_rank 32)
        linear_attn_config=dict(_layers(6, [3, 6]), num_heads=4, head_dim=16, short_conv_kernel_size=4),
        attn_res_block_size=2,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=64,
        num_shared_experts=1,
        routed_scaling_factor=1.5,
        first_k_dense_replace=1,
        num_expert_group=2,
        topk_group=1,
        num_nextn_predict_layers=1,
    ),
    "small": dict(
        _COMMON,
        torch_dtype="bfloat16",
        tokenizer_vocab_size=32768,
        hidden_size=1024,
        num_hidden_layers=12,
        intermediate_size=2816,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        num_attention_heads=8,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=256,
        index_rope_head_dim=64,
        index_cache_dtype="auto",  # as tiny; bench keeps the family default, MXFP8
        linear_attn_config=dict(_layers(12, [4, 8, 12]), num_heads=8, head_dim=128, short_conv_kernel_size=4),
        attn_res_block_size=4,
        num_experts=16,
        num_experts_per_token=4,
        moe_intermediate_size=384,
        num_shared_experts=1,
        routed_scaling_factor=2.0,
        first_k_dense_replace=1,
        num_expert_group=4,
        topk_group=2,
        num_nextn_predict_layers=1,
    ),
    "bench": dict(
        _COMMON,
        torch_dtype="bfloat16",
        tokenizer_vocab_size=32768,
        vocab_size=163840,
        hidden_size=2304,
        num_hidden_layers=27,
        intermediate_size=9216,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        num_attention_heads=32,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=2048,
        index_rope_head_dim=64,
        linear_attn_config=dict(
            _layers(27, [4, 8, 12, 16, 20, 24, 27]), num_heads=32, head_dim=128, short_conv_kernel_size=4
        ),
        attn_res_block_size=4,
        num_experts=256,
        num_experts_per_token=8,
        moe_intermediate_size=1024,
        num_shared_experts=1,
        routed_scaling_factor=2.446,
        first_k_dense_replace=1,
        num_expert_group=1,
        topk_group=1,
        num_nextn_predict_layers=1,
    ),
}

# Presets whose weights are written; the others get config + tokenizer only.
WITH_WEIGHTS = ("tiny", "small")


def preset_config(name: str) -> dict:
    """A fresh copy of the preset's config fields (tokenizer size included)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
