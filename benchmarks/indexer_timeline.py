"""When each program of the fused indexer's scoring kernel starts, loads its queries, ends its
tile loop and ends: where a program's time beyond its positions goes (GPU only).

At 8 x 128K the scoring kernel's 256 programs each took about 21 us beyond their 4096
positions (sparse_path_timing.md, run 87), and removing the final merge did not change the
kernel's time (run 88); this timeline put about 18 us of it in the tile loop (run 90). It
loads a copy of kernels/indexer_topk.py whose scoring kernel also stores, per program, the SM
it ran on and %globaltimer (ns) at four points:

- start: its first instruction;
- queries: its queries and head weights in registers;
- loop: its last tile scored (the running Top-KP and the candidates in hand);
- end: its final merge done, or on splits too short to merge, its padding (stores issued).

and reports, over the programs of one launch (after warm-up, eager): how far apart they
start and end (the wave's ramp and its uneven end), the median and spread of each phase,
and the whole indexer's time with and without the timer reads. The copy is made by
inserting the timer reads at fixed anchors of the kernel's source; an anchor that is gone
fails loudly, so the script follows the kernel or says it must.

    python benchmarks/indexer_timeline.py --case decode:8x131072 --case decode:64x131072 --out $OUT/timeline.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from indexer_variants import load_variant  # noqa: E402
from sparse_path_timing import D, HI, TOPK, paged_history, parse_case  # noqa: E402

KERNEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "indexer_topk.py")

# (anchor in the kernel source, what replaces it). Each timer read depends on a value of the
# phase it closes, so it waits for that phase's loads and stores.
_T = "_tl_cuda.globaltimer()"
_EDITS = [
    ("import triton.language as tl\n",
     "import triton.language as tl\nfrom triton.language.extra import cuda as _tl_cuda\n"),
    ("    qs_ptr, ks_ptr, part_ptr, cand_ptr, seen_ptr, tail_start_ptr,",
     "    qs_ptr, ks_ptr, part_ptr, cand_ptr, seen_ptr, timeline_ptr, tail_start_ptr,"),
    ("    # One program: up to BLOCK_M consecutive rows of one request, sharing every K tile, over\n",
     f"    t_start = {_T}\n"
     "    # One program: up to BLOCK_M consecutive rows of one request, sharing every K tile, over\n"),
    ("    NONE: tl.constexpr = -9223372036854775807 - 1\n    offs_2k = tl.arange(0, 2 * KP)\n",
     f"    t_queries = {_T} + (tl.sum(tl.sum(q.to(tl.float32), axis=1), axis=0)\n"
     "                        + tl.sum(tl.sum(w, axis=1), axis=0) == -1.0).to(tl.int64)\n"
     "    NONE: tl.constexpr = -9223372036854775807 - 1\n    offs_2k = tl.arange(0, 2 * KP)\n"),
    ("    if IN_PLACE:  # no merge:",
     f"    t_loop = {_T} + (tl.max(_each_row(bar, BLOCK_M), axis=0) + tl.max(_each_row(count, BLOCK_M), axis=0)\n"
     "                     == 1).to(tl.int64)\n"
     "    if IN_PLACE:  # no merge:"),
    ("        _merge_candidates(buf, part, _each_row(held, BLOCK_M), _each_row(count, BLOCK_M), offs_2k, width, NONE, KP,"
     " GPU)\n\n\ndef _row_blocks",
     "        held, _, _ = _merge_candidates(buf, part, _each_row(held, BLOCK_M), _each_row(count, BLOCK_M), offs_2k,"
     " width, NONE, KP, GPU)\n"
     f"    t_end = {_T} + (tl.max(_each_row(held, BLOCK_M), axis=0) + tl.max(_each_row(count, BLOCK_M), axis=0)"
     " == -1).to(tl.int64)\n"
     "    at = timeline_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * 5\n"
     "    tl.store(at, t_start)\n    tl.store(at + 1, t_queries)\n    tl.store(at + 2, t_loop)\n"
     "    tl.store(at + 3, t_end)\n    tl.store(at + 4, _tl_cuda.smid().to(tl.int64))\n\n\ndef _row_blocks"),
    ("starts, ends, q_scale, k_scale, part, cand, seen,\n",
     "starts, ends, q_scale, k_scale, part, cand, seen, TIMELINE,\n"),
]


def timed_source(src: str) -> str:
    """kernels/indexer_topk.py's source with the timeline inserted into its scoring kernel."""
    for anchor, replacement in _EDITS:
        if src.count(anchor) != 1:
            raise SystemExit(f"indexer_timeline: the kernel source no longer has this anchor once:\n{anchor}")
        src = src.replace(anchor, replacement)
    return src + "\n\nTIMELINE = None  # int64 [programs, 5], set by benchmarks/indexer_timeline.py\n"


def load_timed():
    """The timed copy, loaded as its own module."""
    with tempfile.NamedTemporaryFile("w", suffix="_indexer_topk_timed.py", delete=False) as f:
        f.write(timed_source(open(KERNEL).read()))
    return load_variant(f"timed={f.name}")[1]


def summary(timeline: torch.Tensor) -> dict:
    """Microseconds: the launch's span, its programs' start and end spread, and each phase's
    median and 10th / 90th percentiles over the programs."""
    t = timeline[:, :4].double()
    t0 = t[:, 0].min()
    q = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    phase = lambda d: [round(v, 2) for v in (d / 1e3).quantile(q).tolist()]  # noqa: E731
    return {"programs": t.shape[0], "sms": int(timeline[:, 4].unique().numel()),
            "span_us": round(float(t[:, 3].max() - t0) / 1e3, 2),
            "start_after_first_us[p10,p50,p90]": phase(t[:, 0] - t0),
            "end_before_last_us[p10,p50,p90]": phase(t[:, 3].max() - t[:, 3]),
            "queries_us[p10,p50,p90]": phase(t[:, 1] - t[:, 0]),
            "loop_us[p10,p50,p90]": phase(t[:, 2] - t[:, 1]),
            "final_merge_us[p10,p50,p90]": phase(t[:, 3] - t[:, 2])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", required=True, metavar="decode:BATCHxHISTORY")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    timed = load_timed()
    from sglang_hybrid.kernels import indexer_topk

    results = {"device": torch.cuda.get_device_name(), "cases": []}
    for spec in args.case:
        kind, reqs, length = parse_case(spec)
        if kind != "decode":
            raise SystemExit(f"indexer_timeline times decode cases, not {spec}")
        g = torch.Generator(device="cuda").manual_seed(reqs * 1_000_003 + length)
        k, table = paged_history(reqs, length, D, g)
        q = torch.randn(reqs, HI, D, device="cuda", generator=g, dtype=torch.bfloat16)
        w = torch.randn(reqs, HI, device="cuda", generator=g)
        row_req = torch.arange(reqs, device="cuda", dtype=torch.int32)
        row_len = torch.full((reqs,), length, device="cuda", dtype=torch.int32)
        timed.TIMELINE = torch.zeros(1 << 16, 5, dtype=torch.int64, device="cuda")
        case = {"case": spec}
        for _ in range(5):  # warm: compiled, caches as in a steady decode step
            got = timed.indexer_topk(q, w, k, table, row_req, row_len, TOPK)
        torch.cuda.synchronize()
        case["same_as_plain"] = bool(torch.equal(got, indexer_topk.indexer_topk(q, w, k, table, row_req, row_len, TOPK)))
        timeline = timed.TIMELINE[timed.TIMELINE[:, 0] > 0].cpu()  # the last call's
        # What the timer reads cost: the whole indexer with and without them (CUDA-graph medians).
        for name, module in (("plain", indexer_topk), ("timed", timed)):
            case[f"indexer_ms[{name}]"] = do_bench_cudagraph(
                lambda m=module: m.indexer_topk(q, w, k, table, row_req, row_len, TOPK), return_mode="median")
        case.update(summary(timeline))
        results["cases"].append(case)
        print(json.dumps(case), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
