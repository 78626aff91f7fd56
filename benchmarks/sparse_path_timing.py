"""Timing of the sparse path on one GPU, each against baselines measured in the same run.

Decode (one row per request) and prefill (a causal chunk of one request) at DSA-like
shapes (64 index heads x 128, Top-K 2048, latent 512 + 64 rope, 128 query heads):

- indexer: the fused `indexer_topk` (BF16 and MXFP8 index cache) against the unfused
  PyTorch path it replaces (gather the history, score matrix [rows, heads, history]
  in fp32 through HBM, torch.topk), and against the bytes it must read (index-K rows
  of every visible position) at the HBM copy bandwidth measured here;
- sparse MLA: `sparse_mla` (BF16 and FP8 latent) against its gather + softmax PyTorch
  reference and against the bytes of the selected latent rows at that bandwidth.

    python benchmarks/sparse_path_timing.py --out $OUT/sparse_path_timing.json

Times are medians of CUDA-event timings (triton.testing.do_bench); no claim is made
here about any number before it is run and recorded in benchmarks/.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from sglang_hybrid.kernels import fp8_kv, indexer_topk, mxfp8, sparse_mla
from sglang_hybrid.reference.ops import topk_positions

HI, D, TOPK, H, RANK, ROPE = 64, 128, 2048, 128, 512, 64


def hbm_copy_gbps() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")  # 256 MiB
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6  # read + write, GB/s


def paged_history(reqs: int, length: int, width: int, dtype, g):
    """A pool with each request's positions scattered over the slots, and its table."""
    slots = torch.randperm(reqs * length, device="cuda", generator=g).view(reqs, length).to(torch.int32)
    cache = torch.randn(reqs * length, width, device="cuda", generator=g).to(dtype)
    return cache, slots


def unfused_indexer(q, w, k, table, row_req, row_len, topk):
    """The path the fused kernel replaces: gathered keys, an fp32 score matrix in HBM, topk."""
    L = table.shape[1]
    keys = k[table[row_req.long()].long()]  # [R, L, D]
    s = torch.einsum("rhd,rld->rhl", q.float(), keys.float()).relu_()
    s = torch.einsum("rh,rhl->rl", w, s)
    s.masked_fill_(torch.arange(L, device=s.device)[None, :] >= row_len[:, None], float("-inf"))
    return topk_positions(s, topk) if L < 8192 else s.topk(topk, dim=-1).indices  # stable sort is slow at 128K


def bench_indexer(rows, reqs, length, row_len, row_req, g, bw, block_m):
    out = {}
    k, table = paged_history(reqs, length, D, torch.bfloat16, g)
    q = torch.randn(rows, HI, D, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(rows, HI, device="cuda", generator=g)
    visible = int(row_len.sum())
    out["bytes_min"] = visible * D * 2 + q.numel() * 2
    out["fused_bf16_ms"] = do_bench(lambda: indexer_topk.indexer_topk(q, w, k, table, row_req, row_len, TOPK,
                                                                      block_m=block_m))
    qd, qs = mxfp8.quantize_mxfp8(q)
    kd, ks = mxfp8.quantize_mxfp8(k)
    out["fused_mxfp8_ms"] = do_bench(lambda: indexer_topk.indexer_topk(qd, w, kd, table, row_req, row_len, TOPK,
                                                                       block_m=block_m, q_scale=qs, k_scale=ks))
    out["bytes_min_mxfp8"] = visible * (D + D // 32) + qd.numel() + qs.numel()
    if rows * length * HI * 4 <= 8 << 30:  # the unfused score matrix must fit
        out["unfused_ms"] = do_bench(lambda: unfused_indexer(q, w, k, table, row_req, row_len, TOPK))
        out["speedup_vs_unfused"] = out["unfused_ms"] / out["fused_bf16_ms"]
    out["fraction_of_hbm_bf16"] = out["bytes_min"] / (out["fused_bf16_ms"] * 1e6) / bw
    out["fraction_of_hbm_mxfp8"] = out["bytes_min_mxfp8"] / (out["fused_mxfp8_ms"] * 1e6) / bw
    selected = indexer_topk.indexer_topk(q, w, k, table, row_req, row_len, TOPK, block_m=block_m)
    return out, table, selected


def bench_sparse_mla(rows, reqs, length, table, row_req, selected, g, bw):
    out = {}
    kv, _ = paged_history(reqs, length, RANK + ROPE, torch.bfloat16, g)
    q = torch.randn(rows, H, RANK + ROPE, device="cuda", generator=g).to(torch.bfloat16)
    scale = (128 + ROPE) ** -0.5  # DeepSeek's qk_nope 128 + rope 64
    n_sel = int((selected >= 0).sum())
    out["bytes_min"] = n_sel * (RANK + ROPE) * 2 + q.numel() * 2 + rows * H * RANK * 2
    out["kernel_bf16_ms"] = do_bench(lambda: sparse_mla.sparse_mla(q, kv, table, row_req, selected, RANK, scale))
    data, kscale = fp8_kv.quantize_kv_fp8_torch(kv[:, :RANK])
    rope = kv[:, RANK:].contiguous()
    out["kernel_fp8_ms"] = do_bench(lambda: sparse_mla.sparse_mla(q, data, table, row_req, selected, RANK, scale,
                                                                 kv_scale=kscale, kv_rope=rope))
    out["bytes_min_fp8"] = n_sel * (RANK + RANK // 128 * 4 + ROPE * 2) + q.numel() * 2 + rows * H * RANK * 2
    out["torch_reference_ms"] = do_bench(lambda: sparse_mla.sparse_mla_torch(q, kv, table, row_req, selected, RANK,
                                                                           scale))
    out["speedup_vs_torch"] = out["torch_reference_ms"] / out["kernel_bf16_ms"]
    out["fraction_of_hbm_bf16"] = out["bytes_min"] / (out["kernel_bf16_ms"] * 1e6) / bw
    out["fraction_of_hbm_fp8"] = out["bytes_min_fp8"] / (out["kernel_fp8_ms"] * 1e6) / bw
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="one small case of each kind")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    bw = hbm_copy_gbps()
    results = {"hbm_copy_GBps": bw, "shapes": dict(index_heads=HI, index_dim=D, topk=TOPK, heads=H, rank=RANK,
                                                    rope=ROPE), "cases": []}
    decode = [(1, 8192), (32, 32768), (8, 131072)] if not args.quick else [(4, 4096)]
    prefill = [(2048, 8192), (4096, 32768)] if not args.quick else [(256, 2048)]
    for reqs, length in decode:
        row_req = torch.arange(reqs, device="cuda", dtype=torch.int32)
        row_len = torch.full((reqs,), length, device="cuda", dtype=torch.int32)
        idx, table, selected = bench_indexer(reqs, reqs, length, row_len, row_req, g, bw, 1)
        mla = bench_sparse_mla(reqs, reqs, length, table, row_req, selected, g, bw)
        results["cases"].append({"kind": "decode", "requests": reqs, "history": length, "indexer": idx,
                                 "sparse_mla": mla})
        print(json.dumps(results["cases"][-1]), flush=True)
    for rows, length in prefill:  # the last `rows` positions of one request, causal
        row_req = torch.zeros(rows, device="cuda", dtype=torch.int32)
        row_len = torch.arange(length - rows + 1, length + 1, device="cuda", dtype=torch.int32)
        cases = {}
        for block_m in (1, 4, 8):
            cases[f"block_m={block_m}"], table, selected = bench_indexer(rows, 1, length, row_len, row_req,
                                                                         g, bw, block_m)
        mla = bench_sparse_mla(rows, 1, length, table, row_req, selected, g, bw)
        results["cases"].append({"kind": "prefill", "rows": rows, "history": length, "indexer": cases,
                                 "sparse_mla": mla})
        print(json.dumps(results["cases"][-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
