"""Zigzag partition of a batch of prefill requests over W context-parallel ranks.

Each request's tokens are cut into 2W contiguous chunks; rank r holds chunks r and
2W-1-r. Under a causal indexer and causal attention a token's cost grows with its
position, so pairing an early chunk with its mirror gives every rank about the same
work; a contiguous split (rank r holds chunks 2r and 2r+1) leaves the last rank with
the most.

Lengths not divisible by 2W: the first n mod 2W chunks are one token longer. A request
shorter than 2W tokens leaves some chunks empty (its tokens land on few ranks): its work
is small by definition, and the rule needs no special case. A cached prefix is history,
not work: only the new tokens of a request are partitioned (`prefix_lens`), at their
absolute positions.

The plan is made once per batch on the host; a served batch moves it to the device once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def chunk_bounds(n: int, parts: int) -> list[int]:
    """parts + 1 boundaries of n tokens cut into `parts` contiguous chunks, the first
    n mod parts of them one token longer."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return bounds


@dataclass(frozen=True)
class ZigzagPlan:
    """Where every new token of the batch goes.

    rank_tokens[r]: indices into the batch's concatenated new tokens held by rank r, in
    the order rank r processes them: its first chunk of every request, then its second
    (SGLang's ZigzagCPStrategy lays a rank's rows out so, and cuts chunks as chunk_bounds
    does: tests/test_cp_algebra.py checks both); rank_positions[r]: their absolute
    positions (prefix included).
    """

    world: int
    rank_tokens: list[torch.Tensor]
    rank_positions: list[torch.Tensor]

    @property
    def total(self) -> int:
        """New tokens in the batch."""
        return sum(t.numel() for t in self.rank_tokens)

    def to(self, device) -> ZigzagPlan:
        """The plan with its indices on `device` (a served forward restores order every layer:
        indices already there cost no host-to-device copy)."""
        return ZigzagPlan(self.world, [t.to(device) for t in self.rank_tokens],
                          [p.to(device) for p in self.rank_positions])

    @functools.cached_property
    def _inverse(self) -> torch.Tensor:
        """For each new token of the batch, its row among the ranks' outputs concatenated
        (computed once per plan, on the plan's device: every layer restores with it)."""
        return torch.argsort(torch.cat(self.rank_tokens))

    def restore(self, per_rank: list[torch.Tensor]) -> torch.Tensor:
        """Rank outputs (dim 0 in rank_tokens order) -> the batch's original token order."""
        return torch.cat(per_rank).index_select(0, self._inverse)


def _plan(lengths: list[int], world: int, prefix_lens: list[int] | None, owner) -> ZigzagPlan:
    prefix_lens = prefix_lens or [0] * len(lengths)
    if len(prefix_lens) != len(lengths):
        raise ValueError(f"{len(prefix_lens)} prefix lengths for {len(lengths)} requests")
    if world < 1 or any(n < 0 for n in lengths) or any(p < 0 for p in prefix_lens):
        raise ValueError(f"world must be >= 1 and lengths >= 0, got world={world}, lengths={lengths}")
    tokens = [[] for _ in range(world)]
    positions = [[] for _ in range(world)]
    for r in range(world):
        for c in owner(r, world):  # the rank's first chunk of every request, then its second
            start = 0
            for n, prefix in zip(lengths, prefix_lens):
                bounds = chunk_bounds(n, 2 * world)
                lo, hi = bounds[c], bounds[c + 1]
                tokens[r].extend(range(start + lo, start + hi))
                positions[r].extend(range(prefix + lo, prefix + hi))
                start += n
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return ZigzagPlan(world, [as_tensor(t) for t in tokens], [as_tensor(p) for p in positions])


def zigzag_chunks(rank: int, world: int) -> tuple[int, int]:
    """The two of a request's 2W chunks that a rank holds."""
    return rank, 2 * world - 1 - rank


def zigzag_plan(lengths: list[int], world: int, prefix_lens: list[int] | None = None) -> ZigzagPlan:
    """Rank r holds chunks r and 2W-1-r of every request's new tokens."""
    return _plan(lengths, world, prefix_lens, zigzag_chunks)


def contiguous_plan(lengths: list[int], world: int, prefix_lens: list[int] | None = None) -> ZigzagPlan:
    """The baseline: rank r holds chunks 2r and 2r+1 (one contiguous slice per request)."""
    return _plan(lengths, world, prefix_lens, lambda r, w: (2 * r, 2 * r + 1))


def rank_work(plan: ZigzagPlan, index_topk: int) -> list[dict]:
    """Per rank: indexer positions scored (a token at position p scores its p + 1 visible
    positions) and sparse-attention positions attended (min(index_topk, p + 1)); both
    times the per-position cost give the rank's FLOPs."""
    return [{"tokens": int(p.numel()),
             "indexer_positions": int((p + 1).sum()),
             "attended_positions": int((p + 1).clamp(max=index_topk).sum())}
            for p in plan.rank_positions]
