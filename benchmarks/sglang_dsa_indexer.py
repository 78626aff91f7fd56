"""SGLang 0.5.17's own DSA indexer on the same inputs: the baseline issue 3 asks for beside the unfused path.

Per decode step and sparse layer, SGLang's Indexer (srt/layers/attention/dsa/dsa_indexer.py,
_get_topk_paged) makes two launches:
- DeepGEMM's paged MQA logits over its FP8 index-K pages. A page holds 64 tokens x 128 e4m3
  bytes, then 64 fp32 scales: 132 B a token, and page size 64 only. The launch writes fp32
  logits [rows, max_len] to HBM.
- sgl-kernel's top-k over those logits.

This module converts a bf16 paged history (sparse_path_timing.paged_history: pages of 64
positions) to that layout and returns the two launches as one callable. The schedule
metadata is computed once, as SGLang does per batch, outside the layers. The layout
conversion is plain PyTorch and runs anywhere; `pipeline` needs CUDA, DeepGEMM and sgl-kernel.
"""

from __future__ import annotations

import torch

PAGE = 64  # DeepGEMM's paged MQA logits: page size 64 only
E4M3_MAX = 448.0


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with amax / s <= 448 (ue8m0 scales, DeepSeek-V3.2's scale_fmt)."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / E4M3_MAX)))


def to_dsa_pages(k: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 index keys [slots, D], whose pages of 64 slots each hold 64 consecutive positions of
    one request, -> SGLang's index-K buffer [pages, 64 * (D + 4)] uint8 and its block table
    [requests, pages per request] int32. Each page is 64 e4m3 rows, then their 64 fp32 scales
    (DSATokenToKVPool's layout); one scale per token."""
    slots, D = k.shape
    if slots % PAGE or table.shape[1] % PAGE:
        raise ValueError(f"SGLang's DSA index cache holds pages of {PAGE} tokens: got {slots} slots, "
                         f"tables {table.shape[1]} wide")
    first = table[:, ::PAGE].long()
    if bool((first % PAGE != 0).any()) or not torch.equal(table.long(), (first[:, :, None] + torch.arange(
            PAGE, device=table.device)).flatten(1)):
        raise ValueError(f"each run of {PAGE} positions must fill one page of {PAGE} slots")
    pages = slots // PAGE
    kf = k.float().view(pages, PAGE, D)
    scale = _pow2_scale(kf.abs().amax(-1))
    data = (kf / scale[..., None]).to(torch.float8_e4m3fn)
    buf = torch.cat([data.view(torch.uint8).reshape(pages, PAGE * D),
                     scale.contiguous().view(torch.uint8).reshape(pages, PAGE * 4)], dim=1)
    return buf, (first // PAGE).to(torch.int32).contiguous()


def from_dsa_pages(buf: torch.Tensor, D: int = 128) -> torch.Tensor:
    """The inverse of to_dsa_pages' quantization: the dequantized keys [slots, D] fp32."""
    pages = buf.shape[0]
    data = buf[:, :PAGE * D].contiguous().view(torch.float8_e4m3fn).view(pages, PAGE, D).float()
    scale = buf[:, PAGE * D:].contiguous().view(torch.float32).view(pages, PAGE)
    return (data * scale[..., None]).reshape(pages * PAGE, D)


def quantize_queries(q: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index queries [rows, H, D] -> e4m3 with one power-of-two scale per (row, head), the scale
    folded into the head weights [rows, H] fp32, as SGLang's Indexer does."""
    scale = _pow2_scale(q.float().abs().amax(-1))
    return (q.float() / scale[..., None]).to(torch.float8_e4m3fn), (w.float() * scale).contiguous()


def reference_logits(q8: torch.Tensor, w8: torch.Tensor, buf: torch.Tensor, table: torch.Tensor,
                     row: int, length: int) -> torch.Tensor:
    """One row's logits [length] in fp32 from the quantized inputs: what DeepGEMM computes."""
    keys = from_dsa_pages(buf, q8.shape[-1])[table[row, :length].long()]
    return (torch.einsum("hd,ld->hl", q8[row].float(), keys).relu() * w8[row, :, None]).sum(0)


def pipeline(q, w, k, table, row_len, topk):
    """SGLang's decode indexer over these inputs (one row per request): (select, logits). select()
    runs both launches and returns positions [rows, topk]; logits() the first alone. Also
    returns what they were built from (q8, w8, buf) for checks."""
    import deep_gemm
    from sgl_kernel import fast_topk_v2

    from sglang.kernels.ops.attention.dsa.paged_mqa_logits import deepgemm_paged_mqa_logits_split

    buf, block_tables = to_dsa_pages(k, table)
    kv = buf.view(buf.shape[0], PAGE, 1, buf.shape[1] // PAGE)
    q8, w8 = quantize_queries(q, w)
    lens = row_len.to(torch.int32).contiguous()
    lens_2d = lens.unsqueeze(-1).contiguous()
    schedule = deep_gemm.get_paged_mqa_logits_metadata(lens_2d, PAGE, deep_gemm.get_num_sms())
    max_len = block_tables.shape[1] * PAGE

    def logits():  # SGLang's own call (plain decode: one row per request)
        return deepgemm_paged_mqa_logits_split(deep_gemm.fp8_paged_mqa_logits, q8, kv, w8, lens_2d, block_tables,
                                               schedule, max_len, q_offset=q8.shape[0])

    def select():
        return fast_topk_v2(logits(), lens, topk)

    return select, logits, (q8, w8, buf)
