"""`sglang-hybrid make-checkpoint`: seeded weights, offline tokenizer with a chat template."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sglang_hybrid.checkpoints.maker import load_weights


def test_cli_writes_a_loadable_checkpoint_deterministic_in_the_seed(tmp_path):
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        subprocess.run([sys.executable, "-m", "sglang_hybrid.cli", "make-checkpoint", "--preset", "tiny",
                        "--out", str(tmp_path / name), "--seed", str(seed)], check=True, capture_output=True)
    a, b, c = (load_weights(tmp_path / n) for n in "abc")
    assert a.keys() == b.keys() == c.keys()
    assert all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in a)
    index = json.load(open(tmp_path / "a" / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(a)


def test_tokenizer_round_trips_and_has_a_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from sglang_hybrid.checkpoints.maker import make_checkpoint

    tok = AutoTokenizer.from_pretrained(make_checkpoint("tiny", str(tmp_path), with_weights=False))
    text = "def f(x):\n    return x ** 2  # ünïcode ok\n"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok) == json.load(open(tmp_path / "config.json"))["vocab_size"]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert "hi" in chat and chat.endswith("assistant\n")
    assert tok.eos_token is not None


def test_bench_preset_is_config_only(tmp_path):
    from sglang_hybrid.checkpoints.maker import make_checkpoint
    from sglang_hybrid.configs import HybridLinearSparseConfig

    path = make_checkpoint("bench", str(tmp_path))
    assert not [n for n in os.listdir(path) if n.endswith(".safetensors")]
    cfg = HybridLinearSparseConfig.from_pretrained(path)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 2048)


def test_near_bigram_logit_scale_sharpens_without_changing_choices(tmp_path):
    """--logit-scale multiplies the target's and the draft head's logits alike: the same
    greedy tokens and draft proposals, a sharper distribution (what tree drafts select on)."""
    import pytest
    import torch

    from sglang_hybrid.checkpoints.maker import make_checkpoint
    from sglang_hybrid.reference import load

    ids = [5, 6, 7, 8, 9, 10, 11]
    plain, sharp = (load(make_checkpoint("tiny", str(tmp_path / f"s{s}"), near_bigram=0.3, logit_scale=s))
                    for s in (1.0, 8.0))
    torch.testing.assert_close(sharp.logits(ids), 8.0 * plain.logits(ids), rtol=1e-4, atol=1e-4)
    assert plain.generate(ids, 12) == sharp.generate(ids, 12)
    assert plain.speculative_generate(ids, 12, 3) == sharp.speculative_generate(ids, 12, 3)
    with pytest.raises(ValueError, match="near_bigram checkpoint only"):
        make_checkpoint("tiny", str(tmp_path / "x"), logit_scale=8.0)
    with pytest.raises(ValueError, match="must be positive"):
        make_checkpoint("tiny", str(tmp_path / "y"), near_bigram=0.3, logit_scale=0.0)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
