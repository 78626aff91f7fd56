"""A sparse (indexer + MLA) layer under zigzag context parallelism.

Every rank's rows need the full causal history of their request: index-K for the
indexer and the attention keys/values for the selected positions. Each rank all-gathers
the rows the other ranks computed (one all-gather per tensor, padded to the largest
rank), restores the batch order (ZigzagPlan.restore), prepends each request's cached
prefix, and then scores, selects Top-K and attends for its own rows only, at their
absolute positions. A ring exchange would overlap this with compute; at the sizes of
index-K (index_head_dim per token) and the MLA latent (rank + rope per token) one
all-gather is the simple first form.

Plain-PyTorch (reference.ops) per request; the kernels take over on the GPU path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sglang_hybrid.parallel.zigzag import ZigzagPlan
from sglang_hybrid.reference.ops import indexer_scores, sparse_attention, topk_positions


def gather_rows(local: torch.Tensor, plan: ZigzagPlan, group=None) -> torch.Tensor:
    """This rank's rows of a per-token tensor -> every rank's, in the batch's order."""
    longest = max(t.numel() for t in plan.rank_tokens)
    padded = local.new_zeros((longest,) + tuple(local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(plan.world)]
    dist.all_gather(parts, padded, group=group)
    return plan.restore([p[: t.numel()] for p, t in zip(parts, plan.rank_tokens)])


def request_rows(plan: ZigzagPlan, lengths: list[int], rank: int):
    """Per request: (its first index in the batch's new tokens, its length, the indices of
    this rank's rows holding it)."""
    tokens = plan.rank_tokens[rank]
    start = 0
    for n in lengths:
        yield start, n, ((tokens >= start) & (tokens < start + n)).nonzero().flatten()
        start += n


def sparse_layer_cp(index_q, index_w, index_k, q, k, v, plan: ZigzagPlan, lengths: list[int], topk: int,
                    scale: float, prefixes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
                    group=None) -> torch.Tensor:
    """This rank's rows (in plan.rank_tokens order): index_q [T, Hi, D], index_w [T, Hi],
    index_k [T, D], q / k [T, H, Dqk], v [T, H, Dv]. prefixes: per request, the cached
    (index_k, k, v) before its new tokens (None: no prefix). Returns [T, H, Dv]."""
    rank = dist.get_rank(group)
    full = [gather_rows(x, plan, group) for x in (index_k, k, v)]
    positions = plan.rank_positions[rank]
    out = v.new_empty(v.shape)
    for i, (start, n, mine) in enumerate(request_rows(plan, lengths, rank)):
        history = [x[start:start + n] for x in full]
        if prefixes and prefixes[i] is not None:
            history = [torch.cat([p, h]) for p, h in zip(prefixes[i], history)]
        if mine.numel():
            scores = indexer_scores(index_q[mine], index_w[mine], history[0], positions[mine])
            selected = topk_positions(scores, topk)
            out[mine] = sparse_attention(q[mine], history[1], history[2], selected, scale)
    return out
