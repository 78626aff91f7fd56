"""Sparse MLA attention over the indexer's selection, in absorbed (latent) form.

Each query row r attends only to the positions its indexer kept, selected[r, :]
(-1 = none). The latent cache holds one row per token, [c (rank) | k_pe (rope)],
shared by all heads (MQA over the latent); the absorbed query per head is
[q_nope W_kc (rank) | q_pe (rope)]. Per row:

    logits[h, j] = scale * q[h] . kv[slot(selected[j])]
    out[h]       = softmax_j(logits[h]) @ kv[slot(selected[j]), :rank]

The kernel walks the selection in blocks with an online softmax (one program per
row and block of heads: a [heads x rank] fp32 accumulator for all 128 heads would not fit
on chip), gathering the selected latent rows through req_to_token. When rows x head
blocks give too few programs to fill the GPU (small decode batches), the selection is
split across programs too (flash-decoding): each split writes its normalized partial
output and log-sum-exp, and one combine weighs them by exp(lse - max). The caller applies
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
    q_ptr, kv_ptr, rope_ptr, ks_ptr, table_ptr, row_req_ptr, sel_ptr, out_ptr, lse_ptr,
    stride_qr, stride_qh, stride_kv, stride_rope, stride_ks, stride_table, stride_sel, stride_or, stride_oh,
    H, RANK, ROPE, TOPK, SPLIT_N, scale,
    BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_TILE: tl.constexpr, SPLIT: tl.constexpr,
):
    # One query row, heads [BLOCK_H * program_id(1), ...) of it, selected entries
    # [SPLIT_N * program_id(2), ...) of it. int64: row * stride passes 2^31 past ~29K rows
    # of 128 heads (a 64K-token prefill crashed with an illegal address).
    row = tl.program_id(0).to(tl.int64)
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
    lo = tl.program_id(2) * SPLIT_N
    hi = tl.minimum(lo + SPLIT_N, TOPK)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        pos = tl.load(sel_ptr + row * stride_sel + offs_n, mask=offs_n < hi, other=-1).to(tl.int64)
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
    if SPLIT:  # this split's part of [R, splits, H, rank] fp32 and its log-sum-exp [R, splits, H]
        part = row * tl.num_programs(2) + tl.program_id(2)
        tl.store(out_ptr + part * stride_or + offs_h[:, None] * stride_oh + offs_c[None, :], out,
                 mask=mask_h[:, None] & (offs_c[None, :] < RANK))
        tl.store(lse_ptr + part * H + offs_h, tl.where(l == 0.0, float("-inf"), m + tl.log(l)), mask=mask_h)
    else:
        tl.store(out_ptr + row * stride_or + offs_h[:, None] * stride_oh + offs_c[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & (offs_c[None, :] < RANK))


def sparse_mla(q: torch.Tensor, kv_cache: torch.Tensor, req_to_token: torch.Tensor, row_req: torch.Tensor,
               selected: torch.Tensor, rank: int, scale: float, block_n: int = 32, block_h: int = 32,
               kv_scale: torch.Tensor | None = None, kv_rope: torch.Tensor | None = None,
               programs: int | None = None) -> torch.Tensor:
    """q: [R, H, rank + rope] absorbed queries; kv_cache: [slots, rank + rope] latent rows;
    req_to_token: [reqs, max_len]; row_req: [R]; selected: [R, topk] positions (-1 = none).
    FP8 (kernels.fp8_kv): kv_cache is e4m3 [slots, rank], kv_scale [slots, rank // tile]
    fp32 and kv_rope [slots, rope]. block_h heads share a program (and its latent loads).
    programs: about how many programs to run (default: 2 per SM); with fewer row x head
    blocks the selection is split (from its width, so a CUDA graph replays the same split).
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
        topk = selected.shape[1]
        blocks = R * triton.cdiv(H, block_h)
        if programs is None:
            programs = 2 * torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        splits = min(triton.cdiv(topk, block_n), max(1, triton.cdiv(programs, blocks)))
        split_n = triton.cdiv(triton.cdiv(max(topk, 1), splits), block_n) * block_n
        splits = triton.cdiv(max(topk, 1), split_n)
        part = torch.empty(R, splits, H, rank, dtype=torch.float32, device=q.device) if splits > 1 else out
        lse = torch.empty(R, splits, H, dtype=torch.float32, device=q.device) if splits > 1 else out
        _sparse_mla_kernel[(R, triton.cdiv(H, block_h), splits)](
            q, kv_cache, kv_rope, kv_scale, req_to_token, row_req, selected, part, lse,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_rope.stride(0), kv_scale.stride(0),
            req_to_token.stride(0), selected.stride(0), part.stride(-3), part.stride(-2),
            H, rank, rope, topk, split_n, scale,
            BLOCK_H=block_h, BLOCK_C=max(16, triton.next_power_of_2(rank)),
            BLOCK_R=max(16, triton.next_power_of_2(max(rope, 1))), BLOCK_N=block_n, FP8_TILE=tile,
            SPLIT=splits > 1,
        )
        if splits > 1:
            out.copy_(_combine_splits(part, lse))
    return out


def _combine_splits(part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """[R, splits, H, rank] normalized partial outputs and their log-sum-exps [R, splits, H]
    -> [R, H, rank]: each split weighed by its share of the softmax mass. Splits (and rows)
    with nothing selected have lse -inf and weigh nothing; a row with nothing gives zeros."""
    top = lse.amax(1, keepdim=True)
    w = torch.exp(lse - torch.where(top == float("-inf"), 0.0, top))  # [R, splits, H]
    return (w[..., None] * part).sum(1) / w.sum(1).clamp_min(torch.finfo(torch.float32).tiny)[..., None]


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
