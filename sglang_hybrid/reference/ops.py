"""Plain-PyTorch reference ops: the definition of "correct" for every kernel.

Readable first, fast never. Everything computes in the dtype of its inputs
(the golden model feeds fp32 or fp64). Shapes use T = tokens, H = heads,
K = key dim, V = value dim, S = history length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # the eps SGLang's / fla's KDA kernels use inside l2norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def silu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


# ----------------------------------------------------------------------------- KDA


def short_causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over new tokens, continuing from a cached window.

    x: [T, D] new pre-conv inputs; window: [W-1, D] the previous W-1 inputs
    (zeros at sequence start); weight: [D, W]. Output t sees inputs t-W+1..t.
    Returns (out [T, D], next window [W-1, D]).
    """
    width = weight.shape[1]
    full = torch.cat([window, x], dim=0)  # [W-1+T, D]
    out = torch.stack([(full[t : t + width] * weight.T).sum(0) for t in range(x.shape[0])]) if x.shape[0] else x
    return F.silu(out), full[full.shape[0] - (width - 1) :]


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Log-space channel-wise decay: g = -exp(A_log[h]) * softplus(f + dt_bias). f: [T, H, K]."""
    H, K = f.shape[-2:]
    return -A_log.reshape(H, 1).exp() * F.softplus(f + dt_bias.reshape(H, K))


def kda_recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule with channel-wise decay, one token at a time.

    q, k: [T, H, K] (already l2-normalised, q already scaled); v: [T, H, V];
    g: [T, H, K] log decay; beta: [T, H]; state: [H, K, V].
        S <- diag(exp(g_t)) S
        S <- S + beta_t k_t (v_t - S^T k_t)^T
        o_t = S^T q_t
    Returns (o [T, H, V], final state [H, K, V]).
    """
    S = state.clone()
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp().unsqueeze(-1)
        v_pred = torch.einsum("hk,hkv->hv", k[t], S)
        S = S + torch.einsum("hk,hv->hkv", beta[t].unsqueeze(-1) * k[t], v[t] - v_pred)
        out.append(torch.einsum("hk,hkv->hv", q[t], S))
    o = torch.stack(out) if out else v.new_zeros(v.shape)
    return o, S


# ------------------------------------------------------------------------- indexer


def rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE over the last dim of x [T, ..., R] at absolute positions [T]."""
    R = x.shape[-1]
    if R == 0:
        return x
    inv_freq = 1.0 / (theta ** (torch.arange(0, R, 2, dtype=torch.float64, device=x.device) / R))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, R/2]
    cos = angles.cos().to(x.dtype)
    sin = angles.sin().to(x.dtype)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (R // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    x1, x2 = x[..., : R // 2], x[..., R // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def hadamard_matrix(d: int, dtype: torch.dtype) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix of size d (a power of two)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(dtype)


def indexer_scores(
    q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor
) -> torch.Tensor:
    """score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) for s <= q_positions[t], else -inf.

    q: [T, Hi, D]; w: [T, Hi] (all scales folded in); k: [S, D] the whole history.
    """
    logits = torch.einsum("thd,sd->ths", q, k).relu()
    scores = torch.einsum("th,ths->ts", w, logits)
    visible = torch.arange(k.shape[0], device=k.device)[None, :] <= q_positions[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def topk_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Per row, the Top-K visible positions; -1 pads rows with fewer than K visible.

    Ties, the rule every kernel of this project follows: higher scores win; of equal
    scores (e.g. exact zeros from relu) the lower positions. Best first here; the fused
    kernel (kernels.indexer_topk) returns the same set in ascending position.
    Returns [T, topk] int64.
    """
    T, S = scores.shape
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
    picked = torch.gather(scores, 1, order)
    order = order.masked_fill(picked == float("-inf"), -1)
    if order.shape[1] < topk:
        order = torch.cat([order, order.new_full((T, topk - order.shape[1]), -1)], dim=1)
    return order


def sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of each row over its selected positions only.

    q: [T, H, Dqk]; k: [S, H, Dqk]; v: [S, H, Dv]; selected: [T, topk] (-1 = none).
    """
    T, S = q.shape[0], k.shape[0]
    allowed = torch.zeros(T, S, dtype=torch.bool, device=q.device)
    rows = torch.arange(T, device=q.device)[:, None].expand_as(selected)
    valid = selected >= 0
    allowed[rows[valid], selected[valid]] = True
    logits = torch.einsum("thd,shd->hts", q, k) * scale
    logits = logits.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hts,shd->thd", logits.softmax(-1), v)


# ----------------------------------------------------------------- residual + MoE


def attn_res_mix(rows: list[torch.Tensor], proj: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Block attention residual: softmax over rows of w . RMSNorm(row), then the weighted sum.

    rows: block representations [T, D] (completed blocks, then the running partial block);
    proj: [1, D] pseudo-query; norm_weight: [D] key norm.
    """
    stacked = torch.stack(rows, dim=1)  # [T, R, D]
    scores = (rms_norm(stacked, norm_weight, eps) @ proj.reshape(-1, 1)).squeeze(-1)  # [T, R]
    return (scores.softmax(-1).unsqueeze(-1) * stacked).sum(1)


def moe_route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    topk: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with score-correction bias and grouped top-k (DeepSeek-V3 noaux_tc).

    Groups are ranked by the sum of their two best biased scores; experts by biased
    score inside the kept groups; weights are the unbiased sigmoid scores.
    Returns (weights [T, topk], expert ids [T, topk]).
    """
    T, E = logits.shape
    scores = logits.sigmoid()
    biased = scores + bias
    group_scores = biased.view(T, num_groups, E // num_groups).topk(min(2, E // num_groups), dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
    keep = keep.repeat_interleave(E // num_groups, dim=1)
    ids = biased.masked_fill(~keep, float("-inf")).topk(topk, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids
