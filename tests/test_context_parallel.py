"""SGLang's context-parallel prefill switches, served: `--tp-size 4 --enable-prefill-cp
--cp-strategy zigzag --attn-cp-size 2` (two CP ranks, each an attention TP group of two;
the FFN tensor-parallel over all four), four CPU processes over gloo, against the golden
model. Prefill batches are split (parallel.prefill_cp), decode is not; each rank's cache
must end as a single rank's, so every decoded token checks it too.

Tokens must equal the golden model's: the KDA fold reorders fp32 sums (states within
~1e-6 of the sequential recurrence, tests/test_cp_gloo.py), far below these checkpoints'
greedy margins on the prompts here.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import time

import pytest
import requests

from conftest import Server
from test_radix_snapshots import _generate, _tokens, check_repeat_branch_and_mid_chunk_reuse
from test_server import logprob_errors

pytestmark = pytest.mark.slow

CP_ARGS = ["--tp-size", "4", "--enable-prefill-cp", "--cp-strategy", "zigzag", "--attn-cp-size", "2",
           "--chunked-prefill-size", "128"]


@pytest.fixture(scope="module")
def cp_server(checkpoint, tmp_path_factory):
    log_dir = os.environ.get("SGLANG_HYBRID_TEST_LOGS") or str(tmp_path_factory.mktemp("logs"))
    srv = Server(checkpoint, os.path.join(log_dir, "cp_server.log"), CP_ARGS)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_ragged_batch_split_over_ranks_equals_golden(cp_server, check):
    """Concurrent requests of 1, 3, 37, 150 and 300 tokens (shorter than the 2W = 4 chunks,
    one chunk-sized, several 128-token prefill chunks continuing a prefix): the greedy
    continuations equal the golden model's, and every rank says its prefill was split."""
    rng = random.Random(60)
    prompts = [_tokens(rng, n) for n in (1, 3, 37, 150, 300)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        served = list(pool.map(lambda ids: _generate(cp_server.url, ids, 16)[0], prompts))
    for ids, out in zip(prompts, served):
        check.greedy(ids, out)
    log = cp_server.read_log()
    for rank in ("ATTN_CP0 TP0", "ATTN_CP0 TP1", "ATTN_CP1 TP2", "ATTN_CP1 TP3"):
        assert f"{rank}] context-parallel prefill:" in log, f"{rank} never split a prefill"


def test_radix_reuse_from_context_parallel_snapshots_equals_cold(cp_server, check):
    """The radix cache's KDA snapshots inside a split prefill (256 of a 300-token prompt in
    the third 128-token chunk, owned by one rank; the branch point 192) are folded and
    shared by the rank that holds them: requests resuming there equal the golden model."""
    check_repeat_branch_and_mid_chunk_reuse(cp_server, check)


def test_prefill_logprobs_from_gathered_rows_match_golden(cp_server, golden, tolerance):
    """Every prompt position's log-probability (the hidden states all-gathered back to batch
    order before the LM head) and every decoded one, against the golden model's."""
    errors = logprob_errors(cp_server, golden)
    assert max(errors.values()) <= tolerance.logprob, errors


def test_server_runs_the_cp_layout_and_its_leak_check_stays_clean(cp_server):
    info = requests.get(cp_server.url + "/get_server_info", timeout=30).json()
    assert (info["tp_size"], info["attn_cp_size"], info["enable_prefill_cp"], info["cp_strategy"]) == \
        (4, 2, True, "zigzag")
    time.sleep(5)  # SGLang checks its pools for leaks when the scheduler goes idle
    assert requests.get(cp_server.url + "/health", timeout=30).status_code == 200
    log = cp_server.read_log()
    assert "memory leak detected" not in log and "double free" not in log


def test_four_cp_ranks_with_mixed_chunks_equal_golden(checkpoint, tmp_path, check):
    """`--attn-cp-size 4` (attention TP 1) with --enable-mixed-chunk: staggered requests make
    prefill chunks of 64 tokens that carry running requests' decode tokens as one-token
    extends, split over four ranks with the new prompts' rows. Every continuation equals
    the golden model's."""
    srv = Server(checkpoint, str(tmp_path / "cp4_server.log"),
                 ["--tp-size", "4", "--enable-prefill-cp", "--cp-strategy", "zigzag", "--attn-cp-size", "4",
                  "--chunked-prefill-size", "64", "--enable-mixed-chunk"])
    try:
        srv.wait_ready()
        rng = random.Random(61)
        lengths = [2, 40, 130, 200]

        def staggered(i):
            # Later prompts join running decodes: the first decodes long enough (96 tokens,
            # seconds on any host) that the others' chunks meet it however fast it runs.
            time.sleep(0.5 * i)
            return _generate(srv.url, prompts[i], 96 if i == 0 else 16)[0]

        prompts = [_tokens(rng, n) for n in lengths]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(staggered, range(len(prompts))))
        for ids, out in zip(prompts, served):
            check.greedy(ids, out)
        log = srv.read_log()
        assert "ATTN_CP3 TP3] context-parallel prefill:" in log
        assert re.search(r"TP0\] Prefill batch, #new-seq: \d+, #new-token: \d+, .*#running-req: [1-9]", log), \
            "no prefill ran beside running requests: the mixed-chunk path was not exercised"
    finally:
        srv.stop()
