"""Which length the radix cache files a decode snapshot under, in the orders SGLang's
schedulers process results.

With the extra_buffer strategy a request keeps two snapshot slots (ping-pong): a decode
step whose length is a multiple of --mamba-track-interval writes its state into the slot
at `mamba_next_track_idx`, and processing that step's result swaps the index, so the
other slot holds the latest snapshot and `mamba_last_track_seqlen` says at what length;
a finished request files that slot in the tree under that many tokens. The overlap
scheduler prepares (and launches) batch N+1 before it processes batch N, and N+1 may be
a prefill without this request. Here SGLang's own result step
(`SchedulerBatchResultProcessor._mamba_prefix_cache_update`, with the plugin's hook
applied) runs on a real `Req` and `ScheduleBatch` in every such order, and after each
processed result the slot it would file must hold a state of exactly the length it is
filed under. The forward is the one thing stood in for: a record of the length each
slot's state was written at (what ScheduleBatch.prepare_for_decode's track mask makes
the KDA backends write).
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch

INTERVAL = 16
PROMPT = 40  # prefill snapshot at 32 (the last 16-aligned point): not a decode boundary


@pytest.fixture(scope="module")
def sglang_runtime():
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_context

    load_plugins()  # applies sglang_hybrid.plugin's hooks in this process, as in a server's
    override = get_context().override_server_args(mamba_track_interval=INTERVAL,
                                                   mamba_radix_cache_strategy="extra_buffer")
    override.install()
    yield
    override.restore()


def _replay(schedule: str, overlap: bool) -> list[str]:
    """Serve one request through `schedule` (D: a decode batch with it, P: a prefill
    batch of other requests) and return every inconsistency between the slot SGLang
    would file and the length it would file it under."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    pool = types.SimpleNamespace(mamba_ping_pong_track_buffer_size=2, enable_mamba_extra_buffer_lazy=False)
    pool.get_mamba_ping_pong_other_idx = lambda i: HybridReqToTokenPool.get_mamba_ping_pong_other_idx(pool, i)
    keep_idx = lambda req: HybridReqToTokenPool.get_mamba_ping_pong_keep_idx(pool, req)  # noqa: E731
    processor = SchedulerBatchResultProcessor.__new__(SchedulerBatchResultProcessor)

    req = Req("r", "", list(range(PROMPT)), SamplingParams(max_new_tokens=len(schedule)))
    req.mamba_ping_pong_track_buffer = torch.tensor([5, 7])
    # After the prefill (ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend): it
    # wrote slot 5 at the prompt's last aligned point and swapped the index.
    written = {5: PROMPT // INTERVAL * INTERVAL}
    req.mamba_next_track_idx, req.mamba_last_track_seqlen = 1, written[5]
    req.kv_committed_len = seq_len = PROMPT

    def prepare_and_run(kind):
        nonlocal seq_len
        if kind == "P":
            return None
        seq_len += 1  # prepare_for_decode: seq_lens_cpu and kv_committed_len move together
        req.kv_committed_len += 1
        batch = ScheduleBatch(reqs=[req], seq_lens_cpu=torch.tensor([seq_len]), req_to_token_pool=pool,
                              spec_algorithm=SpeculativeAlgorithm.NONE)
        if seq_len % INTERVAL == 0:  # the track mask: the forward writes the next ping-pong slot
            written[int(req.mamba_ping_pong_track_buffer[req.mamba_next_track_idx])] = seq_len
        return batch

    wrong = []

    def process(batch):
        if batch is None:
            return
        processor._mamba_prefix_cache_update(req, batch, None, 0)
        slot = int(req.mamba_ping_pong_track_buffer[keep_idx(req)])
        if written.get(slot) != req.mamba_last_track_seqlen:
            wrong.append(f"after the step at length {int(batch.seq_lens_cpu[0])}: slot {slot} holds the state at "
                         f"{written.get(slot)} tokens, filed under {req.mamba_last_track_seqlen}")

    in_flight = None
    for kind in schedule:
        batch = prepare_and_run(kind)
        if overlap:  # batch N+1 is prepared and launched before batch N is processed
            process(in_flight)
            in_flight = batch
        else:
            process(batch)
    process(in_flight)
    return wrong


def _schedules():
    """Decoding across three track boundaries, a prefill of other requests after every
    possible decode step of one interval (and none)."""
    yield "D" * 50
    for k in range(1, INTERVAL + 1):
        yield "D" * k + "P" + "D" * (50 - k)
        yield "D" * k + "PP" + "D" * (50 - k)


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_a_decode_snapshot_is_filed_under_the_length_it_holds(sglang_runtime, overlap):
    failures = {s: w for s in _schedules() if (w := _replay(s, overlap))}
    runs = lambda s: " ".join(f"{k}{len(list(g))}" for k, g in itertools.groupby(s))  # noqa: E731
    assert not failures, "\n".join(f"{runs(s)}: {w[0]}" for s, w in failures.items())
