"""Speculative decoding through SGLang's real server: decode speedup against plain decoding by
acceptance and draft length, the cost of one speculative cycle against one decode step, and
the cost of the KDA rollback copy.

Acceptance is set by the checkpoint: `make-checkpoint --near-bigram SCALE` makes target and
draft head one bigram model plus SCALE x their own layers, so a smaller SCALE means a head
that agrees more often (0: always). The acceptance actually reached is measured and reported
(SGLang's accepted / proposed drafts per request), not assumed from SCALE.

Per server, B concurrent requests of --new-tokens greedy tokens from short random prompts;
decode throughput = B x new tokens / wall time (the prompt's prefill is a few ms of it).
Cycle over step = (wall / verifies per request) / (plain decoding's wall / new tokens): one
draft + verify + draft-extend cycle against one plain decode step at the same batch, an upper
bound on the verify forward's own cost over a decode step.

Rollback: after a verify SGLang copies each request's accepted step (state and conv window of
every KDA layer) from the per-step scratch into its slot (its Triton gather-scatter,
`scatter_mamba_states_after_mtp_verify`, which this model uses unchanged on the GPU). Timed at
the --rollback-preset's dims against a device copy of the same bytes.

With --profile, each server then runs --profile-steps scheduler steps (a decode step, or one
draft-verify cycle) at batch 1 under SGLang's torch profiler (/start_profile); from the trace
come the GPU's busy time per step (kernels and copies, overlaps merged) against the wall time
per step, and the kernels that take the most of it: whether a cycle waits on the GPU or on
the host. Each CUDA-graph replay is also timed apart (its kernels' GPU time, by the SGLang
frame that launched it): the verify forward's over plain decoding's decode step is the
verify-step cost, free of host gaps and of the draft's own work.

Each batch size is timed --repeats times and the median run kept (a run is under a second
at these sizes, and one run's wall time moved by up to 2x between configurations that do
the same work, run 37). A server whose start-up was starved by its neighbours' (SGLang sizes
its pools from the memory free while it starts) is started again alone.

The servers start --parallel-starts at a time (each takes --mem-fraction-static of the GPU) and
are then timed one at a time while the others sit idle (give them --sleep-on-idle: an idle scheduler otherwise
polls a CPU core at 100%, and the timed server's launches need the CPU).

    python benchmarks/speculative_decode.py --preset small --out spec.json [server args...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import sys
import time
from types import SimpleNamespace

import requests
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_trace  # noqa: E402
from prefix_reuse import start_server, stop_server  # noqa: E402


def rollback_cost(preset: str, batch_sizes: list[int], draft_tokens: int) -> list[dict]:
    """SGLang's post-verify state copy at the preset's KDA dims (fp32 state, bf16 conv window)."""
    from sglang.kernels.ops.mamba.mamba_state_scatter_triton import scatter_mamba_states_after_mtp_verify
    from sglang.srt.configs.mamba_utils import KimiLinearStateShape

    from sglang_hybrid.checkpoints.presets import preset_config
    from sparse_path_timing import bench  # the project's median timing (Triton's do_bench)

    lac = preset_config(preset)["linear_attn_config"]
    shape = KimiLinearStateShape.create(tp_world_size=1, num_heads=lac["num_heads"], head_dim=lac["head_dim"],
                                        conv_kernel_size=lac["short_conv_kernel_size"])
    layers, rows = len(lac["kda_layers"]), []
    for batch in batch_sizes:
        slots = 2 * batch + 1
        caches = SimpleNamespace(
            temporal=torch.zeros(layers, slots, *shape.temporal, device="cuda"),
            intermediate_ssm=torch.randn(layers, batch, draft_tokens, *shape.temporal, device="cuda"),
            conv=[torch.zeros(layers, slots, *c, device="cuda", dtype=torch.bfloat16) for c in shape.conv],
            intermediate_conv_window=[torch.randn(layers, batch, draft_tokens, *c, device="cuda").bfloat16()
                                      for c in shape.conv])
        slot_ids = torch.randperm(slots, device="cuda")[:batch].int()
        steps = torch.randint(0, draft_tokens, (batch,), device="cuda", dtype=torch.int32)
        ms = bench(lambda: scatter_mamba_states_after_mtp_verify(caches, slot_ids, steps, None, None))
        # One request's accepted step, for every layer, is read once and written once.
        moved = 2 * batch * layers * sum(t[0, 0, 0].numel() * t.element_size()
                                         for t in [caches.intermediate_ssm, *caches.intermediate_conv_window])
        src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_ms = bench(lambda: dst.copy_(src))
        rows.append({"batch": batch, "draft_tokens": draft_tokens, "kda_layers": layers, "ms": ms,
                     "bytes_moved": moved, "copy_same_bytes_ms": copy_ms, "fraction_of_copy_bw": copy_ms / ms})
        print(json.dumps(rows[-1]), flush=True)
        del caches, src, dst
        torch.cuda.empty_cache()
    return rows


def profile_steps(url: str, out_dir: str, steps: int, prompt_len: int) -> dict:
    # enough steps whatever the acceptance
    return profile_trace.profile(url, out_dir, steps, lambda: decode_run(url, 1, steps * 8, prompt_len, seed=12345))


def decode_run(url: str, batch: int, new_tokens: int, prompt_len: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 1900) for _ in range(prompt_len)] for _ in range(batch)]

    def one(ids):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                      "ignore_eos": True}}
        r = requests.post(url + "/generate", json=body, timeout=900)
        r.raise_for_status()
        return r.json()["meta_info"]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        metas = list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    out = {"batch": batch, "wall_s": wall, "tokens_per_s": batch * new_tokens / wall}
    if "spec_verify_ct" in metas[0]:
        proposed = sum(m["spec_proposed_drafts"] for m in metas)
        out.update(verifies=max(m["spec_verify_ct"] for m in metas),
                   accept_rate=sum(m["spec_accepted_drafts"] for m in metas) / max(proposed, 1),
                   tokens_per_verify=batch * new_tokens / sum(m["spec_verify_ct"] for m in metas))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--scales", type=float, nargs="+", default=[0.0, 0.003, 0.02, 0.05])
    ap.add_argument("--logit-scale", type=float, default=1.0,
                    help="every checkpoint's logits x this (same choices, a sharper distribution for trees)")
    ap.add_argument("--steps", type=int, nargs="+", default=[2, 4, 6], help="draft lengths")
    ap.add_argument("--topks", type=int, nargs="+", default=[1], help="branches per draft step (1: a chain; "
                    "a tree needs --page-size 1)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rollback-preset", default="bench")
    ap.add_argument("--rollback-batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--parallel-starts", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per batch size; the median is kept")
    ap.add_argument("--profile", action="store_true", help="also profile --profile-steps steps per server")
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--workdir", default="/tmp/spec-bench")
    ap.add_argument("--port", type=int, default=31700)
    ap.add_argument("--out", required=True)
    args, server_args = ap.parse_known_args()
    from sglang_hybrid.checkpoints.maker import make_checkpoint

    result = {"preset": args.preset, "logit_scale": args.logit_scale, "new_tokens": args.new_tokens,
              "prompt_len": args.prompt_len, "server_args": server_args, "command": " ".join(sys.argv)}
    if torch.cuda.is_available():
        result["rollback"] = rollback_cost(args.rollback_preset, args.rollback_batch_sizes, 4)

    checkpoints = {s: make_checkpoint(args.preset, f"{args.workdir}/scale_{s}", seed=0, near_bigram=s,
                                      logit_scale=args.logit_scale)
                   for s in args.scales}
    # Plain decoding runs the same architecture at the same cost whatever the weights: one baseline.
    configs = [("plain", args.scales[0], 0, 1)] + [
        (f"scale {s} steps {k}" + (f" topk {t}" if t > 1 else ""), s, k, t)
        for t in args.topks for s in args.scales for k in args.steps]
    log_dir = os.path.dirname(os.path.abspath(args.out))

    def launch(i):
        name, scale, steps, topk = configs[i]
        # A tree verifies steps x topk drafts and the root (a chain: steps + 1).
        spec = [] if steps == 0 else ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(steps),
                                      "--speculative-eagle-topk", str(topk),
                                      "--speculative-num-draft-tokens", str(steps * topk + 1)]
        log = os.path.join(log_dir, f"spec_server_{i}.log")
        try:
            return start_server(checkpoints[scale], args.port + i, [*server_args, *spec], log)
        except (RuntimeError, TimeoutError) as e:  # reported; the other configurations still run
            print(f"{name}: {e}", flush=True)
            return None

    # SGLang sizes its pools from the GPU memory free while it starts: a few at a time, so that
    # one server's allocations do not starve another's.
    with concurrent.futures.ThreadPoolExecutor(args.parallel_starts) as pool:
        procs = list(pool.map(launch, range(len(configs))))
    for i in range(len(configs)):  # a start starved by its neighbours, again alone
        if procs[i] is None:
            procs[i] = launch(i)
    rows, profiles = [], []
    try:
        for i, (name, scale, steps, topk) in enumerate(configs):
            if procs[i] is None:
                continue
            url = f"http://127.0.0.1:{args.port + i}"
            for batch in args.batch_sizes:
                decode_run(url, batch, 16, args.prompt_len, seed=-batch)  # compile, set up this batch size
                runs = sorted((decode_run(url, batch, args.new_tokens, args.prompt_len, seed=batch)
                               for _ in range(args.repeats)), key=lambda r: r["wall_s"])
                row = {"config": name, "scale": scale, "steps": steps, "topk": topk, **runs[len(runs) // 2],
                       "walls_s": [r["wall_s"] for r in runs]}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if args.profile:
                trace_dir = os.path.join(log_dir, f"profile_{i}")
                profiles.append({"config": name, **profile_steps(url, trace_dir, args.profile_steps,
                                                                 args.prompt_len)})
                print(json.dumps(profiles[-1]), flush=True)
            stop_server(procs[i])
    finally:
        for p in filter(None, procs):
            stop_server(p)
    plain = {r["batch"]: r for r in rows if r["steps"] == 0}
    for r in rows:
        base = plain.get(r["batch"])
        if base is None:
            continue
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        if r["steps"]:
            r["cycle_over_decode_step"] = (r["wall_s"] / r["verifies"]) / (base["wall_s"] / args.new_tokens)
    result["decode"] = rows
    plain_replay = next((p["graph_replays"].get("decode") for p in profiles if p["config"] == "plain"
                         and "graph_replays" in p), None)
    for p in profiles:
        verify = p.get("graph_replays", {}).get("verify")
        if plain_replay and verify:
            p["verify_over_decode_gpu"] = verify["gpu_ms_per_replay"] / plain_replay["gpu_ms_per_replay"]
            print(f"{p['config']}: verify forward {verify['gpu_ms_per_replay']:.3f} ms GPU = "
                  f"{p['verify_over_decode_gpu']:.2f} x a decode step", flush=True)
    result["profiles"] = profiles
    print(f"{'config':<24}{'batch':>6}{'tok/s':>9}{'speedup':>9}{'accept':>8}{'tok/verify':>11}{'cycle/step':>11}")
    for r in rows:
        print(f"{r['config']:<24}{r['batch']:>6}{r['tokens_per_s']:>9.1f}{r.get('speedup', float('nan')):>9.2f}"
              f"{r.get('accept_rate', float('nan')):>8.2f}{r.get('tokens_per_verify', 1.0):>11.2f}"
              f"{r.get('cycle_over_decode_step', 1.0):>11.2f}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
