"""Compile the project's Triton kernels for an H100/H200 (sm_90) on a machine without a GPU.

Triton's front end, its GPU passes and ptxas all run on the CPU; only loading and
launching need the device. A stand-in driver reports an sm_90 target and every launch
is turned into a compile (JITFunction warmup), so the kernels' own Python wrappers run
on CPU tensors at the shapes the model serves. This catches what the interpreter
cannot: constructs the GPU compiler rejects, and blocks that ask for more shared
memory than an sm_90 block may have. Run in a fresh process without TRITON_INTERPRET
(tests/test_compile_for_sm90.py does); prints one JSON line per case.

    python tests/compile_for_sm90.py [CASE_SUBSTRING] [--shard I/N]
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

assert not os.environ.get("TRITON_INTERPRET"), "compiles for the GPU: run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

SM90_SHARED_BYTES = 232448  # the most shared memory one sm_90 block may opt in to (227 KiB)


class _Sm90Driver:
    """What JITFunction asks of the active driver before a launch, for an sm_90 device."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


_compiled = []


def _compile_instead_of_launch(run):
    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        _compiled.append((self.fn.__name__, kernel))
        return kernel
    return compile_only


def cases():
    """(name, thunk) at the served DSA-like shapes: 64 index heads x 128, Top-K 2048, latent
    512 + rope 64, 128 heads; decode rows one per request, extend rows in the backend's blocks."""
    from sglang_hybrid.kernels import fp8_kv, indexer_topk, mxfp8, sparse_mla
    from sglang_hybrid.layers.sparse_mla_backend import _EXTEND_ROW_BLOCK

    g = torch.Generator().manual_seed(0)
    rows, hist = 8, 4096
    q = torch.randn(rows, 64, 128, generator=g).bfloat16()
    w = torch.randn(rows, 64, generator=g)
    k = torch.randn(hist, 128, generator=g).bfloat16()
    table = torch.arange(hist, dtype=torch.int32).view(1, hist)
    row_req = torch.zeros(rows, dtype=torch.int32)
    row_len = torch.arange(hist - rows + 1, hist + 1, dtype=torch.int32)
    qd, qs = mxfp8.quantize_mxfp8_torch(q.float())
    kd, ks = mxfp8.quantize_mxfp8_torch(k.float())
    out = []
    # Split as on a GPU: into splits of 512 (no shared bar; tiles stored whole, in place), a
    # history twice as long into two splits longer than KP (the shared bar's code; tiles
    # stored whole, in place), and eight times as long into two splits longer than
    # IN_PLACE_KPS x KP (the keys that beat the bar appended, merged as they come).
    long_k, long_ks = torch.cat([k, k]), torch.cat([ks, ks])
    long_kd, long_table = torch.cat([kd, kd]), torch.arange(2 * hist, dtype=torch.int32).view(1, 2 * hist)
    longer = [torch.cat([x] * 8) for x in (k, kd, ks)] + [torch.arange(8 * hist, dtype=torch.int32).view(1, 8 * hist)]
    for block_m, kind in ((1, "decode"), (_EXTEND_ROW_BLOCK, "extend")):
        for (kk, kkd, kks, tab, lens, programs, bar) in ((k, kd, ks, table, row_len, 264, ""),
                                                         (long_k, long_kd, long_ks, long_table, row_len + hist,
                                                          2 * rows // min(block_m, 2), ",shared bar"),
                                                         (*longer, row_len + 7 * hist, 2 * rows // block_m,
                                                          ",shared bar,long splits")):
            out.append((f"indexer_topk[{kind},bf16{bar}]", lambda b=block_m, kk=kk, tab=tab, lens=lens, p=programs:
                        indexer_topk.indexer_topk(q, w, kk, tab, row_req, lens, 2048, block_m=b, programs=p)))
            out.append((f"indexer_topk[{kind},mxfp8{bar}]",
                        lambda b=block_m, kkd=kkd, kks=kks, tab=tab, lens=lens, p=programs: indexer_topk.indexer_topk(
                            qd, w, kkd, tab, row_req, lens, 2048, block_m=b, q_scale=qs, k_scale=kks, programs=p)))
    # One scale a vector (MXFP8 at group = D): the dot takes e4m3 as stored.
    (qt, qts), (kt, kts) = mxfp8.quantize_mxfp8_torch(q.float(), 128), mxfp8.quantize_mxfp8_torch(k.float(), 128)
    for block_m, kind in ((1, "decode"), (_EXTEND_ROW_BLOCK, "extend")):
        out.append((f"indexer_topk[{kind},fp8 a scale a vector]", lambda b=block_m: indexer_topk.indexer_topk(
            qt, w, kt, table, row_req, row_len, 2048, block_m=b, q_scale=qts, k_scale=kts, programs=264)))
    # A head narrower than the e4m3 MMA's K of 32 (the tests' 16) takes the dot in bf16 instead.
    (qn, qns), (kn, kns) = (mxfp8.quantize_mxfp8_torch(x[..., :16].float(), 16) for x in (q, k))
    out.append(("indexer_topk[decode,fp8 a scale a vector,head dim 16]", lambda: indexer_topk.indexer_topk(
        qn, w, kn, table, row_req, row_len, 2048, q_scale=qns, k_scale=kns, programs=264)))
    # One long decode row's splits hand the ordering many chunks: the select's steps read [32, 32] keys.
    keys = indexer_topk.encode_keys_torch(torch.randn(1, 32 * 2048, generator=g), torch.arange(32 * 2048).view(1, -1))
    out.append(("order_keys[32 chunks]", lambda: indexer_topk.order_keys(keys.view(1, 32, -1), 2048)))
    tree = (row_len - rows, torch.full((rows,), 2**rows - 1, dtype=torch.int64))  # verify rows of a draft tree
    out.append(("indexer_topk[tree verify,bf16]", lambda: indexer_topk.indexer_topk(
        q, w, k, table, row_req, row_len, 2048, block_m=_EXTEND_ROW_BLOCK, rows_per_request=rows, tree=tree)))
    qm = torch.randn(rows, 128, 576, generator=g).bfloat16()
    kv = torch.randn(hist, 576, generator=g).bfloat16()
    selected = torch.randint(0, hist, (rows, 2048), generator=g, dtype=torch.int32)
    data, scale = fp8_kv.quantize_kv_fp8_torch(kv[:, :512])
    for programs, split in ((1, ""), (264, ",split")):  # the whole selection per program, or split (an H200's 2 x 132)
        out.append((f"sparse_mla[bf16{split}]", lambda p=programs: sparse_mla.sparse_mla(
            qm, kv, table, row_req, selected, 512, 0.07, programs=p)))
        out.append((f"sparse_mla[fp8{split}]", lambda p=programs: sparse_mla.sparse_mla(
            qm, data, table, row_req, selected, 512, 0.07, kv_scale=scale, kv_rope=kv[:, 512:].contiguous(),
            programs=p)))
    loc = torch.arange(rows, dtype=torch.int64)
    out.append(("quantize_mxfp8", lambda: mxfp8.quantize_mxfp8(q)))
    out.append(("store_mxfp8", lambda: mxfp8.store_mxfp8(k[:rows], loc, kd.clone(), ks.clone())))
    out.append(("store_kv_fp8", lambda: fp8_kv.store_kv_fp8(kv[:rows, :512], loc, data.clone(), scale.clone())))
    # The indexer's pieces as benchmarks/indexer_breakdown.py times them: they call the
    # kernel's device functions, so a change there must keep these compiling.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import indexer_breakdown
    out.append(("indexer_breakdown[scoring]", lambda: indexer_breakdown.scoring_launch(
        q, w, k, table.expand(rows, hist).contiguous(), row_len, 2048, programs=264)()))
    out.append(("indexer_breakdown[scoring,mxfp8]", lambda: indexer_breakdown.scoring_launch(
        qd, w, kd, table.expand(rows, hist).contiguous(), row_len, 2048, programs=264, q_scale=qs, k_scale=ks)()))
    out.append(("indexer_breakdown[merge]", lambda: indexer_breakdown.merge_launch(2048, 264, 2, "cpu")()))
    # benchmarks/indexer_timeline.py's copy of the kernel, with its timer reads (anchored in its source).
    import indexer_timeline
    timed = indexer_timeline.load_timed()
    timed.TIMELINE = torch.zeros(64, 5, dtype=torch.int64)
    out.append(("indexer_timeline[decode,bf16,shared bar]", lambda: timed.indexer_topk(
        q, w, long_k, long_table.expand(rows, -1).contiguous(), torch.arange(rows, dtype=torch.int32), row_len + hist,
        2048, programs=2 * rows)))
    return out


def _loop_copy_wait(ptx: str) -> int | None:
    """N of the first `cp.async.wait_group N` in the kernel's first loop: how many copy groups
    may still be loading when an iteration starts computing (0: the loop waits for all of its
    copies, so none overlaps its compute; sparse_path_timing.md, runs 70-73). None without one."""
    at = ptx.find("Loop Header")
    found = re.search(r"cp\.async\.wait_group\s+(\d+)", ptx[at:]) if at >= 0 else None
    return int(found.group(1)) if found else None


def main() -> None:
    driver.set_active(_Sm90Driver())
    jit.JITFunction.run = _compile_instead_of_launch(jit.JITFunction.run)
    args = sys.argv[1:]
    shard, shards = 0, 1
    if "--shard" in args:
        at = args.index("--shard")
        shard, shards = map(int, args[at + 1].split("/"))
        del args[at:at + 2]
    wanted = args[0] if args else ""
    for i, (name, thunk) in enumerate(cases()):
        if wanted not in name or i % shards != shard:
            continue
        t0, _compiled[:] = time.time(), []
        report = {"case": name}
        try:
            thunk()
            report.update(ok=True, kernels=[
                {"kernel": fn, "shared_bytes": k.metadata.shared, "num_warps": k.metadata.num_warps,
                 "loop_copy_wait": _loop_copy_wait(k.asm["ptx"])} for fn, k in _compiled])
        except Exception as e:  # noqa: BLE001  (reported: the test names the case and the compiler's reason)
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            report.update(ok=False, error=f"{type(cause).__name__}: {cause}"[-3000:])
        report["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
