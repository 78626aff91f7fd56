"""KDA under context parallelism: each chunk of a sequence as an affine map of its incoming state.

The gated delta rule with channel-wise decay (reference.ops.kda_recurrence), per head,
with state S [K, V], D_t = diag(exp(g_t)):

    S_t = D_t S_{t-1} + beta_t k_t (v_t - (D_t S_{t-1})^T k_t)^T
        = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T
        = A_t S_{t-1} + B_t

is affine in the state. Over a chunk of tokens 1..T the composition is again affine:

    S_T = M S_0 + E,   M = A_T ... A_1  [K, K],   E = the chunk run from S_0 = 0  [K, V].

So every rank summarizes its chunks without knowing their incoming states; after an
all-gather of the (M, E) pairs, an ordered fold S_{j+1} = M_j S_j + E_j (fp32) gives each
chunk its true initial state, and the chunk's outputs o_t = S_t^T q_t are recomputed from
it (the state's contribution to them is not affine-free, so recomputing is the simplest
exact way). Per chunk, layer and head the summary is K (K + V) fp32 values: at K = V =
128 and 32 heads, 4 MiB per chunk per layer, against 2 * hidden bytes per token of
activations (a 32K-token chunk of a 2304-wide bf16 model: 144 MiB); it does not grow
with the chunk.

The short causal conv in front of the recurrence needs the last width - 1 pre-conv
inputs before a chunk (its halo), which may span several earlier chunks when chunks
are short; conv_windows folds them in order like the states.

These are the plain-PyTorch definitions (fp32 on any device); the CP layers run them over
all of a rank's chunks at once (each_sequence's contract).
"""

from __future__ import annotations

import torch


def chunk_summary(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """k: [T, H, K] (l2-normalised); v: [T, H, V]; g: [T, H, K] log decay; beta: [T, H].
    Returns (M [H, K, K], E [H, K, V]) in fp32 with S_out = M S_in + E per head."""
    T, H, K = k.shape
    k, v, g, beta = k.float(), v.float(), g.float(), beta.float()
    M = torch.eye(K, device=k.device).expand(H, K, K).clone()
    E = k.new_zeros(H, K, v.shape[-1])
    for t in range(T):
        # A_t X = (I - beta k k^T) D X, applied to both M and E (E also gains B_t).
        for X in (M, E):
            X.mul_(g[t].exp().unsqueeze(-1))
            X.sub_(torch.einsum("hk,hj,hjx->hkx", beta[t, :, None] * k[t], k[t], X))
        E.add_(torch.einsum("hk,hv->hkv", beta[t, :, None] * k[t], v[t]))
    return M, E


def each_sequence(recurrence):
    """A recurrence over several sequences at once, the contract parallel.kda_cp runs its chunks
    with: (q, k, v, g, beta, states [N, H, K, V], cu [N + 1] row offsets) -> (o, final states
    [N, H, K, V] fp32), from one with reference.ops.kda_recurrence's (one sequence, one state),
    run sequence by sequence. An empty sequence keeps its state."""
    def run(q, k, v, g, beta, states, cu):
        o, finals = v.new_zeros(v.shape), states.float().clone()
        for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            if b > a:
                out, finals[n] = recurrence(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], states[n])
                o[a:b] = out.to(o.dtype)
        return o, finals
    return run


def summary_by_recurrence(recurrence, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          cu: list[int]):
    """chunk_summary's (M [N, H, K, K], E [N, H, K, V]) of each sequence cu[n]:cu[n + 1], from one
    run of the recurrence itself (each_sequence's contract): the map is linear in the state
    column by column, so running a sequence on values [v | 0] from the state [0 | I] ([K, V + K])
    ends at M [0 | I] + [E | 0] = [E | M]. On a GPU that is one fused-kernel launch for every
    sequence instead of T small matrix products each."""
    T, H, K = k.shape
    V = v.shape[-1]
    values = torch.cat([v.float(), v.new_zeros(T, H, K, dtype=torch.float32)], dim=-1)
    start = torch.cat([k.new_zeros(H, K, V, dtype=torch.float32), torch.eye(K, device=k.device).expand(H, K, K)],
                      dim=-1)
    _, end = recurrence(k.new_zeros(T, H, K, dtype=torch.float32), k.float(), values, g.float(), beta.float(),
                        start.expand(len(cu) - 1, H, K, V + K).contiguous(), cu)
    return end[..., V:], end[..., :V]


def fold_states(summaries: list[tuple[torch.Tensor, torch.Tensor]], initial: torch.Tensor) -> list[torch.Tensor]:
    """Chunk summaries in sequence order and the state before the first chunk [H, K, V] ->
    the state entering each chunk, and after the last (len(summaries) + 1 states), in fp32."""
    states = [initial.float()]
    for M, E in summaries:
        states.append(torch.bmm(M.float(), states[-1]) + E.float())
    return states


def conv_windows(chunks: list[torch.Tensor], window: torch.Tensor) -> list[torch.Tensor]:
    """Pre-conv inputs of each chunk [T_j, D] in order and the window before the first
    [W-1, D] -> the window entering each chunk, and after the last."""
    keep = window.shape[0]
    windows = [window]
    for x in chunks:
        full = torch.cat([windows[-1], x], dim=0)
        windows.append(full[full.shape[0] - keep:])
    return windows
