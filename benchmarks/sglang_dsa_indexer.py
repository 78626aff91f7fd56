"""SGLang 0.5.17's own DSA indexer on the same inputs: the baseline issue 3 asks for beside the unfused path.

SGLang keeps the index keys in FP8 pages: 64 tokens x 128 e4m3 bytes, then 64 fp32 scales,
132 B a token, page size 64 only. Per sparse layer its Indexer (srt/layers/attention/dsa/
dsa_indexer.py) makes, at decode (_get_topk_paged, `pipeline` here):
- DeepGEMM's paged MQA logits over the pages, fp32 logits [rows, max_len] written to HBM;
- sgl-kernel's top-k over those logits.
At prefill (_get_topk_ragged, `prefill_pipeline` here):
- a Triton gather of the request's keys and scales out of their pages;
- DeepGEMM's ragged MQA logits (each row sees [ks, ke) of the gathered keys), fp32 logits
  [rows, keys] written to HBM, in row chunks when they pass SGLang's logits budget;
- sgl-kernel's ragged top-k per chunk.

This module converts a bf16 paged history (sparse_path_timing.paged_history: pages of 64
positions) to that layout and returns the launches as one callable. Metadata (DeepGEMM's
schedule, the row ranges) is computed once, as SGLang does per batch, outside the layers.
The layout conversion is plain PyTorch and runs anywhere; the pipelines need CUDA, DeepGEMM
and sgl-kernel.
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


def reference_logits(q8: torch.Tensor, w8: torch.Tensor, buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One row's logits over the keys in `slots` (its visible positions' slots), fp32, from its
    quantized query [H, D] and weights [H]: what DeepGEMM computes."""
    keys = from_dsa_pages(buf, q8.shape[-1])[slots.long()]
    return (torch.einsum("hd,ld->hl", q8.float(), keys).relu() * w8[:, None]).sum(0)


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


# SGLang's prefill logits budget (Indexer._get_mqa_logits_budget_bytes with no server schedule,
# as in a benchmark): a fifth of the free memory (SGLANG_DSA_MQA_LOGITS_FREE_MEM_FRACTION),
# at most 30% of the card; below 8M logits it does not chunk at all.
LOGITS_FREE_MEM_FRACTION, LOGITS_TOTAL_MEM_FRACTION, LOGITS_STATIC_SKIP = 0.2, 0.3, 8_000_000


def logits_rows_per_chunk(rows: int, keys: int, free_bytes: int, total_bytes: int) -> int:
    """How many rows of fp32 logits [rows, keys] SGLang computes at once (_should_chunk_mqa_logits)."""
    budget = max(1, min(int(free_bytes * LOGITS_FREE_MEM_FRACTION), int(total_bytes * LOGITS_TOTAL_MEM_FRACTION)))
    if rows * keys < LOGITS_STATIC_SKIP or rows * keys * 4 <= budget:
        return rows
    return max(1, min(rows, budget // (keys * 4)))


def prefill_pipeline(q, w, k, table, topk):
    """SGLang's prefill indexer over one request whose every token is a query row (causal, no
    cached prefix; q [L, H, D], table [1, L]): (select, chunk_rows, (q8, w8, buf)). select()
    gathers the request's FP8 keys out of their pages, then per row chunk runs DeepGEMM's
    fp8_mqa_logits and sgl-kernel's ragged top-k, and returns positions [L, topk] (-1 past a
    row's history). Its logits are rows x history fp32, in chunks of chunk_rows rows."""
    import deep_gemm
    from sgl_kernel import fast_topk_transform_ragged_fused

    from sglang.kernels.ops.attention.dsa.index_buf_accessor import _get_k_and_s_triton

    L, D = q.shape[0], q.shape[-1]
    if table.shape != (1, L):
        raise ValueError(f"one request of {L} rows: the table must be [1, {L}], got {list(table.shape)}")
    buf, block_tables = to_dsa_pages(k, table)
    q8, w8 = quantize_queries(q, w)
    seq_lens = torch.tensor([L], dtype=torch.int64, device=q.device)
    ks = torch.zeros(L, dtype=torch.int32, device=q.device)  # row i sees gathered keys [0, i + 1)
    ke = torch.arange(1, L + 1, dtype=torch.int32, device=q.device)
    free, total = torch.cuda.mem_get_info(q.device)
    chunk = logits_rows_per_chunk(L, L, free, total)

    def select():
        k_u8, s_u8 = _get_k_and_s_triton(buf, block_tables, seq_lens, L, L, PAGE, D)
        kv = (k_u8.view(torch.float8_e4m3fn), s_u8.view(torch.float32).squeeze(-1))
        out = torch.empty(L, topk, dtype=torch.int32, device=q.device)
        for r0 in range(0, L, chunk):
            rows = slice(r0, min(L, r0 + chunk))
            logits = deep_gemm.fp8_mqa_logits(q8[rows], kv, w8[rows], ks[rows], ke[rows], clean_logits=False)
            out[rows] = fast_topk_transform_ragged_fused(score=logits, lengths=ke[rows], topk_indices_offset=ks[rows],
                                                         topk=topk, row_starts=ks[rows])
        return out

    return select, chunk, (q8, w8, buf)
