"""The golden model and its ops: caches, independent KDA cross-check, indexer rules."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_hybrid.reference import ops


@pytest.fixture(scope="module")
def golden64(tmp_path_factory):
    from sglang_hybrid.checkpoints.maker import make_checkpoint
    from sglang_hybrid.reference import load

    return load(make_checkpoint("tiny", str(tmp_path_factory.mktemp("tiny")), seed=3), dtype=torch.float64)


def test_prefill_then_decode_equals_one_long_prefill(golden64):
    """Prefill in uneven pieces, then token by token, against one prefill of the whole
    sequence: KDA state and conv window, latent/index-K caches, attention residual blocks."""
    rng = random.Random(0)
    ids = [rng.randrange(3, 2000) for _ in range(60)]  # beyond index_topk = 16: the indexer drops positions
    whole = golden64.logits(ids)
    cache = golden64.new_cache()
    pieces = [golden64.forward(ids[:7], cache), golden64.forward(ids[7:30], cache)]
    pieces += [golden64.forward([t], cache) for t in ids[30:]]
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=1e-9, atol=1e-9)


def test_generate_is_greedy_over_cached_decode(golden64):
    ids = [5, 6, 7]
    out = golden64.generate(ids, 8)
    for i, tok in enumerate(out):
        assert tok == int(golden64.logits(ids + out[:i])[-1].argmax())


@pytest.mark.parametrize("T, H, K, V, with_state", [(1, 1, 4, 4, False), (8, 2, 8, 6, True), (48, 3, 16, 16, True)])
def test_kda_recurrence_matches_fla_naive_kda(T, H, K, V, with_state):
    """Against flash-linear-attention's naive KDA (fla-core), an independent implementation."""
    from fla.ops.kda.gate import naive_kda_gate
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

    g = torch.Generator().manual_seed(T)
    q, k = (ops.l2norm(torch.randn(T, H, K, generator=g, dtype=torch.float64)) for _ in range(2))
    v = torch.randn(T, H, V, generator=g, dtype=torch.float64)
    f = torch.randn(T, H, K, generator=g, dtype=torch.float64)
    A_log, dt_bias = torch.rand(H, generator=g, dtype=torch.float64), torch.randn(H * K, generator=g, dtype=torch.float64)
    beta = torch.rand(T, H, generator=g, dtype=torch.float64)
    state = torch.randn(H, K, V, generator=g, dtype=torch.float64) if with_state else torch.zeros(H, K, V, dtype=torch.float64)

    gate = ops.kda_gate(f, A_log, dt_bias)
    # fla computes the gate in fp32 whatever the input dtype.
    torch.testing.assert_close(gate, naive_kda_gate(f, A_log, dt_bias, output_dtype=torch.float64), rtol=1e-5, atol=1e-5)
    o, final = ops.kda_recurrence(q * K**-0.5, k, v, gate, beta, state)

    args = (q[None], k[None], v[None], gate[None], beta[None])
    o_ref, final_ref = naive_recurrent_kda(*args, scale=K**-0.5, initial_state=state[None], output_final_state=True)
    torch.testing.assert_close(o, o_ref[0].to(o.dtype), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, final_ref[0].to(final.dtype), rtol=1e-5, atol=1e-5)
    o_chunk, _ = naive_chunk_kda(*args, scale=K**-0.5, initial_state=state[None], output_final_state=True,
                                 chunk_size=min(T, 16))  # several chunks for T = 48
    torch.testing.assert_close(o, o_chunk[0].to(o.dtype), rtol=1e-4, atol=1e-4)


def test_short_conv_continues_across_calls():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, 6, generator=g), torch.randn(6, 4, generator=g)
    whole, _ = ops.short_causal_conv(x, torch.zeros(3, 6), w)
    a, window = ops.short_causal_conv(x[:4], torch.zeros(3, 6), w)
    b, _ = ops.short_causal_conv(x[4:], window, w)
    torch.testing.assert_close(torch.cat([a, b]), whole)


def test_topk_positions_order_ties_and_padding():
    inf = float("-inf")
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, inf], [2.0, inf, inf, inf, inf]])
    # Higher first; equal scores keep the lower position first; -inf never selected; -1 pads.
    assert ops.topk_positions(scores, 4).tolist() == [[1, 2, 0, 3], [0, -1, -1, -1]]
    assert ops.topk_positions(scores[:, :2], 3).tolist() == [[1, 0, -1], [0, -1, -1]]  # K > history


def test_topk_near_ties_are_recorded_and_flipped():
    from sglang_hybrid.reference.model import TopKNearTies

    inf = float("-inf")
    # Top-2 of: a row whose 2nd and 3rd scores differ by 5e-5 of themselves (a near tie), a
    # row with a clear gap, a row with an exact relu-zero tie (kept by position), a row whose
    # history is shorter than K + 1 after the masked positions.
    scores = torch.tensor([[3.0, 1.0, 1.00005, 0.5], [3.0, 2.0, 1.0, 0.5], [3.0, 0.0, 0.0, 0.0], [3.0, 1.0, inf, inf]])
    positions = torch.tensor([5, 6, 7, 8])
    probe = TopKNearTies(rel=1e-4, flips=frozenset({("layer.", 5)}))
    selected = ops.topk_positions(scores, 2)
    assert selected.tolist() == [[0, 2], [0, 1], [0, 1], [0, 1]]
    probe.visit("layer.", positions, scores, selected)
    assert probe.ties == [("layer.", 5)]
    assert selected.tolist() == [[0, 1], [0, 1], [0, 1], [0, 1]]  # the tied row keeps its 3rd-best instead


def test_golden_index_tie_flip_changes_only_its_row_and_later(golden64):
    """A flip is taken at its layer and position: logits before it unchanged, its own moved."""
    rng = random.Random(1)
    ids = [rng.randrange(3, 2000) for _ in range(60)]
    with golden64.probing_index_ties(rel=0.05) as probe:
        plain = golden64.logits(ids)
    layer, pos = next((layer, pos) for layer, pos in probe.ties if pos >= 20)
    with golden64.probing_index_ties([(layer, pos)], rel=0.05):
        flipped = golden64.logits(ids)
    assert torch.equal(flipped[:pos], plain[:pos])
    assert not torch.allclose(flipped[pos], plain[pos])


def test_indexer_is_causal_and_selection_restricts_attention():
    g = torch.Generator().manual_seed(1)
    T, Hi, D = 6, 2, 8
    q, k = torch.randn(T, Hi, D, generator=g), torch.randn(T, D, generator=g)
    w = torch.rand(T, Hi, generator=g)
    scores = ops.indexer_scores(q, w, k, torch.arange(T))
    assert torch.isinf(scores.triu(1)[scores.triu(1) != 0]).all()
    want = torch.einsum("th,ths->ts", w, torch.einsum("thd,sd->ths", q, k).relu())
    torch.testing.assert_close(scores.tril(), want.tril())

    sel = ops.topk_positions(scores, 2)
    H, Dv = 3, 4
    qa, ka, va = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g), torch.randn(T, H, Dv, generator=g)
    out = ops.sparse_attention(qa, ka, va, sel, scale=0.5)
    for t in range(T):
        keep = [s for s in sel[t].tolist() if s >= 0]
        p = (torch.einsum("hd,shd->hs", qa[t], ka[keep]) * 0.5).softmax(-1)
        torch.testing.assert_close(out[t], torch.einsum("hs,shd->hd", p, va[keep]))


def test_hadamard_rotation_is_orthogonal_and_leaves_scores_unchanged():
    h = ops.hadamard_matrix(32, torch.float64)
    torch.testing.assert_close(h @ h.T, torch.eye(32, dtype=torch.float64))
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(5, 3, 32, generator=g, dtype=torch.float64), torch.randn(5, 32, generator=g, dtype=torch.float64)
    w, pos = torch.rand(5, 3, generator=g, dtype=torch.float64), torch.arange(5)
    torch.testing.assert_close(ops.indexer_scores(q @ h, w, k @ h, pos), ops.indexer_scores(q, w, k, pos))


def test_rope_is_a_relative_rotation():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 8, generator=g, dtype=torch.float64), torch.randn(1, 8, generator=g, dtype=torch.float64)

    def dot(pq, pk):
        return (ops.rope_neox(q, torch.tensor([pq]), 1e4) * ops.rope_neox(k, torch.tensor([pk]), 1e4)).sum()

    torch.testing.assert_close(dot(7, 3), dot(104, 100))
