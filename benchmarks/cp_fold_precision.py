"""What bf16 does to the ordered fold of KDA chunk summaries (S_{j+1} = M_j S_j + E_j),
against the same fold in float64, over a growing number of chunks. CPU, seconds.

Inputs: l2-normalised k, q; v ~ N(0, 1); beta ~ U(0, 1); slow channel decays
g ~ -U(0, 0.02) per token (long memory: the case where errors carry furthest); chunks of
64 tokens; 2 heads of K = V = 32.

    python benchmarks/cp_fold_precision.py
"""

from __future__ import annotations

import torch

from sglang_hybrid.parallel.kda_summary import chunk_summary
from sglang_hybrid.reference.ops import l2norm

H, K, V, CHUNK = 2, 32, 32, 64


def main() -> None:
    g = torch.Generator().manual_seed(0)
    n_chunks = 256
    summaries = []
    for _ in range(n_chunks):
        k = l2norm(torch.randn(CHUNK, H, K, generator=g))
        v = torch.randn(CHUNK, H, V, generator=g)
        decay = -torch.rand(CHUNK, H, K, generator=g) * 0.02
        beta = torch.rand(CHUNK, H, generator=g)
        summaries.append(chunk_summary(k, v, decay, beta))
    print("| chunks (tokens) | fp32 fold: rel. error of the state | bf16 fold: rel. error |")
    print("|---:|---:|---:|")
    states = {torch.float64: torch.zeros(H, K, V, dtype=torch.float64),
              torch.float32: torch.zeros(H, K, V), torch.bfloat16: torch.zeros(H, K, V, dtype=torch.bfloat16)}
    for j, (M, E) in enumerate(summaries, 1):
        for dtype in states:
            states[dtype] = torch.bmm(M.to(dtype), states[dtype]) + E.to(dtype)
        if j & (j - 1) == 0 or j == n_chunks:
            ref = states[torch.float64]
            err = {d: float((states[d].double() - ref).norm() / ref.norm()) for d in (torch.float32, torch.bfloat16)}
            print(f"| {j} ({j * CHUNK}) | {err[torch.float32]:.1e} | {err[torch.bfloat16]:.1e} |")


if __name__ == "__main__":
    main()
