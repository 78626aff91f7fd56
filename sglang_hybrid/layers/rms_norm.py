"""SGLang's RMSNorm, usable at --dtype float32 on a GPU.

sgl-kernel's fused RMSNorm has bf16/fp16 kernels only; fp32 activations (the
golden-precision path the GPU tests serve) take SGLang's own torch path instead.
"""

from __future__ import annotations

import torch

from sglang.srt.layers.layernorm import RMSNorm as _SGLangRMSNorm


class RMSNorm(_SGLangRMSNorm):
    def forward_cuda(self, x: torch.Tensor, residual=None, post_residual_addition=None):
        if x.dtype == torch.float32:
            return self.forward_native(x, residual, post_residual_addition)
        return super().forward_cuda(x, residual, post_residual_addition)
