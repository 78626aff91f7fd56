"""Per-rank prefill work of the zigzag partition against a contiguous split (host-side, no GPU).

Work per rank: indexer positions scored (a token at position p scores p + 1) and sparse
attention positions attended (min(Top-K, p + 1)); the spread is max / min over ranks.

    python benchmarks/cp_partition_work.py > benchmarks/results/cp_partition_work.md
"""

from __future__ import annotations

from sglang_hybrid.parallel.zigzag import contiguous_plan, rank_work, zigzag_plan

TOPK = 2048
BATCHES = {"one 128K request": [131072], "32K + 8K + 1000": [32768, 8192, 1000], "8 x 4K": [4096] * 8}


def main() -> None:
    print("| batch | ranks | indexer spread zigzag / contiguous | attention spread zigzag / contiguous |")
    print("|---|---:|---:|---:|")
    for name, lengths in BATCHES.items():
        for world in (2, 4, 8):
            row = []
            for key in ("indexer_positions", "attended_positions"):
                spread = []
                for make in (zigzag_plan, contiguous_plan):
                    work = [w[key] for w in rank_work(make(lengths, world), TOPK)]
                    spread.append(max(work) / min(work))
                row.append(f"{spread[0]:.3f} / {spread[1]:.3f}")
            print(f"| {name} | {world} | {row[0]} | {row[1]} |")


if __name__ == "__main__":
    main()
