"""How close are the GPU KDA kernels to the exact recurrence in fp32? (H200)

Runs one sequence through SGLang's chunk_kda (what the server uses for prefill),
SGLang's fused_recurrent_kda (token by token), and, when fla-core is importable,
fla's own chunk_kda, all in fp32, and reports each output's and final state's
relative error against the recurrence of sglang_hybrid.reference.ops computed in
fp64. Gates as in tests/test_gpu.py: "mild" (decay ~1e-3 per token) and
"checkpoint" (the checkpoint maker's Mamba-style init).

    python benchmarks/kda_chunk_precision.py
"""

from __future__ import annotations

import json
import math
import os

import torch

from sglang_hybrid.reference import ops


def inputs(T: int, gates: str, H: int = 2, K: int = 32):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, f = (torch.randn(1, T, H, K, device="cuda", generator=g) for _ in range(4))
    beta = torch.rand(1, T, H, device="cuda", generator=g)
    a_hi = math.log(16.0) if gates == "checkpoint" else 0.0
    A_log = torch.rand(H, device="cuda", generator=g) * a_hi
    dt = torch.exp(torch.rand(H * K, device="cuda", generator=g) * math.log(100) + math.log(1e-3))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    f = f * 0.1 if gates == "checkpoint" else f * 0 - 6.0
    return q, k, v, f, beta, A_log, dt_bias


def main() -> None:
    from sglang.kernels.ops.attention.fla.kda import chunk_kda, fused_recurrent_kda

    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception as e:  # fla-core is optional on the GPU host
        print(f"fla-core not importable ({type(e).__name__}: {e}); its column is skipped")
        fla_chunk_kda = None

    rows = []
    for gates in ("mild", "checkpoint"):
        for T in (2, 16, 64, 256):
            q, k, v, f, beta, A_log, dt_bias = inputs(T, gates)
            H, K = q.shape[2], q.shape[3]
            gate = ops.kda_gate(f[0].double(), A_log.double(), dt_bias.double())
            want, final = ops.kda_recurrence(ops.l2norm(q[0].double()) * K**-0.5, ops.l2norm(k[0].double()),
                                             v[0].double(), gate, beta[0].double(),
                                             torch.zeros(H, K, K, device="cuda", dtype=torch.float64))

            def rel(a, b):
                return ((a.double() - b).norm() / b.norm()).item()

            row = {"gates": gates, "T": T}
            g32 = gate.float()
            ref32, fin32 = ops.kda_recurrence(ops.l2norm(q[0]) * K**-0.5, ops.l2norm(k[0]), v[0], g32, beta[0],
                                              torch.zeros(H, K, K, device="cuda"))
            row["reference_fp32"] = (rel(ref32, want), rel(fin32, final))

            state = torch.zeros(2, H, K, K, device="cuda")  # [slot, H, V, K]
            cu = torch.tensor([0, T], device="cuda", dtype=torch.int32)
            out = chunk_kda(q=q, k=k, v=v.clone(), g=f, beta=beta, initial_state=state,
                            initial_state_indices=torch.ones(1, device="cuda", dtype=torch.int32),
                            use_qk_l2norm_in_kernel=True, cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias)
            row["sglang_chunk_kda"] = (rel(out[0], want), rel(state[1].transpose(-1, -2), final))

            state = torch.zeros(1, H, K, K, device="cuda")
            out, fin = fused_recurrent_kda(q=q, k=k, v=v.clone(), g=g32.unsqueeze(0), beta=beta, initial_state=state,
                                           use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
            row["sglang_fused_recurrent_kda"] = (rel(out[0], want), rel(fin[0].transpose(-1, -2), final))

            if fla_chunk_kda is not None:
                out, fin = fla_chunk_kda(q=q, k=k, v=v.clone(), g=g32.unsqueeze(0), beta=beta,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
                row["fla_chunk_kda"] = (rel(out[0], want), rel(fin[0], final))
            rows.append(row)
            print(json.dumps(row))
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "kda_chunk_precision.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
