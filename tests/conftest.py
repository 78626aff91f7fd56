"""Shared fixtures: a preset checkpoint (--preset, tiny by default), its golden model,
and a real SGLang server.

The server is SGLang's own (`sglang-hybrid serve` -> `python -m sglang.launch_server`),
started once per session in a subprocess and killed at the end. On a host without
a GPU it runs the CPU path; tests marked gpu are skipped without CUDA.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import requests
import torch

import triton_interpreter

triton_interpreter.prepare()  # before anything imports Triton

from sglang_hybrid import cpu_support  # noqa: E402

# Without a GPU, SGLang (imported by tests and by the Engine) needs the CPU shims first.
cpu_support.activate()

TIMEOUT_S = 600


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def by_request(step, inputs, initial, lengths, cuts=None):
    """A recurrence (`step(*inputs, state) -> (outputs, final state)`, e.g. the reference
    KDA recurrence or short conv) run over each request of a ragged batch on its own:
    (outputs of all rows, each request's final state, and for each {request: tokens} cut
    in request order the state after that many of its tokens) — what the CP paths must
    reproduce."""
    outs, finals, snapshots, start = [], [], [], 0
    for i, n in enumerate(lengths):
        o, final = step(*(x[start:start + n] for x in inputs), initial[i])
        outs.append(o), finals.append(final)
        if cuts and i in cuts:
            snapshots.append(step(*(x[start:start + cuts[i]] for x in inputs), initial[i])[1])
        start += n
    return torch.cat(outs), torch.stack(finals), torch.stack(snapshots) if snapshots else None


class Server:
    """A running `sglang-hybrid serve` subprocess."""

    # A free port cannot be reserved for another process: until the server binds it,
    # SGLang's own internal ports (ZMQ, torch.distributed) may take it. Then try another.
    PORT_ATTEMPTS = 3

    def __init__(self, model_path: str, log_path: str, extra_args=()):
        self.args = ["--model-path", model_path, "--host", "127.0.0.1", *extra_args]
        self.log_path = log_path
        self.log = open(log_path, "w")
        self._start()

    def _start(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang_hybrid.cli", "serve", *self.args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = TIMEOUT_S) -> "Server":
        deadline = time.time() + timeout
        attempts = 1
        while time.time() < deadline:
            if self.proc.poll() is not None:
                lost_port = f"('127.0.0.1', {self.port}): address already in use" in self.read_log()
                if lost_port and attempts < self.PORT_ATTEMPTS:
                    attempts += 1
                    self._start()
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()[-5000:]}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.read_log()[-5000:]}")

    def read_log(self) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def pytest_addoption(parser):
    parser.addoption("--preset", default="tiny", choices=("tiny", "small"),
                     help="checkpoint preset the end-to-end tests serve (small is for GPU hosts)")


# Server arguments on a GPU host. CUDA graphs stay on (SGLang's default). The end-to-end
# tests serve fp32, so the GPU path is held to the golden model's own precision: these
# random checkpoints have near-flat next-token distributions and discrete choices (MoE
# routing, indexer Top-K) that bf16 rounding flips, so bf16 agrees with fp32 only
# statistically (test_gpu.py checks that). A small chunk size makes the longer prompts
# span several chunked-prefill chunks.
# SGLang 0.5.17 takes the static fraction of the memory free when the server starts: at a
# quarter, the checks' test groups can each run a server on the same GPU at once.
GPU_MEM_FRACTION = 0.25
GPU_SERVER_ARGS = ["--dtype", "float32", "--mem-fraction-static", str(GPU_MEM_FRACTION),
                   "--cuda-graph-max-bs", "32", "--chunked-prefill-size", "128"]
if torch.cuda.is_available():
    # Triton rounds fp32 dot inputs to TF32 by default; IEEE keeps the comparison at fp32.
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


@dataclass(frozen=True)
class Tolerance:
    """How closely served outputs must follow the fp32 golden model.

    logprob: max |served - golden| log-probability of the same token at the same position.
    margin: a served greedy token may differ from the golden argmax only where the golden
        model's own top-1 logit leads the served token's logit by at most this much (a near
        tie that rounding may flip); 0 means the tokens must be identical.
    """

    logprob: float
    margin: float


# CPU serves fp32 with the same math as the golden model: identical tokens (but for the
# indexer's near ties, which GoldenCheck tells apart).
CPU_TOLERANCE = Tolerance(logprob=1e-3, margin=0.0)
# GPU serves fp32 through other kernels (the fused Triton indexer and sparse MLA, cuBLAS,
# SGLang's recurrent KDA): fp32 rounding in a different order, amplified through depth.
GPU_FP32_TOLERANCE = Tolerance(logprob=1e-2, margin=2e-2)


@pytest.fixture(scope="session")
def tolerance() -> Tolerance:
    return GPU_FP32_TOLERANCE if torch.cuda.is_available() else CPU_TOLERANCE


@pytest.fixture(scope="session")
def preset(request) -> str:
    return request.config.getoption("--preset")


@pytest.fixture(scope="session")
def checkpoint(preset, tmp_path_factory) -> str:
    from sglang_hybrid.checkpoints.maker import make_checkpoint

    return make_checkpoint(preset, str(tmp_path_factory.mktemp(preset)), seed=0)


@pytest.fixture(scope="session")
def golden(checkpoint):
    from sglang_hybrid.reference import load

    return load(checkpoint, device="cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(checkpoint)


@pytest.fixture(scope="session")
def context_len(checkpoint) -> int:
    from sglang_hybrid.configs import HybridLinearSparseConfig

    return HybridLinearSparseConfig.from_pretrained(checkpoint).max_position_embeddings


class GoldenCheck:
    """Served greedy continuations against the golden model, under a Tolerance."""

    # Near ties of the golden indexer's Top-K tried one at a time (then all together) when a
    # served token is not the golden argmax.
    MAX_TIES_TRIED = 8

    def __init__(self, golden, tol: Tolerance):
        self.golden, self.tol = golden, tol

    def greedy(self, input_ids: list[int], served: list[int]) -> None:
        if served == self.golden.generate(input_ids, len(served)):
            return
        # Teacher-forced on the served tokens: each must be the golden argmax or a near tie
        # within the margin, either as the golden model computes it or once it keeps the other
        # side of one of its indexer's near ties (reference.model.TopKNearTies: a Top-K decided
        # by less than rounding, which another summation order may flip). A wrong state or KV
        # is not explained so.
        lead, ties = self._lead(input_ids, served)
        if float(lead.max()) <= self.tol.margin:
            return
        tries = [[t] for t in ties[: self.MAX_TIES_TRIED]] + ([ties] if len(ties) > 1 else [])
        if any(float(self._lead(input_ids, served, flips)[0].max()) <= self.tol.margin for flips in tries):
            return
        worst = int((lead > self.tol.margin).int().argmax())
        raise AssertionError(
            f"prompt of {len(input_ids)} tokens: served token {served[worst]} at step {worst} trails the golden "
            f"argmax by {float(lead[worst]):.4g} (tolerance {self.tol.margin}); flipping the golden indexer's "
            f"near ties ({len(ties)}) does not explain it")

    def _lead(self, input_ids, served, flips=()):
        """Per served token, how far the golden top-1 logit leads it (teacher-forced), and the
        golden indexer's near ties on the way."""
        with self.golden.probing_index_ties(flips) as probe:
            logits = self.golden.logits(list(input_ids) + list(served[:-1]))[len(input_ids) - 1 :].float()
        rows = torch.arange(len(served), device=logits.device)
        return logits.max(-1).values - logits[rows, torch.tensor(served, device=logits.device)], probe.ties


@pytest.fixture(scope="session")
def check(golden, tolerance) -> GoldenCheck:
    return GoldenCheck(golden, tolerance)


@pytest.fixture(scope="session")
def server(checkpoint, tmp_path_factory):
    """One SGLang server (`sglang-hybrid serve`) for the session; its log goes to $SGLANG_HYBRID_TEST_LOGS if set."""
    log_dir = os.environ.get("SGLANG_HYBRID_TEST_LOGS") or str(tmp_path_factory.mktemp("logs"))
    os.makedirs(log_dir, exist_ok=True)
    extra = GPU_SERVER_ARGS if torch.cuda.is_available() else []
    srv = Server(checkpoint, os.path.join(log_dir, "server.log"), extra)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()
