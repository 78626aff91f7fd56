"""Host-side pieces of the serving paths, checked without a server: the CPU paged
allocator's slot arithmetic (cpu_support.paged_allocator) and the bookkeeping that maps
SGLang's per-chunk state rows to the fp32 GPU path's snapshots (layers.kda_backend)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

from sglang_hybrid.cpu_support import paged_allocator
from sglang_hybrid.layers.kda_backend import _chunk_cuts, _TrackedChunkStates

PAGE = 4


def _allocator(pages: int) -> PagedTokenToKVPoolAllocator:
    return PagedTokenToKVPoolAllocator(size=pages * PAGE, page_size=PAGE, dtype=torch.float32, device="cpu",
                                       kvcache=None, need_sort=False)


def _check_page_aligned(slots, positions):
    """SGLang's paged layout: token at position p sits at offset p mod page of its page."""
    assert [s % PAGE for s in slots] == [p % PAGE for p in positions]


def test_paged_allocator_on_cpu_extends_and_decodes_page_aligned():
    alloc = _allocator(16)
    # Request 0: 2 tokens cached in page 3 (slots 12, 13; the page is taken), extends to 9;
    # request 1: new, 5 tokens; request 2: new, exactly one page.
    alloc.free_pages = alloc.free_pages[alloc.free_pages != 3]
    prefix, seq = torch.tensor([2, 0, 0]), torch.tensor([9, 5, 4])
    last_loc = torch.tensor([13, -1, -1])
    free_before = alloc.free_pages.tolist()
    out = paged_allocator.alloc_extend(None, alloc, prefix, prefix, seq, seq, last_loc, int((seq - prefix).sum()))
    assert out.dtype == torch.int64 and len(set(out.tolist())) == out.numel()
    starts = [0, 7, 12]
    for i in range(3):
        slots = out[starts[i]:starts[i] + int(seq[i] - prefix[i])].tolist()
        _check_page_aligned(slots, range(int(prefix[i]), int(seq[i])))
    assert out[:2].tolist() == [14, 15]  # request 0 first fills its partial page
    used = {s // PAGE for s in out.tolist()} - {3}
    assert sorted(used) == free_before[:len(used)] and alloc.free_pages.tolist() == free_before[len(used):]

    # Decode: request 0's position 9 continues the page of position 8; request 2's position 4
    # (its page is full) starts the next free page.
    last = torch.tensor([int(out[6]), int(out[15])])
    new_seq = torch.tensor([10, 5])
    free_before = alloc.free_pages.tolist()
    step = paged_allocator.alloc_decode(None, alloc, new_seq, new_seq, last)
    assert step.tolist() == [int(out[6]) + 1, free_before[0] * PAGE]
    assert alloc.free_pages.tolist() == free_before[1:]


def test_paged_allocator_on_cpu_refuses_when_pages_run_out():
    alloc = _allocator(2)
    seq = torch.tensor([12])
    assert paged_allocator.alloc_extend(None, alloc, torch.tensor([0]), torch.tensor([0]), seq, seq,
                                        torch.tensor([-1]), 12) is None
    assert alloc.free_pages.numel() == 2  # nothing taken


def test_snapshot_rows_map_to_requests_and_tokens():
    # Requests of 1, 63, 64 and 130 tokens own 1, 1, 1 and 3 rows of 64-token chunk states.
    starts = [0, 1, 64, 128, 258]
    assert _chunk_cuts(starts, None, 64) == {}
    assert _chunk_cuts(starts, torch.tensor([5]), 64) == {3: 128}  # request 3's third row: after 128 tokens
    assert _chunk_cuts(starts, torch.tensor([4, 2]), 64) == {3: 64, 2: 0}
    h_src = torch.tensor([5])
    states = _TrackedChunkStates(h_src, torch.ones(1, 2, 2))
    assert states.squeeze(0)[h_src].shape == (1, 2, 2)
    assert states[torch.tensor([5])].shape == (1, 2, 2)
    with pytest.raises(IndexError, match="only the tracked chunk states"):
        states[torch.tensor([4])]


def test_unpinned_torch_tensor_still_follows_device_contexts():
    """cpu_support wraps torch.tensor (to drop pin_memory); tensors made inside a device
    context still land on its device (transformers builds models under `torch.device("meta")`:
    a CPU tensor there left a Llama's RoPE inv_freq uninitialised)."""
    import torch

    from sglang_hybrid import cpu_support

    if not cpu_support.gpu_available():
        assert torch.tensor.__module__ == cpu_support.__name__  # the wrapper is in place
    with torch.device("meta"):
        assert torch.tensor([1.0], pin_memory=False).device.type == "meta"
