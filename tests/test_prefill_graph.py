"""The mixers' eager break in SGLang's breakable prefill CUDA graph (layers.prefill_graph), on CPU.

SGLang's runner replays a prefill over a token bucket's padded tensors and puts the live
batch in its forward context; the break must hand the backend the real rows only, with the
batch's cache locations and positions cut to them (and restored after), and zero the
padding of its output. And which prefill graph a GPU server gets, through SGLang's own
argument resolution: the breakable one unless it cannot serve (speculative decoding,
context-parallel prefill), and a reason for one asked for that it cannot serve. Served on
the GPU: test_server.py's breakable-graph test.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import enable_breakable_cuda_graph
from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import set_tc_piecewise_forward_context

from sglang_hybrid.layers import kda, prefill_graph, sparse_mla


def _live_batch(real: int, bucket: int):
    loc = torch.arange(100, 100 + bucket)
    loc[real:] = 0  # SGLang's runner zeroes the padded tail of its static buffers
    return SimpleNamespace(num_token_non_padded_cpu=real, out_cache_loc=loc, positions=torch.arange(bucket) % 7)


@pytest.mark.parametrize("real, bucket", [(5, 8), (8, 8), (1, 4)])
def test_break_runs_the_backend_on_the_live_rows_and_zeroes_the_padding(real, bucket):
    batch, layers = _live_batch(real, bucket), ["layer 0", "layer 1"]
    full_loc, full_pos = batch.out_cache_loc, batch.positions
    seen = {}

    def attend(layer, fb, x, gate, nothing):
        seen.update(layer=layer, rows=x.shape[0], gate_rows=gate.shape[0], nothing=nothing,
                    loc=fb.out_cache_loc.tolist(), pos=fb.positions.tolist(), cp=fb.hybrid_prefill_cp)
        return (x[:, :2] * gate).unsqueeze(0)  # a [1, T, ...] result, as KDA's backend returns

    x = torch.randn(bucket, 3)
    gate = torch.randn(bucket, 1)
    out = torch.full((bucket, 2), float("nan"))
    assert not prefill_graph.in_prefill_graph()
    with set_tc_piecewise_forward_context(batch, layers, None, [], []), enable_breakable_cuda_graph():
        assert prefill_graph.in_prefill_graph()
        prefill_graph.live_rows_break(attend, out, 1, x, gate, None)

    assert seen == dict(layer="layer 1", rows=real, gate_rows=real, nothing=None, loc=full_loc[:real].tolist(),
                        pos=full_pos[:real].tolist(), cp=None)
    assert batch.out_cache_loc is full_loc and batch.positions is full_pos
    torch.testing.assert_close(out[:real], x[:real, :2] * gate[:real])
    assert (out[real:] == 0).all()


@pytest.mark.parametrize("attend", [sparse_mla.sparse_attention, kda.kda_attention])
def test_the_mixers_backend_calls_take_the_layer_and_the_batch_first(attend):
    import inspect

    assert list(inspect.signature(attend).parameters)[:2] == ["layer", "forward_batch"]


SPEC = dict(speculative_algorithm="NEXTN", speculative_num_steps=2, speculative_eagle_topk=1,
            speculative_num_draft_tokens=3)
CP = dict(tp_size=2, attn_cp_size=2, enable_prefill_cp=True, cp_strategy="zigzag")


def _prefill_backend(checkpoint, monkeypatch, **args) -> str:
    """The prefill graph SGLang's own argument resolution settles on for a GPU server (on this
    host: with SGLang's CUDA default for the graph, and no radix cache, whose snapshot strategy
    checks for a GPU)."""
    from sglang.srt.model_executor import cuda_graph_config
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    monkeypatch.setattr(cuda_graph_config, "default_prefill_backend", lambda: cuda_graph_config.Backend.BREAKABLE)
    return ServerArgs(model_path=checkpoint, device="cuda", disable_radix_cache=True,
                      **args).cuda_graph_config.prefill.backend


@pytest.mark.parametrize("args, backend", [
    ({}, "breakable"),  # SGLang's rule for non-DSA MLA models would have turned it off
    (dict(cuda_graph_backend_prefill="breakable"), "breakable"),
    (dict(cuda_graph_backend_prefill="disabled"), "disabled"),
    (SPEC, "disabled"),
    (CP, "disabled"),
])
def test_a_gpu_server_prefills_in_the_breakable_graph_unless_it_cannot(checkpoint, monkeypatch, args, backend):
    assert _prefill_backend(checkpoint, monkeypatch, **args) == backend


@pytest.mark.parametrize("args, reason", [
    (dict(cuda_graph_backend_prefill="full"), "only the breakable prefill graph has eager breaks"),
    (dict(cuda_graph_backend_prefill="tc_piecewise"), "only the breakable prefill graph has eager breaks"),
    (dict(cuda_graph_backend_prefill="breakable", **SPEC), "under speculative decoding"),
    (dict(cuda_graph_backend_prefill="breakable", **CP), "context-parallel prefill splits each batch"),
])
def test_a_prefill_graph_it_cannot_serve_is_refused_with_the_reason(checkpoint, monkeypatch, args, reason):
    with pytest.raises(ValueError, match=reason):
        _prefill_backend(checkpoint, monkeypatch, **args)
