"""A KDA layer's recurrence and short conv under zigzag context parallelism.

Each rank holds chunks r and 2W-1-r of every request (parallel.zigzag). Per request it
summarizes its two chunks (parallel.kda_summary: S_out = M S_in + E), all ranks
all-gather the summaries and the chunks' conv tails (the last width-1 pre-conv inputs),
every rank folds the request's 2W chunks in sequence order (fp32), and each rank then
runs its chunks from their true incoming state and window. All ranks end with the
request's final state and window (each rank keeps its own copy of the cache).

A snapshot inside the new tokens (`cuts`: the radix cache's state after c of them) is
known only to the rank whose chunk holds token c: it runs that chunk in two pieces, and
one all-reduce (the other ranks add zeros, exact) gives every rank the pair.

Communication per layer: one all-gather of B x 2 x H x K x (K + V) fp32 summaries and one
of B x 2 x (width-1) x D conv tails per rank, independent of the chunk length.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from sglang_hybrid.parallel.kda_summary import conv_windows, each_sequence, fold_states, summary_by_recurrence
from sglang_hybrid.parallel.zigzag import chunk_bounds, zigzag_chunks
from sglang_hybrid.reference.ops import kda_recurrence, short_causal_conv


def local_chunks(lengths: list[int], world: int, rank: int) -> list[list[slice]]:
    """Per request, the slices of this rank's token rows holding its chunks r and 2W-1-r
    (rows: chunk r of every request, then chunk 2W-1-r of every request; ZigzagPlan)."""
    sizes = [[bounds[c + 1] - bounds[c] for c in zigzag_chunks(rank, world)]
             for bounds in (chunk_bounds(n, 2 * world) for n in lengths)]
    out, front, back = [], 0, sum(s[0] for s in sizes)
    for first, second in sizes:
        out.append([slice(front, front + first), slice(back, back + second)])
        front, back = front + first, back + second
    return out


def _in_sequence_order(gathered: list, world: int) -> list:
    """[rank][slot] -> the request's 2W chunks in order: chunk c < W is rank c's first,
    chunk c >= W is rank 2W-1-c's second."""
    return [gathered[c][0] for c in range(world)] + [gathered[2 * world - 1 - c][1] for c in range(world, 2 * world)]


def _cut_chunk(cut: int, bounds: list[int]) -> int:
    """The chunk that holds a request's token `cut` - 1 (chunk 0 for cut 0: the state before
    the new tokens, which every rank has; its owner contributes it)."""
    return next(c for c in range(len(bounds) - 1) if cut <= bounds[c + 1]) if cut else 0


def _pieces(s: slice, chunk: int, bounds: list[int], cut: int | None) -> tuple[slice, slice | None]:
    """A chunk's rows split where a snapshot falls in it: (rows before, rows after), or (s, None)."""
    if cut is None or _cut_chunk(cut, bounds) != chunk:
        return s, None
    split = s.start + cut - bounds[chunk]
    return slice(s.start, split), slice(split, s.stop)


def _owned_snapshots(snaps: torch.Tensor, group) -> torch.Tensor:
    """Each snapshot filled by its owner, zeros elsewhere -> every rank has all of them."""
    if snaps.numel():
        dist.all_reduce(snaps, group=group)
    return snaps


def conv_cp(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, lengths: list[int], group=None,
            cuts: dict[int, int] | None = None):
    """Short causal conv + SiLU of this rank's pre-conv rows x [T_local, D].
    windows: [B, width-1, D] each request's window before its new tokens (all ranks the
    same). cuts: {request: c} for windows wanted after c of its new tokens. Returns
    (out [T_local, D], final windows [B, width-1, D], windows at the cuts [len(cuts), width-1, D]
    in request order)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    keep = weight.shape[1] - 1
    mine = local_chunks(lengths, world, rank)
    # Each chunk's last `keep` rows (fewer if it is shorter), padded, with their count.
    tails = x.new_zeros(len(lengths), 2, keep, x.shape[1])
    counts = torch.zeros(len(lengths), 2, dtype=torch.int64)
    for i, pair in enumerate(mine):
        for j, s in enumerate(pair):
            rows = x[s][max(0, s.stop - s.start - keep):]
            tails[i, j, keep - rows.shape[0]:] = rows
            counts[i, j] = rows.shape[0]
    all_tails, all_counts = _all_gather(tails, group), _all_gather(counts, group)
    out = torch.empty_like(x)
    finals = []
    cuts = cuts or {}
    snaps = windows.new_zeros(len(cuts), keep, x.shape[1])
    slot = {i: n for n, i in enumerate(sorted(cuts))}
    for i, pair in enumerate(mine):
        per_chunk = _in_sequence_order([[all_tails[r][i, j, keep - int(all_counts[r][i, j]):] for j in (0, 1)]
                                        for r in range(world)], world)
        entering = conv_windows(per_chunk, windows[i])
        bounds = chunk_bounds(lengths[i], 2 * world)
        for s, c in zip(pair, zigzag_chunks(rank, world)):
            out[s] = short_causal_conv(x[s], entering[c], weight)[0]
            before, after = _pieces(s, c, bounds, cuts.get(i))
            if after is not None:
                snaps[slot[i]] = conv_windows([x[before]], entering[c])[-1]
        finals.append(entering[-1])
    return out, torch.stack(finals), _owned_snapshots(snaps, group)


def kda_cp(q, k, v, g, beta, initial: torch.Tensor, lengths: list[int], group=None, cuts: dict[int, int] | None = None,
           recurrence=each_sequence(kda_recurrence), summary=None):
    """The gated delta rule over this rank's rows (q, k: [T_local, H, K]; v: [T_local, H, V];
    g: [T_local, H, K]; beta: [T_local, H]) of a zigzag-partitioned batch. initial: [B, H, K, V]
    each request's state before its new tokens; cuts: {request: c} for states wanted after c
    of its new tokens. Returns (o [T_local, H, V], final states [B, H, K, V], states at the
    cuts [len(cuts), H, K, V] in request order), states in fp32.

    The rank's chunks, each cut in two where a snapshot falls in it, are its pieces, in row
    order. One summary call gives every piece's (M, E); a cut chunk's map is its two pieces'
    composed. After the all-gather and the fold, one recurrence call runs every piece from its
    true incoming state: a chunk's, or for the piece after a cut, the snapshot M S + E of the
    piece before it. recurrence: (q, k, v, g, beta, states [N, ...], cu) -> (o, finals) over N
    sequences of rows cu[n]:cu[n + 1] (kda_summary.each_sequence), the reference by default;
    summary: (k, v, g, beta, cu) -> (M [N, ...], E [N, ...]), by default one run of the
    recurrence (kda_summary.summary_by_recurrence)."""
    summary = summary or functools.partial(summary_by_recurrence, recurrence)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    B, H, K, V = len(lengths), q.shape[1], k.shape[2], v.shape[2]
    mine, ids, cuts = local_chunks(lengths, world, rank), zigzag_chunks(rank, world), cuts or {}
    pieces = []  # (request, which of its two chunks, rows), in row order
    for j in (0, 1):
        for i, pair in enumerate(mine):
            for rows in _pieces(pair[j], ids[j], chunk_bounds(lengths[i], 2 * world), cuts.get(i)):
                if rows is not None:
                    pieces.append((i, j, rows))
    cu = [0] + [rows.stop for _, _, rows in pieces]
    M, E = summary(k, v, g, beta, cu) if pieces else (q.new_zeros(0, H, K, K), q.new_zeros(0, H, K, V))
    maps = {}  # (request, chunk of its two) -> the chunk's (M, E)
    for (i, j, _), m, e in zip(pieces, M.float(), E.float()):
        if (i, j) in maps:  # the piece after a cut: its map follows the one before
            m0, e0 = maps[(i, j)]
            m, e = torch.bmm(m, m0), torch.bmm(m, e0) + e
        maps[(i, j)] = m, e
    summaries = torch.stack([torch.stack([torch.cat(maps[(i, j)], dim=-1) for j in (0, 1)]) for i in range(B)]) \
        if B else q.new_zeros(0, 2, H, K, K + V, dtype=torch.float32)
    gathered = _all_gather(summaries, group)  # [W] x [B, 2, H, K, K + V]
    states = [fold_states(_in_sequence_order([[(gathered[r][i, j, ..., :K], gathered[r][i, j, ..., K:])
                                                for j in (0, 1)] for r in range(world)], world), initial[i])
              for i in range(B)]
    snaps = initial.new_zeros((len(cuts),) + tuple(initial.shape[1:]), dtype=torch.float32)
    slot = {i: n for n, i in enumerate(sorted(cuts))}
    incoming = []
    for n, (i, j, _) in enumerate(pieces):
        if n and pieces[n - 1][:2] == (i, j):  # after a cut: the snapshot, from the piece before it
            snaps[slot[i]] = torch.bmm(M[n - 1].float(), incoming[-1]) + E[n - 1].float()
            incoming.append(snaps[slot[i]])
        else:
            incoming.append(states[i][ids[j]])
    o = recurrence(q, k, v, g, beta, torch.stack(incoming), cu)[0] if pieces else v.new_empty(v.shape)
    finals = torch.stack([s[-1] for s in states]) if B else initial.float()
    return o.to(v.dtype), finals, _owned_snapshots(snaps, group)


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out
