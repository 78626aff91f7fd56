"""The SGLang DSA indexer baseline (benchmarks/sglang_dsa_indexer.py): its conversion to SGLang's
FP8 index-K page layout, SGLang's own gather out of those pages (Triton, through the interpreter
on the CPU) and its prefill logits chunking on any host; on a GPU, SGLang's DeepGEMM logits and
sgl-kernel Top-K over it, decode and prefill, against the same computation in PyTorch."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import sglang_dsa_indexer as dsa  # noqa: E402
from triton_interpreter import DEVICE, import_kernels, interpreter  # noqa: E402, F401 (fixture)


def _paged(reqs: int, length: int, seed: int = 0, D: int = 128):
    """bf16 keys whose 64-slot pages are scattered over the pool, and the position -> slot table."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(reqs * length // dsa.PAGE, generator=g)
    table = (pages[:, None] * dsa.PAGE + torch.arange(dsa.PAGE)).view(reqs, length).to(torch.int32)
    k = (torch.randn(reqs * length, D, generator=g) * torch.rand(reqs * length, 1, generator=g) * 30).to(torch.bfloat16)
    return k.to(DEVICE), table.to(DEVICE)


def test_pages_hold_fp8_rows_then_their_scales_as_sglang_lays_them_out():
    """DSATokenToKVPool's page: 64 e4m3 rows of 128 bytes, then 64 fp32 scales; a slot's
    row and scale sit at its offset in its page, and dequantize to the key within e4m3's
    rounding (the scale a power of two with amax / scale <= 448)."""
    k, table = _paged(3, 256)
    buf, block_tables = dsa.to_dsa_pages(k, table)
    assert buf.dtype == torch.uint8 and buf.shape == (k.shape[0] // 64, 64 * 132)
    assert torch.equal(block_tables.long() * 64, table[:, ::64].long())
    for slot in (0, 63, 64, 200, k.shape[0] - 1):
        page, at = divmod(slot, 64)
        row = buf[page, at * 128:(at + 1) * 128].contiguous().view(torch.float8_e4m3fn).float()
        scale = buf[page, 64 * 128 + 4 * at:64 * 128 + 4 * at + 4].contiguous().view(torch.float32)
        assert float(torch.log2(scale)) == round(float(torch.log2(scale)))  # a power of two
        assert float(row.abs().max()) <= 448
        torch.testing.assert_close(row * scale, k[slot].float(), rtol=2**-4, atol=float(scale) * 2**-10)
    # Every key: within e4m3's relative rounding, or half its smallest subnormal step (2^-10 of the scale).
    scales = buf[:, 64 * 128:].contiguous().view(torch.float32).reshape(-1, 1)
    err = (dsa.from_dsa_pages(buf) - k.float()).abs()
    assert bool((err <= torch.maximum(k.float().abs() * 2**-4, scales * 2**-10)).all())


def test_tables_whose_pages_are_not_whole_are_refused():
    k, table = _paged(2, 128)
    with pytest.raises(ValueError, match="one page"):
        dsa.to_dsa_pages(k, table.roll(1, dims=1))
    with pytest.raises(ValueError, match="pages of 64"):
        dsa.to_dsa_pages(k[:100], table[:, :100])


def test_quantized_queries_fold_their_scale_into_the_head_weights():
    q = torch.randn(3, 8, 128) * 50
    w = torch.randn(3, 8)
    q8, w8 = dsa.quantize_queries(q, w)
    scale = w8 / w
    err = (q8.float() * scale[..., None] - q).abs()
    assert bool((err <= torch.maximum(q.abs() * 2**-4, scale[..., None] * 2**-10)).all())
    assert float(q8.float().abs().max()) <= 448


@pytest.mark.usefixtures("interpreter")
def test_sglang_gathers_a_requests_fp8_keys_and_scales_out_of_its_pages_in_position_order():
    """The prefill pipeline's first launch is SGLang's own Triton gather (GetKAndS): over the
    converted pages and block table it returns the request's keys by position, each row with
    its scale, exactly the dequantized keys of its slots."""
    # Reloaded: a server test may have imported SGLang's module before, outside the interpreter.
    _get_k_and_s_triton = import_kernels("sglang.kernels.ops.attention.dsa.index_buf_accessor",
                                         reload=True)._get_k_and_s_triton

    k, table = _paged(3, 320, seed=3)
    buf, block_tables = dsa.to_dsa_pages(k, table)
    for r, n in ((0, 320), (2, 130)):  # a whole table; a history ending mid-page
        data, scale = _get_k_and_s_triton(buf, block_tables[r:r + 1], torch.tensor([n], device=DEVICE), n, n,
                                          dsa.PAGE, 128)
        got = data.view(torch.float8_e4m3fn).float() * scale.view(torch.float32)
        assert torch.equal(got, dsa.from_dsa_pages(buf)[table[r, :n].long()])


def test_prefill_logits_chunk_as_sglang_budgets_them():
    """SGLang chunks prefill logits only past 8M of them and past its budget: a fifth of the free
    memory, at most 30% of the card; a chunk is as many rows of fp32 logits as fit it."""
    GB = 10**9
    assert dsa.logits_rows_per_chunk(2000, 2000, 1, 80 * GB) == 2000  # 4M logits: never chunked
    assert dsa.logits_rows_per_chunk(32768, 32768, 75 * GB, 80 * GB) == 32768  # 4.3 GB < 15 GB
    assert dsa.logits_rows_per_chunk(65536, 65536, 75 * GB, 80 * GB) == 15 * GB // (65536 * 4)  # 17.2 GB
    assert dsa.logits_rows_per_chunk(65536, 65536, 130 * GB, 140 * GB) == 65536  # 17.2 GB < 26 GB
    assert dsa.logits_rows_per_chunk(65536, 65536, 75 * GB, 40 * GB) == 12 * GB // (65536 * 4)  # 30% of the card
    assert dsa.logits_rows_per_chunk(8192, 10**9, 75 * GB, 80 * GB) == 3  # 4 GB a row
    assert dsa.logits_rows_per_chunk(8192, 10**11, 75 * GB, 80 * GB) == 1  # never below one row


@pytest.mark.gpu
def test_sglang_logits_and_top_k_match_pytorch_on_the_same_fp8_inputs():
    """SGLang's own launches (DeepGEMM paged MQA logits, sgl-kernel fast_topk_v2) over the
    converted pages: the logits equal the PyTorch sum over the dequantized FP8 inputs within
    the FP8 MMA's accumulation, and the Top-K is that sum's, up to near ties. Hopper's FP8 MMA
    keeps about 14 bits of its running sums (DeepSeek-V3 report, 3.3.2): run 78 saw errors up
    to 1.6e-5 of sum_h |w_h| sum_d |q_hd k_d| (1.0 on a logit of ~500), over 5.6% of them,
    beyond fp32 rounding; a wrong scale or key is off by the logit itself."""
    reqs, length, H, topk = 2, 4096, 64, 2048
    k, table = _paged(reqs, length, seed=1)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(reqs, H, 128, generator=g).to(torch.bfloat16).cuda()
    w = torch.randn(reqs, H, generator=g).cuda()
    row_len = torch.tensor([length, length - 1000], dtype=torch.int32, device="cuda")
    select, logits, (q8, w8, buf) = dsa.pipeline(q, w, k, table, row_len, topk)
    got, picked = logits(), select()
    for r in range(reqs):
        n = int(row_len[r])
        want = dsa.reference_logits(q8[r], w8[r], buf, table[r, :n])
        keys = dsa.from_dsa_pages(buf)[table[r, :n].long()]
        size = (torch.einsum("hd,ld->hl", q8[r].float().abs(), keys.abs()) * w8[r].abs()[:, None]).sum(0)
        assert bool(((got[r, :n] - want).abs() <= 2**-13 * size + 1e-2).all())
        assert float((got[r, :n] - want).abs().max()) < 0.01 * float(want.abs().median())
        best = set(want.topk(topk).indices.tolist())
        assert len(best & set(picked[r].tolist())) >= 0.99 * topk


@pytest.mark.gpu
def test_sglang_prefill_top_k_matches_pytorch_on_the_same_fp8_inputs():
    """SGLang's prefill launches (its gather, DeepGEMM's ragged MQA logits, sgl-kernel's ragged
    Top-K) over one causal request: each row's Top-K is the PyTorch sum's over the positions it
    sees, up to near ties; a row that sees fewer than K positions gets them all, then -1."""
    length, H, topk = 4096, 64, 2048
    k, table = _paged(1, length, seed=4)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(length, H, 128, generator=g).to(torch.bfloat16).cuda()
    w = torch.randn(length, H, generator=g).cuda()
    select, chunk, (q8, w8, buf) = dsa.prefill_pipeline(q, w, k, table, topk)
    assert chunk == length
    picked = select()
    for r in (0, 1, 63, 64, 2047, 2048, 3000, length - 1):
        n = r + 1
        want = dsa.reference_logits(q8[r], w8[r], buf, table[0, :n])
        got = [p for p in picked[r].tolist() if p >= 0]
        assert all(0 <= p < n for p in got) and len(got) == len(set(got)) == min(n, topk)
        assert (picked[r, len(got):] == -1).all()
        best = set(want.topk(min(n, topk)).indices.tolist())
        assert len(best & set(got)) >= 0.99 * len(best)
