"""What do the quantization tiers do to the model? Measured on real activations, emulated
in the golden model (quantize, then dequantize, with the kernels' references), not yet
through the served kernels.

Three measurements over one prompt on the golden model (fp32):
1. Indexer Top-K: every sparse layer's index queries, head weights and keys are captured
   and the Top-K re-selected with Q/K in BF16 and in MXFP8 (kernels.mxfp8, group 32).
   Overlap |S_quant & S_ref| / K over the rows whose history exceeds K.
2. FP8 latent KV (kernels.fp8_kv, tile 128): each sparse layer is run a second time on
   the same input with its latent cache quantized; relative error of the layer output.
3. End to end: the whole model with MXFP8 index Q/K, with the FP8 latent, and with both,
   against fp32: mean KL(fp32 || quantized) of the next-token distributions and argmax
   agreement over all positions.

    python benchmarks/quantization_accuracy.py --preset small --tokens 4096 \
        --out benchmarks/results/2026-12-03_cpu_quantization_accuracy_small.json
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from sglang_hybrid.checkpoints.maker import make_checkpoint
from sglang_hybrid.kernels.fp8_kv import dequantize_kv_fp8, quantize_kv_fp8_torch
from sglang_hybrid.kernels.mxfp8 import dequantize_mxfp8, quantize_mxfp8_torch
from sglang_hybrid.reference import load
from sglang_hybrid.reference.model import MLACache


def _summary(x: torch.Tensor) -> dict:
    """An overlap's low tail."""
    q = torch.quantile(x.float(), torch.tensor([0.01, 0.05, 0.5]))
    return {"rows": x.numel(), "mean": x.mean().item(), "min": x.min().item(),
            "p1": q[0].item(), "p5": q[1].item(), "median": q[2].item()}


def _error_summary(x: torch.Tensor) -> dict:
    """An error's high tail."""
    q = torch.quantile(x.float(), torch.tensor([0.5, 0.95, 0.99]))
    return {"rows": x.numel(), "mean": x.mean().item(), "median": q[0].item(),
            "p95": q[1].item(), "p99": q[2].item(), "max": x.max().item()}


class _FP8Latents(list):
    """A latent cache list that stores what an FP8 latent cache would give back."""

    tile = 128

    def append(self, latent):
        super().append(dequantize_kv_fp8(*quantize_kv_fp8_torch(latent, self.tile), latent.dtype))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--out")
    args = ap.parse_args()

    golden = load(make_checkpoint(args.preset, f"/tmp/quantization_accuracy_{args.preset}"))
    c, K, G = golden.config, golden.config.index_topk, args.group
    c.index_cache_dtype = "auto"  # the unquantized baseline; MXFP8 is applied below where measured
    _FP8Latents.tile = min(128, c.kv_lora_rank)  # tiny presets have a narrower latent
    mx = lambda t: dequantize_mxfp8(*quantize_mxfp8_torch(t, G), G)  # noqa: E731
    rng = random.Random(0)
    ids = [rng.randrange(3, c.vocab_size) for _ in range(args.tokens)]
    select, mla = golden._index_select, golden._sparse_mla
    mode = {"mxfp8": False, "fp8_kv": False, "measure": False}
    captured, layer_err = [], {}

    def index_select(q, weights, positions, index_keys, layer=""):
        if mode["measure"]:
            captured.append((q, weights, index_keys, positions))
        if mode["mxfp8"]:
            return select(mx(q), weights, positions, mx(index_keys), layer)
        return select(q, weights, positions, index_keys, layer)

    def sparse_mla(i, x, positions, lc):
        if mode["fp8_kv"] and not isinstance(lc.latent, _FP8Latents):
            lc.latent = _FP8Latents(lc.latent)
        out = mla(i, x, positions, lc)
        if mode["measure"]:  # the same layer, same input, FP8 latent
            mode["measure"] = False  # its indexer rows are already captured
            fp8 = mla(i, x, positions, MLACache(_FP8Latents(), [], [])).double()
            mode["measure"] = True
            ref = out.double()
            layer_err.setdefault(i, []).append((fp8 - ref).norm(dim=-1) / ref.norm(dim=-1))
        return out

    golden._index_select, golden._sparse_mla = index_select, sparse_mla
    report = {"preset": args.preset, "tokens": args.tokens, "index_topk": K, "group": G,
              "fp8_tile": _FP8Latents.tile}
    with torch.no_grad():
        mode["measure"] = True
        ref_logits = golden.logits(ids).double()
        mode["measure"] = False
        ref_logp = ref_logits.log_softmax(-1)
        e2e = {}
        for name, flags in {"mxfp8_index": ("mxfp8",), "fp8_kv": ("fp8_kv",), "both": ("mxfp8", "fp8_kv")}.items():
            mode.update(mxfp8="mxfp8" in flags, fp8_kv="fp8_kv" in flags)
            logp = golden.logits(ids).double().log_softmax(-1)
            kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
            e2e[name] = {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
                         "argmax_agreement": (logp.argmax(-1) == ref_logp.argmax(-1)).float().mean().item()}

    overlaps = {"bf16_vs_fp32": [], "mxfp8_vs_fp32": [], "mxfp8_vs_bf16": []}
    for q, w, k, pos in captured:
        rows = pos + 1 > K  # rows with a real choice to make
        sel = {name: select(qq[rows], w[rows], pos[rows], kk)
               for name, (qq, kk) in {"fp32": (q, k), "bf16": (q.bfloat16().float(), k.bfloat16().float()),
                                      "mxfp8": (mx(q), mx(k))}.items()}
        for name in overlaps:
            a, b = name.split("_vs_")
            overlaps[name].append((sel[b][:, :, None] == sel[a][:, None, :]).any(-1).float().mean(-1))
    report["topk_overlap"] = {name: _summary(torch.cat(v)) for name, v in overlaps.items()}
    report["fp8_kv_layer_output_rel_error"] = {str(i): _error_summary(torch.cat(v)) for i, v in layer_err.items()}
    report["end_to_end_vs_fp32"] = e2e
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
