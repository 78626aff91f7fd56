"""The token mixers' eager breaks in SGLang's breakable prefill CUDA graph.

SGLang's breakable graph (its CUDA default for prefill) captures a prefill forward per token
bucket as graph segments, split by eager breaks: calls that cannot be captured because they
depend on the batch's host-side shape, here each layer's attention-backend call (sparse MLA:
index-K store, Top-K, sparse attention; KDA: conv and chunked delta rule over the pool's states).
At replay the segments run on the bucket's padded tensors, and each break runs the backend on
the live batch, which the runner puts in its forward context, over the real rows only. This is
what SGLang's RadixAttention and RadixLinearAttention do; ours takes every input with its token
axis first (KDA's gates come as [1, T, ...] to the backend, which SGLang's own break would not cut).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
    eager_on_graph,
    is_in_breakable_cuda_graph,
)
from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import get_tc_piecewise_forward_context


def in_prefill_graph() -> bool:
    """Capturing, warming up or replaying SGLang's breakable prefill graph."""
    return is_in_breakable_cuda_graph() and get_tc_piecewise_forward_context() is not None


def _on_live_rows(attend: Callable, out: torch.Tensor, layer_id: int, *inputs: torch.Tensor | None) -> None:
    """out[:n] = attend(layer, live batch, *inputs[:n]) for the live batch's n real tokens (the
    mixers' sparse_attention and kda_attention take the layer and the batch first); the
    padded rows of `out` are zeroed, so that no garbage reaches the residual stream or MoE routing.
    The backend must not see the padding: it would store the padded rows' keys and states."""
    context = get_tc_piecewise_forward_context()
    batch = context.forward_batch
    n = batch.num_token_non_padded_cpu
    batch.hybrid_prefill_cp = None  # the runner's own batch; this graph never runs under CP (plugin)
    bucket = batch.out_cache_loc, batch.positions
    batch.out_cache_loc, batch.positions = bucket[0][:n], bucket[1][:n]
    try:
        ret = attend(context.attention_layers[layer_id], batch, *(None if t is None else t[:n] for t in inputs))
    finally:
        batch.out_cache_loc, batch.positions = bucket
    out[:n].copy_(ret.reshape(out[:n].shape))
    out[n:].zero_()


live_rows_break = eager_on_graph(True)(_on_live_rows)
