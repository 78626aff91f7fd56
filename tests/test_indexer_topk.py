"""Fused indexer Top-K kernel against its PyTorch reference (Triton interpreter on CPU).

Integer-valued inputs make every score exact in fp32, so positions (and the tie
rule) must match bit for bit; random inputs check scores to rounding and positions
wherever the Top-K boundary is not a near tie.
"""

from __future__ import annotations

import math

import pytest
import torch

from triton_interpreter import DEVICE, KERNEL_DTYPES, import_kernels, interpreter  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")

_module = import_kernels("sglang_hybrid.kernels.indexer_topk")
indexer_topk, indexer_topk_torch = _module.indexer_topk, _module.indexer_topk_torch
_mxfp8_module = import_kernels("sglang_hybrid.kernels.mxfp8")
quantize_mxfp8_torch, dequantize_mxfp8 = _mxfp8_module.quantize_mxfp8_torch, _mxfp8_module.dequantize_mxfp8


def _case(row_lens, reqs, H, D, max_len, integer, dtype, seed=0):
    """Random paged cache: each request's positions map to scattered slots."""
    g = torch.Generator().manual_seed(seed)
    n_req = max(reqs) + 1
    slots = torch.randperm(n_req * max_len + 7, generator=g)[: n_req * max_len].reshape(n_req, max_len).to(torch.int32)
    total = n_req * max_len + 7
    if integer:
        k = torch.randint(-3, 4, (total, D), generator=g).to(dtype)
        q = torch.randint(-2, 3, (len(row_lens), H, D), generator=g).to(dtype)
        w = torch.randint(-2, 3, (len(row_lens), H), generator=g).float()
    else:
        k = torch.randn(total, D, generator=g).to(dtype)
        q = torch.randn(len(row_lens), H, D, generator=g).to(dtype)
        w = torch.randn(len(row_lens), H, generator=g)
    to = dict(device=DEVICE)
    return (q.to(**to), w.to(**to), k.to(**to), slots.to(**to),
            torch.tensor(reqs, dtype=torch.int32, **to), torch.tensor(row_lens, dtype=torch.int32, **to))


# (row_lens, request of each row, heads, head dim, topk)
SHAPES = [
    ([0], [0], 4, 16, 8),                     # empty history: all -1
    ([1], [0], 4, 16, 8),                     # one token
    ([5, 16, 17], [0, 1, 2], 4, 32, 16),      # K larger than, equal to, just below the history
    ([64, 65, 130], [0, 0, 1], 3, 16, 16),    # tile boundaries (block 16), two rows of one request
    ([200, 7, 31, 150], [2, 0, 2, 1], 5, 32, 32),  # ragged batch, decode/verify/prefill rows mixed
    ([90], [0], 16, 16, 24),                  # topk not a power of two
    ([300, 299], [1, 1], 8, 16, 64),          # several merges of the running Top-K (K = 64)
    (list(range(3, 10)), [0] * 7, 4, 16, 4),  # a causal prefill chunk: 7 rows of one request
]


@pytest.mark.parametrize("row_lens, reqs, H, D, topk", SHAPES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("block_m, programs", [(1, 1), (4, 1), (1, 64), (4, 64)])
def test_exact_inputs_match_reference_including_ties(row_lens, reqs, H, D, topk, dtype, block_m, programs):
    """Small integers: exact scores, many exact ties (relu zeros, repeated values); rows
    one per program, and in blocks of up to 4 rows of a request sharing K tiles; the
    whole history in one program, or split across programs and merged (programs=64)."""
    args = _case(row_lens, reqs, H, D, max(max(row_lens), 1), integer=True, dtype=dtype)
    idx, scores = indexer_topk(*args, topk, return_scores=True, block_s=16, block_m=block_m, programs=programs)
    ref_idx, ref_scores = indexer_topk_torch(*args, topk, return_scores=True)
    assert torch.equal(idx.cpu(), ref_idx.cpu())
    assert torch.equal(scores.cpu(), ref_scores.cpu())


@pytest.mark.parametrize("per_request, block_m", [(4, 4), (3, 4), (6, 4), (1, 2)])
def test_fixed_rows_per_request_match_reference(per_request, block_m):
    """Speculative verify: the same number of causal rows for every request, in fixed row
    blocks (gcd of block_m and the row count) that need no data-dependent shapes."""
    lens = [40, 90, 17]
    row_lens = [n + j for n in lens for j in range(per_request)]
    reqs = [r for r in range(len(lens)) for _ in range(per_request)]
    args = _case(row_lens, reqs, 4, 16, max(row_lens), integer=True, dtype=torch.float32)
    idx, scores = indexer_topk(*args, 16, return_scores=True, block_s=16, block_m=block_m,
                               rows_per_request=per_request)
    ref_idx, ref_scores = indexer_topk_torch(*args, 16, return_scores=True)
    assert torch.equal(idx.cpu(), ref_idx.cpu())
    assert torch.equal(scores.cpu(), ref_scores.cpu())


def _tree_bits(parents: list[int]) -> list[int]:
    """Per draft node (parents[j] < j, -1 for a child of the last committed token) the bits of
    its path: itself and its ancestors."""
    bits = []
    for j, p in enumerate(parents):
        bits.append((1 << j) | (bits[p] if p >= 0 else 0))
    return bits


@pytest.mark.parametrize("parents, block_m", [
    ([-1, 0, 0, 1, 1, 2], 4),         # topk 2, three levels: siblings must not see each other
    ([-1, 0, 1, 2], 4),               # a chain: the tree is the causal mask
    ([-1, -1, -1, 0, 1, 2, 3], 1),    # topk 3 off the root, then one child each
    ([-1] + list(range(62)), 2),      # a chain of 63 draft tokens: the bits' full width
])
def test_tree_rows_see_only_their_path(parents, block_m):
    """Tree verify: each request's draft nodes sit at positions prefix .. prefix + n; node j sees
    the prefix and its own path. Against the reference, and the reference against the plain
    ranking of every position filtered to the path (independent of its tree code)."""
    n = len(parents)
    prefixes = [40, 90, 17] if n < 16 else [90]  # the 63-chain alone: its 63 rows take the interpreter minutes a request
    row_lens = [p + n for p in prefixes for _ in range(n)]
    reqs = [r for r in range(len(prefixes)) for _ in range(n)]
    args = _case(row_lens, reqs, 4, 16, max(row_lens), integer=True, dtype=torch.float32)
    tail_start = torch.tensor([p for p in prefixes for _ in range(n)], device=DEVICE)
    tail_bits = torch.tensor(_tree_bits(parents) * len(prefixes), dtype=torch.int64, device=DEVICE)
    tree = (tail_start, tail_bits)
    idx, scores = indexer_topk(*args, 16, return_scores=True, block_s=16, block_m=block_m, rows_per_request=n,
                               tree=tree)
    ref_idx, ref_scores = indexer_topk_torch(*args, 16, return_scores=True, tree=tree)
    assert torch.equal(idx.cpu(), ref_idx.cpu())
    assert torch.equal(scores.cpu(), ref_scores.cpu())
    every, every_scores = _best_first(*indexer_topk_torch(*args, max(row_lens), return_scores=True))  # all, ranked
    for r in range(len(row_lens)):
        start, bits = int(tail_start[r]), int(tail_bits[r])
        path = sorted([(int(p), float(v)) for p, v in zip(every[r].tolist(), every_scores[r].tolist())
                       if p >= 0 and (p < start or (bits >> (p - start)) & 1)][:16])  # the best 16, by position
        got = [(int(p), float(v)) for p, v in zip(ref_idx[r].tolist(), ref_scores[r].tolist()) if p >= 0]
        assert got == path, f"row {r}"


def test_paged_tree_draft_rows_skip_other_branches_pages():
    """A paged tree draft's rows (tree with tail_skip, from draft_tree_rows at page 64): the
    kernel equals the reference, and the reference equals the plain ranking of every
    position filtered to the prefix and the row's own branch (none of the positions skipped)."""
    from sglang_hybrid.layers.sparse_mla_backend import draft_tree_rows

    topk, num_steps, step, page = 3, 3, 1, 64
    seq_lens = torch.tensor([40, 90, 17])
    row_req, row_len, tree = draft_tree_rows(torch.arange(3), seq_lens, step, topk, num_steps, page)
    args = _case(row_len.tolist(), row_req.tolist(), 4, 16, int(row_len.max()), integer=True, dtype=torch.float32)
    tree = tuple(t.to(DEVICE) for t in tree)
    idx, scores = indexer_topk(*args, 16, return_scores=True, block_s=16, tree=tree)
    ref_idx, ref_scores = indexer_topk_torch(*args, 16, return_scores=True, tree=tree)
    assert torch.equal(idx.cpu(), ref_idx.cpu())
    assert torch.equal(scores.cpu(), ref_scores.cpu())
    every, every_scores = _best_first(*indexer_topk_torch(*args, int(row_len.max()), return_scores=True))
    for r in range(len(row_len)):
        start, own = int(tree[0][r]), int(tree[0][r] + tree[2][r])
        path = sorted([(int(p), float(v)) for p, v in zip(every[r].tolist(), every_scores[r].tolist())
                       if p >= 0 and (p < start or own <= p <= own + step)][:16])  # the best 16, by position
        got = [(int(p), float(v)) for p, v in zip(ref_idx[r].tolist(), ref_scores[r].tolist()) if p >= 0]
        assert got == path, f"row {r}"
    assert int(tree[2].max()) > 64  # branches beyond the bits' width: the skip, not the bits, reaches them


def test_tree_wants_one_start_and_int64_bits_per_row():
    args = _case([5, 6], [0, 0], 4, 16, 8, integer=True, dtype=torch.float32)
    with pytest.raises(ValueError, match="tree wants tail_start"):
        indexer_topk(*args, 4, tree=(torch.tensor([4, 4], device=DEVICE), torch.tensor([1, 3], device=DEVICE,
                                                                                         dtype=torch.int32)))


def test_top_300_over_several_merges():
    """K = 300 (KP 512, not a power of two) over histories of several merges, two rows sharing tiles."""
    args = _case([1100, 700], [0, 0], 4, 16, 1100, integer=True, dtype=torch.float32)
    idx, scores = indexer_topk(*args, 300, return_scores=True, block_s=16, block_m=2)
    ref_idx, ref_scores = indexer_topk_torch(*args, 300, return_scores=True)
    assert torch.equal(idx.cpu(), ref_idx.cpu())
    assert torch.equal(scores.cpu(), ref_scores.cpu())


def test_positions_come_back_ascending_with_the_padding_last():
    """The kernel's order, by position rather than best first, checked on the kernel alone:
    each row's positions ascend strictly, min(K, history) of them, then only -1 / -inf."""
    lens = [1100, 700, 5]
    args = _case(lens, [0, 1, 2], 4, 16, 1100, integer=False, dtype=torch.float32, seed=2)
    idx, scores = indexer_topk(*args, 300, return_scores=True, block_s=16, programs=8)
    for row, row_scores, n in zip(idx.cpu(), scores.cpu(), lens):
        real = row[row >= 0]
        assert len(real) == min(300, n) and bool((real[1:] > real[:-1]).all())
        assert bool((row[len(real):] == -1).all()) and bool((row_scores[len(real):] == float("-inf")).all())
        assert bool(torch.isfinite(row_scores[:len(real)]).all())


def _count_handed_keys(monkeypatch) -> list[int]:
    """Appends to the returned list how many real keys each order_keys call hands its select:
    those its keep launch left (it drops the keys below the row's bar), from the stats it writes."""
    handed, keep = [], _module._chunk_keep_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(part, kept, stats, *args, **options):
                keep[grid](part, kept, stats, *args, **options)
                handed.append(int(stats[:, :, 0].sum()))
            return launch

    monkeypatch.setattr(_module, "_chunk_keep_kernel", Spy())
    return handed


@pytest.mark.parametrize("order", ["random", "rising", "falling", "tied"])
def test_a_rows_programs_share_a_bar_and_stay_exact(monkeypatch, order):
    """The programs splitting one row's history count the keys they keep in the row's
    histogram and raise their bar to what it proves (_shared_bar): the selection stays the
    reference's whether the best keys come first, last, anywhere, or all tie (the shared bar
    then admits the whole tied bin), and on random scores the ordering's rounds see about K
    keys: those of the splits' Top-KPs that reach the bar the row's finished histogram gives
    for K (37 of the 4 x 32)."""
    L, K = 1024, 32
    g = torch.Generator().manual_seed(7)
    score = {"random": torch.randn(L, generator=g), "rising": torch.arange(L) / L + 1,
             "falling": 2 - torch.arange(L) / L, "tied": torch.ones(L)}[order]
    k = torch.stack([score, torch.zeros(L)], 1).repeat(1, 8)  # [L, 16]: q picks the score out
    q = torch.zeros(1, 1, 16)
    q[0, 0, 0] = 1.0
    args = (q, torch.ones(1, 1), k, torch.randperm(L, generator=g).to(torch.int32)[None],
            torch.zeros(1, dtype=torch.int32), torch.tensor([L], dtype=torch.int32))
    args = tuple(a.to(DEVICE) for a in args)
    handed = _count_handed_keys(monkeypatch)
    handed_over, order_keys = [], _module.order_keys

    def spy(part, topk, seen=None, **kw):
        handed_over.append((part.clone(), seen))
        return order_keys(part, topk, seen, **kw)
    monkeypatch.setattr(_module, "order_keys", spy)
    ref_idx, ref_scores = indexer_topk_torch(*args, K, return_scores=True)
    for bits in (0, _module.SHARED_BAR_BITS):
        monkeypatch.setattr(_module, "SHARED_BAR_BITS", bits)
        idx, scores = indexer_topk(*args, K, return_scores=True, block_s=16, programs=4)
        assert torch.equal(idx.cpu(), ref_idx.cpu()) and torch.equal(scores.cpu(), ref_scores.cpu())
    alone, shared = handed
    assert alone == 4 * K  # 4 splits of 8 KP (longer than IN_PLACE_KPS x KP: merged), each its own Top-KP
    if order == "random":
        assert shared < 2 * K
    # The histogram counts every key the splits hand over (and the ones they let go), each a
    # position of the row: shared_counts_torch's count of the handed keys is a lower bound.
    part, seen = handed_over[1]
    assert handed_over[0][1] is None and bool((seen.cpu() >= _module.shared_counts_torch(part.cpu())).all())
    assert int(seen.sum()) <= L


@pytest.mark.parametrize("programs", [1, 4, 64])
def test_splits_shorter_than_k_share_the_bar_too(monkeypatch, programs):
    """A few long rows spread over many programs: at programs=64 the history splits into
    splits shorter than KP (K = 200, KP 256, splits of 64 positions), each writing every key
    it keeps; the row's shared histogram still lets the ordering drop the keys below the bar
    it gives for K. The ragged last split and a row shorter than the table (its later splits
    empty) included. The same positions and scores as the reference."""
    args = _case([1000, 333], [0, 1], 4, 16, 1000, integer=False, dtype=torch.float32)
    handed = _count_handed_keys(monkeypatch)
    idx, scores = indexer_topk(*args, 200, return_scores=True, block_s=16, programs=programs)
    if programs == 64:
        assert 2 * 200 <= handed[0] < 1000 + 333
    ref_idx, ref_scores = indexer_topk_torch(*args, 200, return_scores=True)
    _assert_match_up_to_near_ties(idx, scores, ref_idx, ref_scores)


class _PoisonedTorch:
    """torch, except that an int64 torch.empty comes back full of a key that would win any
    selection (the best score at position 0): a slot a kernel reads before writing shows. Each
    is the front of a longer buffer whose tail holds another key: a store past its end shows
    (out_of_bounds)."""

    TAIL, TAIL_KEY = 4096, 0x5A5A5A5A5A5A5A5A

    def __init__(self):
        self.buffers = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *size, dtype=None, device=None):
        size = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        if dtype != torch.int64:
            return torch.empty(size, dtype=dtype, device=device)
        n = math.prod(size)
        best = _module.encode_keys_torch(torch.tensor([3.0e38]), torch.tensor([0]))
        buffer = torch.full((n + self.TAIL,), self.TAIL_KEY, dtype=dtype, device=device)
        buffer[:n] = int(best)
        self.buffers.append((buffer, n))
        return buffer[:n].view(size)

    def out_of_bounds(self) -> int:
        """Buffers stored past their end."""
        return sum(int((buffer[n:] != self.TAIL_KEY).any()) for buffer, n in self.buffers)


@pytest.mark.parametrize("programs", [1, 6, 64])
def test_each_split_path_reads_only_what_it_wrote(programs, monkeypatch):
    """K = 100 (KP 128), tiles of 16. At programs=64 every split (64 positions) is at most KP,
    so its tiles go straight to the ordering's input and no merge runs; at programs=6 the
    splits (256 positions) are at most 2 KP, two a row: the same, in part's wider rows; at
    programs=1 the whole history appends the keys that beat the bar and merges as it goes. Each
    selects the reference's set on exact ties, for a causal prefill chunk in blocks of 4 rows
    (the second block half past its request's rows) and a decode row of another request alone
    in its block, with every int64 buffer allocated full of a key that would win: each slot
    read was written. Nothing is stored past a buffer's end: the decode row's block has the
    last programs, and its rows past the block's end, merging unwritten slots, once did."""
    lens, reqs, K = [500, 501, 502, 503, 504, 505, 497], [0, 0, 0, 0, 0, 0, 1], 100
    args = _case(lens, reqs, 4, 16, 505, integer=True, dtype=torch.float32)
    ref_idx, ref_scores = indexer_topk_torch(*args, K, return_scores=True)
    split = _module._split_len(505, 3, programs, 16)
    assert split == {64: 64, 6: 256, 1: 512}[programs]  # in place; in place, 2 KP; appended
    poisoned = _PoisonedTorch()
    monkeypatch.setattr(_module, "torch", poisoned)
    idx, scores = indexer_topk(*args, K, return_scores=True, block_s=16, block_m=4, programs=programs)
    assert poisoned.out_of_bounds() == 0
    assert torch.equal(idx.cpu(), ref_idx.cpu())
    assert torch.equal(scores.cpu(), ref_scores.cpu())


@pytest.mark.parametrize("order", ["rising", "falling"])
@pytest.mark.parametrize("block_m", [1, 2])
def test_histories_that_only_rise_or_only_fall(order, block_m):
    """Scores that rise with position make every key beat the bar (the candidate buffer fills
    and is merged every few tiles); scores that fall let no key in after the first KP. Both
    select exactly what the reference selects."""
    args = list(_case([400, 399], [0, 0], 2, 16, 400, integer=True, dtype=torch.float32))
    q, w, k, slots = args[:4]
    value = torch.arange(400, dtype=torch.float32) if order == "rising" else 400.0 - torch.arange(400)
    k.zero_()
    k[slots[0].long(), 0] = value.to(k.device)  # score[s] = value[s] * sum_h w[h] q[h, 0]
    q.zero_()
    q[:, :, 0] = 1.0
    w.fill_(1.0)
    idx, scores = indexer_topk(*args, 40, return_scores=True, block_s=16, block_m=block_m)
    ref_idx, ref_scores = indexer_topk_torch(*args, 40, return_scores=True)
    assert torch.equal(idx.cpu(), ref_idx.cpu())
    assert torch.equal(scores.cpu(), ref_scores.cpu())


@pytest.mark.parametrize("real", [0, 5, 16, 17, 32])
def test_merge_threshold_keeps_exactly_the_best(real):
    """The merge's threshold on raw keys, 2 KP = 32 per row: no real key, fewer than KP, exactly KP,
    one more, all real; negative and positive keys; keys that differ only in the low word
    (the passes run to bit 0), and a row that settles after its first pass."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(keys_ptr, out_ptr, KP: tl.constexpr):
        offs = tl.arange(0, 4)[:, None] * (2 * KP) + tl.arange(0, 2 * KP)[None, :]
        tl.store(out_ptr + tl.arange(0, 4), _module._top_threshold(tl.load(keys_ptr + offs), KP))

    g = torch.Generator().manual_seed(real)
    none = torch.iinfo(torch.int64).min
    rows = [torch.randint(-2**62, 2**62, (32,), generator=g),  # spread over the high bits
            (torch.randint(-3, 4, (32,), generator=g) << 32) | torch.randperm(32, generator=g),  # low word only
            torch.arange(32) - 15,                                  # -15..16: all 32 real, the cut is at bit 0
            torch.randperm(32, generator=g) << 57]                  # the top bits alone separate
    keys = torch.stack(rows)
    keys = keys[:, torch.randperm(32, generator=g)]
    keys[:, real:] = none
    keys = keys.contiguous().to(DEVICE)
    t = torch.empty(4, dtype=torch.int64, device=DEVICE)
    kernel[(1,)](keys, t, KP=16)
    for row, thr in zip(keys.cpu(), t.cpu()):
        kept = row[(row > none) & (row >= thr)]
        best = row[row > none].sort(descending=True).values[:16]
        assert torch.equal(kept.sort(descending=True).values, best)


@pytest.mark.parametrize("rows, splits, kp, topk, real", [
    (1, 1, 16, 16, 16),       # one split, exactly K real
    (3, 4, 16, 16, 40),       # several splits, more real than K
    (2, 3, 16, 13, 7),        # fewer real keys than K: -1 / -inf pad
    (2, 2, 16, 16, 0),        # none real
    (2, 5, 256, 256, 900),    # the small preset's Top-K, several chunks per round
    (1, 3, 2048, 2048, 5000), # the bench preset's Top-K, two rank programs' worth of blocks
])
@pytest.mark.parametrize("scores", ["random", "ties", "one value", "negative"])
@pytest.mark.parametrize("chunk, step", [(None, None), (16, 8)])
def test_order_keys_equals_torch_topk(rows, splits, kp, topk, real, scores, chunk, step, monkeypatch):
    """The Triton ordering (radix select of the K-th best key, then the write by position)
    against one torch.topk over the same keys: random scores; few distinct scores (the
    select runs into the position bits); every score equal (the first rounds keep
    everything); negative and huge-magnitude scores. With the served chunks and select
    steps, and with chunks of 16 keys read 8 at a time (up to 320 chunks a row: the select's
    steps take one key of each, or a few). The keys handed in are left as they were."""
    if chunk:
        monkeypatch.setattr(_module, "ORDER_CHUNK_KEYS", chunk)
        monkeypatch.setattr(_module, "SELECT_KEYS", step)
    g = torch.Generator().manual_seed(real + topk)
    none = torch.iinfo(torch.int64).min
    part = torch.full((rows, splits * kp), none, dtype=torch.int64)
    for r in range(rows):
        pos = torch.randperm(splits * kp * 4, generator=g)[:real]
        s = {"random": torch.randn(real, generator=g),
             "ties": torch.randint(-2, 3, (real,), generator=g).float(),
             "one value": torch.zeros(real),
             "negative": -torch.rand(real, generator=g) * 1e30}[scores]
        at = torch.randperm(splits * kp, generator=g)[:real].sort().values  # by position, as the kernel writes them
        part[r, at] = _module.encode_keys_torch(s, pos.sort().values)
    part = part.reshape(rows, splits, kp)
    ref_idx, ref_scores = _module.order_keys_torch(part, topk)
    handed = part.clone().to(DEVICE)
    idx, got = _module.order_keys(handed, topk)
    assert torch.equal(idx.cpu(), ref_idx)
    assert torch.equal(got.cpu(), ref_scores)
    assert torch.equal(handed.cpu(), part)


@pytest.mark.parametrize("scores", ["random", "ties", "one value"])
@pytest.mark.parametrize("counted", ["every key", "half the keys", "none"])
@pytest.mark.parametrize("topk", [16, 13, 200])
def test_order_keys_drops_only_keys_below_the_rows_bar(scores, counted, topk, monkeypatch):
    """order_keys(seen=): the keep launch drops the keys below the bar that the counts in
    seen give for K; the set is torch.topk's whether seen counts every key, only some (the
    scoring kernel's counts include keys a program later let go, never keys that do not
    exist), or none (no bar), on ties that fill the boundary bin, and with K past the keys."""
    rows, splits, kp, real, bits = 3, 4, 16, 40, 11
    g = torch.Generator().manual_seed(topk)
    none = torch.iinfo(torch.int64).min
    part = torch.full((rows, splits * kp), none, dtype=torch.int64)
    seen = torch.zeros(rows, 1 << bits, dtype=torch.int32)
    for r in range(rows):
        s = {"random": torch.randn(real, generator=g), "ties": torch.randint(-2, 3, (real,), generator=g).float(),
             "one value": torch.zeros(real)}[scores]
        keys = _module.encode_keys_torch(s, torch.randperm(1000, generator=g)[:real].sort().values)
        part[r, torch.randperm(splits * kp, generator=g)[:real].sort().values] = keys
        counted_keys = {"every key": keys, "half the keys": keys[::2], "none": keys[:0]}[counted]
        seen[r] = _module.shared_counts_torch(counted_keys.view(1, -1), bits)[0]
    part = part.reshape(rows, splits, kp)
    ref_idx, ref_scores = _module.order_keys_torch(part, topk)
    handed = _count_handed_keys(monkeypatch)
    idx, got = _module.order_keys(part.to(DEVICE), topk, seen=seen.to(DEVICE))
    assert torch.equal(idx.cpu(), ref_idx)
    assert torch.equal(got.cpu(), ref_scores)
    left, = handed
    assert left == rows * real if counted == "none" or topk > real else left >= rows * topk
    if counted == "every key" and scores == "random" and topk < real:
        assert left < rows * real


def _best_first(idx, scores):
    order = scores.cpu().argsort(dim=1, descending=True, stable=True)
    return idx.cpu().gather(1, order), scores.cpu().gather(1, order)


def _assert_match_up_to_near_ties(idx, scores, ref_idx, ref_scores, atol=1e-5):
    """Best first: scores to rounding; positions equal except where rounding reorders a near tie."""
    (idx, scores), (ref_idx, ref_scores) = _best_first(idx, scores), _best_first(ref_idx, ref_scores)
    torch.testing.assert_close(scores.cpu(), ref_scores.cpu(), rtol=1e-5, atol=atol)
    gaps = (ref_scores[:, :-1] - ref_scores[:, 1:]).abs().cpu()
    tie = torch.cat([gaps < 10 * atol, torch.zeros(len(gaps), 1, dtype=torch.bool)], 1)
    tie = tie | torch.cat([torch.zeros(len(gaps), 1, dtype=torch.bool), tie[:, :-1]], 1)
    assert torch.equal(idx.cpu()[~tie], ref_idx.cpu()[~tie])


@pytest.mark.parametrize("row_lens, reqs, H, D, topk", SHAPES[2:])
def test_random_inputs_match_reference(row_lens, reqs, H, D, topk):
    args = _case(row_lens, reqs, H, D, max(row_lens), integer=False, dtype=torch.float32, seed=1)
    idx, scores = indexer_topk(*args, topk, return_scores=True, block_s=16)
    ref_idx, ref_scores = indexer_topk_torch(*args, topk, return_scores=True)
    _assert_match_up_to_near_ties(idx, scores, ref_idx, ref_scores)


def _mxfp8(args, group):
    """The case's q and index-K quantized by the reference MXFP8 quantizer (kernels.mxfp8)."""
    q, w, k, *rest = args
    (qd, qs), (kd, ks) = quantize_mxfp8_torch(q, group), quantize_mxfp8_torch(k, group)
    return (qd, w, kd, *rest), dict(q_scale=qs, k_scale=ks)


@pytest.mark.parametrize("row_lens, reqs, H, D, topk", SHAPES)
@pytest.mark.parametrize("groups", [1, 2])
def test_mxfp8_exact_inputs_match_reference_including_ties(row_lens, reqs, H, D, topk, groups):
    """Small integers quantize exactly to MXFP8, so scores and the tie rule stay exact, with
    one scale a vector and with two groups a vector."""
    args, scales = _mxfp8(_case(row_lens, reqs, H, D, max(max(row_lens), 1), integer=True,
                                dtype=torch.float32), D // groups)
    idx, scores = indexer_topk(*args, topk, return_scores=True, block_s=16, block_m=4, **scales)
    ref_idx, ref_scores = indexer_topk_torch(*args, topk, return_scores=True, **scales)
    assert torch.equal(idx.cpu(), ref_idx.cpu())
    assert torch.equal(scores.cpu(), ref_scores.cpu())


def _fp8_mma_error_bound(args, scales, group):
    """Where the GPU's dot takes e4m3 as stored (one scale a vector), the MMA accumulates in
    fewer bits than fp32: each logit to about 2^-13 of the sum of its terms' magnitudes. The
    largest score's bound, sum_h |w_h| sum_d |q_hd k_d|, over the case. Elsewhere fp32's."""
    q, w, k, *_ = args
    if DEVICE != "cuda" or not _module.takes_e4m3(group, q.shape[-1]):
        return 1e-5
    magnitude = torch.einsum("rhd,sd->rhs", dequantize_mxfp8(q, scales["q_scale"], group).abs(),
                             dequantize_mxfp8(k, scales["k_scale"], group).abs())
    return 2**-13 * (w.abs()[:, :, None] * magnitude).sum(1).max().item()


# Groups of 16, and one scale a vector where that is another group size.
@pytest.mark.parametrize("row_lens, reqs, H, D, topk, group",
                         [(*shape, 16) for shape in SHAPES[2:5]] + [(*shape, shape[3]) for shape in SHAPES[2:5]
                                                                     if shape[3] != 16])
def test_mxfp8_random_inputs_match_reference(row_lens, reqs, H, D, topk, group):
    args, scales = _mxfp8(_case(row_lens, reqs, H, D, max(row_lens), integer=False, dtype=torch.float32,
                                seed=1), group)
    idx, scores = indexer_topk(*args, topk, return_scores=True, block_s=16, programs=64, **scales)
    ref_idx, ref_scores = indexer_topk_torch(*args, topk, return_scores=True, **scales)
    _assert_match_up_to_near_ties(idx, scores, ref_idx, ref_scores, atol=_fp8_mma_error_bound(args, scales, group))


def test_mxfp8_each_group_scale_applies_to_its_own_columns():
    """Groups of very different magnitude (2^-6 .. 2^5, exact in e4m3 x e8m0): a scale applied
    to the wrong group's columns changes the scores, so the selection and scores must equal
    the reference's exactly."""
    q, w, k, *rest = _case([150, 90, 33], [0, 1, 1], 4, 64, 150, integer=True, dtype=torch.float32, seed=3)
    per_group = torch.tensor([2.0**-6, 1.0, 2.0**5, 2.0**-2], device=k.device).repeat_interleave(16)
    args, scales = _mxfp8((q * per_group.flip(0), w, k * per_group, *rest), 16)
    idx, scores = indexer_topk(*args, 16, return_scores=True, block_s=16, programs=4, **scales)
    ref_idx, ref_scores = indexer_topk_torch(*args, 16, return_scores=True, **scales)
    assert scales["k_scale"].unique().numel() > 2  # the groups really differ
    assert torch.equal(idx.cpu(), ref_idx.cpu())
    assert torch.equal(scores.cpu(), ref_scores.cpu())


def test_mxfp8_scales_must_come_in_pairs_and_match():
    args, scales = _mxfp8(_case([4], [0], 2, 32, 4, integer=True, dtype=torch.float32), 32)
    with pytest.raises(ValueError, match="both"):
        indexer_topk(*args, 4, q_scale=scales["q_scale"])
    with pytest.raises(ValueError, match="do not match"):
        indexer_topk(*args, 4, q_scale=scales["q_scale"], k_scale=scales["k_scale"][:, :0])


def test_rejects_a_row_block_that_is_not_a_power_of_two():
    args = _case([4], [0], 2, 16, 4, integer=True, dtype=torch.float32)
    with pytest.raises(ValueError, match="block_m"):
        indexer_topk(*args, 4, block_m=3)


def test_rejects_unsupported_head_dim():
    args = _case([4], [0], 2, 12, 4, integer=True, dtype=torch.float32)
    with pytest.raises(ValueError, match="index head dim"):
        indexer_topk(*args, 4)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("topk, num_steps", [(2, 3), (3, 4), (4, 2)])
def test_tree_draft_rows_see_what_sglang_draft_attention_reads(topk, num_steps, page_size):
    """The sparse draft head's tree rows (backend.draft_tree_rows) see exactly the positions
    SGLang's own draft attention reads at each step: its kv indices from
    generate_draft_decode_kv_indices (on the GPU, or in the interpreter on CPU), at page size 1 and with
    pages (each branch in its own page-aligned region)."""
    from sglang_hybrid.layers.sparse_mla_backend import draft_tree_rows

    cache_locs = import_kernels("sglang.kernels.ops.speculative.cache_locs", reload=True)
    seq_lens = torch.tensor([5, 9, 1], dtype=torch.int64)
    req_pool_indices = torch.tensor([2, 0, 1], dtype=torch.int64)
    bs, pool_len = len(seq_lens), 64
    req_to_token = torch.arange(3 * pool_len, dtype=torch.int32).view(3, pool_len)  # slot = req * 64 + position
    width = int(seq_lens.sum()) * topk + bs * topk * num_steps
    kv_indices = torch.full((num_steps, width), -1, dtype=torch.int32)
    kv_indptr = torch.zeros((num_steps, bs * topk + 1), dtype=torch.int32)
    positions = seq_lens.repeat_interleave(topk)
    on = [t.to(DEVICE) for t in (req_pool_indices, req_to_token, seq_lens, kv_indices, kv_indptr, positions)]
    cache_locs.generate_draft_decode_kv_indices[(num_steps, bs, topk)](
        *on, pool_len, width,
        bs * topk + 1, 4, 1 << (num_steps - 1).bit_length(), 1 << (bs * topk - 1).bit_length(), page_size)
    kv_indices, kv_indptr = on[3].cpu(), on[4].cpu()
    for step in range(num_steps - 1):
        row_req, row_len, tree = draft_tree_rows(req_pool_indices, seq_lens, step, topk, num_steps, page_size)
        visible = (_module.tree_visible(tree[0], tree[1], torch.arange(pool_len), tree[2])
                   & (torch.arange(pool_len) < row_len[:, None]))
        for r in range(bs * topk):
            ours = sorted((req_to_token[row_req[r], visible[r]]).tolist())
            lo, hi = kv_indptr[step, r], kv_indptr[step, r + 1]
            assert ours == sorted(kv_indices[step, lo:hi].tolist()), f"step {step}, row {r}"
