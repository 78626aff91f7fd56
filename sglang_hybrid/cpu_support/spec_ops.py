"""SGLang's speculative-decoding bookkeeping ops for a CPU without sgl-kernel's CPU build.

On CPU, SGLang's EAGLE worker imports its bookkeeping ops from `sgl_kernel` (Intel's
CPU build, not on PyPI): the draft's and the accepted tokens' cache slots, the bonus
tokens, the draft tree and the greedy tree verification, and a dense standalone draft's KV
row copies; and SGLang's state commit after verify is a Triton kernel. These are the same
computations as SGLang's own Triton kernels (sglang/kernels/ops/speculative/cache_locs.py and spec_tree.py), one request
at a time in Python: the batches a CPU serves are small. The `sgl_kernel` stand-in
(cpu_support) hands them out under the names SGLang imports.
"""

from __future__ import annotations

import torch

_FULL_MASK = 0  # sglang.srt.speculative.eagle_utils.TreeMaskMode


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len,
                                           topk, num_steps):
    """The slots reserved after each request's sequence, topk * num_steps of them, in order."""
    n = topk * num_steps
    for b, (req, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[b * n:(b + 1) * n] = req_to_token[req, start:start + n]


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Each request's slots at positions [start, end), packed request after request."""
    out = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        out_cache_loc[out:out + end - start] = req_to_token[req, start:end]
        out += end - start


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """The inverse: packed slots written to each request's positions [start, end)."""
    src = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[req, start:end] = out_cache_loc[src:src + end - start]
        src += end - start


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """Each request's last accepted token (accept_lens counts it)."""
    flat = accept_tokens.reshape(-1)
    for b, n in enumerate(accept_lens.tolist()):
        bonus_tokens[b] = flat[accept_stride * b + n - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """The accepted tokens' slots, packed in order (accept_index -1: not accepted)."""
    accepted = [i for i in accept_index.reshape(-1).tolist() if i > -1]
    accept_out_cache_loc[:len(accepted)] = out_cache_loc[accepted]


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrieve_index, retrieve_next_token, retrieve_next_sibling, topk, depth,
                                    draft_token_num, tree_mask_mode):
    """The draft tree of each request (spec_tree.sgl_build_tree_kernel_efficient_triton):
    retrieval links (first child, next sibling), each token's position (prefix length +
    depth) and the tree mask (FULL_MASK: [prefix | tree] columns per row; QLEN_ONLY:
    tree columns only). Node 0 is the verified token; node i > 0 is selected_index[i - 1]."""
    n = draft_token_num
    parents, selected = parent_list.tolist(), selected_index.tolist()
    prefix_sum = 0
    for b, seq_len in enumerate(verified_seq_len.tolist()):
        sel, par = selected[b], parents[b]

        def parent_node(i: int) -> int:
            """The tree node (0 = root) that node i >= 1 hangs from."""
            parent_tb = sel[i - 1] // topk
            if parent_tb == 0:
                return 0
            return next((pp + 1 for pp in range(n - 1) if sel[pp] == par[parent_tb]), -1)

        positions[b * n] = seq_len
        for i in range(n - 1, 0, -1):
            retrieve_index[b, i] = b * n + i
            parent = parent_node(i)
            if parent >= 0:  # prepend i to its parent's children
                if retrieve_next_token[b, parent] != -1:
                    retrieve_next_sibling[b, i] = retrieve_next_token[b, parent]
                retrieve_next_token[b, parent] = i
        retrieve_index[b, 0] = b * n

        for x in range(n):
            if tree_mask_mode == _FULL_MASK:
                row = n * n * b + prefix_sum * n + (seq_len + n) * x + seq_len
            else:
                row = n * n * b + n * x
            tree_mask[row] = True  # the verified token
            tree_mask[row + 1:row + n] = False
            level, node = 0, x
            while node > 0 and level < depth:  # the path from x up to the root
                level += 1
                tree_mask[row + node] = True
                node = parent_node(node)
            positions[b * n + x] = seq_len + level
        prefix_sum += seq_len


def verify_tree_greedy_cpu(*, predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
    """Greedy acceptance down the tree (spec_tree.verify_tree_greedy_kernel_triton): at each
    level the child whose token equals the target's prediction at the last accepted node."""
    num_spec, n = accept_index.shape[1], candidates.shape[1]
    flat_target = target_predict.reshape(-1)
    flat_predicts = predicts.view(-1)
    for b in range(candidates.shape[0]):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, num_spec):
            node = int(retrive_next_token[b, node])
            target = flat_target[last]
            while node != -1 and candidates[b, node] != target:
                node = int(retrive_next_sibling[b, node])
            if node == -1:
                break
            flat_predicts[last] = target
            accepted += 1
            last = int(retrive_index[b, node])
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        flat_predicts[last] = flat_target[last]


def scatter_mamba_states_after_verify(original, mamba_caches, state_indices, last_steps, track_indices,
                                      steps_to_track):
    """After verify, each request's slot takes the state and conv window of its last accepted
    step (and its track slot those of the step that crossed a snapshot interval). SGLang
    does this with Triton; on a CPU, here. Step < 0: nothing to copy for that request."""
    if mamba_caches.temporal.is_cuda:
        return original(mamba_caches, state_indices, last_steps, track_indices, steps_to_track)

    def scatter(slots, steps):
        for i, (slot, step) in enumerate(zip(slots.tolist(), steps.tolist())):
            if step < 0:
                continue
            mamba_caches.temporal[:, slot] = mamba_caches.intermediate_ssm[:, i, step]
            for conv, window in zip(mamba_caches.conv, mamba_caches.intermediate_conv_window):
                conv[:, slot] = window[:, i, step]

    scatter(state_indices, last_steps)
    if track_indices is not None:
        scatter(track_indices, steps_to_track)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """An MHA pool's token rows copied src -> tgt in every layer's K and V buffer
    (cache_move.copy_all_layer_kv_cache_tiled): data_ptrs holds each buffer's address,
    strides its bytes per token. All sources are read before any target is written, as
    in the parallel kernel. A dense standalone draft's pool runs it."""
    import ctypes

    if tgt_loc.numel() == 0:
        return
    rows = int(torch.maximum(tgt_loc.max(), src_loc.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        view = torch.frombuffer((ctypes.c_uint8 * (rows * stride)).from_address(ptr), dtype=torch.uint8)
        view = view.view(rows, stride)
        view[tgt_loc] = view[src_loc]  # advanced indexing: every source read before any write


CPU_OPS = {f.__name__: f for f in (copy_all_layer_kv_cache_cpu, assign_draft_cache_locs_contiguous_cpu,
                                   assign_extend_cache_locs_cpu, assign_req_to_token_pool_cpu, fill_bonus_tokens_cpu,
                                   fill_accept_out_cache_loc_cpu, build_tree_kernel_efficient_cpu,
                                   verify_tree_greedy_cpu)}
