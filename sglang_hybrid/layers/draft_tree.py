"""SGLang's draft-tree links, decoded. A verify tree comes as, per request and node, the
node's first child and its next sibling (-1 for none; node 0 the root, nodes in SGLang's
flattened order). Tensor ops only, a fixed count of them, so they run on the device and
record in a CUDA graph."""

from __future__ import annotations

import torch


def draft_tree_parents(first_child: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """Each node's parent [bs, n] (-1: the root, which runs on from the committed state)."""
    bs, n = first_child.shape
    node = torch.arange(n, device=first_child.device).expand(bs, n)

    def inverse(link):  # inverse[c] = the node whose link is c (-1: none); column n takes the -1 links
        out = torch.full((bs, n + 1), -1, dtype=torch.long, device=link.device)
        return out.scatter_(1, torch.where(link >= 0, link.long(), n), node)[:, :n]

    first_parent, prev_sibling = inverse(first_child), inverse(next_sibling)
    parent = first_parent
    for _ in range(n - 1):  # a later sibling has its first sibling's parent
        parent = torch.where(first_parent >= 0, first_parent,
                             torch.where(prev_sibling >= 0, parent.gather(1, prev_sibling.clamp(min=0)), -1))
    return parent


def draft_tree_paths(first_child: torch.Tensor, next_sibling: torch.Tensor, depth: int) -> torch.Tensor:
    """Per node, the nodes on its path from the root (itself included) as a bitmask [bs, n]
    int64 (bit j: node j); depth bounds the path's length."""
    parent = draft_tree_parents(first_child, next_sibling)
    own = torch.ones_like(parent) << torch.arange(parent.shape[1], device=parent.device)
    bits = own
    for _ in range(depth - 1):
        bits = own | torch.where(parent >= 0, bits.gather(1, parent.clamp(min=0)), 0)
    return bits
