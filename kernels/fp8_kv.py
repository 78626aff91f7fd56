"""FP8 latent KV for the sparse MLA layers: per token (the latent is one head, shared by
all query heads), the latent c [rank] as e4m3 with one fp32 scale per tile of `tile`
elements; the rope part [rope] stays in the model dtype (FlashMLA's FP8 layout does the
same: it is small and carries position).

    scale[t, i] = amax(|c[t, tile i]|) / 448   (1 for an all-zero tile)
    data[t, j]  = e4m3(c[t, j] / scale[t, j // tile])

Both divisions are IEEE round-to-nearest here and in the kernel (div_rn), so kernel and
reference agree bit for bit. Attention dequantizes on load: data * scale, rounded to the
query's dtype (what FlashMLA's FP8 path feeds its bf16 MMA); `dequantize_kv_fp8` is that
step's reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn


def _check(c: torch.Tensor, tile: int) -> None:
    if tile <= 0 or tile & (tile - 1):
        raise ValueError(f"FP8 KV tile must be a power of two, got {tile}")
    if c.shape[-1] % tile:
        raise ValueError(f"latent width {c.shape[-1]} is not a multiple of the FP8 KV tile {tile}")


def quantize_kv_fp8_torch(c: torch.Tensor, tile: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """c [T, rank] -> (data [T, rank] e4m3, scale [T, rank // tile] fp32)."""
    _check(c, tile)
    g = c.float().unflatten(-1, (-1, tile))
    amax = g.abs().amax(-1)
    # A tensor divisor: CUDA torch turns division by a Python scalar into a multiply by
    # its reciprocal, which is not the IEEE quotient the kernel computes.
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    return (g / scale.unsqueeze(-1)).to(FP8).flatten(-2), scale


def dequantize_kv_fp8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(data [T, rank] e4m3, scale [T, rank // tile]) -> [T, rank] in dtype."""
    tile = data.shape[-1] // scale.shape[-1]
    return (data.float().unflatten(-1, (-1, tile)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)


@triton.jit
def _store_kv_fp8_kernel(c_ptr, loc_ptr, data_ptr, scale_ptr, T, NT, stride_c, stride_d, stride_s,
                         TILE: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tile = tl.program_id(1)
    cols = tile * TILE + tl.arange(0, TILE)
    mask = rows < T
    c = tl.load(c_ptr + rows[:, None].to(tl.int64) * stride_c + cols[None, :], mask=mask[:, None],
                other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(c), axis=1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full([BLOCK_T], 448.0, tl.float32)), 1.0)
    q = tl.math.div_rn(c, tl.broadcast_to(scale[:, None], [BLOCK_T, TILE]))
    slot = tl.load(loc_ptr + rows, mask=mask, other=0).to(tl.int64)
    tl.store(data_ptr + slot[:, None] * stride_d + cols[None, :], q.to(tl.float8e4nv), mask=mask[:, None])
    tl.store(scale_ptr + slot * stride_s + tile, scale, mask=mask)


def store_kv_fp8(c: torch.Tensor, loc: torch.Tensor, data_cache: torch.Tensor, scale_cache: torch.Tensor) -> None:
    """Quantize latent rows c [T, rank] into cache slots loc [T] in one launch:
    data_cache [slots, rank] e4m3, scale_cache [slots, rank // tile] fp32."""
    tile = c.shape[-1] // scale_cache.shape[-1]
    _check(c, tile)
    if data_cache.dtype != FP8 or scale_cache.dtype != torch.float32 or data_cache.shape[-1] != c.shape[-1]:
        raise ValueError(f"FP8 KV cache must be e4m3 [slots, {c.shape[-1]}] + fp32 scales, got "
                         f"{data_cache.dtype} {tuple(data_cache.shape)} + {scale_cache.dtype}")
    T = c.shape[0]
    if T:
        block_t = 16
        _store_kv_fp8_kernel[(triton.cdiv(T, block_t), c.shape[-1] // tile)](
            c, loc.contiguous(), data_cache, scale_cache, T, c.shape[-1] // tile,
            c.stride(0), data_cache.stride(0), scale_cache.stride(0), TILE=tile, BLOCK_T=block_t)


def store_kv_fp8_torch(c, loc, data_cache, scale_cache) -> None:
    """Reference of store_kv_fp8."""
    data, scale = quantize_kv_fp8_torch(c, c.shape[-1] // scale_cache.shape[-1])
    data_cache[loc.long()] = data
    scale_cache[loc.long()] = scale
