"""KDA rollback after a speculative verify, bit for bit.

A verify runs every draft token of a request from its committed state and leaves each
step's state and conv window in SGLang's per-step scratch (MambaPool's intermediate_ssm
and intermediate_conv_window: dense on a CPU and for trees, a sliding view for a chain on
a GPU), the slot itself untouched; after
acceptance SGLang copies the last accepted step's pair into the slot. The slot must then
hold exactly what a server that only ever saw the accepted tokens would hold: the
same request decoded token by token from the same committed state. Checked with
SGLang's real pool, on the CPU backend (layers.kda_backend.TorchKDAAttnBackend) and
the commit SGLang runs on this host (cpu_support.spec_ops on a CPU, SGLang's Triton
gather-scatter on a GPU); for a draft chain and a draft tree.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_hybrid.cpu_support import mamba_pool_on_cpu, spec_ops
from sglang_hybrid.layers.draft_tree import draft_tree_parents
from sglang_hybrid.layers.kda_backend import TorchKDAAttnBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, K, W = 2, 16, 4  # heads, head dim, short-conv width
DRAFT_TOKENS = 4
SLOTS, SPEC_ROWS = 8, 4


def _pool(topk: int = 1):
    from sglang.srt.configs.mamba_utils import KimiLinearCacheParams, KimiLinearStateShape, Mamba2StateDType
    from sglang.srt.mem_cache.memory_pool import MambaPool

    shape = KimiLinearStateShape.create(tp_world_size=1, num_heads=H, head_dim=K, conv_kernel_size=W)
    params = KimiLinearCacheParams(shape=shape, layers=[0],
                                   dtype=Mamba2StateDType(conv=torch.float32, temporal=torch.float32))
    pool = MambaPool.__new__(MambaPool)
    mamba_pool_on_cpu(MambaPool.__init__, pool, size=SLOTS, spec_state_size=SPEC_ROWS, cache_params=params,
                      mamba_layer_ids=[0], device=DEVICE, speculative_num_draft_tokens=DRAFT_TOKENS,
                      speculative_eagle_topk=topk)  # a tree keeps dense per-step conv windows
    return pool


def _layer(g):
    P = H * K
    return SimpleNamespace(layer_id=0, num_v_heads=H, head_k_dim=K, head_v_dim=K,
                           A_log=torch.randn(1, 1, H, 1, generator=g).to(DEVICE),
                           dt_bias=torch.randn(P, generator=g).to(DEVICE),
                           conv_weights=torch.randn(3 * P, W, generator=g).to(DEVICE))


def _backend(pool, slots, tree_links=None):
    """tree_links: SGLang's (first child, next sibling) per request and node, for a tree verify."""
    backend = TorchKDAAttnBackend.__new__(TorchKDAAttnBackend)
    backend.req_to_token_pool = SimpleNamespace(mamba2_layer_cache=pool.mamba2_layer_cache)
    first_child, next_sibling = tree_links or (None, None)
    backend.forward_metadata = SimpleNamespace(mamba_cache_indices=torch.tensor(slots, device=DEVICE),
                                               retrieve_next_token=first_child, retrieve_next_sibling=next_sibling)
    return backend


def _tree_links(parents: list[int]) -> tuple[list[int], list[int]]:
    first_child, next_sibling = [-1] * len(parents), [-1] * len(parents)
    for node in reversed(range(1, len(parents))):  # children in order: the last pushed first
        next_sibling[node], first_child[parents[node]] = first_child[parents[node]], node
    return first_child, next_sibling


def _commit(pool, slots, last_steps):
    caches = pool.get_speculative_mamba2_params_all_layers()
    slots = torch.tensor(slots, device=DEVICE, dtype=torch.int32)
    steps = torch.tensor(last_steps, device=DEVICE, dtype=torch.int32)
    if DEVICE == "cuda":  # what SGLang runs after a verify on a GPU
        from sglang.kernels.ops.mamba.mamba_state_scatter_triton import scatter_mamba_states_after_mtp_verify

        scatter_mamba_states_after_mtp_verify(caches, slots, steps, None, None)
    else:
        spec_ops.scatter_mamba_states_after_verify(None, caches, slots, steps, None, None)


CHAIN = [-1, 0, 1, 2]
TREE = [-1, 0, 0, 1]  # topk 2: nodes 1 and 2 are siblings, 3 a child of 1


@pytest.mark.parametrize("parents, last_steps", [(CHAIN, [0, 2, 3]), (CHAIN, [1, -1, 0]), (TREE, [2, 3, 1])])
def test_rollback_equals_decoding_only_the_accepted_tokens(parents, last_steps):
    """Three requests in one verify, each accepting a different number of draft tokens
    (step -1: a row SGLang skips, e.g. a finished request); the slot after the commit
    equals, bit for bit, the slot after decoding just the accepted tokens. In a tree the
    accepted tokens are the path to the last accepted node (node 2 after the root, not
    its sibling 1; node 3 after 0 and 1)."""
    g = torch.Generator().manual_seed(0)
    layer, slots = _layer(g), [5, 2, 7]
    P, B = H * K, len(slots)
    draft_qkv = torch.randn(B * DRAFT_TOKENS, 3 * P, generator=g).to(DEVICE)
    a = torch.randn(B * DRAFT_TOKENS, H * K, generator=g).to(DEVICE)
    b = torch.randn(B * DRAFT_TOKENS, H, generator=g).to(DEVICE)

    spec, plain = _pool(1 if parents == CHAIN else 2), _pool()
    for pool in (spec, plain):  # the same committed states in both
        cache = pool.mamba2_layer_cache(0)
        gen = torch.Generator().manual_seed(1)
        cache.temporal.copy_(torch.randn(cache.temporal.shape, generator=gen))
        cache.conv[0].copy_(torch.randn(cache.conv[0].shape, generator=gen))
    untouched = [s for s in range(SLOTS) if s not in slots]
    before = spec.mamba2_layer_cache(0).temporal[untouched].clone()

    fb = SimpleNamespace(spec_info=SimpleNamespace(ragged_verify_layout=None, draft_token_num=DRAFT_TOKENS))
    links = None
    if parents != CHAIN:
        first_child, next_sibling = _tree_links(parents)
        links = (torch.tensor([first_child] * B), torch.tensor([next_sibling] * B))
        assert draft_tree_parents(*links).tolist() == [parents] * B
    verify_out = _backend(spec, slots, links)._verify(layer, fb, draft_qkv, a, b)[0]
    assert torch.equal(spec.mamba2_layer_cache(0).temporal[untouched], before)
    _commit(spec, slots, last_steps)

    # Decode each request's accepted tokens one step at a time, from the same state.
    for i, (slot, last) in enumerate(zip(slots, last_steps)):
        path = []
        while last >= 0:
            path, last = [last, *path], parents[last]
        for j in path:
            t = i * DRAFT_TOKENS + j
            out = _backend(plain, [slot]).forward_decode(layer, SimpleNamespace(mamba_track_mask=None),
                                                         draft_qkv[t : t + 1], a[t : t + 1], b[t : t + 1])[0]
            assert torch.equal(out[0], verify_out[t]), f"request {i} step {j}: verify output"
    spec_cache, plain_cache = spec.mamba2_layer_cache(0), plain.mamba2_layer_cache(0)
    assert torch.equal(spec_cache.temporal, plain_cache.temporal)
    assert torch.equal(spec_cache.conv[0], plain_cache.conv[0])
