"""Kernel tests without a GPU run in Triton's interpreter (fp32/fp16; bf16 is broken there).

The interpreter is chosen when a kernel is defined and consulted again at launch, so it is
switched on for the kernel module's import and, through the `interpreter` fixture, for each
test that launches it — and nowhere else (server tests must not inherit it).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ENV = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}


def import_kernels(name: str):
    saved = {key: os.environ.get(key) for key in _ENV}
    os.environ.update(_ENV)
    try:
        return importlib.import_module(name)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


@pytest.fixture
def interpreter(monkeypatch):
    for key, value in _ENV.items():
        monkeypatch.setenv(key, value)
