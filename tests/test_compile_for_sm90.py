"""The Triton kernels compile for sm_90 (H100/H200) at the served shapes, on this machine
without a GPU, and each block fits the shared memory an sm_90 block may have.

The interpreter runs the kernels' logic on CPU but never compiles them; this catches the
rest before a GPU run does: constructs Triton's GPU compiler rejects (seen: an unrolled
constexpr reassignment, a register gather its layout pass asserts on) and blocks that ask
for more than 227 KiB of shared memory (seen: a 4-row extend block of the MXFP8 indexer
at Top-K 2048). tests/compile_for_sm90.py does the compiling in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SM90_SHARED_BYTES = 232448  # 227 KiB, the most one sm_90 block may opt in to


@pytest.fixture(scope="module")
def reports():
    """Every case's report; two shards at once (compiling is single-threaded)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "compile_for_sm90.py")
    shards = [subprocess.Popen([sys.executable, script, "--shard", f"{i}/2"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for i in range(2)]
    out = {}
    for proc in shards:
        stdout, stderr = proc.communicate(timeout=1800)
        assert proc.returncode == 0, stderr[-5000:]
        out.update((r["case"], r) for r in map(json.loads, stdout.splitlines()))
    return out


CASES = [f"indexer_topk[{kind},{dtype}]" for kind in ("decode", "extend") for dtype in ("bf16", "mxfp8")] + [
    "indexer_topk[tree verify,bf16]", "order_keys[32 chunks]", "sparse_mla[bf16]", "sparse_mla[fp8]", "sparse_mla[bf16,split]", "sparse_mla[fp8,split]", "quantize_mxfp8", "store_mxfp8", "store_kv_fp8",
    "indexer_breakdown[scoring]", "indexer_breakdown[scoring,mxfp8]", "indexer_breakdown[merge]",
    "indexer_timeline[decode,bf16,shared bar]"]


@pytest.mark.parametrize("case", CASES)
def test_kernel_compiles_for_sm90_within_shared_memory(reports, case):
    report = reports[case]
    assert report["ok"], report["error"]
    for kernel in report["kernels"]:
        assert kernel["shared_bytes"] <= SM90_SHARED_BYTES, kernel
