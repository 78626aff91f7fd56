"""Linear-attention (KDA) backend: SGLang's own on GPU, the reference ops on CPU.

SGLang's KDAAttnBackend runs the Triton chunk/recurrent kernels on the mamba
state pool (conv window [W-1, 3P] and state [H, V, K] per slot). Its CPU branch
needs a CPU build of sgl-kernel that PyPI does not ship, so on CPU this module's
TorchKDAAttnBackend reads and writes the same pool with the golden model's ops.
"""

from __future__ import annotations

import torch

from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from sglang_hybrid.reference import ops


def create_kda_backend(model_runner) -> MambaAttnBackendBase:
    """Named in the LinearAttnModelSpec; SGLang calls it with the model runner."""
    if str(model_runner.device).startswith("cuda"):
        from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend

        backend = KDAAttnBackend(model_runner)
        if model_runner.model_config.dtype == torch.float32:
            backend.kernel_dispatcher.extend_kernel = _recurrent_fp32_extend_kernel()
        return backend
    return TorchKDAAttnBackend(model_runner)


def _recurrent_fp32_extend_kernel():
    """fp32 serving is the exact mode (the one checked token for token against the golden
    model). SGLang's chunk_kda is not fp32-exact by design: it rounds the off-diagonal
    intra-chunk products to bf16 and solves in TF32, about 2e-3 relative error on the
    H200 at any gate strength, while its token-by-token fused_recurrent_kda is within
    1e-6 (benchmarks/kda_chunk_precision.py). So fp32 prefill runs the recurrence; bf16
    keeps the chunked kernel. The radix cache's per-chunk snapshots (extra_buffer) need
    chunk_kda's chunk states and still take it."""
    from sglang.kernels.ops.attention.fla.kda import fused_recurrent_kda
    from sglang.srt.layers.attention.linear.kernels.kda_triton import TritonKDAKernel

    class RecurrentFp32KDAKernel(TritonKDAKernel):
        def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, A_log=None,
                   dt_bias=None, lower_bound=None, return_intermediate_states=False, **kwargs):
            if return_intermediate_states or lower_bound is not None or A_log is None:
                return super().extend(q, k, v, g, beta, ssm_states=ssm_states, cache_indices=cache_indices,
                                      query_start_loc=query_start_loc, A_log=A_log, dt_bias=dt_bias,
                                      lower_bound=lower_bound, return_intermediate_states=return_intermediate_states,
                                      **kwargs)
            gate = ops.kda_gate(g[0].float(), A_log, dt_bias).unsqueeze(0)
            state = ssm_states[cache_indices]  # [N, H, V, K], a copy the kernel updates in place
            out, state = fused_recurrent_kda(q=q, k=k, v=v, g=gate, beta=beta, initial_state=state,
                                             use_qk_l2norm_in_kernel=True, cu_seqlens=query_start_loc)
            ssm_states[cache_indices] = state
            return out

    return RecurrentFp32KDAKernel()


class TorchKDAAttnBackend(MambaAttnBackendBase):
    """KDA on the reference ops, one request at a time (CPU path)."""

    def __init__(self, model_runner):
        super().__init__(model_runner)
        conv = model_runner.req_to_token_pool.mamba_pool.mamba_cache.conv[0]
        self.conv_states_shape = conv.transpose(-1, -2).shape

    def forward_extend(self, layer, forward_batch: ForwardBatch, mixed_qkv=None, a=None, b=None, **kwargs):
        if forward_batch.forward_mode.is_target_verify():
            raise NotImplementedError("speculative verify is not implemented on the CPU KDA path")
        if self.forward_metadata.has_mamba_track_mask:
            raise NotImplementedError("the extra-buffer mamba cache is not supported on CPU; use no_buffer")
        slots = self.forward_metadata.mamba_cache_indices.tolist()
        starts = self.forward_metadata.query_start_loc.tolist()
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        g = ops.kda_gate(a[0].float(), layer.A_log, layer.dt_bias)
        out = self._run(layer, mixed_qkv, g, b[0].float(), slots, starts, [p > 0 for p in prefix_lens])
        return out.unsqueeze(0)

    def forward_decode(self, layer, forward_batch: ForwardBatch, mixed_qkv=None, a=None, b=None, **kwargs):
        slots = self.forward_metadata.mamba_cache_indices.tolist()
        T = mixed_qkv.shape[0]
        g = ops.kda_gate(a.float().reshape(T, layer.num_v_heads, layer.head_k_dim), layer.A_log, layer.dt_bias)
        beta = b.float().reshape(T, layer.num_v_heads).sigmoid()
        out = self._run(layer, mixed_qkv, g, beta, slots, list(range(T + 1)), [True] * T)
        return out.unsqueeze(0)

    def _run(self, layer, mixed_qkv, g, beta, slots, starts, continues):
        cache = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
        conv_pool, state_pool = cache.conv[0], cache.temporal  # [N, W-1, 3P], [N, H, V, K]
        H, K, V = layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
        conv_w = layer.conv_weights.float()
        out = mixed_qkv.new_empty(mixed_qkv.shape[0], H, V)
        for i, slot in enumerate(slots):
            s, e = starts[i], starts[i + 1]
            if slot < 0 or e == s:  # padded row
                continue
            window = conv_pool[slot].float() if continues[i] else conv_pool.new_zeros(conv_pool.shape[1:], dtype=torch.float32)
            state = state_pool[slot].float().transpose(-1, -2) if continues[i] else state_pool.new_zeros((H, K, V), dtype=torch.float32)
            qkv, window = ops.short_causal_conv(mixed_qkv[s:e].float(), window, conv_w)
            q, k, v = qkv.reshape(e - s, 3, H, K).unbind(1)
            o, state = ops.kda_recurrence(ops.l2norm(q) * K**-0.5, ops.l2norm(k), v, g[s:e], beta[s:e], state)
            out[s:e] = o.to(out.dtype)
            conv_pool[slot] = window.to(conv_pool.dtype)
            state_pool[slot] = state.transpose(-1, -2).to(state_pool.dtype)
        return out
