"""The golden model's prefill of a batch under zigzag context parallelism (W ranks).

Every op of the model is per token except three steps, which GoldenModel keeps apart:
the KDA short conv and recurrence (parallel.kda_cp: summaries all-gathered and folded,
per request), and the MLA layers' history (latent, rope key and index-K: all-gathered
and restored to batch order, parallel.sparse_cp.gather_rows, then appended to each
request's cache), after which each rank selects and attends for its own rows of each
request at their absolute positions. Each rank runs the model on its zigzag rows of
every request; ZigzagPlan.restore puts the logits back in batch order. Each request's
cache ends as a single-rank prefill leaves it (full history, final states), so decode
continues unchanged.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from sglang_hybrid.parallel.kda_cp import conv_cp, kda_cp
from sglang_hybrid.parallel.sparse_cp import gather_rows, request_rows
from sglang_hybrid.parallel.zigzag import ZigzagPlan, zigzag_plan
from sglang_hybrid.reference.model import GoldenModel, SequenceCache


class ZigzagGolden(GoldenModel):
    """`golden` (same config, weights and cache tiers) prefilling this rank's zigzag share."""

    def __init__(self, golden: GoldenModel, group=None):
        super().__init__(golden.config, golden.w, golden.dtype, golden.device)
        self.kv_cache_dtype = golden.kv_cache_dtype
        self.group = group
        self.plan: ZigzagPlan | None = None
        self.lengths: list[int] = []

    @torch.no_grad()
    def prefill(self, batch: list[list[int]], caches: list[SequenceCache], rank: int,
                world: int) -> tuple[torch.Tensor, ZigzagPlan]:
        """Logits of this rank's rows (in plan.rank_tokens[rank] order, indices into the
        batch's concatenated new tokens) for the new tokens of each request, continuing
        its cache, which advances as a single-rank prefill's would."""
        if len(batch) != len(caches):
            raise ValueError(f"{len(batch)} requests but {len(caches)} caches")
        self.lengths = [len(ids) for ids in batch]
        self.plan = zigzag_plan(self.lengths, world, [c.length for c in caches])
        tokens = [t for ids in batch for t in ids]
        mine = self.plan.rank_tokens[rank]
        layers = [[c.layers[i] for c in caches] for i in range(self.config.num_hidden_layers)]
        logits = self._forward([tokens[int(t)] for t in mine], self.plan.rank_positions[rank].to(self.device),
                               SimpleNamespace(layers=layers))
        for c, n in zip(caches, self.lengths):
            c.length += n
        return logits, self.plan

    # The three cross-token steps, for the batch: `lcs` holds each request's layer cache.
    def _conv(self, pre, conv_w, lcs):
        out, windows, _ = conv_cp(pre, torch.stack([lc.conv for lc in lcs]), conv_w, self.lengths, self.group)
        for lc, window in zip(lcs, windows):
            lc.conv = window
        return out

    def _recurrence(self, q, k, v, g, beta, lcs):
        o, finals, _ = kda_cp(q, k, v, g, beta, torch.stack([lc.state for lc in lcs]), self.lengths, self.group)
        for lc, final in zip(lcs, finals):
            lc.state = final.to(lc.state.dtype)
        return o

    def _sparse_history(self, p, lcs, new, q, q_index, index_weights, positions):
        full = [gather_rows(t, self.plan, self.group) for t in new]  # every rank's rows, batch order
        out = q.new_empty(q.shape[:2] + (self.config.v_head_dim,))
        for lc, (start, n, mine) in zip(lcs, request_rows(self.plan, self.lengths, dist.get_rank(self.group))):
            for chunks, rows in zip((lc.latent, lc.rope_key, lc.index_key), full):
                chunks.append(rows[start:start + n])
            if mine.numel():
                out[mine] = self._select_attend(p, lc, q[mine], q_index[mine], index_weights[mine], positions[mine])
        return out
