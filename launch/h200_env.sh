# Source on the air-gapped H200 host, from the project root, before tests or benchmarks:
#   source launch/h200_env.sh
# Installs the shared wheel bundle (../shared/device, carried as .device-bundle) and this
# project, then applies one fix-up: the bundle ships FlashInfer without its JIT sources,
# so FlashInfer's DeepSeek routing kernel (SGLang's first choice for biased grouped top-k)
# cannot build there. Hiding it makes SGLang route with its own Triton router instead.
source .device-bundle/gpu_bootstrap.sh .device-bundle || return 1
python3 - <<'PY'
import importlib.util
import pathlib

init = pathlib.Path(importlib.util.find_spec("flashinfer").submodule_search_locations[0]) / "fused_moe" / "__init__.py"
text = init.read_text()
block = "from .fused_routing_dsv3 import (  # noqa: F401\n    fused_topk_deepseek as fused_topk_deepseek,\n)\n"
if block in text:
    init.write_text(text.replace(block, ""))
    print("h200_env: FlashInfer fused_topk_deepseek hidden (no JIT sources in the bundle)")
PY
