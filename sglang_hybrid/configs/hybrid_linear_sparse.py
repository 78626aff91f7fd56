"""HybridLinearSparseConfig: KDA linear layers + MLA layers with a DSA indexer.

Field names follow Kimi-Linear (KDA, MLA, MoE, attention residuals) and
DeepSeek-V3.2 (indexer: ``index_n_heads``, ``index_head_dim``, ``index_topk``),
so a checkpoint of this family written with those names loads unchanged.
Layer lists in ``linear_attn_config`` are 1-based, as in Kimi-Linear.

Every inconsistency fails at construction with one ``ConfigError`` that names
the field; nothing is silently defaulted for fields the model cannot run without.
"""

from __future__ import annotations

from transformers.configuration_utils import PretrainedConfig

MODEL_TYPE = "hybrid_linear_sparse"
ARCHITECTURE = "HybridLinearSparseForCausalLM"
DRAFT_ARCHITECTURE = "HybridLinearSparseForCausalLMNextN"

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "linear_attn_config",
)
_LINEAR_ATTN_KEYS = (
    "kda_layers",
    "full_attn_layers",
    "num_heads",
    "head_dim",
    "short_conv_kernel_size",
)


class ConfigError(ValueError):
    """A HybridLinearSparseConfig field is missing or inconsistent."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{MODEL_TYPE} config: `{field}` {problem}")
        self.field = field


class HybridLinearSparseConfig(PretrainedConfig):
    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values"]
    # Required fields have no defaults: transformers must not build a bare instance.
    has_no_defaults_at_init = True

    def __init__(
        self,
        vocab_size: int | None = None,
        hidden_size: int | None = None,
        num_hidden_layers: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        intermediate_size: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 4096,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        # MLA (Kimi / DeepSeek names). MLA layers are NoPE, as in Kimi-Linear.
        q_lora_rank: int | None = None,
        kv_lora_rank: int | None = None,
        qk_nope_head_dim: int | None = None,
        qk_rope_head_dim: int | None = None,
        v_head_dim: int | None = None,
        mla_use_nope: bool = True,
        # DSA lightning indexer (DeepSeek-V3.2 names).
        index_n_heads: int | None = None,
        index_head_dim: int | None = None,
        index_topk: int | None = None,
        index_rope_head_dim: int = 0,
        index_use_hadamard: bool = True,
        # Index Q/K cache tier: "mxfp8" (e4m3 + one e8m0 scale per group) or "auto" (serving dtype).
        index_cache_dtype: str = "mxfp8",
        index_quant_group_size: int = 32,
        # Latent KV tile of the FP8 cache (one fp32 scale per token per tile), used when the
        # server runs with --kv-cache-dtype fp8_e4m3.
        kv_cache_quant_tile: int = 128,
        # KDA.
        linear_attn_config: dict | None = None,
        # Block attention residuals (None: plain pre-norm residual stream).
        attn_res_block_size: int | None = None,
        # MoE (Kimi names).
        num_experts: int | None = None,
        num_experts_per_token: int | None = None,
        moe_intermediate_size: int | None = None,
        num_shared_experts: int = 0,
        routed_scaling_factor: float = 1.0,
        moe_renormalize: bool = True,
        moe_router_activation_func: str = "sigmoid",
        first_k_dense_replace: int = 0,
        moe_layer_freq: int = 1,
        use_grouped_topk: bool = True,
        num_expert_group: int = 1,
        topk_group: int = 1,
        topk_method: str = "noaux_tc",
        # Draft head.
        num_nextn_predict_layers: int = 0,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        # MLA keeps one latent KV "head"; SGLang reads this for MHA-style sizing only.
        self.num_key_value_heads = (
            num_key_value_heads if num_key_value_heads is not None else num_attention_heads
        )
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.initializer_range = initializer_range

        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        if qk_nope_head_dim is not None and qk_rope_head_dim is not None:
            self.head_dim = qk_nope_head_dim + qk_rope_head_dim

        self.index_n_heads = index_n_heads
        self.index_head_dim = index_head_dim
        self.index_topk = index_topk
        self.index_rope_head_dim = index_rope_head_dim
        self.index_use_hadamard = index_use_hadamard
        self.index_cache_dtype = index_cache_dtype
        self.index_quant_group_size = index_quant_group_size
        self.kv_cache_quant_tile = kv_cache_quant_tile

        self.linear_attn_config = linear_attn_config
        self.attn_res_block_size = attn_res_block_size

        self.num_experts = self.n_routed_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.moe_intermediate_size = moe_intermediate_size
        self.num_shared_experts = num_shared_experts
        self.routed_scaling_factor = routed_scaling_factor
        self.moe_renormalize = moe_renormalize
        self.moe_router_activation_func = moe_router_activation_func
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.topk_method = topk_method
        self.num_nextn_predict_layers = num_nextn_predict_layers

        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate()

    # ------------------------------------------------------------------ layout
    @property
    def index_mxfp8_group(self) -> int | None:
        """The MXFP8 group size of the index Q/K cache; None when it keeps the serving dtype."""
        return self.index_quant_group_size if self.index_cache_dtype == "mxfp8" else None

    def is_kda_layer(self, layer_idx: int) -> bool:
        return (layer_idx + 1) in self.linear_attn_config["kda_layers"]

    @property
    def linear_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_kda_layer(i)]

    @property
    def full_attention_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_kda_layer(i)]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.num_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def is_mla(self) -> bool:
        return True

    @property
    def is_linear_attn(self) -> bool:
        return True

    @property
    def mamba2_cache_params(self):
        """Per-request KDA state shapes, in SGLang's Kimi-Linear pool layout."""
        from sglang.srt.configs.mamba_utils import (
            KimiLinearCacheParams,
            KimiLinearStateShape,
        )
        from sglang.srt.runtime_context import get_parallel

        lac = self.linear_attn_config
        shape = KimiLinearStateShape.create(
            tp_world_size=get_parallel().attn_tp_size,
            num_heads=lac["num_heads"],
            head_dim=lac["head_dim"],
            conv_kernel_size=lac["short_conv_kernel_size"],
        )
        return KimiLinearCacheParams(
            shape=shape, layers=self.linear_layer_ids, dtype=self._kda_state_dtype()
        )

    def _kda_state_dtype(self):
        """SGLang keeps conv windows in bf16 unless told otherwise, but its Triton
        short conv needs them in the activation dtype (fp32/fp16 serving fails to
        compile). So they follow --dtype unless SGLANG_MAMBA_CONV_DTYPE is set."""
        import dataclasses

        from sglang.srt.configs.mamba_utils import mamba2_state_dtype
        from sglang.srt.configs.model_config import _get_and_verify_dtype
        from sglang.srt.environ import envs
        from sglang.srt.runtime_context import get_server_args

        dtype = mamba2_state_dtype(self)
        if envs.SGLANG_MAMBA_CONV_DTYPE.is_set():
            return dtype
        try:
            serving_dtype = get_server_args().dtype
        except ValueError:  # not inside a server or engine (e.g. offline tools)
            return dtype
        return dataclasses.replace(dtype, conv=_get_and_verify_dtype(self, serving_dtype))

    # -------------------------------------------------------------- validation
    def validate(self) -> None:
        for name in _REQUIRED:
            if getattr(self, name) is None:
                raise ConfigError(name, "is required but missing")
        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
            "index_topk", "max_position_embeddings",
        ):
            _positive_int(self, name)

        lac = self.linear_attn_config
        if not isinstance(lac, dict):
            raise ConfigError("linear_attn_config", f"must be a dict, got {type(lac).__name__}")
        for key in _LINEAR_ATTN_KEYS:
            if lac.get(key) is None:
                raise ConfigError(f"linear_attn_config.{key}", "is required but missing")
        for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
            if not isinstance(lac[key], int) or lac[key] <= 0:
                raise ConfigError(f"linear_attn_config.{key}", f"must be a positive int, got {lac[key]!r}")
        if lac["short_conv_kernel_size"] < 2:
            raise ConfigError("linear_attn_config.short_conv_kernel_size", "must be at least 2")
        n = self.num_hidden_layers
        kda, full = list(lac["kda_layers"]), list(lac["full_attn_layers"])
        for key, layers in (("kda_layers", kda), ("full_attn_layers", full)):
            if len(set(layers)) != len(layers):
                raise ConfigError(f"linear_attn_config.{key}", f"lists a layer twice: {layers}")
            bad = [x for x in layers if not isinstance(x, int) or not 1 <= x <= n]
            if bad:
                raise ConfigError(
                    f"linear_attn_config.{key}",
                    f"holds {bad}: layers are 1-based and must lie in [1, num_hidden_layers={n}]",
                )
        both = sorted(set(kda) & set(full))
        if both:
            raise ConfigError("linear_attn_config", f"puts layers {both} in both kda_layers and full_attn_layers")
        missing = sorted(set(range(1, n + 1)) - set(kda) - set(full))
        if missing:
            raise ConfigError("linear_attn_config", f"assigns layers {missing} to neither kda_layers nor full_attn_layers")
        if not full:
            raise ConfigError("linear_attn_config.full_attn_layers", "is empty: the family needs at least one sparse MLA layer")

        if not self.mla_use_nope:
            raise ConfigError("mla_use_nope", "must be true: MLA layers of this family are NoPE (position comes from KDA and the indexer)")
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ConfigError("rope_scaling", f"is not supported (got {self.rope_scaling!r}); only plain RoPE on the indexer")
        if self.index_topk > self.max_position_embeddings:
            raise ConfigError(
                "index_topk",
                f"= {self.index_topk} is larger than the context limit max_position_embeddings = {self.max_position_embeddings}",
            )
        r = self.index_rope_head_dim
        if not isinstance(r, int) or r < 0 or r % 2 or r > self.index_head_dim:
            raise ConfigError("index_rope_head_dim", f"must be an even int in [0, index_head_dim={self.index_head_dim}], got {r!r}")
        d = self.index_head_dim
        if self.index_use_hadamard and d & (d - 1):
            raise ConfigError("index_head_dim", f"= {d} must be a power of two when index_use_hadamard is true")
        if self.index_cache_dtype not in ("auto", "mxfp8"):
            raise ConfigError("index_cache_dtype", f"must be 'auto' or 'mxfp8', got {self.index_cache_dtype!r}")
        if self.index_cache_dtype == "mxfp8":
            gs = self.index_quant_group_size
            if not isinstance(gs, int) or gs <= 0 or gs & (gs - 1) or d % gs:
                raise ConfigError("index_quant_group_size",
                                  f"must be a power of two dividing index_head_dim = {d}, got {gs!r}")
        t = self.kv_cache_quant_tile
        if not isinstance(t, int) or t <= 0 or t & (t - 1) or self.kv_lora_rank % t:
            raise ConfigError("kv_cache_quant_tile",
                              f"must be a power of two dividing kv_lora_rank = {self.kv_lora_rank}, got {t!r}")
        if self.attn_res_block_size is not None:
            _positive_int(self, "attn_res_block_size")
        if self.hidden_act != "silu":
            raise ConfigError("hidden_act", f"must be 'silu', got {self.hidden_act!r}")

        if self.num_experts is not None:
            for name in ("num_experts", "num_experts_per_token", "moe_intermediate_size",
                         "num_expert_group", "topk_group", "moe_layer_freq"):
                _positive_int(self, name)
            if self.num_experts_per_token > self.num_experts:
                raise ConfigError("num_experts_per_token", f"= {self.num_experts_per_token} exceeds num_experts = {self.num_experts}")
            if self.num_experts % self.num_expert_group:
                raise ConfigError("num_expert_group", f"= {self.num_expert_group} does not divide num_experts = {self.num_experts}")
            if self.topk_group > self.num_expert_group:
                raise ConfigError("topk_group", f"= {self.topk_group} exceeds num_expert_group = {self.num_expert_group}")
            per_group = self.num_experts // self.num_expert_group
            if per_group < 2 and self.num_expert_group > 1:
                raise ConfigError("num_expert_group", "leaves fewer than 2 experts per group (group scores sum the top 2)")
            if self.topk_group * per_group < self.num_experts_per_token:
                raise ConfigError("topk_group", "selects too few experts for num_experts_per_token")
            if self.moe_router_activation_func != "sigmoid":
                raise ConfigError("moe_router_activation_func", f"must be 'sigmoid', got {self.moe_router_activation_func!r}")
            if not self.use_grouped_topk:
                raise ConfigError("use_grouped_topk", "must be true (sigmoid router with grouped top-k and score bias)")
            if self.num_shared_experts is None or self.num_shared_experts < 0:
                raise ConfigError("num_shared_experts", f"must be >= 0, got {self.num_shared_experts!r}")
        if self.num_nextn_predict_layers not in (0, 1):
            raise ConfigError("num_nextn_predict_layers", f"must be 0 or 1, got {self.num_nextn_predict_layers!r}")

    @property
    def draft_layer_id(self) -> int:
        """The draft head's layer in the checkpoint: model.layers.{num_hidden_layers}.* (DeepSeek-V3's MTP names)."""
        return self.num_hidden_layers

    def draft_head_config(self) -> "HybridLinearSparseConfig":
        """The draft head's decoder layer as layer 0 of a one-layer model: a sparse MLA layer,
        MoE when the model has experts, on a plain residual stream. Layer 0 because SGLang
        gives a draft worker one full-attention layer with that id."""
        import copy

        c = copy.deepcopy(self)
        c.num_hidden_layers = 1
        c.linear_attn_config = dict(c.linear_attn_config, kda_layers=[], full_attn_layers=[1])
        c.first_k_dense_replace, c.moe_layer_freq = 0, 1
        c.attn_res_block_size = None
        return c

    def validate_parallel(self, tp_size: int) -> None:
        """Head counts that tensor parallelism splits must divide by the TP size."""
        for field, value in (
            ("num_attention_heads", self.num_attention_heads),
            ("linear_attn_config.num_heads", self.linear_attn_config["num_heads"]),
        ):
            if value % tp_size:
                raise ConfigError(field, f"= {value} is not divisible by the tensor-parallel size {tp_size}")


def _positive_int(cfg: HybridLinearSparseConfig, name: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(name, f"must be a positive int, got {value!r}")
