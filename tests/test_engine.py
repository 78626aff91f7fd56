"""sglang.Engine (offline, in-process entry point) against the golden model."""

from __future__ import annotations

import pytest

from sglang_hybrid.cli import CPU_DEFAULTS
from sglang_hybrid.cpu_support import gpu_available

pytestmark = pytest.mark.slow


def _engine_kwargs() -> dict:
    if gpu_available():
        return {"dtype": "float32", "mem_fraction_static": 0.5, "cuda_graph_max_bs_decode": 8}
    kwargs = {}
    for flag, value in CPU_DEFAULTS.items():
        key = flag[2:].replace("-", "_")
        kwargs[key] = True if value is None else type_of(key)(value)
    return kwargs


def type_of(key):
    return float if key == "mem_fraction_static" else int if key.startswith("max_") else str


def test_engine_generate_matches_golden(checkpoint, check):
    import sglang

    prompts = [[5, 6, 7, 8], list(range(100, 160))]
    engine = sglang.Engine(model_path=checkpoint, **_engine_kwargs())
    try:
        outs = engine.generate(input_ids=prompts,
                               sampling_params={"max_new_tokens": 64, "temperature": 0, "ignore_eos": True})
    finally:
        engine.shutdown()
    for ids, out in zip(prompts, outs):
        check.greedy(ids, out["output_ids"])
