"""Time to first token with and without a cached prefix, through SGLang's real server.

For each of N rounds a fresh random prefix of --prefix tokens is sent with a short
suffix (cold: nothing cached), then the same prefix with another suffix (warm: the
radix cache restores latent KV, index-K and every KDA layer's state and conv window
at the deepest snapshot, and only the rest is prefilled). TTFT is the latency of a
one-token request; its floor is the TTFT of a fresh prompt as short as the suffix
(the server's fixed cost per request, which no cache removes). One untimed round
first compiles the kernels for these shapes. Also reported: the reuse depth SGLang returns (cached_tokens), the
bytes of one state snapshot (all KDA layers) and of one token of latent KV + index-K,
read from the server's own allocation log lines.

With --profile, after the timed rounds one floor request and one warm request are each run
as a profiled scheduler step (SGLang's /start_profile, benchmarks/profile_trace.py): GPU busy
time against the step's span and its host ops' span, launches, and the top kernels, which
says where the floor goes.

    python benchmarks/prefix_reuse.py --model-path CKPT --out result.json [server args...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_trace  # noqa: E402


def start_server(model_path: str, port: int, extra: list[str], log_path: str) -> subprocess.Popen:
    """SGLang's server on `port`, ready. It runs in its own session, so it is stopped here if it
    does not come up, and a SIGTERM to this script (`timeout`) stops it too (stop_server in the
    caller's finally): a server left behind would answer the next script's requests."""
    from sglang_hybrid.cli import launch_server_argv  # SGLang's own launch_server (+ CPU defaults without a GPU)

    url = f"http://127.0.0.1:{port}"
    try:
        requests.get(url + "/health", timeout=5)
        raise RuntimeError(f"port {port} already serves something: stop it, or pass another --port")
    except requests.ConnectionError:
        pass
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    cmd = launch_server_argv(["--model-path", model_path, "--port", str(port), "--host", "127.0.0.1", *extra])
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    return proc
            except requests.RequestException:
                pass
            time.sleep(2)
        raise TimeoutError(f"server not ready; see {log_path}")
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen) -> None:
    """The launcher and its scheduler processes (one per rank) alike."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def first_token(url: str, ids: list[int]) -> tuple[float, int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    t = time.perf_counter()
    r = requests.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t, r.json()["meta_info"]["cached_tokens"]


def allocation_bytes(log: str) -> dict:
    """Snapshot and per-token cache sizes from SGLang's allocation log lines."""
    out = {}
    m = re.search(r"max_mamba_cache_size: (\d+), conv_state size: ([\d.]+)GB, ssm_state size: ([\d.]+)GB", log)
    if m:
        slots, conv, ssm = int(m[1]), float(m[2]), float(m[3])
        out["state_snapshot_bytes"] = (conv + ssm) * 2**30 / slots
    m = re.search(r"KV Cache is allocated\..*#tokens: (\d+), KV size: ([\d.]+) GB", log)
    if m:
        out["kv_bytes_per_token"] = float(m[2]) * 2**30 / int(m[1])
    return out


def prefill_graph_use(log: str) -> dict:
    """How many prefill batches replayed SGLang's prefill CUDA graph (its log line says so)."""
    lines = [line for line in log.splitlines() if "Prefill batch" in line]
    return {"prefill_batches": len(lines), "prefill_batches_in_cuda_graph": sum("cuda graph: True" in line for line in lines)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--prefix", type=int, default=32000)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--port", type=int, default=31555)
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", default=None)
    ap.add_argument("--profile", action="store_true", help="profile one floor and one warm request's prefill step")
    args, server_args = ap.parse_known_args()
    log_path = args.log or args.out.replace(".json", "_server.log")
    proc = start_server(args.model_path, args.port, server_args, log_path)
    url = f"http://127.0.0.1:{args.port}"
    rng = random.Random(0)
    with open(os.path.join(args.model_path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    tokens = lambda n: [rng.randrange(100, min(vocab, 30000)) for _ in range(n)]  # noqa: E731
    try:
        rounds = []
        for _ in range(args.rounds + 1):
            prefix = tokens(args.prefix)
            cold_s, cold_hit = first_token(url, prefix + tokens(args.suffix))
            warm_s, warm_hit = first_token(url, prefix + tokens(args.suffix))
            floor_s, _ = first_token(url, tokens(args.suffix))
            rounds.append({"cold_s": cold_s, "warm_s": warm_s, "floor_s": floor_s, "cold_cached": cold_hit,
                           "warm_cached": warm_hit})
            print(json.dumps(rounds[-1]), flush=True)
        rounds = rounds[1:]  # the first compiled the kernels
        profiles = {}
        if args.profile:
            trace_root = os.path.join(os.path.dirname(os.path.abspath(log_path)), "profile")
            profiles["floor"] = profile_trace.profile(url, os.path.join(trace_root, "floor"), 1,
                                                      lambda: first_token(url, tokens(args.suffix)))
            prefix = tokens(args.prefix)
            first_token(url, prefix + tokens(args.suffix))  # cold, not profiled
            profiles["warm"] = profile_trace.profile(url, os.path.join(trace_root, "warm"), 1,
                                                     lambda: first_token(url, prefix + tokens(args.suffix)))
            print(json.dumps(profiles, indent=1), flush=True)
    finally:
        stop_server(proc)
    cold = statistics.median(r["cold_s"] for r in rounds)
    warm = statistics.median(r["warm_s"] for r in rounds)
    floor = statistics.median(r["floor_s"] for r in rounds)
    result = {"prefix": args.prefix, "suffix": args.suffix, "server_args": server_args, "rounds": rounds,
              "cold_ttft_s": cold, "warm_ttft_s": warm, "floor_ttft_s": floor, "warm_over_cold": warm / cold,
              "floor_over_cold": floor / cold, **({"profiles": profiles} if profiles else {}),
              **allocation_bytes(open(log_path, errors="replace").read()),
              **prefill_graph_use(open(log_path, errors="replace").read())}
    if "state_snapshot_bytes" in result and "kv_bytes_per_token" in result:
        result["snapshot_in_tokens_of_kv"] = result["state_snapshot_bytes"] / result["kv_bytes_per_token"]
    print(json.dumps({k: v for k, v in result.items() if k not in ("rounds", "profiles")}, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
