"""What context-parallel prefill costs a KDA layer, measured on one GPU, and the TTFT it implies.

Issue 4, item 6. One request of T tokens in {32K, 64K, 128K}; W ranks in {2, 4, 8}; the
bench preset's KDA layer (32 heads x 128, bf16). Zigzag: each rank holds two chunks of
L = T / (2W) tokens. Everything is fla-core's Triton (the GPU path reuses fla's KDA
context parallelism, cp_prefill.md); parallel.kda_cp is its PyTorch reference.

- plain: `chunk_kda` over all T tokens: the layer's prefill on one GPU, no CP.
- local: what one rank computes: `chunk_kda` over its two chunks (two sequences) from
  their initial states, the intra-chunk work (w, u, gated k) included.
- summary: `chunk_cp_fwd_h` over one chunk: its affine map h -> M h + h_local as [H, K,
  V + K] fp32, from the w, u, gated k that `local` computes anyway. Two per rank.
- fold: `chunk_cp_merge` over the 2W - 1 summaries before the last chunk (the longest
  chain: the back chunk of rank 0), TF32x3 in fp32.
- all-gather: 2 summaries per rank, 2 x H x K x (V + K) x 4 bytes, at an NVLink bandwidth
  given on the command line (this host has one GPU; nothing is sent).
- served_*: what the served CP path (parallel.kda_cp through layers.kda_backend.cp_kernels)
  runs for a rank's two chunks, each kernel one call over both, from the fp32 activations it
  holds: `served_chunk_ms` their outputs and final states from their true initial states
  (SGLang's chunk_kda on bf16 inputs, the bf16 serving path), `served_summary_ms` their
  summaries (fla's chunk_kda_fwd_intra + chunk_cp_fwd_h, kda_backend.chunked_summary),
  `served_fused_summary_ms` the summaries of the fp32 serving path (one fused-recurrence run
  on [v | 0] from [0 | I], kda_summary.summary_by_recurrence). `served_plain_ms` is the
  served layer without CP: the same chunk_kda call over all T tokens; the served layer's
  speedup is taken against it, not against fla's `plain` (two different kernels).
  --served-only skips fla's pieces and their ~200 s of compiling and autotuning (and with
  them the fold, 0.03-0.12 ms in run 61, left out of its served layer).

Model per KDA layer: t_cp(W) = local(W) + 2 summary(W) + fold(W) + all_gather(W), speedup
= plain / t_cp. For the whole model's TTFT the other layers' prefill (sparse MLA, MoE,
projections) is taken as dividing by W (zigzag evens the indexer's work exactly, attention
nearly: cp_partition_work.py) plus the all-gather of index-K and latent KV for the sparse
layers; their single-GPU time is an input (--other-ms-per-token), not measured here.

Before timing, a check that fla's pieces are used as intended: the state after two halves,
folded from their summaries, equals `chunk_kda`'s final state over the whole sequence, and
the second half's outputs from that state equal the one-pass outputs (fp32 relative error).

    python benchmarks/cp_prefill_cost.py --out $OUT/cp_prefill_cost.json [--lengths 32768 65536 131072]
        [--ranks 2 4 8] [--nvlink-GBps 450] [--served-only]

Needs fla-core 0.6.0 on the GPU host, as serving does (a dependency): `pip download fla-core==0.6.0
--no-deps -d .device-bundle` before the call (the bootstrap installs every wheel in the bundle).
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

H, K, V = 32, 128, 128  # the bench preset's KDA layer
KDA_LAYERS, SPARSE_LAYERS = 20, 7  # of the bench preset's 27
SUMMARY_BYTES_PER_RANK = 2 * H * K * (V + K) * 4  # a rank's two chunk summaries [H, K, V + K], fp32
SPARSE_BYTES_PER_TOKEN = 128 + 128 // 32 + 576 * 2  # MXFP8 index-K + its scales, bf16 latent KV (per sparse layer)


def inputs(T: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    q = torch.nn.functional.normalize(randn(1, T, H, K), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(randn(1, T, H, K), dim=-1).bfloat16()
    v = randn(1, T, H, V).bfloat16()
    gate = torch.nn.functional.logsigmoid(randn(1, T, H, K) + 4.0)  # slow decays: the state carries far
    beta = torch.sigmoid(randn(1, T, H)).bfloat16()
    return q, k, v, gate, beta


def kda(q, k, v, gate, beta, cu=None, h0=None):
    from fla.ops.kda import chunk_kda
    return chunk_kda(q, k, v, gate, beta, scale=K ** -0.5, initial_state=h0, output_final_state=True,
                     cu_seqlens=cu)


def summaries(q, k, v, gate, beta, cu):
    """[segments, H, K, V + K] fp32 affine summaries of each segment of cu (fla's layout:
    h_local in the first V columns, M in the last K)."""
    from fla.ops.cp.chunk_fwd import chunk_cp_fwd_h
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd
    from fla.ops.utils.index import prepare_chunk_indices

    out = chunk_kda_fwd(q=q, k=k, v=v, g=gate, beta=beta, scale=K ** -0.5, initial_state=None,
                        output_final_state=False, cu_seqlens=cu,
                        chunk_indices=prepare_chunk_indices(cu, 64), disable_recompute=True)
    g_cum, w, u, kg = out[2], out[5], out[6], out[8]
    hm = torch.zeros(len(cu) - 1, H, K, V + K, device="cuda", dtype=torch.float32)

    def one(i):
        chunk_cp_fwd_h(k=kg, w=w, u=u, hm=hm[i], gk=g_cum, cu_seqlens=cu[i:i + 2], chunk_size=64)

    for i in range(len(cu) - 1):
        one(i)
    return hm, one


def fold(hm, upto: int):
    """The state entering segment `upto` from a zero state: segments 0 .. upto - 1 composed."""
    from fla.ops.cp.chunk_merge import chunk_cp_merge
    h = torch.zeros(H, K, V, device="cuda", dtype=torch.float32)
    chunk_cp_merge(h=h, ag_hm=hm, num_ranks=upto, rank=upto)
    return h


def check(T: int = 8192) -> dict:
    """Fold of two halves' summaries against the one-pass final state and outputs."""
    q, k, v, gate, beta = inputs(T, seed=1)
    o_full, h_full = kda(q, k, v, gate, beta)
    cu = torch.tensor([0, T // 2, T], device="cuda", dtype=torch.long)
    hm, _ = summaries(q, k, v, gate, beta, cu)
    h_two = fold(hm, 2)
    h_mid = fold(hm, 1)
    half = slice(T // 2, T)
    o_second, _ = kda(q[:, half], k[:, half], v[:, half], gate[:, half], beta[:, half], h0=h_mid[None])

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    return {"tokens": T, "final_state_rel_err": rel(h_two, h_full[0]),
            "second_half_outputs_rel_err": rel(o_second, o_full[:, half])}


def measure(T: int, ranks: list[int], served_only: bool) -> dict:
    case = {"tokens": T, "served_plain_ms": served_plain(T)}
    if served_only:
        return case | {f"W={W}": served(T, T // (2 * W)) for W in ranks}
    q, k, v, gate, beta = inputs(T)
    case["plain_ms"] = do_bench(lambda: kda(q, k, v, gate, beta), return_mode="median")
    for W in ranks:
        L = T // (2 * W)
        mine = [q[:, :2 * L], k[:, :2 * L], v[:, :2 * L], gate[:, :2 * L], beta[:, :2 * L]]
        cu = torch.tensor([0, L, 2 * L], device="cuda", dtype=torch.long)
        h0 = torch.zeros(2, H, K, V, device="cuda", dtype=torch.float32)
        chain = torch.randn(2 * W, H, K, V + K, device="cuda") * 0.01  # values do not change the time
        _, one = summaries(*mine, cu)
        case[f"W={W}"] = {
            "local_ms": do_bench(lambda: kda(*mine, cu=cu, h0=h0), return_mode="median"),
            "summary_ms": do_bench(lambda: one(0), return_mode="median"),
            "fold_ms": do_bench(lambda: fold(chain, 2 * W - 1), return_mode="median"),
            "summary_bytes_per_rank": SUMMARY_BYTES_PER_RANK,
            **served(T, L),
        }
    return case


def served_inputs(T: int, n: int):
    """The first n tokens of inputs(T) as the served CP path holds them: fp32, q scaled."""
    q, k, v, gate, beta = (t[0, :n].float() for t in inputs(T))
    return q * K ** -0.5, k, v, gate, beta


def served_plain(T: int) -> float:
    """The served bf16 prefill of the layer without CP: SGLang's chunk_kda over all T tokens."""
    from sglang_hybrid.layers.kda_backend import chunked_recurrence

    q, k, v, gate, beta = served_inputs(T, T)
    states = torch.zeros(1, H, K, V, device="cuda")
    return do_bench(lambda: chunked_recurrence(q, k, v, gate, beta, states, [0, T]), return_mode="median")


def served(T: int, L: int) -> dict:
    """A rank's two chunks of L tokens through the served path's kernels (see the docstring)."""
    from sglang_hybrid.layers.kda_backend import chunked_recurrence, chunked_summary, fused_recurrence
    from sglang_hybrid.parallel.kda_summary import summary_by_recurrence

    q, k, v, gate, beta = served_inputs(T, 2 * L)
    states, cu = torch.zeros(2, H, K, V, device="cuda"), [0, L, 2 * L]  # a rank's two chunks, one call
    return {"chunk_tokens": L, "served_chunk_ms": do_bench(lambda: chunked_recurrence(q, k, v, gate, beta, states, cu),
                                        return_mode="median"),
            "served_summary_ms": do_bench(lambda: chunked_summary(k, v, gate, beta, cu), return_mode="median"),
            "served_fused_summary_ms": do_bench(lambda: summary_by_recurrence(fused_recurrence, k, v, gate, beta, cu),
                                                rep=20, warmup=1, return_mode="median")}


def model(case: dict, nvlink_gbps: float, other_ms_per_token: float) -> dict:
    """TTFT terms per W (see the module docstring); all times in ms."""
    T, plain = case["tokens"], case.get("plain_ms")
    out = {"W=1": {"kda_layer_ms": plain, "served_kda_layer_ms": case["served_plain_ms"]}}
    if plain is not None:
        out["W=1"]["ttft_ms"] = KDA_LAYERS * plain + other_ms_per_token * T
    for key, r in case.items():
        if not key.startswith("W="):
            continue
        W = int(key[2:])
        gather = (W - 1) * SUMMARY_BYTES_PER_RANK / (nvlink_gbps * 1e6)  # ring all-gather, per rank
        # The layer as served: one call of the served kernels for the rank's two chunks' outputs, one for their
        # summaries, against the served kernel over all T tokens.
        served = r["served_chunk_ms"] + r["served_summary_ms"] + r.get("fold_ms", 0.0) + gather
        out[key] = {"served_kda_layer_ms": served, "served_kda_layer_speedup": case["served_plain_ms"] / served}
        if plain is None:
            continue
        layer = r["local_ms"] + 2 * r["summary_ms"] + r["fold_ms"] + gather
        history = (W - 1) / W * T * SPARSE_BYTES_PER_TOKEN / (nvlink_gbps * 1e6)  # the rest of the history, per sparse layer
        out[key] |= {"kda_layer_ms": layer, "kda_layer_speedup": plain / layer, "kda_allgather_ms": gather,
                    "kda_cp_overhead_ms": 2 * r["summary_ms"] + r["fold_ms"] + gather,
                    "sparse_history_allgather_ms": history,
                    "ttft_ms": KDA_LAYERS * layer + SPARSE_LAYERS * history + other_ms_per_token * T / W}
        out[key]["ttft_speedup"] = out["W=1"]["ttft_ms"] / out[key]["ttft_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--nvlink-GBps", type=float, default=450.0, help="per-direction NVLink bandwidth per GPU")
    ap.add_argument("--other-ms-per-token", type=float, default=0.0,
                    help="single-GPU prefill time per token of everything but the KDA recurrences (0: KDA only)")
    ap.add_argument("--served-only", action="store_true", help="only the served kernels (no fla pieces, no check)")
    args = ap.parse_args()
    results = {"device": torch.cuda.get_device_name(), "shape": dict(heads=H, k=K, v=V),
               "check": None if args.served_only else check(),
               "assumptions": dict(nvlink_GBps=args.nvlink_GBps, other_ms_per_token=args.other_ms_per_token,
                                   kda_layers=KDA_LAYERS, sparse_layers=SPARSE_LAYERS,
                                   sparse_bytes_per_token=SPARSE_BYTES_PER_TOKEN,
                                   overlap="none: communication adds to compute"),
               "cases": []}
    print(json.dumps(results["check"]), flush=True)
    for T in args.lengths:
        case = measure(T, args.ranks, args.served_only)
        case["model"] = model(case, args.nvlink_GBps, args.other_ms_per_token)
        results["cases"].append(case)
        print(json.dumps(case), flush=True)
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
