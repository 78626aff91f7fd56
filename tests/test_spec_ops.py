"""The CPU stand-ins for SGLang's speculative-decoding ops (cpu_support.spec_ops) against
SGLang's own Triton kernels for them (sglang/kernels/ops/speculative), run in Triton's
interpreter: draft trees (chain and topk > 1) from the EAGLE worker's own selection code,
then greedy verification of random target predictions down those trees."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import import_kernels, interpreter  # noqa: F401 (fixture)

from sglang_hybrid.cpu_support import spec_ops

pytestmark = pytest.mark.usefixtures("interpreter")


def _draft_tree(bs, topk, steps, vocab, g):
    """(parent_list, top_scores_index, draft_tokens) as EagleWorkerV2.draft_forward builds them."""
    from sglang.srt.speculative import spec_utils
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    later = getattr(spec_utils._select_top_k_tokens_later, "_torchdynamo_orig_callable",
                    spec_utils._select_top_k_tokens_later)
    scores, lists = None, ([], [], [])
    rows = bs
    for i in range(steps):
        p = torch.rand(rows, vocab, generator=g).softmax(-1)
        topk_p, topk_index = p.topk(topk, dim=-1)
        if i == 0:
            _, _, scores, info = spec_utils._select_top_k_tokens_first(topk_p, topk_index, None, topk)
        else:
            _, _, scores, info = later(i, topk_p, topk_index, None, scores, topk)
        for lst, x in zip(lists, info):
            lst.append(x)
        rows = bs * topk
    return organize_draft_results(*lists, num_draft_token=topk * steps + 1)  # at most the candidates


@pytest.mark.parametrize("bs, topk, steps, mode", [(2, 1, 3, 1), (3, 2, 3, 0), (2, 4, 2, 1), (1, 2, 4, 0),
                                                    (2, 1, 3, 0), (2, 3, 4, 0)])
def test_tree_build_and_greedy_verify_match_sglang_triton(bs, topk, steps, mode):
    spec_tree = import_kernels("sglang.kernels.ops.speculative.spec_tree", reload=True)
    g = torch.Generator().manual_seed(bs * 100 + topk * 10 + steps)
    parent_list, selected, draft_tokens = _draft_tree(bs, topk, steps, 50, g)
    n = selected.shape[1] + 1
    seq_lens = torch.randint(3, 9, (bs,), generator=g)

    def build(fn_or_kernel):
        mask_len = n * n * bs + (int(seq_lens.sum()) * n if mode == 0 else 0)
        out = dict(tree_mask=torch.ones(mask_len, dtype=torch.bool), positions=torch.empty(bs * n, dtype=torch.long),
                   retrieve=torch.full((3, bs, n), -1, dtype=torch.long))
        args = (parent_list, selected, seq_lens, out["tree_mask"], out["positions"], *out["retrieve"])
        if fn_or_kernel is None:
            spec_ops.build_tree_kernel_efficient_cpu(*args, topk, steps, n, mode)
        else:
            spec_tree.sgl_build_tree_kernel_efficient_triton[(bs,)](
                args[0], args[1], args[2], torch.cumsum(seq_lens, 0) - seq_lens, *args[3:],
                topk=topk, depth=steps, draft_token_num=n, tree_mask_mode=mode, batch_size=bs,
                parent_list_stride=parent_list.stride(0) if parent_list.dim() > 1 else parent_list.shape[0],
                selected_index_stride=selected.stride(0))
        return out

    ours, theirs = build(None), build("triton")
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key

    retrieve_index, next_token, next_sibling = ours["retrieve"]
    if mode == 0:  # FULL_MASK: each node's row [seq_len + n] says which draft nodes it attends
        from sglang_hybrid.layers.draft_tree import draft_tree_paths

        paths = draft_tree_paths(next_token, next_sibling, steps + 1)
        at = 0
        for b in range(bs):
            width = int(seq_lens[b]) + n
            rows = ours["tree_mask"][at:at + n * width].view(n, width)[:, int(seq_lens[b]):]
            at += n * width
            expected = (rows.long() << torch.arange(n)).sum(1)
            assert torch.equal(paths[b], expected), f"request {b}"
    candidates = torch.cat([torch.randint(0, 50, (bs, 1), generator=g), draft_tokens], dim=1)
    for trial in range(4):  # targets that agree with the drafts more or less often
        agree = torch.rand(bs, n, generator=g) < trial / 3
        target = torch.where(agree, candidates.roll(-1, dims=1), torch.randint(0, 50, (bs, n), generator=g))

        def verify(triton):
            out = dict(predicts=torch.full((bs * n,), -1, dtype=torch.int32),
                       accept_index=torch.full((bs, steps + 1), -1, dtype=torch.int32),
                       accept_token_num=torch.zeros(bs, dtype=torch.int32))
            kw = dict(candidates=candidates, retrive_index=retrieve_index, retrive_next_token=next_token,
                      retrive_next_sibling=next_sibling, target_predict=target)
            if triton:
                spec_tree.verify_tree_greedy_kernel_triton[(bs,)](
                    out["predicts"], out["accept_index"], out["accept_token_num"], candidates, retrieve_index,
                    next_token, next_sibling, target, batch_size=bs, num_speculative_tokens=steps + 1,
                    num_draft_tokens=n)
            else:
                spec_ops.verify_tree_greedy_cpu(**out, **kw)
            return out

        ours_v, theirs_v = verify(False), verify(True)
        for key in ours_v:
            assert torch.equal(ours_v[key], theirs_v[key]), (trial, key)


def test_cache_slot_ops():
    req_to_token = torch.arange(40).reshape(4, 10) + 100
    reqs, start, end = torch.tensor([2, 0]), torch.tensor([3, 5]), torch.tensor([6, 7])
    out = torch.zeros(5, dtype=torch.long)
    spec_ops.assign_extend_cache_locs_cpu(reqs, req_to_token, start, end, out, 10)
    assert out.tolist() == [123, 124, 125, 105, 106]
    back = req_to_token.clone()
    spec_ops.assign_req_to_token_pool_cpu(reqs, back, start, end, out + 1000, 10)
    assert back[2, 3:6].tolist() == [1123, 1124, 1125] and back[0, 5:7].tolist() == [1105, 1106]
    draft = torch.zeros(2 * 3, dtype=torch.long)
    spec_ops.assign_draft_cache_locs_contiguous_cpu(reqs, req_to_token, torch.tensor([4, 1]), draft, 10, 1, 3)
    assert draft.tolist() == [124, 125, 126, 101, 102, 103]
    bonus = torch.zeros(2, dtype=torch.long)
    spec_ops.fill_bonus_tokens_cpu(torch.tensor([[7, 8, 9], [4, 5, 6]]), torch.tensor([2, 3]), bonus, 3)
    assert bonus.tolist() == [8, 6]
    accepted = torch.zeros(4, dtype=torch.long)
    spec_ops.fill_accept_out_cache_loc_cpu(torch.tensor([[0, 2, -1], [3, -1, -1]]), torch.arange(6) + 50, accepted)
    assert accepted[:3].tolist() == [50, 52, 53]


def test_kv_row_copy_matches_sglang_native_move():
    """copy_all_layer_kv_cache_cpu (raw buffer addresses and byte strides, as SGLang's MHA pool
    passes them) against SGLang's move_kv_cache_native on the same buffers, with a target
    that is also a source: every source is read before any target is written."""
    from sglang.srt.mem_cache.memory_pool import move_kv_cache_native

    g = torch.Generator().manual_seed(0)
    k = [torch.randn(12, 2, 8, generator=g) for _ in range(3)]
    v = [torch.randn(12, 2, 4, generator=g).half() for _ in range(3)]
    tgt, src = torch.tensor([5, 9, 2, 7]), torch.tensor([2, 3, 11, 5])
    want_k, want_v = [t.clone() for t in k], [t.clone() for t in v]
    move_kv_cache_native(want_k, want_v, tgt, src)
    buffers = k + v
    spec_ops.copy_all_layer_kv_cache_cpu(torch.tensor([t.data_ptr() for t in buffers]),
                                         torch.tensor([t[0].nbytes for t in buffers]), tgt, src)
    for got, want in zip(buffers, want_k + want_v):
        assert torch.equal(got, want)
