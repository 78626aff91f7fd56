"""SGLang's context-parallel prefill switches, applied to this model's forward pass.

`--enable-prefill-cp --cp-strategy zigzag --attn-cp-size W` (with --tp-size a multiple of
W) gives SGLang's attention CP group: W ranks that get the same batch. For an extend
batch this module cuts every request's new tokens as parallel.zigzag does (rank r holds
chunks r and 2W-1-r, SGLang's own ZigzagCPStrategy layout) and the model runs each
layer on the rank's rows only:

- token mixers on the rank's rows, exchanging only what crosses tokens: the KDA layers'
  chunk summaries and conv tails (parallel.kda_cp), the sparse layers' new latent and
  index-K rows, all-gathered so that every rank's cache holds the whole prompt
  (layers.sparse_mla_backend);
- the FFN on every row of the batch: the rows are all-gathered over the CP group, the FFN
  runs tensor-parallel over the whole TP group as without CP, and each rank keeps its own
  rows (SGLang's default for its own CP models when --moe-dp-size is 1);
- the final hidden states all-gathered back to batch order before the logits.

Decode, verify and draft forwards are not split: each rank's cache equals a single
rank's, so they run unchanged. A batch with fewer than 2W new tokens is not split either.
A cached prefix (radix hit or an earlier chunk of a chunked prefill) is history, not work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sglang.srt.distributed.parallel_state import get_attn_cp_group
from sglang.srt.layers.cp.base import get_cp_strategy
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.runtime_context import get_parallel

from sglang_hybrid.parallel.sparse_cp import gather_rows
from sglang_hybrid.parallel.zigzag import ZigzagPlan, zigzag_plan


logger = logging.getLogger(__name__)
_announced = False


@dataclass(frozen=True)
class PrefillCP:
    """One extend batch split over the attention CP group."""

    plan: ZigzagPlan  # on the batch's device
    lengths: list[int]  # new tokens per request
    rows: torch.Tensor  # this rank's rows: indices into the batch's new tokens, on the device
    group: object  # the CP group's torch.distributed group

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor over the batch's new tokens (dim 0) -> this rank's rows."""
        return x[self.rows]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows -> every rank's, in the batch's order."""
        return gather_rows(x, self.plan, self.group)


def split_prefill(forward_batch: ForwardBatch) -> PrefillCP | None:
    """The batch's CP split on this rank, or None where the forward is not split."""
    if get_cp_strategy() is None or not forward_batch.forward_mode.is_context_parallel_extend():
        return None  # --enable-prefill-cp with --attn-cp-size > 1 set it (zigzag: plugin checks)
    ps = get_parallel()
    world = ps.attn_cp_size
    lengths = [int(n) for n in forward_batch.extend_seq_lens_cpu]
    if sum(lengths) < 2 * world:
        return None
    plan = zigzag_plan(lengths, world, [int(p) for p in forward_batch.extend_prefix_lens_cpu])
    plan = plan.to(forward_batch.input_ids.device)
    rows = plan.rank_tokens[ps.attn_cp_rank]
    global _announced
    if not _announced:  # once per process: says the path is live (tests read it)
        _announced = True
        logger.info("context-parallel prefill: %d new tokens of %d requests split over %d ranks, %d rows here",
                    sum(lengths), len(lengths), world, rows.numel())
    return PrefillCP(plan, lengths, rows, get_attn_cp_group().device_group)
