"""Kernel tests without a GPU run in Triton's interpreter (fp32/fp16; bf16 is broken there).

The interpreter is chosen when a function is decorated with @triton.jit: this
project's kernels *and* Triton's own library (tl.sort, tl.cdiv, ...) must be defined
in interpreter mode, and gluon's import checks the mode too. conftest therefore calls
`prepare()` before anything imports Triton; kernel modules are imported through
`import_kernels`, and the `interpreter` fixture keeps the mode on while a test
launches them. Elsewhere the variable stays unset, so servers never inherit it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Dtypes a kernel test covers here: the interpreter's, plus bf16 on a GPU.
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
_ENV = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}


@contextlib.contextmanager
def _interpreting():
    saved = {key: os.environ.get(key) for key in _ENV}
    os.environ.update(_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


def prepare() -> None:
    """Define Triton's library, and this project's kernels, in the mode the kernel tests
    launch in (call before any Triton import). The kernels too: a test module that imports
    the golden model (which imports kernel modules for their PyTorch references) may be
    collected before the kernel tests, and a module is defined once per process."""
    with _interpreting():
        import triton.experimental.gluon.language  # noqa: F401
        import triton.language  # noqa: F401

        import sglang_hybrid.kernels
        for module in pkgutil.iter_modules(sglang_hybrid.kernels.__path__):
            importlib.import_module(f"sglang_hybrid.kernels.{module.name}")


def import_kernels(name: str, reload: bool = False):
    """The module with its kernels defined for the interpreter; reload: define them again
    (a module outside this project may have been imported before, in the default mode)."""
    with _interpreting():
        module = importlib.import_module(name)
        return importlib.reload(module) if reload else module


@pytest.fixture
def interpreter(monkeypatch):
    for key, value in _ENV.items():
        monkeypatch.setenv(key, value)


def e4m3_exact_inputs(shape, block: int, g: torch.Generator) -> torch.Tensor:
    """Inputs for FP8 (e4m3) quantizer tests, blocks of `block` along the last dim.

    On a GPU: random floats over six decades (rounding is the hardware's RNE). The
    interpreter's fp32 -> e4m3 conversion does not round to nearest even (it truncates
    and drops the carry into the exponent), so on CPU each block is e4m3 values times a
    power of two, one of them 448: quantizing them needs no rounding, which checks
    everything else bit for bit. Values fit fp16 as well.
    """
    if DEVICE == "cuda":
        return torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])
    codes = torch.randint(0, 0x7F, shape, generator=g, dtype=torch.uint8)  # finite; signs below
    v = codes.view(torch.float8_e4m3fn).float() * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
    v = v.unflatten(-1, (-1, block))
    v[..., 0] = 448.0  # pins the block's scale to the power of two
    k = torch.randint(-10, 5, v.shape[:-1], generator=g).float()
    return (v * torch.exp2(k).unsqueeze(-1)).flatten(-2)
