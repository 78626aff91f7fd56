"""Timing of the sparse path on one GPU, each against baselines measured in the same run.

Shapes are DSA-like (64 index heads x 128, Top-K 2048, latent 512 + 64 rope, 128 query
heads). Decode: batch {1, 8, 32, 64} x history {4K, 32K, 128K}, one row per request.
Prefill: one request of {8K, 32K, 64K} tokens, every row causal.

- indexer: the fused `indexer_topk` (BF16 and MXFP8 index cache; decode also without
  split-K) against the unfused PyTorch path (bf16 tensor-core logits [rows x heads x
  history] through HBM, relu, head-weighted sum, torch.topk; processed in row chunks so
  its memory stays bounded), with the extra memory each path allocates;
- sparse MLA: `sparse_mla` (BF16 and FP8 latent) against its gather + softmax PyTorch
  reference (where the gather fits) and sgl-kernel's FlashMLA sparse kernel (BF16);
- floors: the bytes each kernel must read (index-K rows of every visible position; the
  selected latent rows) at the device-to-device copy bandwidth measured here, and its
  FLOPs at the bf16 GEMM throughput measured here. fraction_of_hbm = floor time from
  bytes / measured time; fraction_of_gemm likewise from FLOPs.

    python benchmarks/sparse_path_timing.py --out $OUT/sparse_path_timing.json [--kind decode] [--case prefill:32768 ...] [--quick]

Times are medians of CUDA-event timings: decode cases replay CUDA graphs, as serving
does (triton.testing.do_bench_cudagraph, no launch overhead), prefill cases run eagerly
(do_bench). The history's pages of 64 positions are scattered over the pool. The JSON
is rewritten after every case, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from sglang_hybrid.kernels import flashmla_sparse, fp8_kv, indexer_topk, mxfp8, sparse_mla

HI, D, TOPK, H, RANK, ROPE = 64, 128, 2048, 128, 512, 64
CHUNK_BYTES = 2 << 30  # the unfused path's logits per row chunk


def hbm_copy_gbps() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, far beyond L2
    y = torch.empty_like(x)
    return 2 * x.numel() / bench(lambda: y.copy_(x)) / 1e6  # read + write, GB/s


def gemm_tflops(fp8: bool = False) -> float:
    """A dense 8192^3 matmul's rate, BF16 or FP8 e4m3 (torch._scaled_mm, bf16 out): the
    measured ceiling a compute-bound launch is held to."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    if not fp8:
        return 2 * 8192**3 / bench(lambda: a @ a) / 1e9
    a8, one = a.to(torch.float8_e4m3fn), torch.ones((), device="cuda")
    return 2 * 8192**3 / bench(lambda: torch._scaled_mm(a8, a8.t(), one, one, out_dtype=torch.bfloat16)) / 1e9


def bench(fn, graph: bool = False) -> float:
    """Median ms, replaying a CUDA graph of fn when graph is set."""
    return do_bench_cudagraph(fn, return_mode="median") if graph else do_bench(fn, return_mode="median")


def timed(fn, graph: bool) -> tuple[float, int]:
    """(median ms, bytes allocated beyond what was live before the call)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    return bench(fn, graph), extra


def paged_history(reqs: int, length: int, width: int, g, page: int = 64):
    """A bf16 pool whose pages of `page` positions are scattered over the slots (a
    fragmented paged allocator), and its table."""
    pages = torch.randperm(reqs * length // page, device="cuda", generator=g)
    slots = (pages[:, None] * page + torch.arange(page, device="cuda")).view(reqs, length).to(torch.int32)
    cache = torch.randn(reqs * length, width, device="cuda", generator=g, dtype=torch.bfloat16)
    return cache, slots


def unfused_indexer(q, w, k, table, row_req, row_len, topk, one_request: bool):
    """What the fused kernel replaces, as fast as plain PyTorch does it: per chunk of rows,
    bf16 GEMM logits into HBM, relu, weighted head sum, topk. Decode rows gather their own
    history; the rows of one request (prefill) share one gathered history."""
    R, L = q.shape[0], table.shape[1]
    chunk = max(1, CHUNK_BYTES // (L * HI * 2))
    out = torch.empty(R, topk, dtype=torch.int64, device=q.device)
    wb = w.to(q.dtype)
    shared = k[table[0].long()] if one_request else None  # [L, D]
    for r0 in range(0, R, chunk):
        rows = slice(r0, min(R, r0 + chunk))
        if one_request:
            logits = (shared @ q[rows].flatten(0, 1).T).relu_().view(L, -1, HI)  # [L, r, HI]
            s = torch.einsum("lrh,rh->rl", logits, wb[rows]).float()
        else:
            keys = k[table[row_req[rows].long()].long()]  # [r, L, D]
            logits = torch.bmm(keys, q[rows].transpose(1, 2)).relu_()  # [r, L, HI]
            s = torch.bmm(logits, wb[rows, :, None]).squeeze(-1).float()  # [r, L]
        s.masked_fill_(torch.arange(L, device=s.device)[None, :] >= row_len[rows, None], float("-inf"))
        out[rows] = s.topk(topk, dim=-1).indices
    return out


def bench_indexer(rows, reqs, length, row_len, row_req, g, bw, tflops, block_ms, decode):
    out = {}
    k, table = paged_history(reqs, length, D, g)
    q = torch.randn(rows, HI, D, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(rows, HI, device="cuda", generator=g)
    qd, qs = mxfp8.quantize_mxfp8(q)
    kd, ks = mxfp8.quantize_mxfp8(k)
    visible = int(row_len.sum())
    bytes_bf16 = visible * D * 2 + q.numel() * 2
    bytes_mxfp8 = visible * (D + D // 32) + qd.numel() + qs.numel()
    flops = 2 * visible * HI * D
    out.update(visible_positions=visible, bytes_floor_bf16=bytes_bf16, bytes_floor_mxfp8=bytes_mxfp8,
               flops=flops, floor_ms_bytes_bf16=bytes_bf16 / bw / 1e6, floor_ms_flops=flops / tflops / 1e9)
    for block_m in block_ms:
        for warps in (4, 8):
            tag = f"block_m={block_m},num_warps={warps}"
            opts = dict(block_m=block_m, num_warps=warps)
            out[f"fused_bf16_ms[{tag}]"], out[f"fused_bf16_extra_bytes[{tag}]"] = timed(
                lambda: indexer_topk.indexer_topk(q, w, k, table, row_req, row_len, TOPK, **opts), decode)
            out[f"fused_mxfp8_ms[{tag}]"], _ = timed(
                lambda: indexer_topk.indexer_topk(qd, w, kd, table, row_req, row_len, TOPK, q_scale=qs, k_scale=ks,
                                                  **opts), decode)
    # The selection the next stage attends over; split-K must not change it.
    selected = indexer_topk.indexer_topk(q, w, k, table, row_req, row_len, TOPK, block_m=block_ms[0])
    if decode:
        out["fused_bf16_no_split_ms"], _ = timed(
            lambda: indexer_topk.indexer_topk(q, w, k, table, row_req, row_len, TOPK, programs=1), decode)
        out["split_equals_no_split"] = bool(torch.equal(selected, indexer_topk.indexer_topk(
            q, w, k, table, row_req, row_len, TOPK, programs=1)))
    # Against the fp32 PyTorch reference on a few rows: the same positions up to near ties
    # (the kernel's bf16 products are exact, its fp32 sums run in another order).
    few = slice(0, min(rows, 4)) if decode else slice(rows - 4, rows)
    reference = indexer_topk.indexer_topk_torch(q[few], w[few], k, table, row_req[few], row_len[few], TOPK)
    out["overlap_with_fp32_reference"] = sum(
        len(set(a.tolist()) & set(b.tolist())) for a, b in zip(selected[few], reference)) / reference.numel()
    best = min(v for key, v in out.items() if key.startswith("fused_bf16_ms"))
    best_mx = min(v for key, v in out.items() if key.startswith("fused_mxfp8_ms"))
    out["unfused_ms"], out["unfused_extra_bytes"] = timed(
        lambda: unfused_indexer(q, w, k, table, row_req, row_len, TOPK, one_request=not decode), decode)
    out["speedup_vs_unfused_bf16"] = out["unfused_ms"] / best
    out["speedup_vs_unfused_mxfp8"] = out["unfused_ms"] / best_mx
    out["fraction_of_hbm_bf16"] = out["floor_ms_bytes_bf16"] / best
    out["fraction_of_hbm_mxfp8"] = bytes_mxfp8 / bw / 1e6 / best_mx
    out["fraction_of_gemm_bf16"] = out["floor_ms_flops"] / best
    del k, q, qd, kd
    return out, table, selected


def ablate_indexer(rows, reqs, length, row_len, row_req, g, decode):
    """Where the fused indexer's time goes: one factor at a time against the default (the
    tile size, the software-pipelining depth of the tile loads, how many programs share
    the GPU: the default targets 2 per SM, what fits side by side), then, for decode, the
    kernel's pieces timed apart (indexer_breakdown: the scoring loop alone, one merge, and
    how many merges a program does on this data). Run 18 measured loading the next tile
    by hand into registers: no faster than Triton's pipeliner, so the kernel lost it. Each
    time is printed as it comes, so a cut run keeps what it measured."""
    from indexer_breakdown import merge_us, merges_per_program, scoring_ms

    out = {}
    k, table = paged_history(reqs, length, D, g)
    q = torch.randn(rows, HI, D, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(rows, HI, device="cuda", generator=g)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def record(key, value):
        out[key] = value
        print(json.dumps({"ablation": key, "value": value}), flush=True)

    def run(key, **opts):
        record(key, bench(lambda: indexer_topk.indexer_topk(q, w, k, table, row_req, row_len, TOPK, **opts), decode))

    run("default")
    run("block_s=64", block_s=64)
    for stages in (2, 4):
        run(f"num_stages={stages}", num_stages=stages)
    for per_sm in (1, 4):
        run(f"programs={per_sm}xSM", programs=per_sm * sms)
    if decode:
        record("scoring_loop_only_ms", scoring_ms(q, w, k, table, row_len, TOPK))
        # MXFP8 reads half the bytes but ran no faster than BF16 (runs 71-72): is it the loop?
        (q8, qs), (k8, ks) = mxfp8.quantize_mxfp8(q), mxfp8.quantize_mxfp8(k)
        record("default[mxfp8]", bench(lambda: indexer_topk.indexer_topk(
            q8, w, k8, table, row_req, row_len, TOPK, q_scale=qs, k_scale=ks), decode))
        record("scoring_loop_only_ms[mxfp8]", scoring_ms(q8, w, k8, table, row_len, TOPK, q_scale=qs, k_scale=ks))
        record("one_merge_us", merge_us(TOPK))
        scores = (k[table[0, :length].long()].float() @ q[0].float().T).relu() @ w[0]  # row 0, fp32
        split_len = indexer_topk._split_len(table.shape[1], rows, 2 * sms, 128)
        record("merges_per_program[first,last split]", merges_per_program(scores, TOPK, split_len))
        record("tiles_per_program", triton.cdiv(split_len, 128))
    return out


def bench_sparse_mla(rows, reqs, length, table, row_req, selected, g, bw, tflops, graph):
    out = {}
    kv, _ = paged_history(reqs, length, RANK + ROPE, g)
    q = torch.randn(rows, H, RANK + ROPE, device="cuda", generator=g, dtype=torch.bfloat16)
    scale = (128 + ROPE) ** -0.5  # DeepSeek's qk_nope 128 + rope 64
    n_sel = int((selected >= 0).sum())
    io = q.numel() * 2 + rows * H * RANK * 2  # queries in, outputs out
    out["bytes_floor_bf16"] = n_sel * (RANK + ROPE) * 2 + io
    out["bytes_floor_fp8"] = n_sel * (RANK + RANK // 128 * 4 + ROPE * 2) + io
    out["flops"] = 2 * n_sel * H * (RANK + ROPE + RANK)
    for block_h in (16, 32, 64):
        out[f"kernel_bf16_ms[block_h={block_h}]"] = bench(
            lambda: sparse_mla.sparse_mla(q, kv, table, row_req, selected, RANK, scale, block_h=block_h), graph)
    outs = [sparse_mla.sparse_mla(q, kv, table, row_req, selected, RANK, scale, block_h=b).float() for b in (16, 64)]
    out["block_h_16_vs_64_max_abs_diff"] = float((outs[0] - outs[1]).abs().max())  # the same math, split differently
    del outs
    best_h = min((16, 32, 64), key=lambda b: out[f"kernel_bf16_ms[block_h={b}]"])
    out["best_block_h"] = best_h
    best = out[f"kernel_bf16_ms[block_h={best_h}]"]
    out["kernel_bf16_no_split_ms"] = bench(  # the whole selection in each program (no flash-decoding split)
        lambda: sparse_mla.sparse_mla(q, kv, table, row_req, selected, RANK, scale, block_h=best_h, programs=1), graph)
    data, kscale = fp8_kv.quantize_kv_fp8_torch(kv[:, :RANK])
    rope = kv[:, RANK:].contiguous()
    try:  # sgl-kernel's FlashMLA sparse kernel on the same BF16 latent (kernels.flashmla_sparse)
        out["flashmla_bf16_ms"] = bench(lambda: flashmla_sparse.sparse_mla_flashmla(q, kv, table, row_req, selected,
                                                                                   RANK, scale), graph)
        out["ours_vs_flashmla"] = out["flashmla_bf16_ms"] / best
    except Exception as e:  # noqa: BLE001  (recorded: where FlashMLA does not run here)
        out["flashmla_error"] = repr(e)
    out["kernel_fp8_ms"] = bench(lambda: sparse_mla.sparse_mla(q, data, table, row_req, selected, RANK, scale,
                                                              block_h=best_h, kv_scale=kscale, kv_rope=rope), graph)
    out["fraction_of_hbm_bf16"] = out["bytes_floor_bf16"] / bw / 1e6 / best
    out["fraction_of_hbm_fp8"] = out["bytes_floor_fp8"] / bw / 1e6 / out["kernel_fp8_ms"]
    out["fraction_of_gemm_bf16"] = out["flops"] / tflops / 1e9 / best
    if rows * TOPK * (RANK + ROPE) * 4 <= CHUNK_BYTES:  # the reference gathers [rows, topk, width] fp32
        out["torch_reference_ms"] = bench(
            lambda: sparse_mla.sparse_mla_torch(q, kv, table, row_req, selected, RANK, scale), graph)
        out["speedup_vs_torch"] = out["torch_reference_ms"] / best
    return out


def parse_case(text: str) -> tuple[str, int, int]:
    """'decode:64x131072' -> ('decode', 64, 131072); 'prefill:32768' -> ('prefill', 1, 32768)."""
    kind, shape = text.split(":")
    batch, _, history = shape.rpartition("x")
    return kind, int(batch or 1), int(history)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--kind", choices=("decode", "prefill"), help="only these cases (default: both)")
    ap.add_argument("--case", action="append", default=[], metavar="KIND:[BATCHx]HISTORY",
                    help="only these cases, e.g. decode:64x131072 or prefill:32768 (repeatable)")
    ap.add_argument("--indexer-only", action="store_true", help="time the indexer, not sparse MLA")
    ap.add_argument("--ablate", action="store_true", help="also time the indexer's ablations (ablate_indexer)")
    ap.add_argument("--quick", action="store_true", help="one small case of each kind")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    bw, tflops = hbm_copy_gbps(), gemm_tflops()
    results = {"device": torch.cuda.get_device_name(), "hbm_copy_GBps": bw, "bf16_gemm_TFLOPs": tflops,
               "shapes": dict(index_heads=HI, index_dim=D, topk=TOPK, heads=H, rank=RANK, rope=ROPE), "cases": []}
    decode = [(b, L) for L in (4096, 32768, 131072) for b in (1, 8, 32, 64)] if not args.quick else [(4, 4096)]
    prefill = [8192, 32768, 65536] if not args.quick else [4096]
    cases = [("decode", b, L) for b, L in decode] + [("prefill", 1, L) for L in prefill]
    cases = [c for c in cases if args.kind in (None, c[0])]
    if args.case:
        cases = [c for c in cases if c in set(map(parse_case, args.case))]
    for kind, reqs, length in cases:
        case = {"kind": kind, "requests": reqs, "history": length,
                "timing": "cuda_graph" if kind == "decode" else "eager"}
        try:
            if kind == "decode":
                rows = reqs
                row_req = torch.arange(reqs, device="cuda", dtype=torch.int32)
                row_len = torch.full((reqs,), length, device="cuda", dtype=torch.int32)
                block_ms = (1,)
            else:  # every position of one request, causal
                rows = length
                row_req = torch.zeros(rows, device="cuda", dtype=torch.int32)
                row_len = torch.arange(1, length + 1, device="cuda", dtype=torch.int32)
                block_ms = (1, 2)  # indexer_topk caps block_m at 4096 // KP = 2
            if args.ablate:  # first: the ablations are what such a run is for
                case["indexer_ablation_ms"] = ablate_indexer(rows, reqs, length, row_len, row_req, g, kind == "decode")
            case["indexer"], table, selected = bench_indexer(rows, reqs, length, row_len, row_req, g, bw, tflops,
                                                             block_ms, kind == "decode")
            if not args.indexer_only:
                case["sparse_mla"] = bench_sparse_mla(rows, reqs, length, table, row_req, selected, g, bw, tflops,
                                                      kind == "decode")
        except Exception:  # record it and go on: one shape's failure says nothing about the others
            case["error"] = traceback.format_exc(limit=3)
        torch.cuda.empty_cache()
        results["cases"].append(case)
        print(json.dumps(case), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
