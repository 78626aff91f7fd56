"""The golden model: the whole hybrid family in plain PyTorch, top to bottom.

It reads the same safetensors tensors (HF / Kimi / DeepSeek names) that the SGLang
model loads and computes in fp32 (or fp64). Per-sequence caches are explicit, so
prefill followed by decode gives the same logits as one long prefill: KDA layers
carry (conv window, recurrent state), sparse MLA layers carry (latent KV, rope key,
index key). Every served output in the tests is compared to this model.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from sglang_hybrid.checkpoints.maker import load_weights
from sglang_hybrid.configs.hybrid_linear_sparse import HybridLinearSparseConfig
from sglang_hybrid.kernels.fp8_kv import dequantize_kv_fp8, quantize_kv_fp8_torch
from sglang_hybrid.kernels.mxfp8 import dequantize_mxfp8, quantize_mxfp8_torch
from sglang_hybrid.reference import ops


@dataclass
class KDACache:
    conv: torch.Tensor  # [W-1, 3P] previous pre-conv q|k|v inputs
    state: torch.Tensor  # [H, K, V]


@dataclass
class MLACache:
    latent: list[torch.Tensor] = field(default_factory=list)  # [T, kv_lora_rank] chunks
    rope_key: list[torch.Tensor] = field(default_factory=list)  # [T, qk_rope_head_dim]
    index_key: list[torch.Tensor] = field(default_factory=list)  # [T, index_head_dim]


@dataclass
class SequenceCache:
    layers: list  # KDACache | MLACache per layer
    length: int = 0


@dataclass
class TopKNearTies:
    """The indexer's Top-K is discontinuous: where a row's K-th and (K+1)-th scores differ
    by less than rounding, the same math summed in another order (a server's kernels, other
    prefill chunks) may keep the other position, and the row's attention moves by far more
    than rounding. Installed on a GoldenModel (GoldenModel.probing_index_ties), this records
    every row whose K-th score leads the next by at most `rel` of itself, keyed (layer
    prefix, position), and for the keys in `flips` keeps the (K+1)-th position instead of
    the K-th: a comparison can then tell such a flip from a wrong result."""

    rel: float = 1e-4
    flips: frozenset = frozenset()
    ties: list = field(default_factory=list)

    def visit(self, layer: str, positions: torch.Tensor, scores: torch.Tensor, selected: torch.Tensor) -> None:
        k = selected.shape[1]
        if scores.shape[1] <= k:
            return
        ranked = torch.sort(scores, dim=-1, descending=True, stable=True)  # topk_positions' order and ties
        kth, nxt = ranked.values[:, k - 1], ranked.values[:, k]
        for r in (torch.isfinite(nxt) & (kth > 0) & (kth - nxt <= self.rel * kth)).nonzero().flatten().tolist():
            key = (layer, int(positions[r]))
            self.ties.append(key)
            if key in self.flips:
                selected[r, k - 1] = ranked.indices[r, k]


class GoldenModel:
    def __init__(self, config: HybridLinearSparseConfig, weights: dict[str, torch.Tensor], dtype=torch.float32,
                 device="cpu"):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.w = {name: t.to(self.device, dtype) for name, t in weights.items()}
        lac = config.linear_attn_config
        self.kda_heads, self.kda_dim = lac["num_heads"], lac["head_dim"]
        self.conv_width = lac["short_conv_kernel_size"]
        self.hadamard = (
            ops.hadamard_matrix(config.index_head_dim, dtype).to(self.device) if config.index_use_hadamard else None
        )
        # The server's --kv-cache-dtype: "fp8_e4m3" rounds the MLA latent as the FP8 cache holds it.
        self.kv_cache_dtype = "auto"
        self.index_ties: TopKNearTies | None = None

    # ------------------------------------------------------------------ public
    def new_cache(self) -> SequenceCache:
        c = self.config
        proj = self.kda_heads * self.kda_dim
        layers = []
        for i in range(c.num_hidden_layers):
            if c.is_kda_layer(i):
                layers.append(
                    KDACache(
                        conv=torch.zeros(self.conv_width - 1, 3 * proj, dtype=self.dtype, device=self.device),
                        state=torch.zeros(self.kda_heads, self.kda_dim, self.kda_dim, dtype=self.dtype, device=self.device),
                    )
                )
            else:
                layers.append(MLACache())
        return SequenceCache(layers=layers)

    @torch.no_grad()
    def forward(self, input_ids: list[int], cache: SequenceCache | None = None) -> torch.Tensor:
        """Logits [T, vocab] for the new tokens, continuing the sequence in `cache`."""
        return self.hidden(input_ids, cache if cache is not None else self.new_cache()) @ self._lm_head().T

    @torch.no_grad()
    def hidden(self, input_ids: list[int], cache: SequenceCache) -> torch.Tensor:
        """Final hidden states [T, D] for the new tokens, continuing the sequence in `cache`."""
        positions = torch.arange(cache.length, cache.length + len(input_ids), device=self.device)
        h = self._hidden(input_ids, positions, cache)
        cache.length += len(input_ids)
        return h

    def _forward(self, input_ids, positions, cache):
        return self._hidden(input_ids, positions, cache) @ self._lm_head().T

    def _hidden(self, input_ids, positions, cache):
        """The final hidden states [T, D]: what the LM head reads, and what the draft head is given."""
        x = self._embed(input_ids)
        if self.config.attn_res_block_size is None:
            return self._residual_stream(x, positions, cache)
        return self._attn_res_stream(x, positions, cache)

    def _embed(self, input_ids):
        return self.w["model.embed_tokens.weight"][torch.tensor(input_ids, dtype=torch.long, device=self.device)]

    def with_weights_rounded_to(self, dtype: torch.dtype) -> "GoldenModel":
        """The same model on weights rounded to `dtype` (what a server at that dtype holds),
        still computing in this model's dtype."""
        rounded = GoldenModel(self.config, {k: v.to(dtype) for k, v in self.w.items()}, self.dtype, self.device)
        rounded.kv_cache_dtype = self.kv_cache_dtype
        return rounded

    @contextmanager
    def probing_index_ties(self, flips=(), rel: float = 1e-4):
        """Within: the indexer's near ties recorded and `flips` taken (TopKNearTies)."""
        self.index_ties = TopKNearTies(rel, frozenset(flips))
        try:
            yield self.index_ties
        finally:
            self.index_ties = None

    def logits(self, input_ids: list[int]) -> torch.Tensor:
        """Logits of one full prefill, [T, vocab]."""
        return self.forward(input_ids, self.new_cache())

    @torch.no_grad()
    def generate(self, input_ids: list[int], max_new_tokens: int, stop_token_ids=()) -> list[int]:
        """Greedy continuation (no EOS stop unless stop_token_ids are given)."""
        cache = self.new_cache()
        logits = self.forward(list(input_ids), cache)
        out: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(torch.argmax(logits[-1]))
            out.append(nxt)
            if nxt in stop_token_ids:
                break
            logits = self.forward([nxt], cache)
        return out

    # -------------------------------------------------------------- draft head
    @torch.no_grad()
    def draft(self, input_ids: list[int], hidden: torch.Tensor, cache: MLACache, start: int):
        """The MTP draft head over positions start.. (models.hybrid_linear_sparse_nextn): row t
        takes token x_{t+1} and hidden h_t and predicts x_{t+2}. Returns (logits [T, vocab],
        its own final hidden [T, D], which a later draft step takes as h); `cache` is the head's
        sparse-layer cache, appended to."""
        c, w, eps = self.config, self.w, self.config.rms_norm_eps
        p, L = f"model.layers.{c.draft_layer_id}.", c.draft_layer_id
        positions = torch.arange(start, start + len(input_ids), device=self.device)
        x = torch.cat([ops.rms_norm(self._embed(input_ids), w[p + "enorm.weight"], eps),
                       ops.rms_norm(hidden, w[p + "hnorm.weight"], eps)], dim=-1) @ w[p + "eh_proj.weight"].T
        x = x + self._sparse_mla(L, ops.rms_norm(x, w[p + "input_layernorm.weight"], eps), positions, cache)
        x = x + self._ffn(L, ops.rms_norm(x, w[p + "post_attention_layernorm.weight"], eps), moe=c.is_moe)
        h = ops.rms_norm(x, w[p + "shared_head.norm.weight"], eps)
        return h @ self._lm_head().T, h

    @torch.no_grad()
    def speculative_generate(self, input_ids: list[int], max_new_tokens: int, num_steps: int):
        """Greedy EAGLE chain decoding with the draft head, as SGLang runs it: the head drafts
        num_steps tokens (its first from the last verified position, the rest from its own
        hidden), the target verifies them in one pass, the longest agreeing prefix plus the
        target's next token is kept, and the head's cache is rebuilt over the kept positions
        from the target's hidden states. Returns (tokens, accepted drafts per verify): the
        tokens equal `generate`'s; the counts say what a correct draft head achieves."""
        cache, draft_cache = self.new_cache(), MLACache()
        seq = list(input_ids)
        hidden = self.hidden(seq, cache)
        seq.append(int(torch.argmax(hidden[-1] @ self._lm_head().T)))
        logits, h = self.draft(seq[1:], hidden, draft_cache, 0)
        accepted: list[int] = []
        while len(seq) - len(input_ids) < max_new_tokens:
            n = len(seq) - 1  # target positions processed; seq[n] is the token to verify from
            drafts, step_cache = [int(torch.argmax(logits[-1]))], _copy_mla(draft_cache)
            for i in range(1, num_steps):
                logits_i, h = self.draft([drafts[-1]], h[-1:], step_cache, n + i)
                drafts.append(int(torch.argmax(logits_i[-1])))
            verify_cache = _copy_cache(cache)
            predicted = torch.argmax(self.forward([seq[n], *drafts], verify_cache), dim=-1).tolist()
            m = next((j for j, d in enumerate(drafts) if d != predicted[j]), num_steps)
            accepted.append(m)
            kept = [seq[n], *drafts[:m]]
            hidden = self.hidden(kept, cache)
            seq += drafts[:m] + [predicted[m]]
            logits, h = self.draft(seq[n + 1 :], hidden, draft_cache, n)
        return seq[len(input_ids) :][:max_new_tokens], accepted

    # ---------------------------------------------------------- residual streams
    def _residual_stream(self, x, positions, cache):
        c, w = self.config, self.w
        h = x
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = h + self._mixer(i, ops.rms_norm(h, w[p + "input_layernorm.weight"], c.rms_norm_eps), positions, cache)
            h = h + self._ffn(i, ops.rms_norm(h, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps))
        return ops.rms_norm(h, w["model.norm.weight"], c.rms_norm_eps)

    def _attn_res_stream(self, x, positions, cache):
        """Block attention residuals.

        Blocks of `attn_res_block_size` layers. The embedding is the first block;
        at the first layer of every block the running partial sum is banked as a
        completed block and the partial restarts from the attention output. Each
        sublayer input is its norm over a softmax-weighted mix of the banked
        blocks and the current partial sum, with per-sublayer pseudo-query and key norm.
        """
        c, w, eps = self.config, self.w, self.config.rms_norm_eps

        def mix(rows, name):
            return ops.attn_res_mix(rows, w[name + "_res_proj.weight"], w[name + "_res_norm.weight"], eps)

        bank: list[torch.Tensor] = []
        partial = x
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            attn_in = mix(bank + [partial], p + "self_attention")
            if i % c.attn_res_block_size == 0:
                bank.append(partial)
                partial = None
            a = self._mixer(i, ops.rms_norm(attn_in, w[p + "input_layernorm.weight"], eps), positions, cache)
            partial = a if partial is None else partial + a
            ffn_in = mix(bank + [partial], p + "mlp")
            partial = partial + self._ffn(i, ops.rms_norm(ffn_in, w[p + "post_attention_layernorm.weight"], eps))
        return ops.rms_norm(mix(bank + [partial], "model.output_attn"), w["model.norm.weight"], eps)

    def _lm_head(self):
        if self.config.tie_word_embeddings:
            return self.w["model.embed_tokens.weight"]
        return self.w["lm_head.weight"]

    # ------------------------------------------------------------------ mixers
    def _mixer(self, i, x, positions, cache):
        if self.config.is_kda_layer(i):
            return self._kda(i, x, cache.layers[i])
        return self._sparse_mla(i, x, positions, cache.layers[i])

    def _kda(self, i, x, lc: KDACache):
        w, H, K = self.w, self.kda_heads, self.kda_dim
        p = f"model.layers.{i}.self_attn."
        T = x.shape[0]
        pre = torch.cat([x @ w[p + n + "_proj.weight"].T for n in ("q", "k", "v")], dim=-1)
        conv_w = torch.cat([w[p + n + "_conv1d.weight"].reshape(H * K, -1) for n in ("q", "k", "v")], dim=0)
        qkv = self._conv(pre, conv_w, lc)
        q, k, v = qkv.reshape(T, 3, H, K).unbind(1)
        q = ops.l2norm(q) * K**-0.5
        k = ops.l2norm(k)
        f = (x @ w[p + "f_a_proj.weight"].T) @ w[p + "f_b_proj.weight"].T
        g = ops.kda_gate(f.reshape(T, H, K), w[p + "A_log"], w[p + "dt_bias"])
        beta = (x @ w[p + "b_proj.weight"].T).sigmoid()
        o = self._recurrence(q, k, v, g, beta, lc)
        gate = (x @ w[p + "g_a_proj.weight"].T) @ w[p + "g_b_proj.weight"].T
        o = ops.rms_norm(o, w[p + "o_norm.weight"], self.config.rms_norm_eps) * gate.reshape(T, H, K).sigmoid()
        return o.reshape(T, H * K) @ w[p + "o_proj.weight"].T

    # The steps that carry state across tokens, apart so that context parallelism
    # (parallel.golden_cp) can replace them and nothing else.
    def _conv(self, pre, conv_w, lc: KDACache):
        out, lc.conv = ops.short_causal_conv(pre, lc.conv, conv_w)
        return out

    def _recurrence(self, q, k, v, g, beta, lc: KDACache):
        o, lc.state = ops.kda_recurrence(q, k, v, g, beta, lc.state)
        return o

    def _sparse_history(self, p, lc: MLACache, new, q, q_index, index_weights, positions):
        """The new rows' history (latent, rope key, index key) appended; then the rows select
        over the whole history and attend there: [T, H, v_head_dim]."""
        for chunks, rows in zip((lc.latent, lc.rope_key, lc.index_key), new):
            chunks.append(rows)
        return self._select_attend(p, lc, q, q_index, index_weights, positions)

    def _sparse_mla(self, i, x, positions, lc: MLACache):
        c, w = self.config, self.w
        p = f"model.layers.{i}.self_attn."
        T, H = x.shape[0], c.num_attention_heads
        nope, rope, vdim, rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank

        q_latent = ops.rms_norm(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], c.rms_norm_eps)
        q = (q_latent @ w[p + "q_b_proj.weight"].T).reshape(T, H, nope + rope)
        kv = x @ w[p + "kv_a_proj_with_mqa.weight"].T
        latent = self._latent_cached(ops.rms_norm(kv[:, :rank], w[p + "kv_a_layernorm.weight"], c.rms_norm_eps))
        new = (latent, kv[:, rank:], self._index_key(p, x, positions))
        q_index, index_weights = self._index_query(p, x, q_latent, positions)
        o = self._sparse_history(p, lc, new, q, q_index, index_weights, positions)
        return o.reshape(T, H * vdim) @ w[p + "o_proj.weight"].T

    def _select_attend(self, p, lc: MLACache, q, q_index, index_weights, positions):
        """Rows at `positions` select their Top-K of lc's history and attend there."""
        c, w = self.config, self.w
        H, nope, rope, vdim = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        latent = torch.cat(lc.latent)  # [S, rank]
        S = latent.shape[0]
        k_nope, v = (latent @ w[p + "kv_b_proj.weight"].T).reshape(S, H, nope + vdim).split([nope, vdim], -1)
        k_rope = torch.cat(lc.rope_key)[:, None, :].expand(S, H, rope)
        k = torch.cat([k_nope, k_rope], dim=-1)
        selected = self._index_select(q_index, index_weights, positions, torch.cat(lc.index_key), p)
        return ops.sparse_attention(q, k, v, selected, scale=(nope + rope) ** -0.5)

    def _latent_cached(self, c):
        """The MLA latent as the KV cache holds it: FP8 with one scale per tile (kernels.fp8_kv)."""
        if self.kv_cache_dtype != "fp8_e4m3":
            return c
        return dequantize_kv_fp8(*quantize_kv_fp8_torch(c, self.config.kv_cache_quant_tile), c.dtype)

    def _index_key(self, p, x, positions):
        c, w = self.config, self.w
        k = ops.layer_norm(
            x @ w[p + "indexer.wk.weight"].T, w[p + "indexer.k_norm.weight"], w[p + "indexer.k_norm.bias"], 1e-6
        )
        return self._index_cached(self._index_rotate(k, positions))

    def _index_cached(self, t):
        """Index q / k as the index cache tier holds them: MXFP8 rounds them (kernels.mxfp8)."""
        group = self.config.index_mxfp8_group
        return dequantize_mxfp8(*quantize_mxfp8_torch(t, group), group).to(t.dtype) if group else t

    def _index_rotate(self, t, positions):
        """RoPE on the first index_rope_head_dim dims, then the optional Hadamard rotation."""
        c = self.config
        r = c.index_rope_head_dim
        t = torch.cat([ops.rope_neox(t[..., :r], positions, c.rope_theta), t[..., r:]], dim=-1)
        return t @ self.hadamard if self.hadamard is not None else t

    def _index_query(self, p, x, q_latent, positions):
        """The indexer's queries [T, Hi, D] and head weights [T, Hi] (scales folded in)."""
        c, w = self.config, self.w
        T, Hi, D = x.shape[0], c.index_n_heads, c.index_head_dim
        q = self._index_cached(self._index_rotate((q_latent @ w[p + "indexer.wq_b.weight"].T).reshape(T, Hi, D), positions))
        weights = (x @ w[p + "indexer.weights_proj.weight"].T) * (Hi**-0.5 * D**-0.5)
        return q, weights

    def _index_select(self, q, weights, positions, index_keys, layer: str = ""):
        scores = ops.indexer_scores(q, weights, index_keys, positions)
        selected = ops.topk_positions(scores, self.config.index_topk)
        if self.index_ties is not None:
            self.index_ties.visit(layer, positions, scores, selected)
        return selected

    # --------------------------------------------------------------------- FFN
    def _ffn(self, i, x, moe: bool | None = None):
        c, w = self.config, self.w
        if not (c.is_moe_layer(i) if moe is None else moe):
            p = f"model.layers.{i}.mlp."
            return ops.silu_mlp(x, w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])
        p = f"model.layers.{i}.block_sparse_moe."
        weights, ids = ops.moe_route(
            x @ w[p + "gate.weight"].T,
            w[p + "gate.e_score_correction_bias"],
            c.num_experts_per_token,
            c.num_expert_group,
            c.topk_group,
            c.moe_renormalize,
            c.routed_scaling_factor,
        )
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            q = f"{p}experts.{e}."
            y = ops.silu_mlp(x[rows], w[q + "w1.weight"], w[q + "w3.weight"], w[q + "w2.weight"])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        if c.num_shared_experts:
            q = p + "shared_experts."
            out = out + ops.silu_mlp(x, w[q + "gate_proj.weight"], w[q + "up_proj.weight"], w[q + "down_proj.weight"])
        return out


def _copy_mla(lc: MLACache) -> MLACache:
    """A cache to append to without touching lc (its tensors are never modified in place)."""
    return MLACache(list(lc.latent), list(lc.rope_key), list(lc.index_key))


def _copy_cache(cache: SequenceCache) -> SequenceCache:
    layers = [_copy_mla(lc) if isinstance(lc, MLACache) else KDACache(lc.conv, lc.state) for lc in cache.layers]
    return SequenceCache(layers, cache.length)


def load(checkpoint_dir: str, dtype: torch.dtype = torch.float32, device="cpu") -> GoldenModel:
    """Load the golden model from a checkpoint folder (config.json + *.safetensors)."""
    config = HybridLinearSparseConfig.from_pretrained(checkpoint_dir)
    return GoldenModel(config, load_weights(checkpoint_dir), dtype, device)
