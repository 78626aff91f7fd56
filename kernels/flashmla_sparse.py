"""sgl-kernel's FlashMLA sparse attention on this project's sparse-MLA interface.

An alternative to kernels.sparse_mla.sparse_mla for the BF16 latent cache on Hopper
and Blackwell: same arguments, same result (tests/test_sparse_mla_kernel.py compares it with
sparse_mla_torch on a GPU). FlashMLA's sparse kernel (`flash_mla_sparse_fwd`) takes slot
indices into the latent pool rather than positions, a latent of 512 + 64, heads in
multiples of 64 (Hopper) or 128 (Blackwell) and Top-K in multiples of 64; this
adapter maps positions to slots through req_to_token and pads heads and Top-K.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RANK, WIDTH, TOPK_MULTIPLE = 512, 576, 64


def check_supported(device: torch.device, dtype: torch.dtype, rank: int, width: int) -> None:
    """Raise ValueError naming what FlashMLA's sparse kernel cannot serve here."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        raise ValueError("FlashMLA sparse attention needs a Hopper or newer GPU")
    if dtype != torch.bfloat16:
        raise ValueError(f"FlashMLA sparse attention needs a bfloat16 latent cache, got {dtype}")
    if (rank, width) != (RANK, WIDTH):
        raise ValueError(f"FlashMLA sparse attention needs latent {RANK} + rope {WIDTH - RANK}, got {rank} + {width - rank}")
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd  # noqa: F401  (raises if sgl-kernel lacks it)


def sparse_mla_flashmla(q: torch.Tensor, kv_cache: torch.Tensor, req_to_token: torch.Tensor, row_req: torch.Tensor,
                        selected: torch.Tensor, rank: int, scale: float, kv_scale=None, kv_rope=None) -> torch.Tensor:
    """q: [R, H, 576] absorbed queries (bf16); kv_cache: [slots, 576] bf16 latent rows;
    selected: [R, topk] positions (-1 = none). Returns [R, H, 512] bf16; a row with
    nothing selected gives zeros, as sparse_mla does. No FP8 latent (kv_scale, kv_rope)."""
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd

    if kv_scale is not None or kv_rope is not None:
        raise ValueError("the FlashMLA alternative serves the BF16 latent cache only")

    R, H, width = q.shape
    pad_h = (128 if torch.cuda.get_device_capability(q.device)[0] >= 10 else 64)
    pad_h = -H % pad_h
    if pad_h:
        q = F.pad(q, (0, 0, 0, pad_h))
    slots = req_to_token[row_req.long()[:, None], selected.clamp(min=0).long()]
    slots = torch.where(selected >= 0, slots, -1).to(torch.int32)
    slots = F.pad(slots, (0, -slots.shape[1] % TOPK_MULTIPLE), value=-1)
    out, _, _ = flash_mla_sparse_fwd(q.contiguous(), kv_cache.view(-1, 1, width), slots.unsqueeze(1), scale,
                                     d_v=rank)
    out = out[:, :H]
    return torch.where((selected >= 0).any(1)[:, None, None], out, 0)
