"""MXFP8 quantization of the indexer's Q and K: FP8 e4m3 data with one power-of-two
scale (e8m0: a biased exponent byte) per `group` consecutive elements of the last dim.

Scale rule (DeepSeek-V3.2's / DeepGEMM's ue8m0): s = 2^e with the smallest e such that
amax <= 448 * 2^e, so x / s fits e4m3 without saturating; e is clamped to [-127, 127]
and an all-zero group takes e = -127. The byte stored is e + 127. Dividing by a power of
two is exact, so the only rounding is e4m3's round-to-nearest-even.

`quantize_mxfp8_torch` is the reference; `quantize_mxfp8` is the Triton kernel (one
program per row block; the exponent comes from the float's bits, no log2 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
E8M0_BIAS = 127
FP8 = torch.float8_e4m3fn


def _check(x: torch.Tensor, group: int) -> None:
    if group <= 0 or group & (group - 1):
        raise ValueError(f"MXFP8 group size must be a power of two, got {group}")
    if x.shape[-1] % group:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the MXFP8 group size {group}")


def quantize_mxfp8_torch(x: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (data [..., D] e4m3, scale bytes [..., D // group] uint8)."""
    _check(x, group)
    g = x.float().unflatten(-1, (-1, group))
    amax = g.abs().amax(-1).double()
    # Exact in double with a tensor divisor (CUDA torch multiplies by the reciprocal of a
    # Python scalar, which would push amax = 448 * 2^k just past 2^k).
    e = torch.ceil(torch.log2(amax / torch.full_like(amax, E4M3_MAX))).clamp(-E8M0_BIAS, E8M0_BIAS)
    e = torch.where(amax > 0, e, torch.full_like(e, -E8M0_BIAS))
    data = (g / torch.exp2(e).float().unsqueeze(-1)).to(FP8).flatten(-2)
    return data, (e + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp8(data: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """(data [..., D] e4m3, scale bytes [..., D // group]) -> fp32 [..., D]."""
    s = torch.exp2(scale.float() - E8M0_BIAS)
    return (data.float().unflatten(-1, (-1, group)) * s.unsqueeze(-1)).flatten(-2)


@triton.jit
def _quantize_mxfp8_kernel(x_ptr, dst_ptr, data_ptr, scale_ptr, R, NG, GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_G: tl.constexpr, SCATTER: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # offsets pass 2^31
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = tl.arange(0, GROUP)
    rg_mask = (rows[:, None] < R) & (groups[None, :] < NG)  # [BLOCK_R, BLOCK_G]
    offs = (rows[:, None, None] * NG + groups[None, :, None]) * GROUP + cols[None, None, :]
    x = tl.load(x_ptr + offs, mask=rg_mask[:, :, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=2)
    # amax = m * 2^E, m in [1, 2): amax <= 1.75 * 2^(8 + e)  <=>  e >= E - 8 + (m > 1.75).
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    e = tl.where(amax > 0, e, -127)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e from its bits (e <= 121 for finite x)
    out_rows = rows
    if SCATTER:  # row r goes to cache slot dst[r]
        out_rows = tl.load(dst_ptr + rows, mask=rows < R, other=0).to(tl.int64)
    out = (out_rows[:, None, None] * NG + groups[None, :, None]) * GROUP + cols[None, None, :]
    tl.store(data_ptr + out, (x * inv[:, :, None]).to(tl.float8e4nv), mask=rg_mask[:, :, None])
    tl.store(scale_ptr + out_rows[:, None] * NG + groups[None, :], (e + 127).to(tl.uint8), mask=rg_mask)


def _launch(x2, dst, data, scale, group):
    R, NG = x2.shape[0], x2.shape[1] // group
    if R:
        block_r = 16
        block_g = min(triton.next_power_of_2(NG), max(1, 1024 // group))
        grid = (triton.cdiv(R, block_r), triton.cdiv(NG, block_g))
        _quantize_mxfp8_kernel[grid](x2, x2 if dst is None else dst, data, scale, R, NG, GROUP=group,
                                     BLOCK_R=block_r, BLOCK_G=block_g, SCATTER=dst is not None)


def quantize_mxfp8(x: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of quantize_mxfp8_torch (same outputs, bit for bit)."""
    _check(x, group)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    data = torch.empty(x2.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x2.shape[0], x2.shape[1] // group, dtype=torch.uint8, device=x.device)
    _launch(x2, None, data, scale, group)
    return data.reshape(x.shape), scale.reshape(*x.shape[:-1], x.shape[-1] // group)


def store_mxfp8(x: torch.Tensor, loc: torch.Tensor, data_cache: torch.Tensor, scale_cache: torch.Tensor) -> None:
    """Quantize rows x [T, D] and write them to cache slots loc [T] in one launch:
    data_cache [slots, D] e4m3, scale_cache [slots, D // G] (the group G follows from it)."""
    group = x.shape[-1] // scale_cache.shape[-1]
    _check(x, group)
    if data_cache.dtype != FP8 or scale_cache.dtype != torch.uint8 or data_cache.shape[-1] != x.shape[-1]:
        raise ValueError(f"MXFP8 cache must be e4m3 [slots, {x.shape[-1]}] + uint8 scales, got "
                         f"{data_cache.dtype} {tuple(data_cache.shape)} + {scale_cache.dtype}")
    _launch(x.contiguous(), loc.contiguous(), data_cache, scale_cache, group)


def store_mxfp8_torch(x, loc, data_cache, scale_cache) -> None:
    """Reference of store_mxfp8."""
    data, scale = quantize_mxfp8_torch(x, x.shape[-1] // scale_cache.shape[-1])
    data_cache[loc.long()] = data
    scale_cache[loc.long()] = scale
