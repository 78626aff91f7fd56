"""Tensor and context parallelism served on several GPUs, against one GPU (issue 7).

For each layout that the host's GPUs allow, one server of the same checkpoint:

    tp1       one GPU (the reference)
    tp2       --tp-size 2
    cp2       --tp-size 2 --enable-prefill-cp --cp-strategy zigzag --attn-cp-size 2
    cp4       --tp-size 4 ... --attn-cp-size 4
    cp2xtp2   --tp-size 4 ... --attn-cp-size 2   (two CP ranks, each an attention TP group of two)

and on each:

- correctness: greedy continuations of fixed random prompts (short to a few thousand tokens,
  prefilled in several chunks) with every prompt and output token's log-probability and the
  top-2 margin of each output step; against tp1: whether the tokens are identical, the first
  step where they differ and its margin there (a bf16 near-tie, or not), and the largest
  log-probability difference over the positions both share;
- TTFT: one request of each --lengths tokens, one output token (median of --repeats, after
  one untimed request that compiles the shapes);
- per-rank prefill time: the longest request's prefill step under SGLang's profiler, GPU busy
  time per rank (benchmarks/profile_trace.py): the spread across CP ranks.

    python benchmarks/multi_gpu.py --model-path CKPT --out multi_gpu.json [--layouts tp1 cp2 ...]
        [--lengths 32768 65536 131072] [server args...]

Long lengths need the context: pass --context-length (and SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1
beyond the checkpoint's). On a CPU host the layouts run over gloo (a smoke test of this script;
tests/test_context_parallel.py is the CPU correctness test).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_trace  # noqa: E402
from prefix_reuse import first_token, start_server, stop_server  # noqa: E402

CP = ["--enable-prefill-cp", "--cp-strategy", "zigzag"]
LAYOUTS = {
    "tp1": (1, []),
    "tp2": (2, ["--tp-size", "2"]),
    "cp2": (2, ["--tp-size", "2", *CP, "--attn-cp-size", "2"]),
    "cp4": (4, ["--tp-size", "4", *CP, "--attn-cp-size", "4"]),
    "cp2xtp2": (4, ["--tp-size", "4", *CP, "--attn-cp-size", "2"]),
}


def generate(url: str, ids: list[int], new_tokens: int) -> dict:
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, timeout=1800)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    tops = meta["output_top_logprobs"]
    return {"output_ids": r.json()["output_ids"],
            "input_logprobs": [lp for lp, _, _ in meta["input_token_logprobs"][1:]],  # the first has none
            "output_logprobs": [lp for lp, _, _ in meta["output_token_logprobs"]],
            "margins": [top[0][0] - top[1][0] for top in tops]}


def compare(ref: dict, got: dict) -> dict:
    """got against ref (tp1), one prompt."""
    n = min(len(ref["output_ids"]), len(got["output_ids"]))
    first = next((i for i in range(n) if ref["output_ids"][i] != got["output_ids"][i]), None)
    shared_out = n if first is None else first + 1  # the positions up to the first difference share a prefix
    diffs = [abs(a - b) for a, b in zip(ref["input_logprobs"], got["input_logprobs"])]
    diffs += [abs(a - b) for a, b in zip(ref["output_logprobs"][:shared_out], got["output_logprobs"][:shared_out])]
    return {"identical": first is None, "first_difference": first,
            "ref_margin_there": None if first is None else ref["margins"][first],
            "max_abs_logprob_diff": max(diffs) if diffs else 0.0}


def ttft(url: str, ids: list[int]) -> float:
    return first_token(url, ids)[0]


def run_layout(name: str, args, server_args: list[str], prompts, long_prompts, log_dir: str) -> dict:
    ranks, layout_args = LAYOUTS[name]
    log = os.path.join(log_dir, f"{name}_server.log")
    proc = start_server(args.model_path, args.port, [*layout_args, *server_args], log)
    url = f"http://127.0.0.1:{args.port}"
    try:
        out = {"layout": name, "args": layout_args,
               "outputs": [generate(url, ids, args.new_tokens) for ids in prompts]}
        # Per length: an untimed request that compiles its shapes, then the timed ones; all
        # different prompts, so nothing comes from the radix cache.
        out["ttft_s"] = {}
        for first, *timed in long_prompts[:-1]:
            ttft(url, first)
            out["ttft_s"][len(first)] = statistics.median(ttft(url, ids) for ids in timed)
        if args.profile and long_prompts:
            out["prefill_profile"] = profile_trace.profile(url, os.path.join(log_dir, f"profile_{name}"), 1,
                                                           lambda: ttft(url, long_prompts[-1][0]), ranks=ranks)
        return out
    finally:
        stop_server(proc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", nargs="+", default=None, help="default: every layout the GPUs allow")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[5, 77, 600, 3000])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="profile the longest prefill on every rank")
    ap.add_argument("--port", type=int, default=31777)
    args, server_args = ap.parse_known_args()
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    layouts = args.layouts or [n for n, (ranks, _) in LAYOUTS.items() if ranks <= max(gpus, 1)]
    if "tp1" not in layouts:
        layouts = ["tp1", *layouts]
    with open(os.path.join(args.model_path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in args.prompt_lens]
    # Per length, repeats + 1 prompts (the first untimed); one more for the profiled prefill.
    long_prompts = [[[rng.randrange(3, vocab) for _ in range(n)] for _ in range(args.repeats + 1)]
                    for n in args.lengths] + [[[rng.randrange(3, vocab) for _ in range(max(args.lengths))]]]
    log_dir = os.path.dirname(os.path.abspath(args.out))
    results = []
    for name in layouts:
        results.append(run_layout(name, args, server_args, prompts, long_prompts, log_dir))
        ref = results[0]
        results[-1]["against_tp1"] = [compare(a, b) for a, b in zip(ref["outputs"], results[-1]["outputs"])]
        results[-1]["ttft_speedup_over_tp1"] = {n: ref["ttft_s"][n] / t for n, t in results[-1]["ttft_s"].items()}
        print(json.dumps({k: results[-1][k] for k in ("layout", "against_tp1", "ttft_s", "ttft_speedup_over_tp1")}),
              flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpus": gpus, "server_args": server_args, "prompt_lens": args.prompt_lens, "layouts": results},
                  f, indent=1)


if __name__ == "__main__":
    main()
