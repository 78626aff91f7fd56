"""The eviction workload of test_radix_snapshots.py over many seeds on one server: a
reproduction tool for prefix reuse under eviction, not part of the default run (pytest
collects test_*.py only).

    STRESS_SEEDS="$(seq -s ' ' 0 29)" python -m pytest -q tests/stress_radix_eviction.py
    STRESS_ARGS="--disable-overlap-schedule" ...   # extra server arguments

Each seed is sixteen three-turn conversations over three shared system prompts, four at a
time, on a server whose pools force eviction; every answer is checked against the golden
model (GoldenCheck: exact, or explained by one of the golden indexer's near ties). Each
answer that differs from the golden model's own greedy continuation is appended to
$STRESS_LOG (default /tmp/stress_radix_eviction.jsonl) with its prompt, output and cached
tokens, for replay. `STRESS_ARGS` adds server arguments (`--mamba-track-interval 64` makes decode
snapshot boundaries a quarter as frequent as the CI test's, one a page). `STRESS_NEAR_BIGRAM=0` serves a
near-bigram checkpoint (`make-checkpoint --near-bigram`) whose draft head always agrees with
the target: with speculative arguments in STRESS_ARGS, accepted runs then cross decode
snapshot boundaries. What it found, and the fix (a decode
snapshot filed under the wrong length by SGLang's overlap scheduler):
benchmarks/prefix_reuse.md.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import Server
from test_radix_snapshots import PAGED_SERVER_ARGS, eviction_workload

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def checkpoint(preset, tmp_path_factory) -> str:
    from sglang_hybrid.checkpoints.maker import make_checkpoint

    scale = os.environ.get("STRESS_NEAR_BIGRAM")
    return make_checkpoint(preset, str(tmp_path_factory.mktemp(preset)), seed=0,
                           near_bigram=None if scale is None else float(scale))


@pytest.fixture(scope="module")
def stress_server(checkpoint, tmp_path_factory):
    log_dir = os.environ.get("SGLANG_HYBRID_TEST_LOGS") or str(tmp_path_factory.mktemp("logs"))
    srv = Server(checkpoint, os.path.join(log_dir, "stress_server.log"),
                 [*PAGED_SERVER_ARGS, *os.environ.get("STRESS_ARGS", "").split()])
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.mark.parametrize("seed", [int(s) for s in os.environ.get("STRESS_SEEDS", "0 1 2 3 4 5 6 7 8 9").split()])
def test_eviction_workload(stress_server, check, seed):
    _, _, served = eviction_workload(stress_server.url, 1000 + seed)
    results = [turn for conversation in served for turn in conversation]
    wrong = []
    for ids, out, hit in results:
        if out == check.golden.generate(ids, len(out)):
            continue
        with open(os.environ.get("STRESS_LOG", "/tmp/stress_radix_eviction.jsonl"), "a") as f:
            f.write(json.dumps({"seed": seed, "input_ids": ids, "output_ids": out, "cached_tokens": hit}) + "\n")
        try:
            check.greedy(ids, out)
        except AssertionError as e:
            wrong.append(f"{e} [reused {hit} tokens]")
    assert not wrong, "\n".join(wrong)
