"""Context-parallel prefill: zigzag partition of requests over ranks, KDA state summaries."""
