"""Where the fused indexer's time goes, in its own pieces, measured apart (GPU only).

indexer_topk's program is a loop over tiles of positions (load the tile's page-table
entries and index-K rows, one dot with the row's heads, relu, head-weighted sum, key
encoding, compare with the running bar) plus, now and then, a merge of the candidate
buffer into the running Top-KP. This module times each piece with the kernel's own
device functions, so the sum can be held against the whole:

- scoring_ms: the same tile loop, grid and split as indexer_topk's, keeping only a
  running maximum key per lane (no candidate buffer, no merge): the floor of the
  scoring structure as written;
- merge_us: one `_merge_candidates` call (a full candidate buffer merged into a full
  running Top-KP), repeated inside one program, with as many programs as the GPU runs
  at once;
- merges: how many merges the kernel does per program on the case's data, counted by
  replaying its buffer rule in PyTorch over one row's exact scores (split 0 and the
  last split).

Used by sparse_path_timing.py --ablate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from sglang_hybrid.kernels import indexer_topk
from sglang_hybrid.kernels.indexer_topk import _load_queries, _merge_candidates, _tile_keys


@triton.jit
def _scoring_kernel(q_ptr, w_ptr, k_ptr, table_ptr, row_len_ptr, out_ptr, qs_ptr, ks_ptr, stride_qr, stride_qh,
                    stride_wr, stride_k, stride_table, stride_qsr, stride_qsh, stride_ks, H, SPLIT_LEN,
                    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, GROUP: tl.constexpr,
                    DOT_DTYPE: tl.constexpr):
    """indexer_topk's tile loop for one decode row (its own request) and one split, keeping
    the elementwise maximum key of each lane instead of a Top-K."""
    NONE: tl.constexpr = -9223372036854775807 - 1
    row = tl.program_id(0)
    rows = row + tl.arange(0, 1)
    n = tl.load(row_len_ptr + rows).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    q = _load_queries(q_ptr, qs_ptr, rows, rows >= 0, H, stride_qr, stride_qh, stride_qsr, stride_qsh, D, BLOCK_H,
                      GROUP, DOT_DTYPE)
    w = tl.load(w_ptr + row * stride_wr + offs_h[None, :], mask=offs_h[None, :] < H, other=0.0).to(tl.float32)
    lo = tl.program_id(1).to(tl.int64) * SPLIT_LEN
    n_max = tl.minimum(tl.max(n, axis=0), lo + SPLIT_LEN)
    best = tl.full([1, BLOCK_S], NONE, tl.int64)
    for s0 in range(lo, n_max, BLOCK_S):
        key = _tile_keys(s0, n, n_max, row.to(tl.int64), q, w, table_ptr, k_ptr, ks_ptr, stride_table, stride_k,
                         stride_ks, offs_d, n, n, n, NONE, D, 1, BLOCK_H, BLOCK_S, GROUP, DOT_DTYPE, False)
        best = tl.maximum(best, key)
    tl.store(out_ptr + (row * tl.num_programs(1) + tl.program_id(1)) * BLOCK_S + tl.arange(0, BLOCK_S)[None, :], best)


@triton.jit
def _merge_kernel(buf_ptr, REPS, KP: tl.constexpr):
    """REPS merges of a full candidate buffer into a full running Top-KP, in place."""
    NONE: tl.constexpr = -9223372036854775807 - 1
    buf = buf_ptr + tl.program_id(0).to(tl.int64) * 2 * KP + tl.zeros([1, 1], tl.int64)
    held = tl.full([1], KP, tl.int32)
    for _ in range(REPS):
        # The candidates region keeps its keys, so every merge takes a full buffer again (the
        # duplicates this makes change what is kept, not the work).
        held, bar, _ = _merge_candidates(buf, buf, held, tl.full([1], KP, tl.int32), tl.arange(0, 2 * KP), KP,
                                         NONE, KP, True)


def scoring_launch(q, w, k, table, row_len, topk: int, programs: int, block_s: int = 128, num_warps: int = 4,
                   num_stages: int = 3, q_scale=None, k_scale=None):
    """A launch of the tile loop alone at indexer_topk's grid for these decode rows (one per
    request) when it runs `programs` programs; MXFP8 with q_scale and k_scale, as indexer_topk."""
    R, H, Dh = q.shape
    block_s = min(block_s, triton.next_power_of_2(topk))  # as indexer_topk caps its tiles
    split_len = indexer_topk._split_len(table.shape[1], R, programs, block_s)
    splits = triton.cdiv(table.shape[1], split_len)
    out = torch.empty(R, splits, block_s, dtype=torch.int64, device=q.device)
    w = w.float()
    group = Dh // q_scale.shape[-1] if q_scale is not None else 0
    qs, ks = (q_scale, k_scale) if group else (q, k)  # unused placeholders without MXFP8

    def run():
        _scoring_kernel[(R, splits)](q, w, k, table, row_len, out, qs, ks, q.stride(0), q.stride(1), w.stride(0),
                                     k.stride(0), table.stride(0), qs.stride(0), qs.stride(1), ks.stride(0), H,
                                     split_len, D=Dh, BLOCK_H=triton.next_power_of_2(H), BLOCK_S=block_s, GROUP=group,
                                     DOT_DTYPE=tl.bfloat16, num_warps=num_warps, num_stages=num_stages)
    return run


def merge_launch(topk: int, programs: int, reps: int, device, num_warps: int = 4):
    """A launch of `reps` merges in each of `programs` programs, over keys as the kernel makes
    them (random normal scores, distinct positions): how many passes a merge takes depends
    on where the KP-th best key parts from the next, so uniform 64-bit keys would flatter it."""
    kp = triton.next_power_of_2(topk)
    bits = torch.randn(programs, 2 * kp).view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    buf = ((ordered << 32) | (0x7FFFFFFF - torch.randperm(programs * 2 * kp).view(programs, 2 * kp))).to(device)

    def run():
        _merge_kernel[(programs,)](buf, reps, KP=kp, num_warps=num_warps)
    return run


def scoring_ms(q, w, k, table, row_len, topk: int, **options) -> float:
    """The tile loop alone, at indexer_topk's grid (two programs per SM)."""
    programs = 2 * torch.cuda.get_device_properties(q.device).multi_processor_count
    return do_bench_cudagraph(scoring_launch(q, w, k, table, row_len, topk, programs, **options),
                              return_mode="median")


def merge_us(topk: int, num_warps: int = 4, reps: int = 64) -> float:
    """Microseconds per merge, with two programs per SM merging at once."""
    programs = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    return do_bench_cudagraph(merge_launch(topk, programs, reps, "cuda", num_warps),
                              return_mode="median") * 1e3 / reps


def merges_per_program(scores: torch.Tensor, topk: int, split_len: int, block_s: int = 128) -> list[int]:
    """indexer_topk's merge count over one row's scores [history] for split 0 and the last
    split. A split stored in place never merges: at most KP positions, or IN_PLACE_KPS x KP
    where the history is split. In a longer one a tile's keys that beat the running KP-th best
    join the buffer; a merge when the buffer holds more than KP - block_s. Ties are ignored
    (random fp32 scores). The bar the row's splits share (_shared_bar) is not replayed, so
    where the history is split this is an upper bound: the shared bar lets fewer keys in."""
    kp = triton.next_power_of_2(topk)
    if indexer_topk.stores_in_place(split_len, triton.cdiv(scores.numel(), split_len), kp):
        return [0] * len({0, (scores.numel() - 1) // split_len})
    counts = []
    for lo in sorted({0, (scores.numel() - 1) // split_len * split_len}):
        part = scores[lo:lo + split_len]
        best = torch.empty(0, device=scores.device)
        bar, waiting, merges, pending = float("-inf"), 0, 0, []
        for s0 in range(0, part.numel(), block_s):
            tile = part[s0:s0 + block_s]
            new = tile[tile > bar]
            pending.append(new)
            waiting += new.numel()
            if waiting > kp - block_s:
                best = torch.cat([best, *pending]).topk(min(kp, len(best) + waiting)).values
                bar = float(best[-1]) if len(best) >= kp else float("-inf")
                pending, waiting, merges = [], 0, merges + 1
        counts.append(merges + (1 if waiting else 0))
    return counts


def ordering_ms(rows: int, splits: int, width: int, topk: int) -> dict:
    """The ordering stage alone at the kernel's part shape [rows, splits, width], on keys of
    random fp32 scores at ascending positions, as the scoring kernel writes them, with the
    rows' shared histogram where they are split (as indexer_topk hands it over): order_keys
    (Triton) against order_keys_torch (one torch.topk), CUDA-graph medians, and whether they agree."""
    g = torch.Generator(device="cuda").manual_seed(rows * splits)
    positions = torch.arange(splits * width, device="cuda").repeat(rows, 1)
    part = indexer_topk.encode_keys_torch(torch.randn(rows, splits * width, device="cuda", generator=g),
                                          positions).reshape(rows, splits, width)
    seen = indexer_topk.shared_counts_torch(part) if splits > 1 else None
    same = all(torch.equal(a, b) for a, b in zip(indexer_topk.order_keys(part, topk, seen),
                                                   indexer_topk.order_keys_torch(part, topk)))
    return {"rows": rows, "splits": splits, "topk": topk, "keys_per_row": splits * width, "same": same,
            "triton_ms": do_bench_cudagraph(lambda: indexer_topk.order_keys(part, topk, seen), return_mode="median"),
            "torch_ms": do_bench_cudagraph(lambda: indexer_topk.order_keys_torch(part, topk), return_mode="median")}


def main() -> None:
    """The ordering stage at the decode grid's part shapes (splits as indexer_topk picks
    them: one wave of two programs per SM), Top-K 2048 and 256."""
    import argparse
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    programs = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for topk in (2048, 256):
        kp = triton.next_power_of_2(topk)
        for rows, history in ((1, 4096), (1, 32768), (8, 32768), (64, 32768), (1, 131072), (8, 131072),
                              (32, 131072), (64, 131072)):
            split_len = indexer_topk._split_len(history, rows, programs, min(128, kp))
            out.append(dict(history=history, **ordering_ms(rows, triton.cdiv(history, split_len), min(kp, split_len),
                                                           topk)))
            print(json.dumps(out[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "cases": out}, f, indent=1)


if __name__ == "__main__":
    main()
