"""Multi-turn chat with shared system prompts through SGLang's own benchmark client,
against the same server with the radix cache disabled.

Runs `python -m sglang.benchmark.serving` (SGLang's bench_serving) with its
generated-shared-prefix dataset in multi-turn mode on the OpenAI chat endpoint: groups
of conversations share a system prompt, and every turn resends the whole conversation.
Each of two servers (radix cache on, the default; then --disable-radix-cache) gets the
same workload (same seed). Reported per server: the cache hit rate bench_serving
measures (cached prompt tokens / prompt tokens), request and token throughput, TTFT;
and the ratios.

    python benchmarks/multi_turn_cache.py --model-path CKPT --out result.json [server args...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

from prefix_reuse import start_server, stop_server


def bench_env() -> dict:
    """bench_serving imports HF `datasets` at start-up for datasets this run does not use
    (MMMU); the air-gapped GPU host lacks it (pyarrow alone outweighs the device bundle), so
    there the client gets a stand-in whose load_dataset raises."""
    env = dict(os.environ)
    if importlib.util.find_spec("datasets") is None:
        stub = tempfile.mkdtemp(prefix="datasets-stub-")
        with open(os.path.join(stub, "datasets.py"), "w") as f:
            f.write("def load_dataset(*a, **k):\n"
                    "    raise RuntimeError('HF datasets is not installed on this host')\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [stub, env.get("PYTHONPATH")]))
    return env


def bench(args, port: int, out_jsonl: str) -> dict:
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang-oai-chat",
           "--host", "127.0.0.1", "--port", str(port), "--tokenizer", args.model_path,
           "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(args.groups),
           "--gsp-prompts-per-group", str(args.per_group), "--gsp-system-prompt-len", str(args.system_len),
           "--gsp-question-len", str(args.question_len), "--gsp-output-len", str(args.output_len),
           "--gsp-num-turns", str(args.turns), "--num-prompts", str(args.groups * args.per_group),
           "--max-concurrency", str(args.concurrency), "--seed", "0", "--cache-report",
           "--output-file", out_jsonl]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=bench_env())
    print(run.stdout[-3000:], run.stderr[-2000:] if run.returncode else "", flush=True)
    run.check_returncode()
    with open(out_jsonl) as f:
        result = json.loads(f.read().strip().splitlines()[-1])
    hit = re.search(r"Cache hit rate:\s+([\d.]+)%", run.stdout)
    keep = ("completed", "duration", "request_throughput", "output_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_e2e_latency_ms")
    return {"cache_hit_rate": float(hit[1]) / 100 if hit else None, **{k: result.get(k) for k in keep}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--port", type=int, default=31557)
    ap.add_argument("--timeout", type=int, default=600)
    args, server_args = ap.parse_known_args()
    stem = os.path.splitext(args.out)[0]
    results = {}
    for name, extra in (("radix", []), ("no_radix", ["--disable-radix-cache"])):
        proc = start_server(args.model_path, args.port, [*server_args, *extra], f"{stem}_{name}_server.log")
        try:
            results[name] = bench(args, args.port, f"{stem}_{name}.jsonl")
        finally:
            stop_server(proc)
    r, n = results["radix"], results["no_radix"]
    summary = {"workload": {k: getattr(args, k) for k in ("groups", "per_group", "system_len", "question_len",
                                                          "output_len", "turns", "concurrency")},
               "server_args": server_args, **results,
               "throughput_ratio": r["output_throughput"] / n["output_throughput"],
               "mean_ttft_ratio": r["mean_ttft_ms"] / n["mean_ttft_ms"]}
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
