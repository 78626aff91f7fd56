"""SGLang's paged KV allocator on a CPU: its slot arithmetic is a Triton kernel, which
needs a GPU. These are the same two allocations in torch (SGLang's own
`alloc_extend_naive`, the one its NPU allocator uses, and the decode rule beside it);
plugin.py routes PagedTokenToKVPoolAllocator to them when the pool lives on the CPU, and
the last-slot lookup before a speculative step's allocation to SGLang's torch rule.
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.allocator import alloc_extend_naive
from sglang.srt.utils import get_num_new_pages


def alloc_extend(original, self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                 num_new_pages=None):
    if str(self.device) != "cpu":
        return original(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                        num_new_pages)
    if self.need_sort and extend_num_tokens // self.page_size + len(prefix_lens) + 1 > len(self.free_pages):
        self.merge_and_sort_free()
    if num_new_pages is None:
        num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu)
    if num_new_pages > len(self.free_pages):
        return None
    out = torch.empty((extend_num_tokens,), dtype=torch.int64)
    alloc_extend_naive(prefix_lens, seq_lens, last_loc, self.free_pages, out, self.page_size, self.device)
    self.free_pages = self.free_pages[num_new_pages:]
    return out


def alloc_decode(original, self, seq_lens, seq_lens_cpu, last_loc):
    if str(self.device) != "cpu":
        return original(self, seq_lens, seq_lens_cpu, last_loc)
    if self.need_sort and len(seq_lens) > len(self.free_pages):
        self.merge_and_sort_free()
    num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
    if num_new_pages > len(self.free_pages):
        return None
    out = (last_loc + 1).to(torch.int64)
    starts_page = seq_lens % self.page_size == 1  # the new token is the first of a page
    out[starts_page] = self.free_pages[:num_new_pages] * self.page_size
    self.free_pages = self.free_pages[num_new_pages:]
    return out


def get_last_loc(original, req_to_token, req_pool_indices, prefix_lens):
    """Each request's last slot before prefix_lens (-1 where there is none)."""
    if req_to_token.is_cuda:
        return original(req_to_token, req_pool_indices, prefix_lens)
    from sglang.srt.mem_cache.allocation import get_last_loc_torch

    return get_last_loc_torch(req_to_token, req_pool_indices, prefix_lens)
