"""How much does quantizing the indexer change its Top-K? Measured on real activations.

Runs the golden model (fp32) over a prompt, captures every sparse layer's index queries,
head weights and index keys, and re-selects the Top-K with the queries and keys in
BF16 and in MXFP8 (kernels.mxfp8, group 32 by default). Reports, per layer and over all
rows whose history exceeds K, the overlap |S_quant & S_ref| / K against the fp32
selection and MXFP8 against BF16 (the tier it replaces).

    python benchmarks/topk_overlap.py --preset small --tokens 1024 --out benchmarks/results/topk_overlap_small.json
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from sglang_hybrid.checkpoints.maker import make_checkpoint
from sglang_hybrid.kernels.mxfp8 import dequantize_mxfp8, quantize_mxfp8_torch
from sglang_hybrid.reference import load, ops


def _overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, the fraction of a's selection that b also selected (rows of full K)."""
    hits = (a[:, :, None] == b[:, None, :]).any(-1).float()
    return hits.mean(-1)


def _summary(x: torch.Tensor) -> dict:
    q = torch.quantile(x, torch.tensor([0.01, 0.05, 0.5]))
    return {"rows": x.numel(), "mean": x.mean().item(), "min": x.min().item(),
            "p1": q[0].item(), "p5": q[1].item(), "median": q[2].item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--out")
    args = ap.parse_args()

    golden = load(make_checkpoint(args.preset, f"/tmp/topk_overlap_{args.preset}"))
    captured = []
    select = golden._index_select

    def capture(p, x, q_latent, positions, index_keys):
        c, w = golden.config, golden.w
        T, Hi, D = x.shape[0], c.index_n_heads, c.index_head_dim
        q = golden._index_rotate((q_latent @ w[p + "indexer.wq_b.weight"].T).reshape(T, Hi, D), positions)
        weights = (x @ w[p + "indexer.weights_proj.weight"].T) * (Hi**-0.5 * D**-0.5)
        captured.append((p, q, weights, index_keys, positions))
        return select(p, x, q_latent, positions, index_keys)

    golden._index_select = capture
    rng = random.Random(0)
    ids = [rng.randrange(3, golden.config.vocab_size) for _ in range(args.tokens)]
    with torch.no_grad():
        golden.logits(ids)

    K, G = golden.config.index_topk, args.group
    mx = lambda t: dequantize_mxfp8(*quantize_mxfp8_torch(t, G), G)  # noqa: E731
    report = {"preset": args.preset, "tokens": args.tokens, "index_topk": K, "group": G, "layers": {}}
    totals = {"bf16_vs_fp32": [], "mxfp8_vs_fp32": [], "mxfp8_vs_bf16": []}
    for p, q, w, k, pos in captured:
        rows = pos + 1 > K  # rows with a real choice to make
        sel = {}
        for name, (qq, kk) in {"fp32": (q, k), "bf16": (q.bfloat16().float(), k.bfloat16().float()),
                               "mxfp8": (mx(q), mx(k))}.items():
            sel[name] = ops.topk_positions(ops.indexer_scores(qq[rows], w[rows], kk, pos[rows]), K)
        layer = {}
        for name in totals:
            a, b = name.split("_vs_")
            o = _overlap(sel[b], sel[a])
            totals[name].append(o)
            layer[name] = _summary(o)
        report["layers"][p.split(".")[2]] = layer
    report["all"] = {name: _summary(torch.cat(v)) for name, v in totals.items()}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
