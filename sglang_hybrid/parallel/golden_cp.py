"""The golden model's prefill under zigzag context parallelism (one request, W ranks).

Every op of the model is per token except three steps, which GoldenModel keeps apart:
the KDA short conv and recurrence (parallel.kda_cp: summaries all-gathered and folded)
and the MLA layers' history (latent, rope key and index-K: all-gathered and restored to
sequence order, parallel.sparse_cp.gather_rows), after which each rank scores, selects
and attends for its own rows at their absolute positions. Each rank runs the model on
its zigzag rows; ZigzagPlan.restore puts the logits back in order. The cache ends as a
single-rank prefill leaves it (full history, final states), so decode continues unchanged.
"""

from __future__ import annotations

import torch

from sglang_hybrid.parallel.kda_cp import conv_cp, kda_cp
from sglang_hybrid.parallel.sparse_cp import gather_rows
from sglang_hybrid.parallel.zigzag import ZigzagPlan, zigzag_plan
from sglang_hybrid.reference.model import GoldenModel, SequenceCache


class ZigzagGolden(GoldenModel):
    """`golden` (same config, weights and cache tiers) prefilling this rank's zigzag share."""

    def __init__(self, golden: GoldenModel, group=None):
        super().__init__(golden.config, golden.w, golden.dtype, golden.device)
        self.kv_cache_dtype = golden.kv_cache_dtype
        self.group = group
        self.plan: ZigzagPlan | None = None

    @torch.no_grad()
    def prefill(self, input_ids: list[int], cache: SequenceCache, rank: int, world: int) -> tuple[torch.Tensor, ZigzagPlan]:
        """Logits of this rank's rows (in plan.rank_tokens[rank] order) for the new tokens
        input_ids, continuing `cache`, which advances as a single-rank prefill's would."""
        self.plan = zigzag_plan([len(input_ids)], world, [cache.length])
        mine = self.plan.rank_tokens[rank]
        logits = self._forward([input_ids[int(t)] for t in mine], self.plan.rank_positions[rank].to(self.device), cache)
        cache.length += len(input_ids)
        return logits, self.plan

    def _conv(self, pre, conv_w, lc):
        out, windows = conv_cp(pre, lc.conv[None], conv_w, [self.plan.total], self.group)
        lc.conv = windows[0]
        return out

    def _recurrence(self, q, k, v, g, beta, lc):
        o, finals = kda_cp(q, k, v, g, beta, lc.state[None], [self.plan.total], self.group)
        lc.state = finals[0].to(lc.state.dtype)
        return o

    def _append_history(self, lc, latent, rope_key, index_key):
        super()._append_history(lc, *(gather_rows(t, self.plan, self.group) for t in (latent, rope_key, index_key)))
