"""Context-parallel prefill algebra on one process: the zigzag partition and the KDA
chunk summaries against the plain sequential computation (fp32)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from conftest import by_request

from sglang_hybrid.parallel.kda_summary import (chunk_summary, conv_windows, each_sequence, fold_states,
                                                summary_by_recurrence)
from sglang_hybrid.parallel.zigzag import chunk_bounds, contiguous_plan, rank_work, zigzag_plan
from sglang_hybrid.reference.ops import kda_recurrence, l2norm, short_causal_conv


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("lengths, prefixes", [
    ([64], [0]),                  # divisible by 2W
    ([37, 1, 5, 100], [0, 0, 3, 0]),  # ragged, one-token, shorter than 2W, a cached prefix
    ([0, 9], [4, 0]),             # a request with no new tokens
])
def test_zigzag_plan_places_every_token_once_and_restores_order(world, lengths, prefixes):
    plan = zigzag_plan(lengths, world, prefixes)
    order = torch.cat(plan.rank_tokens)
    assert torch.equal(order.sort().values, torch.arange(sum(lengths)))
    expected_positions = torch.cat([torch.arange(p, p + n) for n, p in zip(lengths, prefixes)])
    assert torch.equal(torch.cat(plan.rank_positions), expected_positions[order])
    x = torch.randn(sum(lengths), 3)
    assert torch.equal(plan.restore([x[t] for t in plan.rank_tokens]), x)
    # Every rank holds its two chunks of each request: sizes differ by at most 2 per request.
    sizes = [t.numel() for t in plan.rank_tokens]
    assert max(sizes) - min(sizes) <= 2 * len(lengths)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("lengths", [[53], [37, 9, 20], [40, 12, 8, 20]])
def test_zigzag_plan_lays_out_rows_as_sglangs_zigzag_strategy(world, lengths):
    """SGLang shards the hidden states with ZigzagCPStrategy; the plan must give each rank
    the same rows in the same order (the layers' local_chunks rely on it)."""
    from itertools import accumulate

    from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy

    class AtRank(ZigzagCPStrategy):  # SGLang reads the rank from its parallel state
        def __init__(self, rank):
            super().__init__(world)
            self.rank = rank

        @property
        def cp_rank(self):
            return self.rank

    plan = zigzag_plan(lengths, world)
    for rank in range(world):
        meta = AtRank(rank).build_metadata(sum(lengths), None, lengths)
        starts = [0, *accumulate(meta.split_list)]
        theirs = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in meta.zigzag_index])
        assert torch.equal(plan.rank_tokens[rank], theirs)


def test_chunk_bounds_spread_the_remainder_over_the_first_chunks():
    assert chunk_bounds(10, 4) == [0, 3, 6, 8, 10]
    assert chunk_bounds(2, 4) == [0, 1, 2, 2, 2]


def test_zigzag_balances_causal_work_where_a_contiguous_split_does_not():
    lengths, world, topk = [32768, 8192, 1000], 4, 2048
    spread = {}
    for name, make in (("zigzag", zigzag_plan), ("contiguous", contiguous_plan)):
        work = [w["indexer_positions"] for w in rank_work(make(lengths, world), topk)]
        spread[name] = max(work) / min(work)
    assert spread["zigzag"] < 1.01 < 1.5 < spread["contiguous"]


def _kda_inputs(T, H=2, K=8, V=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(T, H, K, generator=g)) * K**-0.5
    k = l2norm(torch.randn(T, H, K, generator=g))
    v = torch.randn(T, H, V, generator=g)
    decay = -torch.rand(T, H, K, generator=g) * 0.5
    beta = torch.rand(T, H, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("sizes", [[37], [10, 0, 1, 26], [5, 5, 5, 5, 17]])
def test_folded_chunk_summaries_equal_the_sequential_recurrence(sizes):
    q, k, v, decay, beta = _kda_inputs(sum(sizes))
    initial = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(1))  # a cached prefix's state
    out, final = kda_recurrence(q, k, v, decay, beta, initial)
    cuts = torch.tensor([0] + sizes).cumsum(0).tolist()
    chunks = [slice(a, b) for a, b in zip(cuts, cuts[1:])]
    states = fold_states([chunk_summary(k[c], v[c], decay[c], beta[c]) for c in chunks], initial)
    torch.testing.assert_close(states[-1], final, rtol=1e-5, atol=1e-5)
    per_chunk = [kda_recurrence(q[c], k[c], v[c], decay[c], beta[c], s)[0] for c, s in zip(chunks, states)]
    torch.testing.assert_close(torch.cat(per_chunk), out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens", [[0], [1], [19], [7, 0, 12]])
def test_summary_by_one_recurrence_run_equals_the_matrix_product(lens):
    """The summary the CP layers use (one run of the recurrence on [v | 0] from [0 | I], over
    every sequence at once) equals the explicit product of each sequence's per-token maps."""
    _, k, v, decay, beta = _kda_inputs(sum(lens))
    cu = [0, *itertools.accumulate(lens)]
    M, E = summary_by_recurrence(each_sequence(kda_recurrence), k, v, decay, beta, cu)
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        for got, want in zip((M[n], E[n]), chunk_summary(k[a:b], v[a:b], decay[a:b], beta[a:b])):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _relative_error(got, want):
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("lens", [[45], [200], [45, 0, 200, 1]])
def test_gpu_recurrence_equals_the_reference(dtype, bound, lens):
    """The GPU's kernels under CP (kda_backend.cp_kernels), one call over all of a rank's
    chunks, behind the reference's contract (kda_summary.each_sequence): serving fp32, fla's
    fused recurrence (exact) and a summary from one run of it; serving bf16, SGLang's chunk_kda
    on bf16 inputs (it rounds intra-chunk products, ~2e-3) and fla's CP summary kernel over the
    chunks' WY factors. Outputs, final states and the summaries (M, E), against the fp32
    reference. Chunks shorter than and spanning several of the kernels' 64-token chunks, an
    empty one among them; 64-wide heads, as the presets have."""
    from sglang_hybrid.layers import kda_backend

    recurrence, summary = kda_backend.cp_kernels(torch.empty(0, device="cuda", dtype=dtype))
    cu = [0, *itertools.accumulate(lens)]
    q, k, v, decay, beta = (t.cuda() for t in _kda_inputs(cu[-1], H=4, K=64, V=64))
    decay = decay * 0.1  # gates that keep M well above rounding over 200 tokens
    states = torch.randn(len(lens), 4, 64, 64, generator=torch.Generator().manual_seed(3)).cuda()
    reference = each_sequence(kda_recurrence)
    pairs = [*zip(recurrence(q, k, v, decay, beta, states, cu), reference(q, k, v, decay, beta, states, cu)),
             *zip(summary(k, v, decay, beta, cu), summary_by_recurrence(reference, k, v, decay, beta, cu))]
    errors = [_relative_error(got.float(), want) for got, want in pairs]
    assert max(errors) < bound, f"relative errors (o, finals, M, E): {errors}"


def _stand_in_varlen_kernel(q, k, v, g, beta, scale, cu_seqlens, initial_state, initial_state_indices=None,
                            use_qk_l2norm_in_kernel=False):
    """SGLang's KDA kernels' varlen contract in PyTorch (they run on GPUs only): [1, T, ...]
    inputs, contiguous, sequences at cu_seqlens, states [N, H, V, K], and chunk_kda's pool
    (initial_state_indices) ended in place. Returns (o [1, T, H, V], final states)."""
    assert all(t.is_contiguous() for t in (q, k, v, g, beta)) and q.shape[1] == int(cu_seqlens[-1])
    slots = range(len(cu_seqlens) - 1) if initial_state_indices is None else initial_state_indices.tolist()
    outs, finals = [], []
    for n, slot in enumerate(slots):
        s, e = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        o, h = kda_recurrence(q[0, s:e].float() * scale, k[0, s:e].float(), v[0, s:e].float(), g[0, s:e],
                              beta[0, s:e].float(), initial_state[slot].transpose(-1, -2))
        outs.append(o.to(v.dtype))
        finals.append(h.transpose(-1, -2))
    if initial_state_indices is not None:
        initial_state[initial_state_indices.long()] = torch.stack(finals)
    return torch.cat(outs)[None], torch.stack(finals)


@pytest.mark.parametrize("wrapper, kernel", [("fused_recurrence", "fused_recurrent_kda"),
                                             ("chunked_recurrence", "chunk_kda")])
def test_gpu_recurrence_wrappers_place_rows_and_states(wrapper, kernel, monkeypatch):
    """kda_backend's own part of the GPU recurrences, on CPU: every non-empty sequence's rows
    in one varlen call (an empty one skipped, its state passed through), states to the
    kernels' [H, V, K] layout and back, outputs put back in row order. The kernel is stood in
    by the reference under its calling convention; the GPU tests above run the real ones."""
    import sglang.kernels.ops.attention.fla.kda as sglang_kda

    from sglang_hybrid.layers import kda_backend

    monkeypatch.setattr(sglang_kda, kernel, _stand_in_varlen_kernel)
    lens = [7, 0, 12, 1]
    cu = [0, *itertools.accumulate(lens)]
    q, k, v, decay, beta = _kda_inputs(cu[-1])
    states = torch.randn(len(lens), 2, 8, 4, generator=torch.Generator().manual_seed(5))
    run = getattr(kda_backend, wrapper)
    if wrapper == "chunked_recurrence":
        run = functools.partial(run, dtype=torch.float32)  # bf16 rounding is the kernel's, not the plumbing's
    got = run(q, k, torch.cat([v, v], -1)[..., :4], decay, beta, states, cu)  # v a strided view, as split from qkv
    want = each_sequence(kda_recurrence)(q, k, v, decay, beta, states, cu)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-6), (g - w).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_kda_cp_with_gpu_kernels_equals_the_reference(dtype, bound, tmp_path):
    """parallel.kda_cp as the served CP path runs it on a GPU (cp_kernels at the serving
    dtype), on a one-rank NCCL group (each request in two zigzag chunks: summaries, fold,
    outputs from the folded state, a snapshot inside a chunk), against the reference
    recurrence over each whole request: ragged requests of 1, 45 and 200 tokens, the last on
    a cached state."""
    import torch.distributed as dist

    from sglang_hybrid.layers import kda_backend
    from sglang_hybrid.parallel.kda_cp import kda_cp

    lengths, cuts = [1, 45, 200], {1: 30, 2: 130}
    q, k, v, decay, beta = _kda_inputs(sum(lengths), H=4, K=64, V=64)
    decay = decay * 0.1
    initial = torch.zeros(3, 4, 64, 64)
    initial[2] = torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(4))
    want = by_request(kda_recurrence, (q, k, v, decay, beta), initial, lengths, cuts)
    rows = zigzag_plan(lengths, 1).rank_tokens[0]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        got = kda_cp(*(t[rows].cuda() for t in (q, k, v, decay, beta)), initial.cuda(), lengths, None, cuts,
                     *kda_backend.cp_kernels(torch.empty(0, device="cuda", dtype=dtype)))
    finally:
        dist.destroy_process_group()
    errors = [_relative_error(g.cpu(), w) for g, w in zip(got, (want[0][rows], *want[1:]))]
    assert max(errors) < bound, f"relative errors (o, finals, snapshots): {errors}"


def test_conv_halo_spans_short_chunks():
    g = torch.Generator().manual_seed(2)
    x, weight, window = torch.randn(12, 6, generator=g), torch.randn(6, 4, generator=g), torch.randn(3, 6, generator=g)
    whole, last = short_causal_conv(x, window, weight)
    sizes = [1, 2, 0, 4, 5]  # the first chunks are shorter than the 3-token halo
    cuts = torch.tensor([0] + sizes).cumsum(0).tolist()
    parts = [x[a:b] for a, b in zip(cuts, cuts[1:])]
    windows = conv_windows(parts, window)
    outs = [short_causal_conv(p, w, weight)[0] for p, w in zip(parts, windows)]
    torch.testing.assert_close(torch.cat(outs), whole)
    torch.testing.assert_close(windows[-1], last)
