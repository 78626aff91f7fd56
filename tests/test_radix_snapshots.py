"""Prefix reuse through SGLang's radix cache, served and checked against the golden model.

A hybrid model may reuse a cached prefix only up to a token where it also holds every
KDA layer's state and conv window; the latent KV and index-K sit in the same token
slots (mem_cache.sparse_mla_pool), so the radix tree keeps them with the prefix. This
architecture is served with SGLang's extra_buffer snapshots (plugin.py): the state at
the last mamba_cache_chunk_size-aligned point (64 tokens here) of each prefill chunk,
at the branch point when a request diverges inside a cached prefix, and every
--mamba-track-interval decode tokens, so at a request's end its last whole page when the
interval is the page size (the paged server). A request resumes from the deepest prefix that
has one. Warm must equal cold: every continuation is checked against the golden model,
and how deep each request reused against that policy.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random

import pytest
import requests
import torch

from conftest import GPU_SERVER_ARGS, Server

pytestmark = pytest.mark.slow

CHUNK = 64  # mamba_cache_chunk_size: fla's chunk, and a multiple of both servers' pages
PAGED_POOL_TOKENS = 1536
PAGED_SERVER_ARGS = ["--page-size", "16", "--mamba-track-interval", "16", "--chunked-prefill-size", "128",
                     "--max-total-tokens", str(PAGED_POOL_TOKENS), "--max-mamba-cache-size", "16"]


def _tokens(rng, n):
    return [rng.randrange(3, 2000) for _ in range(n)]


def _generate(url, input_ids, max_new):
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    res = r.json()
    return res["output_ids"], res["meta_info"]["cached_tokens"]


def eviction_workload(url, seed):
    """Sixteen conversations over three shared system prompts, three turns of 24 new
    tokens each, four conversations at a time: (system prompts, conversations, and per
    conversation its turns' (input ids, output ids, cached tokens))."""
    rng = random.Random(seed)
    systems = [_tokens(rng, n) for n in (150, 180, 210)]
    conversations = [(systems[i % 3], [_tokens(rng, rng.randrange(5, 40)) for _ in range(3)]) for i in range(16)]

    def converse(conversation):
        history, served = list(conversation[0]), []
        for user in conversation[1]:
            ids = history + user
            out, hit = _generate(url, ids, 24)
            served.append((ids, out, hit))
            history = ids + out
        return served

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return systems, conversations, list(pool.map(converse, conversations))


@pytest.fixture(scope="module")
def paged_server(checkpoint, tmp_path_factory):
    """Pages of 16 tokens, decode snapshots at every page, and pools small enough that a
    workload of a few thousand distinct tokens must evict prefixes and states."""
    log_dir = os.environ.get("SGLANG_HYBRID_TEST_LOGS") or str(tmp_path_factory.mktemp("logs"))
    gpu = GPU_SERVER_ARGS[:GPU_SERVER_ARGS.index("--chunked-prefill-size")] if torch.cuda.is_available() else []
    srv = Server(checkpoint, os.path.join(log_dir, "paged_server.log"), [*gpu, *PAGED_SERVER_ARGS])
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_server_reports_what_a_snapshot_costs(server, checkpoint):
    """The server log states one snapshot's bytes (every KDA layer's fp32 state [H, K, K]
    and conv window [kernel - 1, 3 H K] at the serving dtype, fp32 in these tests)."""
    import re

    from sglang_hybrid.configs import HybridLinearSparseConfig

    cfg = HybridLinearSparseConfig.from_pretrained(checkpoint)
    lac = cfg.linear_attn_config
    H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    want = len(lac["kda_layers"]) * 4 * (H * K * K + (W - 1) * 3 * H * K)
    m = re.search(r"radix snapshots: (\d+) bytes each \((\d+) KDA layers.*= (\d+) tokens", server.read_log())
    assert m, "no snapshot size in the server log"
    assert (int(m[1]), int(m[2])) == (want, len(lac["kda_layers"]))
    assert int(m[3]) > 0


def prefill_snapshots(prompt_len: int, prefill_chunk: int) -> list[int]:
    """Where a cold prefill of prompt_len tokens leaves states: in each prefill chunk
    of at least CHUNK tokens, at its last CHUNK-aligned point (counted from the chunk's start)."""
    points = []
    for start in range(0, prompt_len, prefill_chunk):
        n = min(prefill_chunk, prompt_len - start)
        if n >= CHUNK:
            points.append(start + n // CHUNK * CHUNK)
    return points


def test_repeat_branch_and_mid_chunk_reuse_equal_cold(server, check):
    """One 300-token prompt, then: the same prompt (resumes at 256); a request branching at
    token 200 (resumes at the deepest snapshot before it, and snapshots the branch point
    192); the same branch again (resumes at 192); a request branching mid-chunk at 290
    (resumes at 256). Warm outputs equal cold ones and the golden model's."""
    check_repeat_branch_and_mid_chunk_reuse(server, check)


def check_repeat_branch_and_mid_chunk_reuse(server, check):
    prefill_chunk = requests.get(server.url + "/get_server_info", timeout=30).json()["chunked_prefill_size"]
    rng = random.Random(50)
    prompt = _tokens(rng, 300)
    branch = prompt[:200] + _tokens(rng, 40)
    mid_chunk = prompt[:290] + _tokens(rng, 20)
    cold, hit = _generate(server.url, prompt, 24)
    assert hit == 0
    check.greedy(prompt, cold)
    before_branch = max([0] + [p for p in prefill_snapshots(len(prompt), prefill_chunk) if p <= 200])
    for ids, want_hit in ((prompt, 256), (branch, before_branch), (branch, 192), (mid_chunk, 256)):
        out, hit = _generate(server.url, ids, 24)
        assert hit == want_hit, f"prompt of {len(ids)} tokens reused {hit}, expected {want_hit}"
        check.greedy(ids, out)
        if ids is prompt:
            assert out == cold


def test_paged_prefill_chunks_and_decode_snapshots_serve_the_next_turn(paged_server, check):
    """With pages of 16 and 128-token prefill chunks, every chunk leaves a snapshot (128,
    then 192 = 128 + the last whole 64 of the second chunk); decode, one at every page
    (--mamba-track-interval 16), so the first turn ends with one at its last whole page: 272
    of the 279 tokens it ran (200 + 80 answered, the last never fed back). The second turn
    resumes there, as deep as the KV cache keeps a finished request; the first turn's
    branch at 192."""
    rng = random.Random(51)
    prompt = _tokens(rng, 200)
    first, hit = _generate(paged_server.url, prompt, 80)
    assert hit == 0
    check.greedy(prompt, first)
    turn2 = prompt + first + _tokens(rng, 5)
    out, hit = _generate(paged_server.url, turn2, 32)
    assert hit == 272
    check.greedy(turn2, out)
    branch = prompt[:195] + _tokens(rng, 30)
    out, hit = _generate(paged_server.url, branch, 16)
    assert hit == 192
    check.greedy(branch, out)


def test_shared_system_prompts_multi_turn_under_eviction(paged_server, check):
    """Sixteen conversations over three shared system prompts, three turns each, four at a
    time: more distinct tokens than the token pool holds and more snapshots than the state
    pool, so prefixes and states are evicted while others are reused. Every answer equals
    the golden model's; SGLang's leak check stays clean."""
    systems, conversations, served = eviction_workload(paged_server.url, 52)
    # Distinct tokens = the shared system prompts plus each conversation's own turns.
    distinct = sum(map(len, systems)) + sum(len(c[-1][0]) + len(c[-1][1]) - len(s) for (s, _), c in
                                            zip(conversations, served))
    assert distinct > 1.5 * PAGED_POOL_TOKENS  # the tree cannot have kept them all
    results = [turn for conversation in served for turn in conversation]
    if os.environ.get("SGLANG_HYBRID_TEST_LOGS"):  # for benchmarks/radix_replay_cold.py
        with open(os.path.join(os.environ["SGLANG_HYBRID_TEST_LOGS"], "radix_workload.json"), "w") as f:
            json.dump([{"input_ids": ids, "output_ids": out, "cached_tokens": hit} for ids, out, hit in results], f)
    reused = [hit for _, _, hit in results]
    assert sum(h > 0 for h in reused) >= len(results) // 2, f"reuse per request: {reused}"
    wrong = []
    for ids, out, hit in results:
        try:
            check.greedy(ids, out)
        except AssertionError as e:
            wrong.append((ids, out, hit, e))
    if wrong:
        # Say whether the same request, alone on an empty cache, is right: that separates a
        # wrong restored state from a wrong batch.
        requests.post(paged_server.url + "/flush_cache", timeout=60).raise_for_status()
        report = []
        for ids, out, hit, e in wrong:
            alone, alone_hit = _generate(paged_server.url, ids, len(out))
            report.append(f"{e} [reused {hit} tokens; alone on an empty cache (reused {alone_hit}): "
                          f"{'equal to the golden model' if alone == check.golden.generate(ids, len(out)) else 'also wrong'}]")
        raise AssertionError(f"{len(wrong)} of {len(results)} answers differ from the golden model:\n" + "\n".join(report))
    log = paged_server.read_log()
    assert "memory leak detected" not in log
