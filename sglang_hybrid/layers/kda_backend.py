"""Linear-attention (KDA) backend: SGLang's own on GPU, the reference ops on CPU.

SGLang's KDAAttnBackend runs the Triton chunk/recurrent kernels on the mamba
state pool (conv window [W-1, 3P] and state [H, V, K] per slot). Its CPU branch
needs a CPU build of sgl-kernel that PyPI does not ship, so on CPU this module's
TorchKDAAttnBackend reads and writes the same pool with the golden model's ops.
"""

from __future__ import annotations

import functools
import itertools

import torch

from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from sglang_hybrid.layers.draft_tree import draft_tree_parents
from sglang_hybrid.parallel.kda_cp import conv_cp, kda_cp
from sglang_hybrid.parallel.kda_summary import each_sequence, summary_by_recurrence
from sglang_hybrid.reference import ops


def create_kda_backend(model_runner) -> MambaAttnBackendBase:
    """Named in the LinearAttnModelSpec; SGLang calls it with the model runner."""
    if str(model_runner.device).startswith("cuda"):
        from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend

        backend = KDAAttnBackend(model_runner)
        if model_runner.model_config.dtype == torch.float32:
            backend.kernel_dispatcher.extend_kernel = _recurrent_fp32_extend_kernel(
                model_runner.server_args.mamba_cache_chunk_size)
        return backend
    return TorchKDAAttnBackend(model_runner)


def _recurrent_fp32_extend_kernel(track_chunk: int):
    """fp32 serving is the exact mode (the one checked token for token against the golden
    model). SGLang's chunk_kda is not fp32-exact by design: it rounds the off-diagonal
    intra-chunk products to bf16 and solves in TF32, about 2e-3 relative error on the
    H200 at any gate strength, while its token-by-token fused_recurrent_kda is within
    1e-6 (benchmarks/kda_chunk_precision.py). So fp32 prefill runs the recurrence; bf16
    keeps the chunked kernel. The radix cache's snapshots (extra_buffer) read the state
    at one chunk boundary per tracked request: the recurrence stops there, hands that
    state over, and goes on (a second launch)."""
    from sglang.kernels.ops.attention.fla.kda import fused_recurrent_kda
    from sglang.srt.layers.attention.linear.kernels.kda_triton import TritonKDAKernel

    class RecurrentFp32KDAKernel(TritonKDAKernel):
        def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, A_log=None,
                   dt_bias=None, lower_bound=None, return_intermediate_states=False, track_ssm_h_src=None,
                   **kwargs):
            if lower_bound is not None or A_log is None:
                return super().extend(q, k, v, g, beta, ssm_states=ssm_states, cache_indices=cache_indices,
                                      query_start_loc=query_start_loc, A_log=A_log, dt_bias=dt_bias,
                                      lower_bound=lower_bound, return_intermediate_states=return_intermediate_states,
                                      track_ssm_h_src=track_ssm_h_src, **kwargs)
            gate = ops.kda_gate(g[0].float(), A_log, dt_bias).unsqueeze(0)
            starts = query_start_loc.tolist()
            cuts = _chunk_cuts(starts, track_ssm_h_src, track_chunk)

            def recur(segments, initial_state):
                tokens = torch.cat([torch.arange(a, b) for a, b in segments]).to(q.device)
                cu = torch.tensor([0] + [b - a for a, b in segments], device=q.device).cumsum(0).to(query_start_loc.dtype)
                o, state = fused_recurrent_kda(q=q[:, tokens], k=k[:, tokens], v=v[:, tokens], g=gate[:, tokens],
                                               beta=beta[:, tokens], initial_state=initial_state,
                                               use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
                return tokens, o, state

            n = len(starts) - 1
            tokens, out_head, state = recur([(starts[i], starts[i] + cuts.get(i, starts[i + 1] - starts[i]))
                                             for i in range(n)], ssm_states[cache_indices])
            out = q.new_empty(*q.shape[:3], v.shape[-1])
            out[:, tokens] = out_head
            snapshots = state[list(cuts)] if cuts else None  # in track_ssm_h_src's order
            rest = [i for i, c in cuts.items() if starts[i] + c < starts[i + 1]]
            if rest:
                tail, out_tail, state_tail = recur([(starts[i] + cuts[i], starts[i + 1]) for i in rest], state[rest])
                out[:, tail] = out_tail
                state[rest] = state_tail
            ssm_states[cache_indices] = state
            return (out, _TrackedChunkStates(track_ssm_h_src, snapshots)) if return_intermediate_states else out

    return RecurrentFp32KDAKernel()


def _chunk_cuts(starts: list[int], h_src: torch.Tensor | None, chunk: int) -> dict[int, int]:
    """{request: tokens before its snapshot}, in h_src's order. h_src indexes the
    per-chunk states a chunked kernel would return (request i owns
    (len_i - 1) // chunk + 1 rows, row j = the state after j * chunk tokens)."""
    if h_src is None:
        return {}
    first_row = [0]
    for a, b in zip(starts, starts[1:]):
        first_row.append(first_row[-1] + (b - a - 1) // chunk + 1)
    cuts = {}
    for src in h_src.tolist():
        i = next(i for i in range(len(starts) - 1) if first_row[i] <= src < first_row[i + 1])
        cuts[i] = (src - first_row[i]) * chunk
    return cuts


class _TrackedChunkStates:
    """Stands for a chunked kernel's per-chunk states h where only the tracked rows
    exist: SGLang's backend reads exactly h.squeeze(0)[track_ssm_h_src]."""

    def __init__(self, h_src, states):
        self.h_src, self.states = h_src, states

    def squeeze(self, dim):
        return self

    def __getitem__(self, index):
        if index is not self.h_src and not torch.equal(index, self.h_src):
            raise IndexError("only the tracked chunk states were kept")
        return self.states


def extend_snapshots(forward_batch, metadata, prefix_lens, chunk: int) -> dict[int, tuple[int, int]]:
    """{row: (tokens of this extend before the snapshot, track slot)}, as SGLang's
    _init_track_ssm_indices reads them: the point is the last chunk-aligned one
    at or before mamba_track_seqlens (which SGLang moves past a forced branch point)."""
    if not metadata.has_mamba_track_mask:
        return {}
    mask = forward_batch.mamba_track_mask.tolist()
    seqlens = forward_batch.mamba_track_seqlens.tolist()
    dst = metadata.mamba_track_indices.tolist()
    return {i: ((seqlens[i] - prefix_lens[i]) // chunk * chunk, dst[i]) for i in range(len(mask)) if mask[i]}


def _nonempty(cu: list[int]) -> tuple[list[int], list[int]]:
    """The sequences of cu with rows, and their own offsets (fla's varlen kernels want no empty one)."""
    keep = [n for n in range(len(cu) - 1) if cu[n + 1] > cu[n]]
    return keep, [0] + list(itertools.accumulate(cu[n + 1] - cu[n] for n in keep))


def _span(cu: list[int]) -> slice:
    """All of cu's rows. Its sequences are consecutive and an empty one has no rows, so the
    kept sequences' rows are one slice: a view, where a gather would copy every input."""
    return slice(cu[0], cu[-1])


def fused_recurrence(q, k, v, g, beta, states, cu):
    """kda_summary.each_sequence's contract (q l2-normalised and scaled, k l2-normalised, g the
    log decay, states [N, H, K, V], rows cu[n]:cu[n + 1] per sequence) on fla's fused recurrent
    KDA kernel (SGLang's copy, which keeps states as [H, V, K]): one launch for every sequence,
    fp32 state."""
    from sglang.kernels.ops.attention.fla.kda import fused_recurrent_kda

    keep, offsets = _nonempty(cu)
    o, finals = v.new_zeros(v.shape), states.float().clone()
    if not keep:
        return o, finals
    rows = _span(cu)
    out, final = fused_recurrent_kda(
        q=q[None, rows].contiguous(), k=k[None, rows].contiguous(), v=v[None, rows].contiguous(),
        g=g[None, rows].contiguous(), beta=beta[None, rows].contiguous(), scale=1.0,
        initial_state=finals[keep].transpose(-1, -2).contiguous(), use_qk_l2norm_in_kernel=False,
        cu_seqlens=torch.tensor(offsets, dtype=torch.long, device=q.device))
    o[rows], finals[keep] = out[0], final.float().transpose(-1, -2)
    return o, finals


def chunked_recurrence(q, k, v, g, beta, states, cu, dtype=torch.bfloat16):
    """The same contract on SGLang's chunked KDA kernel (chunk_kda), what bf16 serving
    prefills with: several times faster than the fused recurrence over long chunks, not
    fp32-exact (see _recurrent_fp32_extend_kernel). q, k, v and beta go in at the serving
    dtype, as SGLang's own prefill hands them over (fp32 inputs run the kernel ~3x slower,
    cp_prefill.md); the gate and the states stay fp32."""
    from sglang.kernels.ops.attention.fla.kda import chunk_kda

    keep, offsets = _nonempty(cu)
    o, finals = v.new_zeros(v.shape), states.float().clone()
    if not keep:
        return o, finals
    rows = _span(cu)
    pool = finals[keep].transpose(-1, -2).contiguous()  # a slot [H, V, K] per sequence; the kernel ends them in place
    out = chunk_kda(q=q[None, rows].to(dtype).contiguous(), k=k[None, rows].to(dtype).contiguous(),
                    v=v[None, rows].to(dtype).contiguous(), g=g[None, rows].float().contiguous(),
                    beta=beta[None, rows].to(dtype).contiguous(), scale=1.0,
                    initial_state=pool, initial_state_indices=torch.arange(len(keep), dtype=torch.int32,
                                                                           device=q.device),
                    cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device=q.device))
    o[rows], finals[keep] = out[0], pool.transpose(-1, -2)
    return o, finals


def chunked_summary(k, v, g, beta, cu, dtype=torch.bfloat16):
    """kda_summary.chunk_summary's (M [N, H, K, K], E [N, H, K, V]) of each sequence of
    chunked_recurrence's, the way fla's own context parallelism summarizes a rank's sequences:
    their WY factors (the intra-chunk half of a chunk_kda prefill) carried through
    chunk_cp_fwd_h, which writes [E | M] ([H, K, V + K] per sequence, fp32), all sequences in
    one launch of each. Where summary_by_recurrence runs every sequence again over V + K value
    columns, this costs about their intra work plus a K x (V + K) state pass."""
    from fla.ops.cp.chunk_fwd import chunk_cp_fwd_h
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.index import prepare_chunk_indices

    H, K, V = k.shape[1], k.shape[2], v.shape[-1]
    keep, offsets = _nonempty(cu)
    hm = torch.zeros(len(cu) - 1, H, K, V + K, device=k.device, dtype=torch.float32)
    hm[..., V:] = torch.eye(K, device=k.device)  # an empty sequence maps its state to itself
    if keep:
        rows = _span(cu)
        lens = torch.tensor(offsets, device=k.device, dtype=torch.long)
        indices = prepare_chunk_indices(lens, 64)
        gk = chunk_local_cumsum(g=g[None, rows].float().contiguous(), scale=RCP_LN2, chunk_size=64, cu_seqlens=lens,
                                chunk_indices=indices)  # fla's kernels take log2 decays, cumulated per 64 tokens
        keys = k[None, rows].to(dtype).contiguous()
        w, u, _, kg, _, _ = chunk_kda_fwd_intra(q=keys, k=keys, v=v[None, rows].to(dtype).contiguous(), gk=gk,
                                                beta=beta[None, rows].to(dtype).contiguous(), scale=1.0,
                                                cu_seqlens=lens, chunk_size=64, chunk_indices=indices)
        part = hm.new_zeros(len(keep), H, K, V + K)
        chunk_cp_fwd_h(k=kg, w=w, u=u, hm=part, gk=gk, cu_seqlens=lens, chunk_size=64, multi_seqs=True)
        hm[keep] = part
    return hm[..., V:], hm[..., :V]


def cp_kernels(x: torch.Tensor):
    """(recurrence, summary) for a rank's chunks in a CP extend (parallel.kda_cp), each one
    call over all of them: the reference on CPU; on a GPU, fla's fused recurrence when serving
    fp32 (the exact mode) and the chunked kernels at the serving dtype otherwise, as without CP."""
    if not x.is_cuda:
        recurrence = each_sequence(ops.kda_recurrence)
        return recurrence, functools.partial(summary_by_recurrence, recurrence)
    if x.dtype == torch.float32:
        return fused_recurrence, functools.partial(summary_by_recurrence, fused_recurrence)
    return functools.partial(chunked_recurrence, dtype=x.dtype), functools.partial(chunked_summary, dtype=x.dtype)


def extend_context_parallel(backend: MambaAttnBackendBase, layer, forward_batch: ForwardBatch, cp, mixed_qkv, a, b):
    """A context-parallel extend (parallel.prefill_cp) of this rank's rows, on either backend's
    pool: the short conv and the recurrence through parallel.kda_cp (summaries exchanged and
    folded in fp32), each request's final conv window and state, and the radix cache's
    snapshots inside the extend, written to every rank's own pool. Each chunk's recurrence
    (outputs and summary) is, on a GPU, fla's fused recurrent kernel when serving fp32 (the
    exact mode) and its chunked kernels otherwise, as without CP; the reference on CPU
    (cp_kernels)."""
    from sglang.srt.runtime_context import get_server_args

    meta = backend.forward_metadata
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    conv_pool, state_pool = cache.conv[0], cache.temporal  # [N, W-1, 3P], [N, H, V, K]
    H, K, V = layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    slots = meta.mamba_cache_indices.tolist()
    prefix_lens = forward_batch.extend_prefix_lens_cpu
    windows = torch.stack([conv_pool[s].float() if p > 0 else conv_pool.new_zeros(conv_pool.shape[1:], dtype=torch.float32)
                           for s, p in zip(slots, prefix_lens)])
    initial = torch.stack([state_pool[s].float().transpose(-1, -2) if p > 0
                           else state_pool.new_zeros((H, K, V), dtype=torch.float32) for s, p in zip(slots, prefix_lens)])
    snapshots = extend_snapshots(forward_batch, meta, prefix_lens, get_server_args().mamba_cache_chunk_size)
    cuts = {i: c for i, (c, _) in snapshots.items()}
    qkv, final_windows, snap_windows = conv_cp(mixed_qkv.float(), windows, layer.conv_weights.float(), cp.lengths,
                                               cp.group, cuts)
    q, k, v = qkv.reshape(-1, 3, H, K).unbind(1)
    g = ops.kda_gate(a[0].float(), layer.A_log, layer.dt_bias)
    o, final_states, snap_states = kda_cp(ops.l2norm(q) * K**-0.5, ops.l2norm(k), v, g, b[0].float(), initial,
                                          cp.lengths, cp.group, cuts, *cp_kernels(mixed_qkv))
    pairs = [(s, w, st) for s, w, st in zip(slots, final_windows, final_states) if s >= 0]
    pairs += [(snapshots[i][1], w, st) for i, w, st in zip(sorted(cuts), snap_windows, snap_states)]
    for slot, window, state in pairs:
        conv_pool[slot] = window.to(conv_pool.dtype)
        state_pool[slot] = state.transpose(-1, -2).to(state_pool.dtype)
    return o.to(mixed_qkv.dtype).unsqueeze(0)


class TorchKDAAttnBackend(MambaAttnBackendBase):
    """KDA on the reference ops, one request at a time (CPU path).

    With the radix cache's extra_buffer strategy it also snapshots: an extend row
    with a track mask copies its conv window and state at the last
    mamba_cache_chunk_size-aligned point of the extend (SGLang's forced branch
    point included) into its track slot; a decode row, its state after the step.
    """

    def __init__(self, model_runner):
        super().__init__(model_runner)
        conv = model_runner.req_to_token_pool.mamba_pool.mamba_cache.conv[0]
        self.conv_states_shape = conv.transpose(-1, -2).shape
        self.track_chunk = model_runner.server_args.mamba_cache_chunk_size

    def forward_extend(self, layer, forward_batch: ForwardBatch, mixed_qkv=None, a=None, b=None, **kwargs):
        if forward_batch.forward_mode.is_target_verify():
            return self._verify(layer, forward_batch, mixed_qkv, a, b)
        slots = self.forward_metadata.mamba_cache_indices.tolist()
        starts = self.forward_metadata.query_start_loc.tolist()
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        g = ops.kda_gate(a[0].float(), layer.A_log, layer.dt_bias)
        out = self._run(layer, mixed_qkv, g, b[0].float(), slots, starts, [p > 0 for p in prefix_lens],
                        self._extend_snapshots(forward_batch, prefix_lens))
        return out.unsqueeze(0)

    def forward_decode(self, layer, forward_batch: ForwardBatch, mixed_qkv=None, a=None, b=None, **kwargs):
        slots = self.forward_metadata.mamba_cache_indices.tolist()
        T = mixed_qkv.shape[0]
        g, beta = self._decode_gates(layer, a, b, T)
        snapshots = {}
        if forward_batch.mamba_track_mask is not None:  # rows whose length reached a track interval
            dst = self.forward_metadata.mamba_track_indices.tolist()
            snapshots = {i: (1, dst[i]) for i in forward_batch.mamba_track_mask.nonzero().flatten().tolist()}
        out = self._run(layer, mixed_qkv, g, beta, slots, list(range(T + 1)), [True] * T, snapshots)
        return out.unsqueeze(0)

    def _verify(self, layer, forward_batch: ForwardBatch, mixed_qkv, a, b):
        """Target verify of a draft chain or tree: each draft token runs on from its parent's
        state and conv window (the request's committed ones for the first), and the pair
        after every step goes to SGLang's per-step scratch (batch row i, step j). The
        request's own slot is left as it was: after acceptance SGLang copies the last
        accepted step's pair there (cpu_support.spec_ops.scatter_mamba_states_after_verify)."""
        if forward_batch.spec_info.ragged_verify_layout is not None:
            raise NotImplementedError("ragged verify layouts are not implemented on the CPU KDA path")
        slots = self.forward_metadata.mamba_cache_indices.tolist()
        T, n = mixed_qkv.shape[0], forward_batch.spec_info.draft_token_num
        g, beta = self._decode_gates(layer, a, b, T)
        cache = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
        conv_pool, state_pool = cache.conv[0], cache.temporal
        step_windows, step_states = cache.intermediate_conv_window[0], cache.intermediate_ssm
        out = mixed_qkv.new_empty(T, layer.num_v_heads, layer.head_v_dim)
        first_child = self.forward_metadata.retrieve_next_token
        tree = (None if first_child is None
                else draft_tree_parents(first_child, self.forward_metadata.retrieve_next_sibling).tolist())
        for i, slot in enumerate(slots[: T // n]):
            if slot < 0:  # padded row
                continue
            parents = list(range(-1, n - 1)) if tree is None else tree[i]
            after = {-1: (conv_pool[slot].float(), state_pool[slot].float().transpose(-1, -2))}
            for j, t in enumerate(range(i * n, (i + 1) * n)):
                out[t], window, state = self._advance(layer, mixed_qkv[t : t + 1], g[t : t + 1], beta[t : t + 1],
                                                      *after[parents[j]])
                after[j] = window, state
                step_windows[i, j] = window.to(step_windows.dtype)
                step_states[i, j] = state.transpose(-1, -2).to(step_states.dtype)
        return out.unsqueeze(0)

    @staticmethod
    def _decode_gates(layer, a, b, T):
        """Decode and verify hand over raw gate projections: the decay gate and beta."""
        g = ops.kda_gate(a.float().reshape(T, layer.num_v_heads, layer.head_k_dim), layer.A_log, layer.dt_bias)
        return g, b.float().reshape(T, layer.num_v_heads).sigmoid()

    @staticmethod
    def _advance(layer, mixed_qkv, g, beta, window, state):
        """Tokens through the short conv and the recurrence: (outputs, window, state)."""
        H, K = layer.num_v_heads, layer.head_k_dim
        qkv, window = ops.short_causal_conv(mixed_qkv.float(), window, layer.conv_weights.float())
        q, k, v = qkv.reshape(-1, 3, H, K).unbind(1)
        o, state = ops.kda_recurrence(ops.l2norm(q) * K**-0.5, ops.l2norm(k), v, g, beta, state)
        return o, window, state

    def _extend_snapshots(self, forward_batch, prefix_lens) -> dict[int, tuple[int, int]]:
        return extend_snapshots(forward_batch, self.forward_metadata, prefix_lens, self.track_chunk)

    def _run(self, layer, mixed_qkv, g, beta, slots, starts, continues, snapshots):
        cache = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
        conv_pool, state_pool = cache.conv[0], cache.temporal  # [N, W-1, 3P], [N, H, V, K]
        H, K, V = layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
        out = mixed_qkv.new_empty(mixed_qkv.shape[0], H, V)
        for i, slot in enumerate(slots):
            s, e = starts[i], starts[i + 1]
            if slot < 0 or e == s:  # padded row
                continue
            window = conv_pool[slot].float() if continues[i] else conv_pool.new_zeros(conv_pool.shape[1:], dtype=torch.float32)
            state = state_pool[slot].float().transpose(-1, -2) if continues[i] else state_pool.new_zeros((H, K, V), dtype=torch.float32)
            segments = [(s + snapshots[i][0], snapshots[i][1])] if i in snapshots else []
            for end, dst in segments + [(e, slot)]:
                if end > s:
                    o, window, state = self._advance(layer, mixed_qkv[s:end], g[s:end], beta[s:end], window, state)
                    out[s:end] = o.to(out.dtype)
                    s = end
                conv_pool[dst] = window.to(conv_pool.dtype)
                state_pool[dst] = state.transpose(-1, -2).to(state_pool.dtype)
        return out
