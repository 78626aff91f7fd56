"""What a torch-profiler trace of SGLang's server says about its steps (SGLang's /start_profile):
the GPU's busy time per scheduler step against the span of the step, the kernels that take
the most of it, and the GPU time of each kind of CUDA-graph replay. Shared by the
benchmarks that profile a server (speculative_decode.py, prefix_reuse.py)."""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import time

import requests


def profile(url: str, out_dir: str, steps: int, run, ranks: int = 1) -> dict:
    """Profile the server's next `steps` scheduler steps while run() sends their requests. With
    ranks > 1 (a tensor- or context-parallel server: each rank writes its own trace,
    `...-TP-<rank>.trace.json.gz`) the summary of each, by rank."""
    os.makedirs(out_dir, exist_ok=True)
    requests.post(url + "/start_profile", json={"output_dir": out_dir, "num_steps": steps,
                                                "activities": ["CPU", "GPU"]}, timeout=60).raise_for_status()
    run()
    deadline = time.time() + 120  # the traces are written after the last profiled step
    while time.time() < deadline and len(_traces(out_dir)) < ranks:
        time.sleep(1)
    time.sleep(2)
    if ranks == 1:
        return gpu_time_per_step(out_dir, steps)
    return {re.search(r"TP-\d+", path)[0]: summarize(path, steps) for path in _traces(out_dir)}


def _traces(trace_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(trace_dir, "*.trace.json.gz")))


def gpu_time_per_step(trace_dir: str, steps: int) -> dict:
    """summarize() of the newest trace in trace_dir."""
    paths = _traces(trace_dir)
    return summarize(paths[-1], steps) if paths else {"error": f"no trace in {trace_dir}"}


def summarize(path: str, steps: int) -> dict:
    """GPU busy time per scheduler step from a torch-profiler trace: kernel, memcpy and memset
    intervals merged, against the span from the first to the last of them, and the span of
    the host's torch ops (a step whose host span far exceeds its GPU busy time waits on the
    host: eager launches, Python)."""
    with gzip.open(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    host = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    host_span = (max(float(e["ts"]) + float(e["dur"]) for e in host) - min(float(e["ts"]) for e in host)) if host else 0.0
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not gpu:
        return {"steps": steps, "host_ops_span_ms_per_step": host_span / steps / 1e3, "gpu": "no GPU events"}
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu)
    busy, end = 0.0, spans[0][0]
    for a, b in spans:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    per_kernel: dict[str, float] = {}
    for e in gpu:
        per_kernel[e["name"]] = per_kernel.get(e["name"], 0.0) + float(e["dur"])
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    span = end - spans[0][0]
    return {"steps": steps, "gpu_busy_ms_per_step": busy / steps / 1e3, "span_ms_per_step": span / steps / 1e3,
            "host_ops_span_ms_per_step": host_span / steps / 1e3,
            "gpu_busy_fraction": busy / span, "launches_per_step": len(gpu) / steps,
            "graph_replays": graph_replay_gpu_ms(events),
            "top_kernels_ms_per_step": {name[:120]: t / steps / 1e3 for name, t in top}}


# Which CUDA graph a replay is, by the Python frame that launched it (SGLang 0.5.17's names).
_PHASES = (("verify", "run_eagle_verify"), ("draft_extend", "draft_extend"),
           ("draft", "eagle_draft_cuda_graph_runner"), ("decode", "decode_cuda_graph_runner"))


def graph_replay_gpu_ms(events: list) -> dict:
    """GPU time of each kind of CUDA-graph replay (the kernels of one cudaGraphLaunch, summed),
    per replay: the target's decode step, its verify forward, the draft head's extend and its
    later steps. The verify's over the decode's is the verify-step cost, free of host gaps."""
    kernels: dict = {}
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e:
            kernels.setdefault(e["args"].get("correlation"), []).append(float(e["dur"]))
    frames: dict = {}
    for e in events:
        if e.get("cat") == "python_function" and e.get("ph") == "X":
            frames.setdefault(e["tid"], []).append(e)
    out: dict = {}
    for e in events:
        if e.get("cat") != "cuda_runtime" or "GraphLaunch" not in e.get("name", ""):
            continue
        durs = kernels.get(e["args"].get("correlation"))
        if not durs:
            continue
        stack = " ".join(f["name"] for f in frames.get(e["tid"], []) if f["ts"] <= e["ts"] <= f["ts"] + f["dur"])
        phase = next((name for name, frame in _PHASES if frame in stack), "other")
        n, total = out.get(phase, (0, 0.0))
        out[phase] = (n + 1, total + sum(durs))
    return {phase: {"replays": n, "gpu_ms_per_replay": total / n / 1e3} for phase, (n, total) in out.items()}
