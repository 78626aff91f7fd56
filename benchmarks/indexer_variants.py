"""Versions of the fused indexer side by side on one GPU: a same-machine A/B (GPU only).

Timings taken on different machines of one kind differed by 10-30% at small batch (run 60
against run 58), more than the change being judged. This loads each given copy of
kernels/indexer_topk.py as its own module and times them on the same inputs, in the same
process, with the unfused path (sparse_path_timing.unfused_indexer) as the common baseline.
Each variant's selection must be the first's set (all are exact).

    cp kernels/indexer_topk.py /tmp/new.py; git show main~1:kernels/indexer_topk.py > /tmp/old.py
    python benchmarks/indexer_variants.py --variant old=/tmp/old.py --variant new=/tmp/new.py \
        --variant new-split2=/tmp/new.py@MIN_SPLIT_TILES=2 --case decode:1x32768 --out $OUT/ab.json

A path followed by @NAME=VALUE (repeatable) loads that file with the module constant NAME
set to VALUE (a number). Cases are decode:BATCHxHISTORY (one row per request, CUDA-graph
medians) or prefill:HISTORY (one request, every position a causal row, in the backend's
row blocks, _EXTEND_ROW_BLOCK; runs 78-79 had one row a block; eager medians); BF16, or
with --mxfp8 the MXFP8 index cache and queries, group 32 (--group to change it); 4 warps.
The variants are timed in order, then again in reverse order, and both are kept; each
variant's GPU time per kernel comes from the torch profiler (kernel_us), its launches
unchained (a launch chained by programmatic dependent launch is profiled from when it is
scheduled, its wait on the grid before it included). A case given
several times is timed on that many random draws (the selection rounds' work depends on
the scores). --sglang-dsa adds SGLang's own DSA indexer on the same keys as a second
baseline (sglang_dsa_indexer.py: its decode or its prefill pipeline).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sglang_hybrid.kernels import mxfp8  # noqa: E402
from sglang_hybrid.layers.sparse_mla_backend import _EXTEND_ROW_BLOCK  # noqa: E402
import sglang_dsa_indexer  # noqa: E402
from sparse_path_timing import (D, HI, TOPK, gemm_tflops, hbm_copy_gbps, paged_history, parse_case,  # noqa: E402
                                 unfused_indexer)


def load_variant(spec: str):
    """'name=path[@CONSTANT=VALUE...]' -> (name, the module loaded from path)."""
    name, _, path = spec.partition("=")
    path, *settings = path.split("@")
    loader = importlib.util.spec_from_file_location(f"indexer_variant_{name.replace('-', '_')}", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    for setting in settings:
        constant, _, value = setting.partition("=")
        if not hasattr(module, constant):
            raise SystemExit(f"{path} has no constant {constant} (--variant {spec})")
        setattr(module, constant, int(value) if value.lstrip("-").isdigit() else float(value))
    return name, module


def kernel_us(fn, reps: int = 10) -> dict[str, float]:
    """Microseconds of GPU time per call, by kernel (torch profiler over eager calls): where
    a variant's time goes, launch by launch."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key[:80]: round(e.device_time_total / reps, 2) for e in prof.key_averages() if e.device_time_total > 0}


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a's positions & b's| / |b's| over all rows (b's -1 padding excluded); rows are sets."""
    a = a.long().sort(1).values
    found = torch.searchsorted(a, b.long().contiguous()).clamp(max=a.shape[1] - 1)
    hits = (a.gather(1, found) == b) & (b >= 0)
    return int(hits.sum()) / max(int((b >= 0).sum()), 1)


def sglang_dsa(case: dict, q, w, k, table, row_len, first, bw: float, prefill: bool) -> None:
    """SGLang's own indexer on the case's keys, recorded in case: the whole pipeline (decode:
    CUDA-graph medians, and its logits launch alone; prefill: eager, with its logits chunking);
    at decode its index-K byte floor (132 B a key it reads); its selection's overlap with the first
    variant's. Where it does not run, why."""
    try:
        if prefill:
            select, case["sglang_dsa_logits_chunk_rows"], _ = sglang_dsa_indexer.prefill_pipeline(q, w, k, table, TOPK)
            case["sglang_dsa_overlap_with_first"] = overlap(select(), first)
            case["sglang_dsa_ms"] = do_bench(select, return_mode="median")
        else:
            select, logits, _ = sglang_dsa_indexer.pipeline(q, w, k, table, row_len, TOPK)
            case["sglang_dsa_overlap_with_first"] = overlap(select(), first)
            case["sglang_dsa_ms"] = do_bench_cudagraph(select, return_mode="median")
            case["sglang_dsa_logits_ms"] = do_bench_cudagraph(logits, return_mode="median")
            case["sglang_dsa_byte_floor_ms"] = int(row_len.sum()) * (k.shape[1] + 4) / bw / 1e6
    except Exception as e:  # noqa: BLE001 (a baseline that cannot run here is reported, not fatal)
        case["sglang_dsa_error"] = repr(e)[:500]
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=PATH[@CONSTANT=VALUE...]")
    ap.add_argument("--case", action="append", required=True, metavar="decode:BATCHxHISTORY|prefill:HISTORY")
    ap.add_argument("--out", required=True)
    ap.add_argument("--mxfp8", action="store_true", help="MXFP8 queries and index-K cache (group 32)")
    ap.add_argument("--group", type=int, default=32, help="the MXFP8 group size (128: one scale a vector)")
    ap.add_argument("--sglang-dsa", action="store_true",
                    help="also time SGLang's own DSA indexer (DeepGEMM paged logits + sgl-kernel top-k; "
                         "benchmarks/sglang_dsa_indexer.py) on the same keys in its FP8 page layout")
    args = ap.parse_args()
    variants = [load_variant(v) for v in args.variant]
    bw = hbm_copy_gbps()
    results = {"device": torch.cuda.get_device_name(), "hbm_copy_GBps": bw, "variants": args.variant, "cases": []}
    if any(spec.startswith("prefill") for spec in args.case):  # prefill reads a key once for many rows
        results["gemm_TFLOPs"] = {"bf16": gemm_tflops(), "fp8": gemm_tflops(fp8=True)}
    seen: dict[str, int] = {}
    for spec, (kind, reqs, length) in zip(args.case, map(parse_case, args.case)):
        # A case's inputs depend on the case and how often it came before, not on the other
        # cases: a case given n times is n draws, the same in every run (before run 78 one
        # generator fed the cases in order, so the draw moved with the list).
        draw = seen[spec] = seen.get(spec, -1) + 1
        g = torch.Generator(device="cuda").manual_seed(reqs * 1_000_003 + length * 101 + draw)
        prefill = kind == "prefill"
        rows = length if prefill else reqs
        k, table = paged_history(reqs, length, D, g)
        q = torch.randn(rows, HI, D, device="cuda", generator=g, dtype=torch.bfloat16)
        w = torch.randn(rows, HI, device="cuda", generator=g)
        if prefill:  # every position of the one request, causal
            row_req = torch.zeros(rows, device="cuda", dtype=torch.int32)
            row_len = torch.arange(1, length + 1, device="cuda", dtype=torch.int32)
        else:
            row_req = torch.arange(reqs, device="cuda", dtype=torch.int32)
            row_len = torch.full((reqs,), length, device="cuda", dtype=torch.int32)
        visible = int(row_len.sum())  # index-K rows read, a row at a time
        byte_floor_ms = (visible * D * 2 + q.numel() * 2) / bw / 1e6
        scales = {}
        if args.mxfp8:  # the unfused baseline keeps the BF16 inputs; the byte floor is MXFP8's own
            (q8, scales["q_scale"]), (k8, scales["k_scale"]) = (mxfp8.quantize_mxfp8(q, args.group),
                                                                mxfp8.quantize_mxfp8(k, args.group))
            byte_floor_ms = (visible * (D + D // args.group) + q8.numel() + scales["q_scale"].numel()) / bw / 1e6
        case = {"kind": kind, "requests": reqs, "history": length, "draw": draw,
                "index": f"mxfp8, group {args.group}" if args.mxfp8 else "bf16"}
        if prefill:  # a tiled prefill reads each key once per block of rows: its floor is the dots
            case.update({f"flop_floor_ms[{t}]": 2 * HI * D * visible / rate / 1e9
                         for t, rate in results["gemm_TFLOPs"].items()})
        else:
            case["byte_floor_ms"] = byte_floor_ms
        median = (lambda fn: do_bench(fn, return_mode="median")) if prefill else (
            lambda fn: do_bench_cudagraph(fn, return_mode="median"))

        options = {"block_m": _EXTEND_ROW_BLOCK} if prefill else {}  # as the backend serves extend rows

        def run(module):
            if args.mxfp8:
                return lambda: module.indexer_topk(q8, w, k8, table, row_req, row_len, TOPK, **scales, **options)
            return lambda: module.indexer_topk(q, w, k, table, row_req, row_len, TOPK, **options)

        first = run(variants[0][1])()
        for name, module in variants:
            got = run(module)()
            # The same set (versions may return it in different orders: best first, or by position).
            same = case[f"same_as_{variants[0][0]}[{name}]"] = bool(torch.equal(got.sort(1).values,
                                                                                 first.sort(1).values))
            if not same:  # rounding (an FP8 MMA's accumulation) may swap near ties
                case[f"overlap_with_{variants[0][0]}[{name}]"] = overlap(got, first)
        for name, module in variants:
            chains = getattr(module, "chains_launches", None)
            if chains:
                module.chains_launches = lambda: False
            case[f"kernel_us[{name}]"] = kernel_us(run(module))
            if chains:
                module.chains_launches = chains
        for order in (variants, variants[::-1]):
            for name, module in order:
                case.setdefault(f"fused_ms[{name}]", []).append(median(run(module)))
        case["unfused_ms"] = median(lambda: unfused_indexer(q, w, k, table, row_req, row_len, TOPK, one_request=prefill))
        if args.sglang_dsa:
            sglang_dsa(case, q, w, k, table, row_len, first, bw, prefill)
        for name, _ in variants:
            best = min(case[f"fused_ms[{name}]"])
            case[f"speedup_vs_unfused[{name}]"] = case["unfused_ms"] / best
            if prefill:  # our dots run in BF16 in both tiers
                case[f"fraction_of_bf16_matmul[{name}]"] = case["flop_floor_ms[bf16]"] / best
            else:
                case[f"fraction_of_hbm[{name}]"] = byte_floor_ms / best
        del k, q, scales
        torch.cuda.empty_cache()
        results["cases"].append(case)
        print(json.dumps(case), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
