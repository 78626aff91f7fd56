# Put on PYTHONPATH by sglang_hybrid.cpu_support.activate(): every SGLang process
# spawned on a CPU-only host gets the sgl_kernel stand-in before it imports SGLang.
import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    from sglang_hybrid.cpu_support import install_stub

    install_stub()
