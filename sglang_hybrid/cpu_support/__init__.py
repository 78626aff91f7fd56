"""What SGLang 0.5.17 needs to run on a machine without a GPU (see CPU_NOTES.md).

PyPI ships sgl-kernel only as a CUDA build, and several SGLang modules import it
at module level, so every SGLang process needs a stand-in `sgl_kernel` before the
first SGLang import. `activate()` installs it in this process and, through
`site/sitecustomize.py` on PYTHONPATH, in every process SGLang spawns. Names are
only looked up at import time; calling any of them raises, so a CPU path that
wrongly reached a CUDA kernel fails loudly instead of computing garbage. The
exceptions are the CPU ops of SGLang's speculative decoding (spec_ops), which
are given in plain Python.

On a host with a GPU, `activate()` does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
# torch.ops.sgl_kernel.<name> lookups that SGLang modules on this plugin's CPU path
# perform at import time (under `if is_cpu():`); each gets a placeholder op that raises.
IMPORT_TIME_OPS = (
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "fused_gdn_gating_cpu",
    "causal_conv1d_update",
)
_placeholder_library = None


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def activate() -> bool:
    """Prepare this process and its future children for SGLang on CPU. Returns True if applied."""
    if gpu_available():
        return False
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    # The CPU path runs in fp32 end to end; SGLang keeps KDA conv windows in bf16 by default.
    os.environ.setdefault("SGLANG_MAMBA_CONV_DTYPE", "float32")
    # The CUDA build of torch brings libnccl, so SGLang would set up NCCL for TP > 1 and stop
    # on the missing device; without it SGLang's groups fall back to gloo on the CPU.
    os.environ.setdefault("SGLANG_NCCL_SO_PATH", "libnccl-not-used-on-cpu.so")
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if SITE_DIR not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([SITE_DIR] + [p for p in paths if p])
    install_stub()
    return True


def bind_tensor_parallel_ranks(tp_size: int) -> None:
    """SGLang on CPU wants each TP rank's cores named (SGLANG_CPU_OMP_THREADS_BIND, 'a-b|c-d')
    when there are more ranks than NUMA nodes: this host's cores split evenly, or shared
    round-robin when there are more ranks than cores."""
    if tp_size <= 1 or "SGLANG_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= tp_size:
        per = len(cores) // tp_size
        groups = [cores[r * per:(r + 1) * per] for r in range(tp_size)]
    else:
        groups = [[cores[r % len(cores)]] for r in range(tp_size)]
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
        f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


class _Missing:
    """Stands for any sgl_kernel name; raises if anything actually uses it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name} was called, but sgl_kernel has no CPU build: "
            "this code path needs a GPU (sglang_hybrid.cpu_support stub)"
        )

    def __repr__(self):
        return f"<sgl_kernel stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        from sglang_hybrid.cpu_support.spec_ops import CPU_OPS

        if self.__name__ == "sgl_kernel" and attr in CPU_OPS:
            return CPU_OPS[attr]
        return _Missing(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+cpu-stub"
        return module

    def exec_module(self, module):
        pass


def install_stub() -> None:
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return
    if "sgl_kernel" in sys.modules and not isinstance(sys.modules["sgl_kernel"], _StubModule):
        raise RuntimeError("the real sgl_kernel was imported before sglang_hybrid.cpu_support.install_stub()")
    # SGLang's AMX fast paths stay off by themselves: they probe
    # torch.ops.sgl_kernel.convert_weight_packed, which is never defined here.
    sys.meta_path.insert(0, _StubFinder())
    _define_placeholder_ops()
    _unpinned_host_memory()


def _define_placeholder_ops() -> None:
    global _placeholder_library
    import torch

    _placeholder_library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in IMPORT_TIME_OPS:
        _placeholder_library.define(f"{name}(Tensor x) -> Tensor")
        _placeholder_library.impl(name, _Missing(f"torch.ops.sgl_kernel.{name}"), "CompositeExplicitAutograd")


def _unpinned_host_memory() -> None:
    """Page-locked host memory needs the CUDA driver, and SGLang's radix-cache snapshot
    path (extra_buffer) pins its index tensors unconditionally; pinning only speeds up
    copies to a GPU, so without one it becomes a no-op."""
    import torch
    from torch.utils._device import _device_constructors

    # torch's device contexts (`with torch.device("meta")`, which transformers' model init
    # uses) know their factories by identity, cached on first use: cache the real
    # torch.tensor, which the wrapper calls, or tensors made in such a context land on the CPU.
    _device_constructors()

    def tensor(*args, pin_memory=False, **kwargs):
        return make_tensor(*args, **kwargs)

    make_tensor = torch.tensor
    torch.tensor = tensor
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


def mamba_pool_on_cpu(original, pool, *args, device: str, **kwargs):
    """SGLang's state pool allocates the speculative-verify scratch (each draft step's state
    and conv window) with device="cuda" written out; on a CPU server those go to the CPU.
    Scoped to the pool's constructor."""
    import torch

    if device != "cpu":
        return original(pool, *args, device=device, **kwargs)
    zeros = torch.zeros

    def zeros_here(*a, **k):
        if k.get("device") == "cuda":
            k["device"] = "cpu"
        return zeros(*a, **k)

    torch.zeros = zeros_here
    try:
        return original(pool, *args, device=device, **kwargs)
    finally:
        torch.zeros = zeros
