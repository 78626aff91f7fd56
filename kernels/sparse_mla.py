"""Sparse MLA attention over the indexer's selection, in absorbed (latent) form.

Each query row r attends only to the positions its indexer kept, selected[r, :]
(-1 = none). The latent cache holds one row per token, [c (rank) | k_pe (rope)],
shared by all heads (MQA over the latent); the absorbed query per head is
[q_nope W_kc (rank) | q_pe (rope)]. Per row:

    logits[h, j] = scale * q[h] . kv[slot(selected[j])]
    out[h]       = softmax_j(logits[h]) @ kv[slot(selected[j]), :rank]

The kernel walks the selection in blocks with an online softmax (one program per
row and block of heads: a [heads x rank] fp32 accumulator for all 128 heads would not fit
on chip), gathering the selected latent rows through req_to_token. The caller applies
W_vc. With an FP8 latent cache (kernels.fp8_kv) the latent c is dequantized on load
to the query's dtype. sparse_mla_torch is the plain-PyTorch reference of the same
interface.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_hybrid.kernels.fp8_kv import dequantize_kv_fp8


@triton.jit
def _sparse_mla_kernel(
    q_ptr, kv_ptr, rope_ptr, ks_ptr, table_ptr, row_req_ptr, sel_ptr, out_ptr,
    stride_qr, stride_qh, stride_kv, stride_rope, stride_ks, stride_table, stride_sel, stride_or, stride_oh,
    H, RANK, ROPE, TOPK, scale,
    BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_TILE: tl.constexpr,
):
    row = tl.program_id(0)  # one query row, heads [BLOCK_H * program_id(1), ...) of it
    req = tl.load(row_req_ptr + row).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = offs_h < H
    q_c = tl.load(q_ptr + row * stride_qr + offs_h[:, None] * stride_qh + offs_c[None, :],
                  mask=mask_h[:, None] & (offs_c[None, :] < RANK), other=0.0)
    q_r = tl.load(q_ptr + row * stride_qr + offs_h[:, None] * stride_qh + RANK + offs_r[None, :],
                  mask=mask_h[:, None] & (offs_r[None, :] < ROPE), other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for n0 in range(0, TOPK, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        pos = tl.load(sel_ptr + row * stride_sel + offs_n, mask=offs_n < TOPK, other=-1).to(tl.int64)
        valid = pos >= 0
        slot = tl.load(table_ptr + req * stride_table + pos, mask=valid, other=0).to(tl.int64)
        kv_c = tl.load(kv_ptr + slot[:, None] * stride_kv + offs_c[None, :],
                       mask=valid[:, None] & (offs_c[None, :] < RANK), other=0.0)
        if FP8_TILE:  # dequantize on load, rounded to the query's dtype (kernels.fp8_kv)
            # One scale load per tile, broadcast over its FP8_TILE channels.
            offs_t = tl.arange(0, BLOCK_C // FP8_TILE)
            ks = tl.load(ks_ptr + slot[:, None] * stride_ks + offs_t[None, :],
                         mask=valid[:, None] & (offs_t[None, :] < RANK // FP8_TILE), other=0.0)
            kv_c = tl.reshape(tl.reshape(kv_c.to(tl.float32), [BLOCK_N, BLOCK_C // FP8_TILE, FP8_TILE])
                              * ks[:, :, None], [BLOCK_N, BLOCK_C]).to(q_c.dtype)
        kv_r = tl.load(rope_ptr + slot[:, None] * stride_rope + offs_r[None, :],
                       mask=valid[:, None] & (offs_r[None, :] < ROPE), other=0.0)
        logits = tl.dot(q_c, tl.trans(kv_c.to(q_c.dtype))) + tl.dot(q_r, tl.trans(kv_r.to(q_r.dtype)))
        logits = tl.where(valid[None, :], logits * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        # Rows that have seen nothing valid yet keep m = -inf; guard exp(-inf - -inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(logits - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv_c.dtype), kv_c).to(tl.float32)
        m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # a row with nothing selected gives zeros
    tl.store(out_ptr + row * stride_or + offs_h[:, None] * stride_oh + offs_c[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & (offs_c[None, :] < RANK))


def sparse_mla(q: torch.Tensor, kv_cache: torch.Tensor, req_to_token: torch.Tensor, row_req: torch.Tensor,
               selected: torch.Tensor, rank: int, scale: float, block_n: int = 32, block_h: int = 32,
               kv_scale: torch.Tensor | None = None, kv_rope: torch.Tensor | None = None) -> torch.Tensor:
    """q: [R, H, rank + rope] absorbed queries; kv_cache: [slots, rank + rope] latent rows;
    req_to_token: [reqs, max_len]; row_req: [R]; selected: [R, topk] positions (-1 = none).
    FP8 (kernels.fp8_kv): kv_cache is e4m3 [slots, rank], kv_scale [slots, rank // tile]
    fp32 and kv_rope [slots, rope]. block_h heads share a program (and its latent loads).
    Returns [R, H, rank] in q's dtype."""
    R, H, width = q.shape
    rope = width - rank
    q, kv_cache, selected = q.contiguous(), kv_cache.contiguous(), selected.contiguous()
    if (kv_scale is None) != (kv_rope is None):
        raise ValueError("the FP8 latent cache needs both kv_scale and kv_rope")
    tile = 0
    if kv_scale is not None:
        tile = rank // kv_scale.shape[-1]
        if tile & (tile - 1):
            raise ValueError(f"the FP8 latent tile must be a power of two, got {tile}")
        if kv_cache.shape[-1] != rank or kv_rope.shape[-1] != rope or rank % kv_scale.shape[-1]:
            raise ValueError(f"FP8 latent cache {tuple(kv_cache.shape)} / scales {tuple(kv_scale.shape)} / rope "
                             f"{tuple(kv_rope.shape)} do not match rank {rank} + rope {rope}")
    else:
        kv_scale, kv_rope = kv_cache, kv_cache[:, rank:]  # rope read from the latent row itself
    out = torch.empty(R, H, rank, dtype=q.dtype, device=q.device)
    if R:
        block_h = min(max(16, triton.next_power_of_2(block_h)), max(16, triton.next_power_of_2(H)))
        _sparse_mla_kernel[(R, triton.cdiv(H, block_h))](
            q, kv_cache, kv_rope, kv_scale, req_to_token, row_req, selected, out,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_rope.stride(0), kv_scale.stride(0),
            req_to_token.stride(0), selected.stride(0), out.stride(0), out.stride(1),
            H, rank, rope, selected.shape[1], scale,
            BLOCK_H=block_h, BLOCK_C=max(16, triton.next_power_of_2(rank)),
            BLOCK_R=max(16, triton.next_power_of_2(max(rope, 1))), BLOCK_N=block_n, FP8_TILE=tile,
        )
    return out


def sparse_mla_torch(q, kv_cache, req_to_token, row_req, selected, rank, scale, kv_scale=None, kv_rope=None):
    """Reference of sparse_mla: gather the selected latent rows, softmax, weighted sum, in fp32."""
    if kv_scale is not None:  # the FP8 latent as the kernel sees it: dequantized to q's dtype
        kv_cache = torch.cat([dequantize_kv_fp8(kv_cache, kv_scale, q.dtype), kv_rope.to(q.dtype)], -1)
    slots = req_to_token[row_req.long()[:, None], selected.clamp(min=0).long()].long()  # [R, topk]
    picked = kv_cache[slots].float()  # [R, topk, rank + rope]
    logits = torch.einsum("rhd,rkd->rhk", q.float(), picked) * scale
    logits = logits.masked_fill((selected < 0)[:, None, :], float("-inf"))
    probs = torch.nan_to_num(logits.softmax(-1))  # nothing selected -> zeros
    return torch.einsum("rhk,rkd->rhd", probs, picked[..., :rank]).to(q.dtype)
