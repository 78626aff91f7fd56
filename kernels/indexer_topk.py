"""Fused lightning-indexer Top-K: no score matrix; one scoring kernel, then the ordering stage.

For every query row r (a decode token, a speculative-verify token, or a prefill
token) the kernel scores each position s < row_len[r] of its request,

    score[r, s] = sum_h w[r, h] * relu(q[r, h] . k[s]),

reading the index-K cache through req_to_token (any page size: the table maps
each position to its slot), and keeps a running Top-K per program. Only the Top-K
keys are written (per row and split: KP, or the split's length if shorter); no
[rows x history] score matrix exists anywhere.

The set and its ties follow reference.ops.topk_positions: higher scores win, and of
equal scores the lower positions; -1 (score -inf) pads a row whose history is shorter
than K. This is exact because every (score, position) pair is packed into one int64
key whose signed order is (score, -position): the score's float bits mapped to an
order-preserving int32 in the high word, 2^31 - 1 - position in the low word. Keys are
unique, so the selection is deterministic. The positions come back in ascending order,
not best first: attention over them does not care, and ordering by score compared every
selected key with every other (run 74); by position, it is the order they are found in.

Each program keeps, per row, a running Top-KP (KP = next_pow2(K)) and the keys scored
since, in 2 KP keys of global memory (L2-resident: a bound per program, never per
position). A key that does not beat the running KP-th best (the bar) can never enter: the
set only improves. A split of at most KP positions, or IN_PLACE_KPS x KP where the row is
split across programs, stores every tile whole, by position, NONE where a key does not beat
the bar, straight into the ordering's input: it never merges (the keep launch drops what the
row's shared bar leaves behind). Its keys never leave the dot's layout but for the store's:
counting and packing only those that beat the bar moved them between layouts through shared
memory, 8-13 barriers a tile against 3-5 (sm_90 PTX), and the whole indexer at 8 x 128K took
136.4 us against 141.5, 1 x 32K 29.4 against 32.3 (H100, run 99). Splits of 2 and 4 KP
stored in place instead of merging once at their end took the scoring kernel from 111 to
101 us at 8 x 128K and from 229 to 199 at 64 x 32K, while the ordering, reading every
position's slot, took 4-6 us more (H100, runs 100-101).
A longer split appends only the keys that beat the bar, and when the buffer might not take
the next tile, merges: storing every tile there merged every KP positions, 13-26% slower at
32-64 x 128K (run 99), where over n positions in random order about KP (1 + ln(n / KP))
keys ever beat the bar, a few merges. Where a row's history is split across programs, they
also count the keys they keep in a histogram of the row's (by the keys' top bits) and raise
their bar to a key that KP of the row's keys already beat (_shared_bar): a split need not
see KP positions of its own first. The ordering stage takes the bar the finished histogram
gives for K, so a short split's Top-KP, most of which falls below it, is not ordered. A merge
finds a threshold that exactly KP of its keys reach, two bits a pass from the top (one
block-wide count per pass, stopping once the KP-th best is separated from the next; no
sort), and keeps the keys that reach it in the order they came, so a split's keys stay in
ascending position (run 19: Triton's sort of 4096 keys took 113 us per merge, three
quarters of the kernel's time at 64 x 128K). A history that only rises merges every KP
positions, never gives a wrong answer. The ordering stage then takes the best K
over a row's splits: order_keys (a radix select of the K-th best key, then every key at or
above it written out in order, in Triton), at every batch: it beat torch.topk over the same
keys from 1 decode row (run 58) to prefill's 64K rows (1.2-1.8x, run 80).
A program serves up to block_m consecutive rows of one request (the rows of a prefill
chunk or of a verify step): each K tile is loaded once for all of them, one dot gives
every row's logits, and the rows keep their running Top-Ks side by side.

Rows of a speculative draft tree (tree=) see the positions before their draft tail and,
of the draft tokens after it, only their own path (a bitmask per row, up to 64 drafts):
siblings never score each other.

MXFP8 (q and the index-K cache as e4m3 with e8m0 scales per group, kernels.mxfp8):
both are dequantized on load; e4m3 x 2^e is exact in bf16, so the dot and the
selection equal the reference run on the dequantized tensors.

indexer_topk_torch is the plain-PyTorch reference of the same interface.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from sglang_hybrid.kernels.mxfp8 import dequantize_mxfp8
from sglang_hybrid.reference.ops import topk_positions

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _encode(score, pos):
    """(fp32 score, int64 position) -> int64 key; signed key order = (score, -position)."""
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 and +0.0 tie, as in torch.sort
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - pos)


@triton.jit
def _e8m0(byte):
    """e8m0 scale byte -> fp32 2^(byte - 127), from its bits (byte 0 is the subnormal 2^-127)."""
    b = byte.to(tl.int32)
    return tl.where(b == 0, 1 << 22, b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_queries(q_ptr, qs_ptr, rows, live, H, stride_qr, stride_qh, stride_qsr, stride_qsh,
                  D: tl.constexpr, BLOCK_H: tl.constexpr, GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The query heads of rows [BLOCK_M] (zero where not live or past H) as the dot's
    [BLOCK_M x BLOCK_H, D] operand. MXFP8 groups smaller than a head are dequantized on
    load: e4m3 x 2^e is exact in bf16, so the dot stays exact."""
    BLOCK_M: tl.constexpr = rows.shape[0]
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    qmask = live[:, None, None] & (offs_h[None, :, None] < H)
    q = tl.load(q_ptr + rows[:, None, None] * stride_qr + offs_h[None, :, None] * stride_qh + offs_d[None, None, :],
                mask=qmask, other=0.0)
    if GROUP and GROUP < D:  # one scale a whole head (GROUP == D) is folded into the weights instead
        qs = tl.load(qs_ptr + rows[:, None, None] * stride_qsr + offs_h[None, :, None] * stride_qsh
                     + (offs_d // GROUP)[None, None, :], mask=qmask, other=127)
        q = q.to(tl.float32) * _e8m0(qs)
    return tl.reshape(q.to(DOT_DTYPE), [BLOCK_M * BLOCK_H, D])


@triton.jit
def _tile_keys(s0, n, n_max, req, q, w, table_ptr, k_ptr, ks_ptr, stride_table, stride_k, stride_ks, offs_d,
               tail0, tail_bits, tail_skip,
               NONE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_S: tl.constexpr, GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr, TREE: tl.constexpr):
    """Keys [BLOCK_M, BLOCK_S] of positions s0 .. s0 + BLOCK_S for the block's rows (NONE past a row's
    history, and with TREE at the draft positions from tail0 on: hidden for tail_skip of them, then
    visible where their bit in tail_bits, counted from there, is set)."""
    pos = s0 + tl.arange(0, BLOCK_S).to(tl.int64)
    seen = pos < n_max
    slot = tl.load(table_ptr + req * stride_table + pos, mask=seen, other=0).to(tl.int64)
    k = tl.load(k_ptr + slot[:, None] * stride_k + offs_d[None, :], mask=seen[:, None], other=0.0)
    if GROUP and GROUP < D:  # one scale byte per group, broadcast over it in registers (not loaded per element)
        offs_g = tl.arange(0, D // GROUP)
        ks = tl.load(ks_ptr + slot[:, None] * stride_ks + offs_g[None, :], mask=seen[:, None], other=127)
        k = tl.reshape(tl.reshape(k.to(tl.float32), [BLOCK_S, D // GROUP, GROUP]) * _e8m0(ks)[:, :, None],
                       [BLOCK_S, D])
    logits = tl.reshape(tl.dot(k.to(DOT_DTYPE), tl.trans(q)), [BLOCK_S, BLOCK_M, BLOCK_H])  # fp32
    score = tl.trans(tl.sum(tl.maximum(logits, 0.0) * w[None, :, :], axis=2))  # [BLOCK_M, BLOCK_S]
    if GROUP == D:  # one scale a key: relu(2^e x) = 2^e relu(x), so it scales the key's score
        score = score * _e8m0(tl.load(ks_ptr + slot * stride_ks, mask=seen, other=127))[None, :]
    visible = pos[None, :] < n[:, None]
    if TREE:
        rel = pos[None, :] - tail0[:, None] - tail_skip[:, None]
        bit = (tail_bits[:, None] >> tl.minimum(tl.maximum(rel, 0), 63)) & 1
        visible = visible & ((pos[None, :] < tail0[:, None]) | ((rel >= 0) & (bit != 0)))
    return tl.where(visible, _encode(score, pos[None, :]), NONE)


@triton.jit
def _after_barrier(x, GPU: tl.constexpr):
    """x (an int32 [1]) once every thread of the block has reached here; bar.sync orders
    global memory too, so what the block stored before is visible to all its threads. Not
    tl.debug_barrier: Triton's software pipeliner gives up on a loop that holds one, and
    the tile loads must stay pipelined. The data dependence on x orders it in the code."""
    if GPU:
        x = tl.inline_asm_elementwise("bar.sync 0;\n\tmov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                      is_pure=False, pack=1)
    return x


@triton.jit
def _one_a_thread(offs):
    """offs, which the compiler can no longer prove contiguous (an xor with a 0 it cannot see),
    so a load or store through them moves one element a thread, as the scattered stores that
    pack keys do. A vector-wide load beside such a store puts the two in different layouts,
    and every tensor between them then crosses threads through shared memory (a barrier each
    time); in one layout the select's pack steps have none (sm_90 PTX, tests/compile_for_sm90.py):
    select 22.4 -> 12.2 us at 8 x 128K with the first round in the keep launch (H100, run 96).
    The scoring kernel keeps its vector-wide merge and shared-bar loads: in one layout it had
    half the barriers a tile and was 11-13 us slower wherever splits merge (run 95). Its whole
    tiles are stored through these, in the layout of the histogram atomics beside them."""
    return offs ^ (tl.program_id(0) >> 31)


@triton.jit
def _carried(x, ONE_ROW: tl.constexpr):
    """A per-row value x [BLOCK_M] as the tile loop carries it: a scalar for one row. Triton
    carries a loop's [BLOCK_M] tensors in each layout a use wants (the appends', the merge's,
    the shared bar's), each recomputed every tile from the tile's keys moved into that layout
    through shared memory: 16 barriers a tile that keeps keys, 13 with scalars (sm_90 PTX),
    and 8 x 128K 149.3 -> 144.8 us, 32 x 32K 154.6 -> 148.6 (H100, run 97)."""
    if ONE_ROW:
        return tl.max(x, axis=0)
    else:
        return x


@triton.jit
def _per_key(x, ONE_ROW: tl.constexpr):
    """A carried per-row value, against a [BLOCK_M, N] tile."""
    if ONE_ROW:
        return x
    else:
        return x[:, None]


@triton.jit
def _each_row(x, BLOCK_M: tl.constexpr):
    """A carried per-row value as a [BLOCK_M] tensor again."""
    return x + tl.zeros([BLOCK_M], x.dtype)


@triton.jit
def _top_threshold(keys, KP: tl.constexpr):
    """Per row of keys [BLOCK_M, N] (NONE, the int64 minimum, where there is none), a
    threshold t with exactly KP keys >= t (all real keys when there are at most KP; t is
    then NONE). Built from the sign down, two bits a pass: the three candidate thresholds'
    counts are packed in 16-bit fields of one int64, so a pass is one block-wide reduction
    (no sort: Triton's sort of 4096 keys took 113 us on the H200, run 19). It stops as soon
    as every row has exactly KP keys at or above its threshold, which is when the prefix
    separates the KP-th best key from the next: about the score's exponent and leading
    mantissa bits, not all 64. A real key is never NONE (its low word is at least 1), and
    every threshold tried is above NONE."""
    NONE: tl.constexpr = -9223372036854775807 - 1
    real = tl.sum((keys > NONE).to(tl.int32), axis=1)
    nonneg = tl.sum((keys >= 0).to(tl.int32), axis=1)
    t = tl.where(nonneg >= KP, 0, NONE).to(tl.int64)  # [BLOCK_M]
    cnt = tl.where(nonneg >= KP, nonneg, real)  # keys >= t; > KP while t is not yet a threshold
    lo = tl.full([], 61, tl.int32)  # this pass decides bits lo + 1 and lo (bit 0 alone last)
    while (lo >= -1) & (tl.max(cnt, axis=0) > KP):
        step = tl.full([1], 1, tl.int64) << tl.maximum(lo, 0).to(tl.int64)
        # The last pass (lo = -1) decides bit 0 only: its t + 2 and t + 3 are prefixes already
        # turned down, which fewer than KP keys reach.
        c1, c2, c3 = t + step, t + 2 * step, t + 3 * step
        packed = ((keys >= c1[:, None]).to(tl.int64) + ((keys >= c2[:, None]).to(tl.int64) << 16)
                  + ((keys >= c3[:, None]).to(tl.int64) << 32))
        total = tl.sum(packed, axis=1)
        n1, n2, n3 = total & 0xFFFF, (total >> 16) & 0xFFFF, total >> 32
        t = tl.where(n3 >= KP, c3, tl.where(n2 >= KP, c2, tl.where(n1 >= KP, c1, t)))
        cnt = tl.where(n3 >= KP, n3, tl.where(n2 >= KP, n2, tl.where(n1 >= KP, n1, cnt))).to(tl.int32)
        lo -= 2
    return t


@triton.jit
def _merge_candidates(buf, dst, held, count, offs_2k, width, NONE: tl.constexpr, KP: tl.constexpr,
                      GPU: tl.constexpr):
    """Keep the best KP of the running Top-KP (buf[:held]) and the candidates (buf[KP:KP +
    count]; NONE where a tile stored none) in dst[:width], in the order they came, which is
    ascending position (NONE past them; width <= KP holds them all when fewer than width keys
    were ever seen): (how many were kept, the new bar, 0)."""
    waiting = tl.max(_after_barrier(tl.max(count, axis=0) + tl.zeros([1], tl.int32), GPU), axis=0)
    valid = tl.where(offs_2k[None, :] < KP, offs_2k[None, :] < held[:, None], offs_2k[None, :] - KP < count[:, None])
    keys = tl.load(buf + offs_2k[None, :], mask=valid & (waiting >= 0), other=NONE,  # after the block's stores
                   cache_modifier=".cg")
    keep = (keys > NONE) & (keys >= _top_threshold(keys, KP)[:, None])
    at = tl.cumsum(keep.to(tl.int32), axis=1) - 1
    kept = tl.sum(keep.to(tl.int32), axis=1)
    # The bar is the KP-th best key itself once KP are held (the threshold may sit below it).
    bar = tl.where(kept >= KP, tl.min(tl.where(keep, keys, 9223372036854775807), axis=1), NONE)
    # Every thread has read the buffer before it is overwritten: the kept keys now, the
    # next tile's candidates (their positions depend on the returned count) later.
    read = tl.max(_after_barrier(tl.max(kept, axis=0) + tl.zeros([1], tl.int32), GPU), axis=0)
    tl.store(dst + at, keys, mask=keep & (read >= 0))
    offs_k = tl.arange(0, KP)
    tl.store(dst + offs_k[None, :], tl.full([1, KP], NONE, tl.int64),
             mask=(offs_k[None, :] >= kept[:, None]) & (offs_k[None, :] < width))
    return kept, bar, tl.zeros_like(count)


@triton.jit
def _bar_bin(seen_ptr, rows, live, KP, BITS: tl.constexpr):
    """Per row of the block, the highest bin of seen [rows, 2^BITS] (keys by their top BITS
    bits) with KP counted at or above it, from the counts the row's programs have added so
    far (-1 while there is none). Every count is a key that exists, so a partial sum of them
    never overstates: KP of the row's keys are in that bin or above whatever the other
    programs have added by the time of the load."""
    BINS: tl.constexpr = 1 << BITS
    bins = tl.arange(0, BINS)
    seen = tl.load(seen_ptr + rows[:, None] * BINS + bins[None, :], mask=live[:, None], other=0,
                   cache_modifier=".cg")  # the atomics' values, in L2
    at_or_above = tl.sum(seen, axis=1)[:, None] - tl.cumsum(seen, axis=1) + seen
    return tl.max(tl.where(at_or_above >= KP, bins[None, :], -1), axis=1).to(tl.int64)


@triton.jit
def _bin_bar(b, BITS: tl.constexpr):
    """The largest key below bin b (of keys by their top BITS bits): every key of bin b and above
    beats it (NONE where b is 0 or none)."""
    NONE: tl.constexpr = -9223372036854775807 - 1
    return tl.where(b > 0, ((b << (64 - BITS)) ^ NONE) - 1, NONE)


@triton.jit
def _shared_bar(seen_ptr, rows, live, KP, BITS: tl.constexpr):
    """Per row of the block, a key that at least KP of the row's keys beat (_bar_bin, _bin_bar)."""
    return _bin_bar(_bar_bin(seen_ptr, rows, live, KP, BITS), BITS)


@triton.jit
def _indexer_topk_kernel(
    q_ptr, w_ptr, k_ptr, table_ptr, row_req_ptr, row_len_ptr, block_start_ptr, block_end_ptr,
    qs_ptr, ks_ptr, part_ptr, cand_ptr, seen_ptr, tail_start_ptr, tail_bits_ptr, tail_skip_ptr,
    stride_qr, stride_qh, stride_wr, stride_k, stride_table, stride_qsr, stride_qsh, stride_ks,
    H, SPLIT_LEN, ROWS,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, KP: tl.constexpr,
    GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr, GPU: tl.constexpr, TREE: tl.constexpr,
    FIXED_BLOCKS: tl.constexpr, SHARED_BITS: tl.constexpr, IN_PLACE: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # programmatic dependent launch: the keep launch is scheduled now and waits for this grid
        gdc_launch_dependents()
    # One program: up to BLOCK_M consecutive rows of one request, sharing every K tile, over
    # positions [SPLIT_LEN * split, SPLIT_LEN * (split + 1)) of their history. Fixed blocks
    # (decode, verify) are rows [BLOCK_M * block, BLOCK_M * (block + 1)); others are listed.
    if FIXED_BLOCKS:
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # offsets pass 2^31
        live = rows < ROWS
    else:
        rows = tl.load(block_start_ptr + tl.program_id(0)).to(tl.int64) + tl.arange(0, BLOCK_M)
        live = rows < tl.load(block_end_ptr + tl.program_id(0))
    req = tl.load(row_req_ptr + rows, mask=live, other=0).to(tl.int64)
    req = tl.max(tl.where(live, req, -1), axis=0)  # the block's request
    n = tl.load(row_len_ptr + rows, mask=live, other=0).to(tl.int64)  # [BLOCK_M]
    tail0 = n
    tail_bits = n
    tail_skip = n
    if TREE:
        tail0 = tl.load(tail_start_ptr + rows, mask=live, other=0).to(tl.int64)
        tail_bits = tl.load(tail_bits_ptr + rows, mask=live, other=0).to(tl.int64)
        tail_skip = tl.load(tail_skip_ptr + rows, mask=live, other=0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    q = _load_queries(q_ptr, qs_ptr, rows, live, H, stride_qr, stride_qh, stride_qsr, stride_qsh, D, BLOCK_H, GROUP,
                      DOT_DTYPE)
    w = tl.load(w_ptr + rows[:, None] * stride_wr + offs_h[None, :], mask=live[:, None] & (offs_h[None, :] < H),
                other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_H]
    if GROUP == D:  # one scale a query head: into its weight (relu(2^e x) = 2^e relu(x))
        w = w * _e8m0(tl.load(qs_ptr + rows[:, None] * stride_qsr + offs_h[None, :] * stride_qsh,
                              mask=live[:, None] & (offs_h[None, :] < H), other=127))

    NONE: tl.constexpr = -9223372036854775807 - 1
    offs_2k = tl.arange(0, 2 * KP)
    # Per row, 2 KP keys of global memory (L2-resident; a bound per program, never per
    # position): the running Top-KP, then the candidates since the last merge, each by position.
    buf = cand_ptr + ((tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * BLOCK_M
                      + tl.arange(0, BLOCK_M).to(tl.int64))[:, None] * (2 * KP)  # [BLOCK_M, 1]
    # The split's keys end in part, by position (all of them in place, else its best KP); order_keys
    # selects across splits.
    width = SPLIT_LEN if IN_PLACE else tl.minimum(SPLIT_LEN, KP)
    part = part_ptr + (rows[:, None] * tl.num_programs(1) + tl.program_id(1)) * width
    if IN_PLACE:  # its tiles go straight to part, whole, and it never merges
        dst = part
    else:
        part = tl.where(live[:, None], part, buf + KP)  # a block's rows past its end write into their own buffer
        dst = buf + KP
    ONE_ROW: tl.constexpr = BLOCK_M == 1
    bar = _carried(tl.full([BLOCK_M], NONE, tl.int64), ONE_ROW)  # the running KP-th best: a key must beat it to matter
    held = _carried(tl.zeros([BLOCK_M], tl.int32), ONE_ROW)  # keys in the running Top-KP
    count = _carried(tl.zeros([BLOCK_M], tl.int32), ONE_ROW)  # candidates waiting
    lo = tl.program_id(1).to(tl.int64) * SPLIT_LEN
    n_max = tl.minimum(tl.max(n, axis=0), lo + SPLIT_LEN)  # the block's longest history, in this split
    for s0 in range(lo, n_max, BLOCK_S):  # score a tile; keep only the keys that beat the running KP-th best
        key = _tile_keys(s0, n, n_max, req, q, w, table_ptr, k_ptr, ks_ptr, stride_table, stride_k, stride_ks,
                         offs_d, tail0, tail_bits, tail_skip, NONE, D, BLOCK_M, BLOCK_H, BLOCK_S, GROUP, DOT_DTYPE,
                         TREE)
        beats = key > _per_key(bar, ONE_ROW)
        if IN_PLACE:  # the tile by position, NONE where a key does not beat the bar. The store's offsets
            # (_one_a_thread) and the atomics' bins (of the stored keys, adding 1) are in one layout,
            # converted from the dot's once: 3 barriers a tile (BF16), 9 without these choices.
            kept = tl.where(beats, key, NONE)
            tl.store(dst + _one_a_thread(s0 - lo + tl.arange(0, BLOCK_S))[None, :], kept, mask=live[:, None])
            if SHARED_BITS:  # counted for the row's other programs (see _shared_bar)
                tl.atomic_add(seen_ptr + rows[:, None] * (1 << SHARED_BITS) + _digit(kept, 64 - SHARED_BITS, SHARED_BITS),
                              1, mask=kept != NONE, sem="relaxed")
        else:  # only the keys that beat the bar, appended
            if ONE_ROW:  # one count serves the check and the append
                beating = tl.sum(tl.sum(beats.to(tl.int32), axis=1), axis=0)
            else:  # a block's rows: counted only in tiles that keep keys (counting first costs every tile 6 barriers)
                beating = tl.max(tl.max(beats.to(tl.int32), axis=1), axis=0)
            # Late in a history most tiles add nothing, and skipping them pays: appending every tile
            # (no check) was 7-9% slower at 1M+ keys (H100, run 92).
            if beating > 0:
                if SHARED_BITS:  # counted for the row's other programs (see _shared_bar)
                    tl.atomic_add(seen_ptr + rows[:, None] * (1 << SHARED_BITS) + _digit(key, 64 - SHARED_BITS, SHARED_BITS),
                                  beats.to(tl.int32), mask=beats, sem="relaxed")
                at = _per_key(count, ONE_ROW) + tl.cumsum(beats.to(tl.int32), axis=1) - 1
                tl.store(dst + at, key, mask=beats)
                if ONE_ROW:
                    count += beating
                else:
                    count += tl.sum(beats.to(tl.int32), axis=1)
                if tl.max(_each_row(count, BLOCK_M), axis=0) > KP - BLOCK_S:  # the buffer might not take the next tile
                    merged_held, merged_bar, merged_count = _merge_candidates(
                        buf, buf, _each_row(held, BLOCK_M), _each_row(count, BLOCK_M), offs_2k, KP, NONE, KP, GPU)
                    held = _carried(merged_held, ONE_ROW)
                    count = _carried(merged_count, ONE_ROW)
                    bar = tl.maximum(bar, _carried(merged_bar, ONE_ROW))
        if SHARED_BITS:  # after this program's tiles 1, 2, 4, 8, ...: the bar the whole row's keys so far give
            t = (s0 - lo) // BLOCK_S
            if (t & (t + 1)) == 0:
                bar = tl.maximum(bar, _carried(_shared_bar(seen_ptr, rows, live, KP, SHARED_BITS), ONE_ROW))
    if IN_PLACE:  # no merge: NONE past the tiles (the final merge cost 8 of 21 us at 1 x 32K, H100, run 88)
        for f in range(tl.maximum(tl.cdiv(n_max - lo, BLOCK_S), 0) * BLOCK_S, SPLIT_LEN, BLOCK_S):
            tl.store(part + _one_a_thread(f + tl.arange(0, BLOCK_S))[None, :], tl.full([BLOCK_M, BLOCK_S], NONE, tl.int64),
                     mask=live[:, None])
    else:
        _merge_candidates(buf, part, _each_row(held, BLOCK_M), _each_row(count, BLOCK_M), offs_2k, width, NONE, KP, GPU)


def _row_blocks(row_req: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of at most block_m consecutive rows of one request: (starts, ends), for rows
    whose blocks are not fixed (ragged prefill; data-dependent shapes)."""
    R = row_req.shape[0]
    idx = torch.arange(R, device=row_req.device)
    new_run = torch.ones(R, dtype=torch.bool, device=row_req.device)
    new_run[1:] = row_req[1:] != row_req[:-1]
    run_start = torch.cummax(torch.where(new_run, idx, 0), 0).values
    starts = torch.nonzero(new_run | ((idx - run_start) % block_m == 0)).flatten()
    ends = torch.cat([starts[1:], starts.new_tensor([R])])
    return starts, ends


# The programs that split one row's history share a bar: each counts the keys it keeps by
# their top SHARED_BAR_BITS bits (the score's sign, exponent and leading mantissa bits) in a
# histogram of the row's, and from it takes a key that KP of the row's keys already beat
# (_shared_bar). A program alone finds its KP-th best only after KP positions, and on short
# splits that is most of its split; with the row's counts the bar rises after a tile. (10 bits
# doubled the select; 12 tied, its finer bar paid for by its reads; 13 lost 20-40 us: runs 92-93.)
SHARED_BAR_BITS = 11

# The fewest tiles a split of the history gets: below it a program's fixed work (its
# queries, the final merge and write) outweighs its share of the scoring.
MIN_SPLIT_TILES = 4

# How long, in KP, a split of a row shared across programs may be and still be stored in place
# (whole tiles, no merge): its part is then bounded by the programs' count, never rows x history.
# A row's only split (prefill) keeps KP, so part stays rows x KP. 4 against 2: 64 x 32K (splits
# of 4 KP) 241 against 259 us, the same elsewhere (H100, run 100). Longer splits (32-64 x 128K)
# append: stored whole there, they were 13-26% slower (run 99).
IN_PLACE_KPS = 4


def stores_in_place(split_len: int, splits: int, kp: int) -> bool:
    """Whether a split stores its tiles whole, into part, and never merges: at most KP
    positions, or IN_PLACE_KPS x KP where the row is split across programs (part's size then
    bounded by theirs, never by rows x history)."""
    return split_len <= (IN_PLACE_KPS if splits > 1 else 1) * kp


def _split_len(history: int, programs: int, target: int, block_s: int) -> int:
    """Positions per split: as many splits as keep the programs within `target` (one wave:
    a second, partial wave costs as much as the first), each a whole number of tiles and
    at least MIN_SPLIT_TILES of them. A split stored in place hands over all its keys, and
    the ordering's keep launch drops all but about K of the row's at its shared bar: so a few
    long rows spread over the GPU instead of a few programs each scoring KP positions. From the table
    width, not the lengths, so it is the same in every replay of a CUDA graph. (Splits capped
    at KP, for more programs and no merges, lost 19-30% at 8 x 128K - 64 x 128K: each program
    costs about 20 us beyond its positions. H100, run 87.)"""
    splits = min(triton.cdiv(history, MIN_SPLIT_TILES * block_s), max(1, target // programs))
    return triton.cdiv(triton.cdiv(history, splits), block_s) * block_s


# The ordering stage, three launches. The first, one program per chunk of a row's keys,
# drops the keys below the bar that the row's shared histogram gives for K (seen) and packs
# the rest at the front of the chunk's span of a second buffer. The select, one program per
# row, finds the bound of the row's Top-K (its min(K, kept)-th best key) by a radix select
# over those, 8 bits a round from the highest bit on which they differ, each round packing
# its candidates in place; it counts each chunk's keys at or above the bound on the way.
# The write then puts those out in the chunks' order, which is ascending position. Where a
# row's programs share a bar, the select reads about K keys of the row; where one split
# holds it, at most KP. Three launches took 18 us at 1 x 32K and 24-31 us at 8-64 rows, where
# six with the first round in chunks over every key took 35 and 30-37 (H100, run 86). The
# select is one program's serial round trips to L2. (Building the next round's histogram in
# each round's pack pass, to read the keys once a round, was exact in the interpreter but
# selected wrongly, differently from call to call, on the GPU: run 88, cause not found.)

@triton.jit
def _digit(key, shift, BITS: tl.constexpr = 8):
    """The BITS bits of key from bit `shift` up (below bit 0 for a negative shift), of the key
    with its sign bit flipped, whose unsigned order is the key's signed order."""
    u = key ^ (-9223372036854775807 - 1)
    return tl.where(shift >= 0, u >> tl.maximum(shift, 0), u << tl.maximum(-shift, 0)) & ((1 << BITS) - 1)


@triton.jit
def _boundary(hist, rest, BINS: tl.constexpr = 256):
    """The digit d that holds the rest-th best of the candidates histogrammed in hist [BINS],
    how many are above it, and whether d's candidates end exactly at the rest-th (then the
    select ends with them)."""
    bins = tl.arange(0, BINS)
    ge = tl.cumsum(hist, 0, reverse=True)  # candidates on this digit or above: falls as the digit rises
    # So the highest digit with rest or more on or above it has the fewest of those (one reduction
    # finds both), and the digits above it are those with fewer than rest, the most of them on d + 1.
    d_ge = tl.max(tl.where(ge >= rest, (bins.to(tl.int64) << 32) | (0x7FFFFFFF - ge), -1))
    above = tl.max(tl.where(ge < rest, ge, 0))
    return (d_ge >> 32).to(tl.int32), above, 0x7FFFFFFF - (d_ge & 0xFFFFFFFF) == rest


@triton.jit
def _first_digit(key, b, BITS: tl.constexpr):
    """The select's first digit where the keep launch counts it: 256 for a key above bar bin b
    (of keys by their top BITS bits; every key kept is in b or above), else the 8 bits below
    its bin's."""
    return tl.where(_digit(key, 64 - BITS, BITS) > b, 256, _digit(key, 64 - BITS - 8))


@triton.jit
def _chunk_keep_kernel(part_ptr, kept_ptr, stats_ptr, seen_ptr, first_ptr, bar_bin_ptr, N, TOPK,
                       BLOCK: tl.constexpr, SEEN_BITS: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk): its real keys, less those at or below the bar the row's counts in
    seen give (_shared_bar at TOPK) with SEEN_BITS, packed in order at the front of the
    chunk's span of kept; their count, maximum and minimum in stats. With SEEN_BITS, also the
    select's first round: the kept keys counted by _first_digit into the row's first [512]
    (zeroed), and the bar's bin in bar_bin."""
    NONE: tl.constexpr = -9223372036854775807 - 1
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # for the scoring grid's part and seen
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(part_ptr + row * N + _one_a_thread(offs), mask=offs < N, other=NONE)  # as they are stored
    keep = key != NONE
    if SEEN_BITS:
        one = tl.full([1], 1, tl.int1)
        b = tl.max(_bar_bin(seen_ptr, row + tl.zeros([1], tl.int64), one, TOPK, SEEN_BITS), axis=0)
        keep &= key > _bin_bar(b, SEEN_BITS)
        tl.atomic_add(first_ptr + row * 512 + _first_digit(key, b, SEEN_BITS), keep.to(tl.int32), mask=keep,
                      sem="relaxed")
        if c == 0:
            tl.store(bar_bin_ptr + row, b)
    tl.store(kept_ptr + row * N + c * BLOCK + tl.cumsum(keep.to(tl.int32), 0) - 1, key, mask=keep)
    at = stats_ptr + (row * tl.num_programs(1) + c) * 3
    tl.store(at, tl.sum(keep.to(tl.int64)))
    tl.store(at + 1, tl.max(tl.where(keep, key, NONE)))
    tl.store(at + 2, tl.min(tl.where(keep, key, 9223372036854775807)))


@triton.jit
def _packed(src, count, o, CHUNK: tl.constexpr, C_POW2: tl.constexpr, W: tl.constexpr):
    """Keys o..o + W of each chunk's packed keys src[c * CHUNK:][:count[c]]: [W, C_POW2], and
    which are there. Through L2 (.cg): the select's threads read what the others stored.
    One key a thread, a chunk's keys along the lanes (_one_a_thread): the layout of the
    scattered store that packs them, and a chunk's cumsum and count stay within a warp."""
    j = o + tl.arange(0, W)
    there = j[:, None] < count[None, :]
    key = tl.load(src + _one_a_thread(j)[:, None] + tl.arange(0, C_POW2)[None, :] * CHUNK, mask=there, other=0,
                  cache_modifier=".cg")
    return key, there


@triton.jit
def _split_round(src, count, d, last, shift, b, bound, top, FIRST: tl.constexpr, CHUNK: tl.constexpr,
                 C_POW2: tl.constexpr, W: tl.constexpr, GPU: tl.constexpr):
    """One round's pass over the candidates, given its boundary digit d: those above it (and on
    it, in the last round) are in the Top-K (the bound falls to their smallest, each chunk's
    count in top rises); those on it stay, packed at the front of their chunk's span. The
    digit is _first_digit (bar bin b) with FIRST = its bits, else the 8 bits from `shift`.
    (the candidates' new counts, bound, top)"""
    LARGEST: tl.constexpr = 9223372036854775807
    chunks = tl.arange(0, C_POW2)
    kept = tl.zeros([C_POW2], tl.int32)
    low = tl.full([W, C_POW2], LARGEST, tl.int64)  # reduced once a round, not once a step
    ups = tl.zeros([W, C_POW2], tl.int32)
    for o in range(0, tl.max(count, axis=0), W):
        key, there = _packed(src, count, o, CHUNK, C_POW2, W)
        if FIRST:
            digit = _first_digit(key, b, FIRST)
        else:
            digit = _digit(key, shift)
        up = there & ((digit > d) | (last & (digit == d)))
        on = there & (digit == d) & ~last
        low = tl.minimum(low, tl.where(up, key, LARGEST))
        ups += up.to(tl.int32)
        # In place: a key moves to or before where it was read in its chunk (the cumsum
        # waits for the loads of the keys before it).
        at_on = kept[None, :] + tl.cumsum(on.to(tl.int32), axis=0) - 1
        tl.store(src + chunks[None, :] * CHUNK + at_on, key, mask=on)
        kept += tl.sum(on.to(tl.int32), axis=0)
    bound = tl.minimum(bound, tl.min(tl.min(low, axis=0), axis=0))
    top += tl.sum(ups, axis=0)
    # The next round reads what other threads stored: after a barrier.
    total = tl.max(_after_barrier(tl.sum(kept) + tl.zeros([1], tl.int32), GPU), axis=0)
    return tl.where(total >= 0, kept, 0), bound, top


@triton.jit
def _select_kernel(kept_ptr, stats_ptr, first_ptr, bar_bin_ptr, bound_ptr, need_ptr, before_ptr, N, C, TOPK,
                   CHUNK: tl.constexpr, C_POW2: tl.constexpr, W: tl.constexpr, FIRST_BITS: tl.constexpr,
                   GPU: tl.constexpr, PDL: tl.constexpr):
    """One program per row: the bound of its Top-K, by a radix select over the keys its chunks
    kept, and how many keys at or above it come before each chunk's. A round histograms the
    candidates' digit (8 bits, from the highest bit on which the kept keys differ down);
    those above the boundary digit are in the Top-K (the bound falls to their smallest),
    those on it stay, packed at the front of their chunk's span; the round whose digit ends
    exactly at the need-th best takes that digit's keys too and is the last (keys are
    unique: one comes by bit 0). The bound is then the need-th best key itself, or the
    largest key when need is 0. With FIRST_BITS (the keep launch dropped keys below a bar
    bin), the first round's histogram is the one the keep launch counted (_first_digit):
    the keys above the bar's bin as one digit, those in it by their next 8 bits."""
    NONE: tl.constexpr = -9223372036854775807 - 1
    LARGEST: tl.constexpr = 9223372036854775807
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # for the keep grid's kept, stats and first
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, C_POW2)
    at = stats_ptr + (row * C + chunks) * 3
    count = tl.load(at, mask=chunks < C, other=0).to(tl.int32)
    kmax = tl.max(tl.load(at + 1, mask=chunks < C, other=NONE))
    kmin = tl.min(tl.load(at + 2, mask=chunks < C, other=LARGEST))
    shift = tl.sum(((kmin ^ kmax) >> tl.arange(0, 64).to(tl.int64) != 0).to(tl.int32)).to(tl.int64)  # the highest differing bit + 1
    need = tl.minimum(tl.sum(count), TOPK)
    src = kept_ptr + row * N
    bound = tl.full([], LARGEST, tl.int64)
    top = tl.zeros([C_POW2], tl.int32)  # each chunk's keys at or above the bound
    left = need
    going = left > 0
    if FIRST_BITS:
        b = tl.load(bar_bin_ptr + row)
        d, above, last = _boundary(tl.load(first_ptr + row * 512 + tl.arange(0, 512)), left, 512)
        count, bound, top = _split_round(src, count, d, last, shift, b, bound, top, FIRST_BITS, CHUNK, C_POW2, W,
                                         GPU)
        left -= above
        going = going & (~last) & (left > 0)
        # The candidates share their top FIRST_BITS + 8 bits; unless seen undercounted the
        # keys above the bar's bin so that the boundary fell among them: then they share what
        # all the kept keys share.
        shift = tl.where(d < 256, 64 - FIRST_BITS - 8, shift).to(tl.int64)
    while going:
        shift -= 8  # the first round's digit: the top 8 of the bits on which the kept keys differ
        hist = tl.zeros([256], tl.int32)
        for o in range(0, tl.max(count, axis=0), W):
            key, there = _packed(src, count, o, CHUNK, C_POW2, W)
            hist += tl.histogram(tl.reshape(_digit(key, shift), [C_POW2 * W]).to(tl.int32), 256,
                                 mask=tl.reshape(there, [C_POW2 * W]))
        d, above, last = _boundary(hist, left)
        count, bound, top = _split_round(src, count, d, last, shift, shift, bound, top, 0, CHUNK, C_POW2, W, GPU)
        left -= above
        going = (~last) & (left > 0) & (shift > -8)
    tl.store(bound_ptr + row, bound)
    tl.store(need_ptr + row, need)
    tl.store(before_ptr + row * C + chunks, tl.cumsum(top, 0) - top, mask=chunks < C)


@triton.jit
def _chunk_write_kernel(part_ptr, bound_ptr, need_ptr, before_ptr, idx_ptr, score_ptr, N, TOPK,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk): its keys at or above the row's bound (a real key, or the largest
    key when need is 0) as positions and scores, after the earlier chunks' (so in the keys'
    order: ascending position), and its share of the -1 / -inf past need."""
    if PDL:
        gdc_wait()  # for the select grid's bound, need and before
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    C = tl.num_programs(1)
    need = tl.load(need_ptr + row)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(part_ptr + row * N + _one_a_thread(offs), mask=offs < N, other=-9223372036854775807 - 1)
    top = (key >= tl.load(bound_ptr + row)) & (need > 0)
    at = row * TOPK + tl.load(before_ptr + row * C + c) + tl.cumsum(top.to(tl.int32), 0) - 1
    ordered = (key >> 32).to(tl.int32)
    score = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    tl.store(idx_ptr + at, (0x7FFFFFFF - (key & 0xFFFFFFFF)).to(tl.int32), mask=top)
    tl.store(score_ptr + at, score, mask=top)
    for s0 in range(c * BLOCK, TOPK, C * BLOCK):
        s = s0 + _one_a_thread(tl.arange(0, BLOCK))  # the layout of the stores above
        pad = (s >= need) & (s < TOPK)
        tl.store(idx_ptr + row * TOPK + s, tl.full([BLOCK], -1, tl.int32), mask=pad)
        tl.store(score_ptr + row * TOPK + s, tl.full([BLOCK], float("-inf"), tl.float32), mask=pad)


# Keys per loop step of the select: [chunks, SELECT_KEYS // chunks]. (512, 2048 and 4096 lost up
# to 7 us or tied, in the six-launch ordering and in the three-launch one: H100, runs 77 and 90.
# Holding all of a row's kept keys in registers, a histogram over them each round, lost 7-11 us:
# run 91.)
SELECT_KEYS = 1024

# Keys per program of the keep and write launches.
# 4096 (half the programs) lost 3-4 us at one row and tied elsewhere (H100, runs 70 and 101).
ORDER_CHUNK_KEYS = 2048


def chains_launches() -> bool:
    """Whether the kernels chain their launches by programmatic dependent launch: CUDA from
    sm_90 (Hopper) on, where griddepcontrol exists; never in the interpreter."""
    if isinstance(_select_kernel, InterpretedFunction):
        return False
    target = triton.runtime.driver.active.get_current_target()
    return target.backend == "cuda" and target.arch >= 90


def order_keys(part: torch.Tensor, topk: int, seen: torch.Tensor | None = None,
               first: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, splits, width] keys in ascending position (NONE where there is none) -> the
    best topk positions [R, topk] int32 in ascending order, and their fp32 scores, -1 /
    -inf past the real keys. Three launches, no host sync (CUDA-graph capturable): keep,
    select, write. Replaces torch.topk over the keys, whose radix select and sort took
    55-130 us at any width (run 42), and ranks by score, which compared every selected key
    with every other (75 us at 64 x 128K, run 74). Keys are unique per position, so the set
    is the reference's (see _encode); order_keys_torch is the reference.

    seen [R, 2^bits] int32: counts of keys of each row by their top bits, every count a key
    that exists (the scoring kernel's shared-bar histogram). The keep launch then drops the
    keys below the bar they give for topk: a split's Top-KP mostly falls below the Top-K of
    a row split many ways, and the select reads only what is left.
    first [R, 512] int32 zeros: the select's first-round histogram, zeroed by the caller in the
    memset that zeroes seen (indexer_topk), else here.

    On sm_90 and later the three launches follow each other, and the scoring kernel before them, by
    programmatic dependent launch: each is scheduled while the one before runs and waits
    (griddepcontrol.wait) for its whole grid before reading what it wrote, so no launch gap
    sits between them. With first's memset folded into seen's, 1 x 32K took 27.5 against
    30.2 us and 8 x 32K 52.2 against 54.2 (H100, run 100)."""
    R = part.shape[0]
    part = part.reshape(R, -1).contiguous()
    N = part.shape[1]
    idx = torch.empty(R, topk, dtype=torch.int32, device=part.device)
    scores = torch.empty(R, topk, dtype=torch.float32, device=part.device)
    if R == 0 or topk == 0:
        return idx, scores
    block = min(ORDER_CHUNK_KEYS, triton.next_power_of_2(N))
    C = triton.cdiv(N, block)
    c_pow2 = triton.next_power_of_2(C)
    kept = torch.empty_like(part)
    stats = torch.empty(R, C, 3, dtype=torch.int64, device=part.device)  # kept keys: count, max, min
    bound = torch.empty(R, dtype=torch.int64, device=part.device)  # the row's need-th best key
    need = torch.empty(R, dtype=torch.int32, device=part.device)
    before = torch.empty(R, C, dtype=torch.int32, device=part.device)
    seen_bits = 0 if seen is None else seen.shape[1].bit_length() - 1
    # With seen, the keep launch also counts the select's first round (_first_digit).
    if first is None:  # called alone: its own memset
        first = torch.zeros(R, 512, dtype=torch.int32, device=part.device) if seen_bits else stats
    bar_bin = torch.empty(R, dtype=torch.int64, device=part.device) if seen_bits else stats  # unused without seen
    gpu = not isinstance(_select_kernel, InterpretedFunction)
    pdl = chains_launches()
    chained = {"launch_pdl": True} if pdl else {}
    _chunk_keep_kernel[(R, C)](part, kept, stats, part if seen is None else seen, first, bar_bin, N, topk, BLOCK=block,
                               SEEN_BITS=seen_bits, PDL=pdl, num_warps=8, **chained)
    _select_kernel[(R,)](kept, stats, first, bar_bin, bound, need, before, N, C, topk, CHUNK=block, C_POW2=c_pow2,
                         W=max(1, SELECT_KEYS // c_pow2), FIRST_BITS=seen_bits,
                         GPU=gpu, PDL=pdl, num_warps=8, **chained)
    _chunk_write_kernel[(R, C)](part, bound, need, before, idx, scores, N, topk, BLOCK=block, PDL=pdl, num_warps=8,
                                **chained)
    return idx, scores


def encode_keys_torch(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """_encode in PyTorch: int64 keys whose signed order is (score, -position)."""
    bits = torch.where(scores == 0, 0.0, scores.float()).view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
    return (ordered << 32) | (0x7FFFFFFF - positions.long())


def shared_counts_torch(part: torch.Tensor, bits: int = SHARED_BAR_BITS) -> torch.Tensor:
    """Keys [R, ...] (NONE where none) -> [R, 2^bits] int32: each row's real keys counted once
    by their top bits, a `seen` for order_keys like the scoring kernel's shared histogram
    (which also counts keys a program later let go)."""
    keys = part.reshape(part.shape[0], -1)
    none = torch.iinfo(torch.int64).min
    bins = ((keys ^ none) >> (64 - bits)) & ((1 << bits) - 1)
    seen = torch.zeros(keys.shape[0], 1 << bits, dtype=torch.int32, device=keys.device)
    return seen.scatter_add_(1, bins, (keys != none).to(torch.int32))


def by_position(idx: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Top-K [R, K] (-1 / -inf padded) in the kernels' order: ascending position, padding last."""
    order = torch.where(idx >= 0, idx.long(), torch.iinfo(torch.int64).max).argsort(dim=1)
    return idx.gather(1, order), scores.gather(1, order)


def order_keys_torch(part: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of order_keys: one torch.topk over each row's keys."""
    keys = part.flatten(1)
    if keys.shape[1] < topk:
        keys = torch.cat([keys, keys.new_full((keys.shape[0], topk - keys.shape[1]), torch.iinfo(torch.int64).min)], 1)
    keys = keys.topk(topk, dim=1).values
    found = keys != torch.iinfo(torch.int64).min
    pos = torch.where(found, 0x7FFFFFFF - (keys & 0xFFFFFFFF), -1).to(torch.int32)
    ordered = (keys >> 32).to(torch.int32)
    bits = torch.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return by_position(pos, torch.where(found, bits.view(torch.float32), float("-inf")))


def takes_e4m3(group: int, head_dim: int) -> bool:
    """Whether the GPU's dot takes MXFP8 data as stored (e4m3, accumulating in fewer bits than
    fp32): with one scale a vector, which folds into the head weight and the score, and a head
    dim that reaches the e4m3 MMA's K of 32. Other groups are dequantized to bf16 on load."""
    return group == head_dim >= 32


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    req_to_token: torch.Tensor,
    row_req: torch.Tensor,
    row_len: torch.Tensor,
    topk: int,
    return_scores: bool = False,
    block_s: int = 128,
    block_m: int = 1,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    programs: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    rows_per_request: int | None = None,
    tree: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Top-K history positions per query row.

    q: [R, H, D] index queries; weights: [R, H] head weights with every scale folded in;
    index_k: [slots, D] index-K cache; req_to_token: [reqs, max_len] position -> slot;
    row_req: [R] request (row of req_to_token) of each query row; row_len: [R] how many
    leading positions the row sees (a causal prefill token at position p sees p + 1).
    MXFP8 (kernels.mxfp8): q and index_k hold e4m3 data and q_scale [R, H, D // G],
    k_scale [slots, D // G] their e8m0 scale bytes; the group size G follows from them.
    block_m > 1 lets up to block_m consecutive rows of one request (prefill, verify) share
    each K tile; decode rows (one per request) want 1. It is capped at 4096 // KP rows: a
    merge holds the block's 2 KP keys per row in registers, and beyond that they spill
    (tests/compile_for_sm90.py compiles the served shapes).
    programs: about how many programs to run (default: 2 per SM; one per SM with 8 warps was
    12-25% slower at 8 x 128K and up, 1-4 us faster at 1-8 x 32K: H100, run 87). When there
    are fewer row blocks, the history is split across programs (split-K, as in
    flash-decoding) and the splits' Top-Ks are merged by the ordering that orders them
    anyway (order_keys): a few KP-wide rows per query row, never a score per position.
    num_warps: per program.
    num_stages: Triton's software pipelining depth for the tile loads (loading the next tile by hand into registers
    instead measured no faster, run 18); the page-table lookup takes one stage of it, and
    below 5 no tile loads while another computes (tests/compile_for_sm90.py reports it as
    loop_copy_wait). Deeper, with one or two tiles loading meanwhile, measured no faster
    (64 or 128 positions x 5 or 7 stages, H100, run 74): the tile's instructions, not its
    loads, set its time. block_s: positions per tile; 128 measured fastest on the H200 (run
    18) and the H100 (run 74), and two such programs still fit on one SM.
    rows_per_request: every request has this many consecutive rows (speculative verify):
    row blocks are then fixed, and the launch captures in a CUDA graph like decode's.
    tree: (tail_start [R], tail_bits [R] int64[, tail_skip [R]]) for rows of a draft tree (tree
    verify, or a branch of a tree draft): the row sees its positions before tail_start as usual,
    none of the next tail_skip (default 0: other branches' pages in a paged tree draft) and, of
    the draft positions tail_start + tail_skip + i (i < 64) below row_len, only those whose bit
    i is set in tail_bits: its own path, not its siblings'. Unset rows see nothing beyond tail_start.
    Returns positions [R, topk] int32, ascending (-1 padded), and their fp32 scores if asked.
    """
    R, H, D = q.shape
    q, index_k = q.contiguous(), index_k.contiguous()
    if D < 16 or D & (D - 1):
        raise ValueError(f"index head dim must be a power of two >= 16, got {D}")
    group = 0
    if (q_scale is None) != (k_scale is None):
        raise ValueError("MXFP8 needs both q_scale and k_scale")
    if q_scale is not None:
        groups = q_scale.shape[-1]
        group = D // max(groups, 1)
        if not groups or D % groups or q_scale.shape != (R, H, groups) or k_scale.shape != (index_k.shape[0], groups):
            raise ValueError(f"MXFP8 scales {tuple(q_scale.shape)} / {tuple(k_scale.shape)} do not match "
                             f"q {tuple(q.shape)} / index_k {tuple(index_k.shape)}")
        q_scale, k_scale = q_scale.contiguous(), k_scale.contiguous()
    elif q.dtype not in _TL_DTYPES:
        raise ValueError(f"q of dtype {q.dtype} needs its MXFP8 scales (q_scale, k_scale)")
    else:
        q_scale = k_scale = q  # unused placeholders
    # Dequantized MXFP8 values are exact in bf16; the interpreter cannot run bf16, fp32 is exact too.
    # (Compiled, not interpreted, as on a GPU: tests/compile_for_sm90.py compiles what runs there.)
    gpu = not isinstance(_indexer_topk_kernel, InterpretedFunction)
    dot_dtype = _TL_DTYPES.get(q.dtype) if not group else (
        (tl.float8e4nv if takes_e4m3(group, D) else tl.bfloat16) if gpu else tl.float32)
    kp = max(triton.next_power_of_2(topk), 16)
    if kp > 16384:  # a merge counts its 2 KP keys in 16-bit fields
        raise ValueError(f"topk must be at most 16384, got {topk}")
    block_s = min(block_s, kp)
    if block_m & (block_m - 1) or block_m < 1:
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    block_m = min(block_m, max(1, 4096 // kp))
    if rows_per_request:
        block_m = math.gcd(block_m, rows_per_request)
    tail_start, tail_bits, tail_skip = _check_tree(tree, R)
    idx = torch.empty(R, topk, dtype=torch.int32, device=q.device)
    scores = torch.empty(R, topk, dtype=torch.float32, device=q.device)
    if R:
        weights = weights.float()
        # Fixed blocks: one row each, or rows_per_request a multiple of block_m. The kernel
        # finds their rows itself, and the launch captures in a CUDA graph.
        fixed = block_m == 1 or bool(rows_per_request)
        starts, ends = (row_req, row_req) if fixed else _row_blocks(row_req, block_m)  # unused when fixed
        blocks = triton.cdiv(R, block_m) if fixed else starts.shape[0]
        block_h = max(triton.next_power_of_2(H), 16 // block_m)  # the dot needs N = block_m * block_h >= 16
        if programs is None:
            programs = 2 * torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        history = max(req_to_token.shape[1], 1)
        split_len = _split_len(history, blocks, programs, block_s)
        splits = triton.cdiv(history, split_len)
        in_place = stores_in_place(split_len, splits, kp)
        part = torch.empty(R, splits, split_len if in_place else min(kp, split_len), dtype=torch.int64, device=q.device)
        cand = torch.empty(1 if in_place else blocks * splits * block_m * 2 * kp, dtype=torch.int64, device=q.device)
        # One program a row has no one to share with. Where splits are no longer than KP
        # (1 x 4K-128K, 8 x 32K: 512 positions) the atomics, 8-264 programs on one row's
        # bins, cost 4-7 us (H100, run 78), and the counts let the ordering drop all but
        # about K of the row's keys.
        shared_bits = SHARED_BAR_BITS if splits > 1 else 0
        # The shared histogram and the select's first round: one memset, before the scoring launch, so
        # that the ordering's launches follow it directly (programmatic dependent launch).
        counts = torch.zeros(R * ((1 << shared_bits) + 512), dtype=torch.int32, device=q.device) if shared_bits else None
        seen = counts[:R << shared_bits].view(R, -1) if shared_bits else part  # unused without
        first = counts[R << shared_bits:].view(R, 512) if shared_bits else None
        _indexer_topk_kernel[(blocks, splits)](
            q, weights, index_k, req_to_token, row_req, row_len, starts, ends, q_scale, k_scale, part, cand, seen,
            *((row_len,) * 3 if tree is None else (tail_start, tail_bits, tail_skip)),
            q.stride(0), q.stride(1), weights.stride(0), index_k.stride(0), req_to_token.stride(0),
            q_scale.stride(0), q_scale.stride(1), k_scale.stride(0),
            H, split_len, R,
            D=D, BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_S=block_s, KP=kp, GROUP=group, DOT_DTYPE=dot_dtype,
            GPU=gpu, TREE=tree is not None, PDL=chains_launches(),
            FIXED_BLOCKS=fixed, SHARED_BITS=shared_bits, IN_PLACE=in_place, num_warps=num_warps,
            num_stages=num_stages,
        )
        idx, scores = order_keys(part, topk, seen=seen if shared_bits else None, first=first)
    return (idx, scores) if return_scores else idx


def _check_tree(tree, R: int):
    """(tail_start, tail_bits, tail_skip) as int64 [R], or (None,) * 3 without a tree."""
    if tree is None:
        return None, None, None
    if len(tree) not in (2, 3):
        raise ValueError(f"tree wants (tail_start, tail_bits[, tail_skip]); got {len(tree)} tensors")
    tail_start, tail_bits = tree[:2]
    tail_skip = tree[2] if len(tree) == 3 else torch.zeros_like(tail_start)
    if tail_start.shape != (R,) or tail_bits.shape != (R,) or tail_skip.shape != (R,) or tail_bits.dtype != torch.int64:
        raise ValueError(f"tree wants tail_start, tail_skip [R] and int64 tail_bits [R] for R = {R} rows; got "
                         f"{tuple(tail_start.shape)}, {tuple(tail_skip.shape)} and {tuple(tail_bits.shape)} "
                         f"{tail_bits.dtype}")
    return tail_start.to(torch.int64).contiguous(), tail_bits.contiguous(), tail_skip.to(torch.int64).contiguous()


def tree_visible(tail_start: torch.Tensor, tail_bits: torch.Tensor, positions: torch.Tensor,
                 tail_skip: torch.Tensor | None = None) -> torch.Tensor:
    """[R, S] whether each row sees each position under a draft tree (see indexer_topk's tree)."""
    rel = positions[None, :] - tail_start[:, None]
    if tail_skip is not None:
        rel = rel - tail_skip[:, None]
    bit = (tail_bits[:, None] >> rel.clamp(0, 63)) & 1
    return (positions[None, :] < tail_start[:, None]) | ((rel >= 0) & (bit != 0))


def indexer_topk_torch(q, weights, index_k, req_to_token, row_req, row_len, topk, return_scores=False,
                       q_scale=None, k_scale=None, score_bytes: int = 256 << 20, tree=None):
    """Reference of indexer_topk: reference.ops scoring and Top-K (reference.ops.topk_positions)
    over each row's history, gathered for blocks of rows padded to the block's longest
    history; score_bytes bounds one block's fp32 logits [rows, heads, history]."""
    group = q.shape[-1] // q_scale.shape[-1] if q_scale is not None else 0
    if group:
        q = dequantize_mxfp8(q, q_scale, group)
    R, H = q.shape[:2]
    tail_start, tail_bits, tail_skip = _check_tree(tree, R)
    idx = torch.full((R, topk), -1, dtype=torch.int32, device=q.device)
    scores = torch.full((R, topk), float("-inf"), dtype=torch.float32, device=q.device)
    longest = int(row_len.max()) if R else 0
    block = max(1, score_bytes // (4 * H * max(longest, 1)))
    for r0 in range(0, R, block):
        rows = slice(r0, min(R, r0 + block))
        L = int(row_len[rows].max())
        if L == 0:
            continue
        slots = req_to_token[row_req[rows].long(), :L].long()
        keys = dequantize_mxfp8(index_k[slots], k_scale[slots], group) if group else index_k[slots].float()  # [B, L, D]
        logits = torch.einsum("bhd,bld->bhl", q[rows].float(), keys).relu_()
        s = torch.einsum("bh,bhl->bl", weights[rows].float(), logits)
        positions = torch.arange(L, device=s.device)
        s = s.masked_fill(positions[None, :] >= row_len[rows, None], float("-inf"))
        if tree is not None:
            visible = tree_visible(tail_start[rows], tail_bits[rows], positions, tail_skip[rows])
            s = s.masked_fill(~visible, float("-inf"))
        sel = topk_positions(s, topk)
        idx[rows] = sel.to(torch.int32)
        scores[rows] = torch.where(sel >= 0, torch.gather(s, 1, sel.clamp(min=0)), float("-inf"))
    idx, scores = by_position(idx, scores)
    return (idx, scores) if return_scores else idx
