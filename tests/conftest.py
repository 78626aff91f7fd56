"""Shared fixtures: the tiny checkpoint, its golden model, and a real SGLang server.

The server is SGLang's own (`sglang-hybrid serve` -> `python -m sglang.launch_server`),
started once per session in a subprocess and killed at the end. On a host without
a GPU it runs the CPU path; GPU tests start their own servers and are skipped
without CUDA.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
import torch

from sglang_hybrid import cpu_support

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


class Server:
    """A running `sglang-hybrid serve` subprocess."""

    def __init__(self, model_path: str, log_path: str, extra_args=(), env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "sglang_hybrid.cli", "serve", "--model-path", model_path,
               "--host", "127.0.0.1", "--port", str(self.port), *extra_args]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = TIMEOUT_S) -> "Server":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
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


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    from sglang_hybrid.checkpoints.maker import make_checkpoint

    return make_checkpoint("tiny", str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="session")
def golden(tiny_checkpoint):
    from sglang_hybrid.reference import load

    return load(tiny_checkpoint)


@pytest.fixture(scope="session")
def tokenizer(tiny_checkpoint):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="session")
def cpu_server(tiny_checkpoint, tmp_path_factory):
    server = Server(tiny_checkpoint, str(tmp_path_factory.mktemp("logs") / "server.log"))
    try:
        yield server.wait_ready()
    finally:
        server.stop()
