"""Per-rank prefill time of the sparse layer under context parallelism, zigzag against a
contiguous split, measured on one GPU.

cp_partition_work.py counts each rank's work; this times it. For one request of T tokens
split over W ranks, each rank's rows (its positions under `parallel.zigzag.zigzag_plan` or
`contiguous_plan`) run what a rank runs in a sparse layer under CP: the fused indexer over
the whole causal history (every rank has all of index-K after the all-gather) and sparse
MLA over the Top-K it selects, with the kernels and row blocks of the served extend path.
One GPU runs the ranks one after another; the spread (slowest rank / mean) is what a W-GPU
prefill would wait for at each sparse layer, communication left out (issue 7 measures the
rest on several GPUs). The KDA layers need no such check: every rank runs the same number
of tokens and two summaries (cp_prefill_cost.py).

Shapes: the DSA-like sparse layer of sparse_path_timing.py (64 index heads x 128, Top-K
2048, latent 512 + rope 64, 128 heads), bf16. Times: median of --repeats runs after one
warm-up, CUDA events.

    python benchmarks/cp_rank_time.py --out cp_rank_time.json [--lengths 32768 65536 131072] [--ranks 2 4 8]

With --device cpu (Triton's interpreter, fp32, tiny shapes) it checks that the script runs:
    TRITON_INTERPRET=1 python benchmarks/cp_rank_time.py --device cpu --lengths 96 --ranks 2 \\
        --topk 16 --index-heads 2 --heads 2 --rank 32 --rope 16 --out /tmp/cp_rank_time.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sglang_hybrid.kernels.indexer_topk import indexer_topk
from sglang_hybrid.kernels.sparse_mla import sparse_mla
from sglang_hybrid.layers.sparse_mla_backend import _EXTEND_ROW_BLOCK
from sglang_hybrid.parallel.zigzag import contiguous_plan, zigzag_plan

PLANS = {"zigzag": zigzag_plan, "contiguous": contiguous_plan}


def timed(fn, device: str, repeats: int) -> float:
    """Median ms of `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def rank_times(T: int, world: int, args, device: str, dtype) -> dict:
    g = torch.Generator(device=device).manual_seed(T)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=g).to(dtype)

    index_k = randn(T, args.index_dim)
    kv = randn(T, args.rank + args.rope)
    table = torch.randperm(T, device=device, generator=g).to(torch.int32).view(1, T)  # scattered slots
    out = {}
    for name, make in PLANS.items():
        plan = make([T], world).to(device)
        per_rank = []
        for positions in plan.rank_positions:
            R = positions.numel()
            q_index, weights = randn(R, args.index_heads, args.index_dim), randn(R, args.index_heads).float()
            q = randn(R, args.heads, args.rank + args.rope)
            row_req = torch.zeros(R, dtype=torch.int32, device=device)
            row_len = (positions + 1).to(torch.int32)

            def select():
                return indexer_topk(q_index, weights, index_k, table, row_req, row_len, args.topk,
                                    block_m=_EXTEND_ROW_BLOCK)

            def layer():
                return sparse_mla(q, kv, table, row_req, select(), args.rank, 0.07)

            per_rank.append({"tokens": R, "layer_ms": timed(layer, device, args.repeats),
                             "indexer_ms": timed(select, device, args.repeats)})
        layer = [r["layer_ms"] for r in per_rank]
        out[name] = {"ranks": per_rank, "slowest_ms": max(layer), "mean_ms": statistics.mean(layer),
                     "spread_max_over_mean": max(layer) / statistics.mean(layer),
                     "spread_max_over_min": max(layer) / min(layer)}
    out["slowest_zigzag_over_contiguous"] = out["zigzag"]["slowest_ms"] / out["contiguous"]["slowest_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--index-heads", type=int, default=64)
    ap.add_argument("--index-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32  # the interpreter cannot run bf16
    cases = []
    for T in args.lengths:
        for world in args.ranks:
            case = {"tokens": T, "world": world, **rank_times(T, world, args, args.device, dtype)}
            cases.append(case)
            print(json.dumps({"tokens": T, "world": world,
                              **{name: {k: round(case[name][k], 3) for k in ("slowest_ms", "mean_ms",
                                                                             "spread_max_over_mean")}
                                 for name in PLANS},
                              "slowest_zigzag_over_contiguous": round(case["slowest_zigzag_over_contiguous"], 3)}),
                  flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "shapes": {k: getattr(args, k) for k in ("topk", "index_heads", "index_dim", "heads", "rank", "rope")},
              "cases": cases}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
