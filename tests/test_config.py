"""HybridLinearSparseConfig: every inconsistency fails with one message that names the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang_hybrid.checkpoints.presets import preset_config
from sglang_hybrid.configs import HybridLinearSparseConfig
from sglang_hybrid.configs.hybrid_linear_sparse import ConfigError


def config_fields(preset: str) -> dict:
    cfg = preset_config(preset)
    cfg["vocab_size"] = cfg.pop("tokenizer_vocab_size")
    return cfg


def tiny(**changes) -> dict:
    cfg = config_fields("tiny")
    for key, value in changes.items():
        if key.startswith("lac_"):
            cfg["linear_attn_config"][key[4:]] = value
        else:
            cfg[key] = value
    return cfg


@pytest.mark.parametrize("changes, field", [
    ({"index_topk": None}, "index_topk"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"kv_lora_rank": "512"}, "kv_lora_rank"),
    ({"linear_attn_config": [1, 2]}, "linear_attn_config"),
    ({"lac_head_dim": None}, "linear_attn_config.head_dim"),
    ({"lac_short_conv_kernel_size": 1}, "linear_attn_config.short_conv_kernel_size"),
    ({"lac_kda_layers": [1, 1, 2, 4, 5]}, "linear_attn_config.kda_layers"),
    ({"lac_full_attn_layers": [0, 3]}, "linear_attn_config.full_attn_layers"),  # 1-based
    ({"lac_full_attn_layers": [3, 6, 5]}, "linear_attn_config"),  # 5 in both lists
    ({"lac_kda_layers": [1, 2, 4]}, "linear_attn_config"),  # 5 in neither
    ({"lac_full_attn_layers": [], "lac_kda_layers": [1, 2, 3, 4, 5, 6]}, "linear_attn_config.full_attn_layers"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"index_topk": 4096}, "index_topk"),  # above max_position_embeddings
    ({"index_rope_head_dim": 3}, "index_rope_head_dim"),
    ({"index_rope_head_dim": 128}, "index_rope_head_dim"),  # above index_head_dim
    ({"index_head_dim": 48, "index_use_hadamard": True, "index_rope_head_dim": 0}, "index_head_dim"),
    ({"index_cache_dtype": "fp8"}, "index_cache_dtype"),
    ({"index_cache_dtype": "mxfp8", "index_quant_group_size": 24}, "index_quant_group_size"),
    ({"index_cache_dtype": "mxfp8", "index_quant_group_size": 256}, "index_quant_group_size"),  # above index_head_dim
    ({"kv_cache_quant_tile": 24}, "kv_cache_quant_tile"),  # does not divide kv_lora_rank
    ({"kv_lora_rank": 48, "kv_cache_quant_tile": 12}, "kv_cache_quant_tile"),  # divides it, not a power of two
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_experts_per_token": 9}, "num_experts_per_token"),
    ({"num_expert_group": 3}, "num_expert_group"),
    ({"topk_group": 3}, "topk_group"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
])
def test_inconsistent_config_names_the_field(changes, field):
    with pytest.raises(ConfigError) as err:
        HybridLinearSparseConfig(**tiny(**changes))
    assert err.value.field == field
    assert f"`{field}`" in str(err.value)


def test_presets_are_valid_and_round_trip(tmp_path):
    for name in ("tiny", "small", "bench"):
        cfg = HybridLinearSparseConfig(**config_fields(name))
        cfg.save_pretrained(tmp_path / name)
        again = HybridLinearSparseConfig.from_pretrained(tmp_path / name)
        assert again.to_dict() == cfg.to_dict()


def test_autoconfig_resolves_the_family_after_plugin_registration(tmp_path):
    from transformers import AutoConfig

    from sglang_hybrid.plugin import register

    HybridLinearSparseConfig(**config_fields("tiny")).save_pretrained(tmp_path)
    register()
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(cfg, HybridLinearSparseConfig)
    assert cfg.architectures == ["HybridLinearSparseForCausalLM"]


def test_tensor_parallel_split_must_divide_heads():
    cfg = HybridLinearSparseConfig(**config_fields("tiny"))
    cfg.validate_parallel(2)
    with pytest.raises(ConfigError, match="not divisible by the tensor-parallel size 3") as err:
        cfg.validate_parallel(3)
    assert err.value.field in ("num_attention_heads", "linear_attn_config.num_heads")


def test_layer_kinds_are_zero_based_views_of_one_based_lists():
    cfg = HybridLinearSparseConfig(**config_fields("tiny"))
    full = [i - 1 for i in preset_config("tiny")["linear_attn_config"]["full_attn_layers"]]
    assert cfg.full_attention_layer_ids == full
    assert [i for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i)] == full


@pytest.mark.slow
def test_serving_a_bad_config_exits_with_the_field_named(tmp_path):
    """Through `sglang-hybrid serve`, i.e. SGLang's real launch path."""
    from sglang_hybrid.checkpoints.maker import make_checkpoint

    ckpt = make_checkpoint("tiny", str(tmp_path / "ckpt"), with_weights=False)
    path = os.path.join(ckpt, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["index_topk"] = cfg["max_position_embeddings"] + 1
    with open(path, "w") as f:
        json.dump(cfg, f)
    proc = subprocess.run([sys.executable, "-m", "sglang_hybrid.cli", "serve", "--model-path", ckpt, "--port", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "`index_topk`" in proc.stdout + proc.stderr
