"""Replay a served workload on a server without the radix cache and compare tokens.

tests/test_radix_snapshots.py writes every request of its eviction workload (prompt,
served tokens, reused prefix length) to radix_workload.json when
$SGLANG_HYBRID_TEST_LOGS is set. This sends each prompt again, cold, to a server
started with the same arguments plus --disable-radix-cache, and reports per request
whether the warm (cache-reusing) tokens equal the cold ones, and where they first
differ: a difference only where the prefix was reused points at the cache; the same
tokens cold and warm point at the serving path's own numerics.

    python benchmarks/radix_replay_cold.py --model-path CKPT --workload radix_workload.json --out replay.json [server args...]
"""

from __future__ import annotations

import argparse
import json

import requests

from prefix_reuse import start_server, stop_server


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=31556)
    args, server_args = ap.parse_known_args()
    workload = json.load(open(args.workload))
    proc = start_server(args.model_path, args.port, [*server_args, "--disable-radix-cache"],
                        args.out.replace(".json", "_server.log"))
    report = []
    try:
        for req in workload:
            body = {"input_ids": req["input_ids"], "sampling_params": {
                "max_new_tokens": len(req["output_ids"]), "temperature": 0, "ignore_eos": True}}
            r = requests.post(f"http://127.0.0.1:{args.port}/generate", json=body, timeout=600)
            r.raise_for_status()
            cold = r.json()["output_ids"]
            first_diff = next((i for i, (a, b) in enumerate(zip(cold, req["output_ids"])) if a != b), None)
            report.append({"prompt_len": len(req["input_ids"]), "warm_cached": req["cached_tokens"],
                           "warm_equals_cold": first_diff is None, "first_difference_at": first_diff})
    finally:
        stop_server(proc)
    summary = {"requests": len(report), "warm_equals_cold": sum(r["warm_equals_cold"] for r in report),
               "differ": [r for r in report if not r["warm_equals_cold"]]}
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "requests": report}, f, indent=1)


if __name__ == "__main__":
    main()
