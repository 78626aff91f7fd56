"""The fp32 expert path the model takes on a GPU (SGLang's Triton experts compute fp32 in
fp16) against the golden model's MoE ops: same routing, same weighted expert sum."""

from types import SimpleNamespace

import pytest
import torch

from sglang_hybrid.models.hybrid_linear_sparse import _routed_experts_fp32
from sglang_hybrid.reference import ops


def test_dense_fp32_experts_match_reference_expert_sum():
    g = torch.Generator().manual_seed(0)
    T, H, I, E, K = 7, 16, 8, 6, 2
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w1, w3 = torch.randn(2, E, I, H, generator=g, dtype=torch.float64)
    w2 = torch.randn(E, H, I, generator=g, dtype=torch.float64)
    weights, ids = ops.moe_route(torch.randn(T, E, generator=g, dtype=torch.float64),
                                 torch.zeros(E, dtype=torch.float64), K, 2, 1, True, 1.0)
    experts = SimpleNamespace(w13_weight=torch.cat([w1, w3], 1), w2_weight=w2, num_experts=E)

    got = _routed_experts_fp32(experts, x, (weights, ids, None))

    want = sum(weights[:, k, None] * torch.stack([ops.silu_mlp(x[t:t + 1], w1[e], w3[e], w2[e])[0]
                                                  for t, e in enumerate(ids[:, k].tolist())])
               for k in range(K))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert ids.unique().numel() > 1  # several experts really took part


def test_expert_parallel_shards_are_refused_by_name():
    experts = SimpleNamespace(w13_weight=torch.zeros(2, 4, 4), w2_weight=torch.zeros(2, 4, 2), num_experts=8)
    x = torch.zeros(1, 4)
    with pytest.raises(NotImplementedError, match="expert parallelism"):
        _routed_experts_fp32(experts, x, (torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long), None))
