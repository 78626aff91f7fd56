"""KDA recurrence and short conv, and the sparse (indexer + attention) layer, under zigzag
context parallelism over W gloo ranks on CPU, against the single-process reference (fp32):
ragged requests, lengths not divisible by 2W, one-token and shorter-than-2W requests, a
request continuing from a cached prefix (its state and window; its index-K and KV), and
the radix cache's snapshots inside the new tokens (at a chunk boundary, inside a chunk, after
none and after all of a request's tokens)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import by_request, free_port

from sglang_hybrid.parallel.kda_cp import conv_cp, kda_cp
from sglang_hybrid.parallel.sparse_cp import sparse_layer_cp
from sglang_hybrid.parallel.zigzag import zigzag_plan
from sglang_hybrid.reference.ops import (indexer_scores, kda_recurrence, l2norm, short_causal_conv, sparse_attention,
                                         topk_positions)

LENGTHS = [37, 1, 5, 20]
H, K, V, D, WIDTH = 2, 8, 4, 6, 4


def _batch():
    g = torch.Generator().manual_seed(0)
    T = sum(LENGTHS)
    return dict(
        q=l2norm(torch.randn(T, H, K, generator=g)) * K**-0.5, k=l2norm(torch.randn(T, H, K, generator=g)),
        v=torch.randn(T, H, V, generator=g), g=-torch.rand(T, H, K, generator=g) * 0.5,
        beta=torch.rand(T, H, generator=g), x=torch.randn(T, D, generator=g),
        weight=torch.randn(D, WIDTH, generator=g),
        # Request 3 continues from a cached prefix: a nonzero state and window.
        initial=torch.stack([torch.zeros(H, K, V)] * 3 + [torch.randn(H, K, V, generator=g)]),
        windows=torch.stack([torch.zeros(WIDTH - 1, D)] * 3 + [torch.randn(WIDTH - 1, D, generator=g)]))


def _reference(b):
    """(KDA outputs, final states, snapshot states), (conv outputs, final windows, snapshot windows)."""
    conv = lambda x, window: short_causal_conv(x, window, b["weight"])  # noqa: E731
    return (by_request(kda_recurrence, [b[n] for n in ("q", "k", "v", "g", "beta")], b["initial"], LENGTHS, CUTS),
            by_request(conv, [b["x"]], b["windows"], LENGTHS, CUTS))


# {request: new tokens before its snapshot}: 23 of 37 (inside a chunk at W = 2 and 4), all
# of a one-token request, none of request 2's, 10 of request 3's 20 (a chunk boundary at
# W = 2, chunks of 5; inside a chunk at W = 4) on top of its cached state.
CUTS = {0: 23, 1: 1, 2: 0, 3: 10}


def _worker(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        b = _batch()
        plan = zigzag_plan(LENGTHS, world)
        rows = plan.rank_tokens[rank]
        o, finals, snap_states = kda_cp(b["q"][rows], b["k"][rows], b["v"][rows], b["g"][rows], b["beta"][rows],
                                        b["initial"], LENGTHS, cuts=CUTS)
        c, windows, snap_windows = conv_cp(b["x"][rows], b["windows"], b["weight"], LENGTHS, cuts=CUTS)
        (ref_o, ref_states, ref_snap_states), (ref_c, ref_windows, ref_snap_windows) = _reference(b)
        torch.testing.assert_close(o, ref_o[rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(finals, ref_states, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c, ref_c[rows], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(windows, ref_windows)
        torch.testing.assert_close(snap_states, ref_snap_states, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(snap_windows, ref_snap_windows)
        # Every rank's rows gathered back and restored: the batch's order.
        gathered = [None] * world
        dist.all_gather_object(gathered, o)
        torch.testing.assert_close(plan.restore(gathered), ref_o, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_kda_and_conv_under_zigzag_cp_equal_one_rank(world):
    mp.spawn(_worker, args=(world, free_port()), nprocs=world, join=True)


HI, DI, HQ, DQK, DV, TOPK = 3, 8, 2, 8, 4, 6


def _sparse_batch():
    g = torch.Generator().manual_seed(3)
    T = sum(LENGTHS)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    prefix = (rnd(9, DI), rnd(9, HQ, DQK), rnd(9, HQ, DV))  # request 3 continues a 9-token cached prefix
    return dict(index_q=rnd(T, HI, DI), index_w=rnd(T, HI), index_k=rnd(T, DI), q=rnd(T, HQ, DQK),
                k=rnd(T, HQ, DQK), v=rnd(T, HQ, DV), prefixes=[None, None, None, prefix])


def _sparse_reference(b):
    outs, start = [], 0
    for i, n in enumerate(LENGTHS):
        s = slice(start, start + n)
        ik, k, v = b["index_k"][s], b["k"][s], b["v"][s]
        offset = 0
        if b["prefixes"][i] is not None:
            pik, pk, pv = b["prefixes"][i]
            ik, k, v, offset = torch.cat([pik, ik]), torch.cat([pk, k]), torch.cat([pv, v]), pik.shape[0]
        positions = torch.arange(offset, offset + n)
        selected = topk_positions(indexer_scores(b["index_q"][s], b["index_w"][s], ik, positions), TOPK)
        outs.append(sparse_attention(b["q"][s], k, v, selected, 0.3))
        start += n
    return torch.cat(outs)


def _sparse_worker(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        b = _sparse_batch()
        prefix_lens = [0 if p is None else p[0].shape[0] for p in b["prefixes"]]
        plan = zigzag_plan(LENGTHS, world, prefix_lens)
        rows = plan.rank_tokens[rank]
        out = sparse_layer_cp(*(b[name][rows] for name in ("index_q", "index_w", "index_k", "q", "k", "v")),
                              plan, LENGTHS, TOPK, 0.3, b["prefixes"])
        torch.testing.assert_close(out, _sparse_reference(b)[rows], rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_sparse_layer_under_zigzag_cp_equals_one_rank(world):
    mp.spawn(_sparse_worker, args=(world, free_port()), nprocs=world, join=True)


def _model_worker(rank, world, port, checkpoint):
    from sglang_hybrid.parallel.golden_cp import ZigzagGolden
    from sglang_hybrid.reference import load

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        golden = load(checkpoint)
        # Per request (new tokens, cached prefix): one whole prompt; the same after a cached
        # 11-token prefix; a prompt shorter than the 2W chunks (some ranks hold no rows of
        # it); a ragged batch with a cached prefix, a one-token and a short request.
        for case in ([(53, 0)], [(53, 11)], [(3, 0)], [(40, 11), (1, 0), (3, 5), (20, 0)]):
            prompts = [[(7 * i + 3 + 5 * r) % 500 + 3 for i in range(n + pre)] for r, (n, pre) in enumerate(case)]
            ref_caches, cp_caches = [golden.new_cache() for _ in case], [golden.new_cache() for _ in case]
            for p, (n, pre), ref_cache, cp_cache in zip(prompts, case, ref_caches, cp_caches):
                if pre:
                    golden.forward(p[:pre], ref_cache)
                    golden.forward(p[:pre], cp_cache)
            refs = [golden.forward(p[pre:], c) for p, (n, pre), c in zip(prompts, case, ref_caches)]
            logits, plan = ZigzagGolden(golden).prefill([p[pre:] for p, (n, pre) in zip(prompts, case)], cp_caches,
                                                        rank, world)
            torch.testing.assert_close(logits, torch.cat(refs)[plan.rank_tokens[rank]], rtol=1e-4, atol=1e-4)
            # Decode continues from each request's CP cache exactly as from a single rank's.
            for ref, ref_cache, cp_cache in zip(refs, ref_caches, cp_caches):
                nxt = int(ref[-1].argmax())
                torch.testing.assert_close(golden.forward([nxt], cp_cache), golden.forward([nxt], ref_cache),
                                           rtol=1e-4, atol=1e-4)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_tiny_model_prefill_under_zigzag_cp_equals_one_rank(world, tmp_path_factory):
    from sglang_hybrid.checkpoints.maker import make_checkpoint

    checkpoint = make_checkpoint("tiny", str(tmp_path_factory.mktemp("tiny_cp")), seed=0)
    mp.spawn(_model_worker, args=(world, free_port(), checkpoint), nprocs=world, join=True)
