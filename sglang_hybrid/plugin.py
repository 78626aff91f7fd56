"""The one place that registers sglang-hybrid with SGLang 0.5.17.

SGLang calls `register()` in every process (entry-point group
`sglang.srt.plugins`). It registers the config class, the model class, the
attention backend names and the linear-attention model spec, and hooks the few
places SGLang hard-codes per architecture:

- ModelConfig._derive_model_shapes: treat the architecture as MLA (latent KV).
- ServerArgs._handle_model_specific_adjustments: default the attention backend
  to ours (`--attention-backend hybrid_linear_sparse_flashmla` picks sgl-kernel's
  FlashMLA for the sparse attention instead of our Triton kernel), keep prefill
  to SGLang's breakable CUDA graph or none (_prefill_graph), and refuse the prefill
  context-parallel settings it does not serve (_context_parallel_checks).
- ServerArgs._disable_breakable_cudagraph_if_incompatible: SGLang's rule that keeps
  non-DSA MLA models out of the breakable prefill graph does not apply to ours.
- KVCacheConfigurator._build_hybrid_linear_kv_pool: MLA pool + index-K cache.
- DefaultPoolConfigurator._compute_cell_size: count index-K bytes per token.
- utils.common.support_triton: no Triton bookkeeping kernels without a GPU.
- PagedTokenToKVPoolAllocator.alloc_extend / alloc_decode, allocation.get_last_loc:
  torch slot arithmetic on a CPU (cpu_support.paged_allocator), so pages > 1 serve
  there too, speculative steps included.
- EagleDraftWorker._capture_cuda_graphs: the draft head's extend is captured in a
  CUDA graph as well (SGLang captures it only for backends on its own list).
- MambaPool.__init__: on a CPU its speculative-verify scratch goes to the CPU
  (SGLang writes device="cuda" there).
- ModelConfig._config_draft_model: a draft worker on our checkpoint builds its
  draft head (models.hybrid_linear_sparse_nextn), as SGLang does for DeepSeek.
- arg_groups.overrides.supports_mamba_cache_extra_buffer and
  ServerArgs._validate_mamba_extra_buffer: SGLang lists the architectures whose
  radix cache may snapshot KDA states mid-sequence (extra_buffer) by name and
  asserts a GPU; ours snapshots on the GPU (SGLang's KDA backend) and on the CPU
  (layers.kda_backend.TorchKDAAttnBackend), so it takes that strategy by default.
- TokenizerManager._validate_one_request: input_ids outside the vocabulary are refused
  (SGLang has the check but never calls it; the scheduler died on such a request).
- SchedulerBatchResultProcessor._mamba_check_track_boundary: a decode step's
  snapshot is filed under the length that step ran at, not the request's latest
  prepared length (see _decode_track_boundary: under the overlap scheduler SGLang
  could file an older snapshot under a newer length).
"""

from __future__ import annotations

import logging

from sglang_hybrid.configs.hybrid_linear_sparse import (
    ARCHITECTURE,
    DRAFT_ARCHITECTURE,
    MODEL_TYPE,
    HybridLinearSparseConfig,
)

logger = logging.getLogger(__name__)

ATTENTION_BACKEND = "hybrid_linear_sparse"
FLASHMLA_ATTENTION_BACKEND = "hybrid_linear_sparse_flashmla"  # same indexer, FlashMLA attention
# Backends SGLang picks by itself on CPU; replaced by ours rather than refused.
_CPU_DEFAULT_BACKENDS = ("intel_amx", "torch_native")


def _is_ours(hf_config) -> bool:
    """The target model or its draft head."""
    return bool({ARCHITECTURE, DRAFT_ARCHITECTURE} & set(getattr(hf_config, "architectures", None) or []))


def register() -> None:
    from transformers import AutoConfig

    from sglang.srt.configs.linear_attn_model_registry import LinearAttnModelSpec, register_linear_attn_model
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_attention_backend_choices

    from sglang_hybrid import cpu_support
    from sglang_hybrid.cpu_support import paged_allocator, spec_ops

    AutoConfig.register(MODEL_TYPE, HybridLinearSparseConfig, exist_ok=True)
    ModelRegistry.register("sglang_hybrid.models", overwrite=True, strict=True)
    register_linear_attn_model(
        LinearAttnModelSpec(
            config_class=HybridLinearSparseConfig,
            backend_class_name="sglang_hybrid.layers.kda_backend.create_kda_backend",
            arch_names=[ARCHITECTURE],
            uses_mamba_radix_cache=True,
            support_mamba_cache=True,
        )
    )
    add_attention_backend_choices([ATTENTION_BACKEND, FLASHMLA_ATTENTION_BACKEND])
    register_attention_backend(ATTENTION_BACKEND)(_create_attention_backend)
    register_attention_backend(FLASHMLA_ATTENTION_BACKEND)(_create_flashmla_attention_backend)

    hooks = {
        "sglang.srt.configs.model_config.ModelConfig._derive_model_shapes": (_derive_mla_shapes, HookType.AFTER),
        "sglang.srt.configs.model_config.ModelConfig._config_draft_model": (_draft_architecture, HookType.AFTER),
        "sglang.srt.server_args.ServerArgs._handle_model_specific_adjustments": (_server_defaults, HookType.AFTER),
        "sglang.srt.server_args.ServerArgs._disable_breakable_cudagraph_if_incompatible": (
            _breakable_prefill_rules, HookType.AROUND),
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_hybrid_linear_kv_pool": (
            _build_kv_pool, HookType.AROUND),
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size": (
            _cell_size_with_index_k, HookType.AROUND),
        "sglang.srt.utils.common.support_triton": (_support_triton, HookType.AROUND),
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_extend": (
            paged_allocator.alloc_extend, HookType.AROUND),
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_decode": (
            paged_allocator.alloc_decode, HookType.AROUND),
        "sglang.srt.mem_cache.allocation.get_last_loc": (paged_allocator.get_last_loc, HookType.AROUND),
        "sglang.srt.mem_cache.memory_pool.MambaPool.__init__": (cpu_support.mamba_pool_on_cpu, HookType.AROUND),
        "sglang.srt.layers.attention.hybrid_linear_attn_backend.scatter_mamba_states_after_mtp_verify": (
            spec_ops.scatter_mamba_states_after_verify, HookType.AROUND),
        "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_decode_backend": (
            _draft_decode_backend, HookType.AROUND),
        "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend": (
            _draft_extend_backend, HookType.AROUND),
        "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._capture_cuda_graphs": (
            _capture_draft_extend_graph, HookType.AROUND),
        "sglang.srt.arg_groups.overrides.supports_mamba_cache_extra_buffer": (_supports_extra_buffer,
                                                                              HookType.AROUND),
        "sglang.srt.server_args.ServerArgs._validate_mamba_extra_buffer": (_validate_extra_buffer, HookType.AROUND),
        "sglang.srt.arg_groups.speculative_hook._handle_eagle_family": (_eagle_checks, HookType.AROUND),
        "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor."
        "_mamba_check_track_boundary": (_decode_track_boundary, HookType.AROUND),
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request": (
            _input_ids_in_vocabulary, HookType.BEFORE),
    }
    for target, (fn, kind) in hooks.items():
        HookRegistry.register(target, fn, kind)


def _create_attention_backend(model_runner):
    from sglang_hybrid.layers.sparse_mla_backend import SparseMLAAttnBackend

    return SparseMLAAttnBackend(model_runner)


def _create_flashmla_attention_backend(model_runner):
    from sglang_hybrid.layers.sparse_mla_backend import SparseMLAAttnBackend

    return SparseMLAAttnBackend(model_runner, flashmla=True)


def _draft_architecture(result, model_config, *args, **kwargs):
    """A draft worker on our checkpoint (--speculative-algorithm NEXTN / EAGLE without a
    separate draft model) builds the checkpoint's draft head, as SGLang does for DeepSeek."""
    archs = model_config.hf_config.architectures
    if model_config.is_draft_model and archs and archs[0] == ARCHITECTURE:
        archs[0] = DRAFT_ARCHITECTURE


def _draft_decode_backend(original, factory):
    """The draft head's steps after the first, each a decode over its own rows."""
    if not _is_ours(factory.draft_model_runner.model_config.hf_config):
        if factory.draft_model_runner.device == "cpu":  # a dense standalone draft
            from sglang_hybrid.cpu_support.dense_draft import DenseDraftMultiStepBackend

            return DenseDraftMultiStepBackend(factory.draft_model_runner, factory.speculative_num_steps)
        return original(factory)
    if factory.speculative_num_steps <= 1:
        return None
    from sglang_hybrid.layers.sparse_mla_backend import SparseMLAMultiStepDraftBackend

    runner = factory.draft_model_runner
    return SparseMLAMultiStepDraftBackend(runner, factory.topk, factory.speculative_num_steps,
                                          flashmla=_uses_flashmla(runner))


def _draft_extend_backend(original, factory):
    """The draft head's extend over the target's verified tokens."""
    if not _is_ours(factory.draft_model_runner.model_config.hf_config):
        if factory.draft_model_runner.device == "cpu":  # a dense standalone draft
            from sglang_hybrid.cpu_support.dense_draft import DenseDraftAttnBackend

            return DenseDraftAttnBackend(factory.draft_model_runner)
        return original(factory)
    from sglang_hybrid.layers.sparse_mla_backend import SparseMLAAttnBackend

    runner = factory.draft_model_runner
    return SparseMLAAttnBackend(runner, flashmla=_uses_flashmla(runner))


def _capture_draft_extend_graph(original, worker):
    """SGLang captures the draft head's extend in a CUDA graph only for the backends on its
    own list. Ours captures as the target's verify does (a fixed number of rows per request,
    no metadata), so it is captured too; eager, this one-layer forward costs about as many
    kernel launches as a decode step of a small model."""
    original(worker)
    from sglang.srt.environ import envs
    from sglang.srt.speculative import eagle_worker_v2 as v2

    from sglang_hybrid.layers.sparse_mla_backend import SparseMLAAttnBackend

    if (worker.cuda_graph_runner_for_draft_extend is None
            and type(worker.draft_extend_attn_backend) is SparseMLAAttnBackend
            and worker.target_worker.device == "cuda"
            and not v2.check_cuda_graph_backend(v2.Phase.DECODE, v2.Backend.DISABLED)
            and not envs.SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH.get()):
        logger.info("Capture draft extend CUDA graph (sparse MLA draft head)")
        worker.cuda_graph_runner_for_draft_extend = v2.EAGLEDraftExtendCudaGraphRunner(worker)


def _uses_flashmla(runner) -> bool:
    """The draft head attends with the kernel the target's sparse layers use."""
    return runner.server_args.attention_backend == FLASHMLA_ATTENTION_BACKEND


def _derive_mla_shapes(result, model_config, *args, **kwargs):
    """Latent-KV MLA for the sparse layers, as SGLang does for Kimi-Linear."""
    from sglang.srt.configs.model_config import AttentionArch

    tc = model_config.hf_text_config
    if not _is_ours(model_config.hf_config):
        return
    model_config.attention_arch = AttentionArch.MLA
    model_config.head_dim = tc.qk_nope_head_dim + tc.qk_rope_head_dim
    model_config.kv_lora_rank = tc.kv_lora_rank
    model_config.qk_nope_head_dim = tc.qk_nope_head_dim
    model_config.qk_rope_head_dim = tc.qk_rope_head_dim
    model_config.v_head_dim = tc.v_head_dim
    model_config.index_head_dim = tc.index_head_dim
    model_config.scaling = model_config.head_dim**-0.5


def _server_defaults(result, server_args, *args, **kwargs):
    if not _is_ours(server_args.get_model_config().hf_config):
        return
    ours = (ATTENTION_BACKEND, FLASHMLA_ATTENTION_BACKEND)
    for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        value = getattr(server_args, field)
        if value is None or value in ours:
            continue
        if field == "attention_backend" and server_args.device == "cpu" and value in _CPU_DEFAULT_BACKENDS:
            continue
        raise ValueError(f"{ARCHITECTURE} runs only on --{field.replace('_', '-')} {' or '.join(ours)}; got {value!r}")
    if server_args.attention_backend not in ours:
        server_args.attention_backend = ATTENTION_BACKEND
    _context_parallel_checks(server_args)
    if server_args.device == "cpu":
        from sglang_hybrid import cpu_support

        cpu_support.bind_tensor_parallel_ranks(server_args.tp_size)  # before the TP ranks start
    if (server_args.speculative_algorithm or "").upper() == "STANDALONE":
        _standalone_draft(server_args)
    _prefill_graph(server_args)


def _prefill_graph(server_args) -> None:
    """Prefill runs in SGLang's breakable CUDA graph (its CUDA default), whose eager breaks are
    the KDA and sparse layers' backend calls (layers.prefill_graph), or eagerly. The
    other prefill graphs would capture the indexer's host-sized extend launches; under
    speculative decoding SGLang's prefill graph drops the radix cache's snapshot slots
    (PrefillCudaGraphRunner._is_mamba_track_enabled), so snapshots would be filed unwritten;
    a context-parallel prefill is split by host-side lengths (SGLang's own rules turn the graph
    off for it too, unless the user asked for it)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase

    config = server_args.cuda_graph_config.prefill
    why_not = None
    if server_args.device != "cuda":
        why_not = "it needs a GPU"
    elif server_args.speculative_algorithm:
        why_not = "under speculative decoding SGLang's prefill graph does not write the radix cache's snapshots"
    elif (server_args.attn_cp_size or 1) > 1 and server_args.enable_prefill_cp:
        why_not = "context-parallel prefill splits each batch by its host-side lengths"
    elif config.backend not in (Backend.BREAKABLE, Backend.DISABLED):
        why_not = "only the breakable prefill graph has eager breaks for the sparse layers"
    if why_not is None:
        return
    if (Phase.PREFILL, "backend") in server_args._cuda_graph_config_locked and config.backend != Backend.DISABLED:
        raise ValueError(f"{ARCHITECTURE} cannot run prefill in a {config.backend!r} CUDA graph here: {why_not}; "
                         f"leave --cuda-graph-backend-prefill unset or pass 'disabled'")
    config.backend = Backend.DISABLED


def _breakable_prefill_rules(original, server_args, *args, **kwargs):
    """SGLang turns its breakable prefill graph off for MLA models other than DSA: their prefill
    takes an MHA path with no eager break. Ours is like DSA: every sparse layer takes the absorbed
    sparse path, whose backend call is an eager break (layers.prefill_graph), so that rule does not
    apply; SGLang's other rules (context parallelism and the rest) still do."""
    if not _is_ours(server_args.get_model_config().hf_config):
        return original(server_args, *args, **kwargs)
    shadowing = "use_mla_backend" not in vars(server_args)  # else an outer call of this hook does
    server_args.use_mla_backend = lambda: False  # shadows the method for this call only
    try:
        return original(server_args, *args, **kwargs)
    finally:
        if shadowing:
            vars(server_args).pop("use_mla_backend")


def _context_parallel_checks(server_args) -> None:
    """What sglang_hybrid.parallel.prefill_cp serves of SGLang's prefill CP switches."""
    if (server_args.attn_cp_size or 1) <= 1 or not server_args.enable_prefill_cp:
        return
    if server_args.cp_strategy != "zigzag":
        raise ValueError(f"{ARCHITECTURE} serves context-parallel prefill with --cp-strategy zigzag only (got "
                         f"{server_args.cp_strategy!r}): its KDA layers fold each rank's tokens as contiguous chunks")
    if server_args.enable_dp_attention:
        raise ValueError(f"{ARCHITECTURE} does not serve context-parallel prefill together with --enable-dp-attention")
    if (server_args.moe_dp_size or 1) > 1:
        raise ValueError(f"{ARCHITECTURE}'s context-parallel prefill runs the FFN on every row of the batch, "
                         f"tensor-parallel over --tp-size; serve it with --moe-dp-size 1 (got {server_args.moe_dp_size})")


def _eagle_checks(original, server_args, *args, **kwargs):
    """SGLang admits tree drafts with pages (--speculative-eagle-topk > 1, --page-size > 1)
    only on attention backends that read each branch's page-aligned region in a second
    pass (flashinfer, fa3, triton). Ours gives every tree row its own path directly
    (draft_tree_rows for the draft's steps, the verify's node paths), so its check is
    made as for one of those; the rest of the check runs unchanged."""
    topk, page = server_args.speculative_eagle_topk or 1, server_args.page_size or 1
    if not (topk > 1 and page > 1 and server_args.attention_backend in (ATTENTION_BACKEND, FLASHMLA_ATTENTION_BACKEND)):
        return original(server_args, *args, **kwargs)
    ours, server_args.attention_backend = server_args.attention_backend, "triton"
    try:
        return original(server_args, *args, **kwargs)
    finally:
        server_args.attention_backend = ours


def _standalone_draft(server_args) -> None:
    """SGLang's standalone mode runs a separate draft model on the target's request pools
    and token allocator, with a KV pool of its own. A dense draft needs nothing else; a
    hybrid one (this family's) would need recurrent-state slots of its own, which the
    shared pools do not give. The draft's attention: SGLang's triton on a GPU (unless
    --speculative-draft-attention-backend says otherwise), cpu_support.dense_draft on CPU."""
    from transformers import AutoConfig

    path = server_args.speculative_draft_model_path
    if not path:
        raise ValueError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path (a dense model "
                         "with the target's tokenizer)")
    draft = AutoConfig.from_pretrained(path, trust_remote_code=server_args.trust_remote_code)
    if _is_ours(draft):
        raise ValueError(f"--speculative-algorithm STANDALONE with a {ARCHITECTURE} draft model ({path}) is not "
                         "served: SGLang's standalone draft shares the target's request pools, and a hybrid draft "
                         "needs KDA state slots of its own. Use a dense draft model, or --speculative-algorithm "
                         "NEXTN with the checkpoint's own draft head")
    if server_args.device == "cpu":
        if (server_args.speculative_eagle_topk or 1) > 1:
            raise ValueError("--speculative-algorithm STANDALONE drafts chains only on CPU (--speculative-eagle-topk "
                             "1): the CPU draft attention (cpu_support.dense_draft) does not separate tree branches")
        server_args.speculative_draft_attention_backend = "torch_native"
    elif not server_args.speculative_draft_attention_backend:
        server_args.speculative_draft_attention_backend = "triton"


def _build_kv_pool(original, configurator, *, max_total_num_tokens, req_to_token_pool, mha_pool_class):
    if not _is_ours(configurator.model_config.hf_config):
        return original(configurator, max_total_num_tokens=max_total_num_tokens,
                        req_to_token_pool=req_to_token_pool, mha_pool_class=mha_pool_class)
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool
    from sglang.srt.runtime_context import get_exec, get_spec

    from sglang_hybrid.mem_cache.sparse_mla_pool import SparseMLATokenToKVPool

    mc, info = configurator.model_config, configurator.layer_info
    if configurator.is_draft_worker:  # the draft head's one sparse layer is layer 0 (SGLang's draft convention)
        layer_ids = [0]
    else:
        layer_ids = [i for i in mc.hf_config.full_attention_layer_ids if info.start_layer <= i < info.end_layer]
    memory_saver = get_exec().features.enable_memory_saver
    full_pool = SparseMLATokenToKVPool(
        size=max_total_num_tokens,
        page_size=configurator.pool_page_size,
        dtype=configurator.kv_cache_dtype,
        kv_lora_rank=mc.kv_lora_rank,
        qk_rope_head_dim=mc.qk_rope_head_dim,
        layer_num=len(layer_ids),
        device=configurator.device,
        enable_memory_saver=memory_saver,
        index_head_dim=mc.hf_config.index_head_dim,
        model_dtype=configurator.model_dtype,
        index_group=mc.hf_config.index_mxfp8_group,
        kv_tile=_fp8_latent_tile(mc.hf_config, configurator.kv_cache_dtype),
    )
    if not configurator.is_draft_worker:
        _report_snapshot_memory(req_to_token_pool.mamba_pool, full_pool)
    return HybridLinearKVPool(
        size=max_total_num_tokens,
        dtype=configurator.kv_cache_dtype,
        page_size=configurator.pool_page_size,
        head_num=1,
        head_dim=mc.kv_lora_rank + mc.qk_rope_head_dim,
        full_attention_layer_ids=layer_ids,
        device=configurator.device,
        mamba_pool=req_to_token_pool.mamba_pool,
        enable_memory_saver=memory_saver,
        enable_kv_cache_copy=get_spec().speculative_algorithm is not None,
        use_mla=True,
        kv_lora_rank=mc.kv_lora_rank,
        qk_rope_head_dim=mc.qk_rope_head_dim,
        start_layer=info.start_layer,
        full_kv_pool=full_pool,
    )


def _report_snapshot_memory(mamba_pool, kv_pool) -> None:
    """What one radix-cache snapshot (every KDA layer's state and conv window) costs, in
    bytes and in tokens of the sparse layers' cache, and how many the state pool holds."""
    cache = mamba_pool.mamba_cache
    per_snapshot = sum(t[:, 0].numel() * t.element_size() for t in [*cache.conv, cache.temporal])
    per_token = kv_pool.get_kv_size_bytes() / (kv_pool.size + kv_pool.page_size)
    logger.info("sglang-hybrid radix snapshots: %d bytes each (%d KDA layers, state and conv window) = %.0f tokens "
                "of latent KV + index-K (%d bytes per token); state pool: %d slots", per_snapshot,
                cache.temporal.shape[0], per_snapshot / per_token, per_token, mamba_pool.size)


def _fp8_latent_tile(hf_config, kv_cache_dtype) -> int | None:
    """The FP8 latent cache's tile when the server runs --kv-cache-dtype fp8_e4m3, else None."""
    import torch

    return hf_config.kv_cache_quant_tile if kv_cache_dtype == torch.float8_e4m3fn else None


def _cell_size_with_index_k(original, pool_configurator, kvc, num_layers):
    cell = original(pool_configurator, kvc, num_layers)
    hf = kvc.model_config.hf_config
    if _is_ours(hf):
        group = hf.index_mxfp8_group
        cell += num_layers * (hf.index_head_dim + hf.index_head_dim // group if group
                              else hf.index_head_dim * kvc.model_dtype.itemsize)
        tile = _fp8_latent_tile(hf, kvc.kv_cache_dtype)
        if tile:  # rope kept in the serving dtype, fp32 tile scales
            cell += num_layers * (hf.qk_rope_head_dim * (kvc.model_dtype.itemsize - 1) + 4 * (hf.kv_lora_rank // tile))
    return cell


def _decode_track_boundary(original, processor, req, batch, result, i):
    """Whether decode step `batch` wrote row i's snapshot (extra_buffer strategy), and at what length.

    The forward writes the snapshot when its own length is a multiple of
    --mamba-track-interval (ScheduleBatch.prepare_for_decode's mask). SGLang decides from
    req.kv_committed_len, which the overlap scheduler has usually moved on to the next
    prepared step when it processes this one, but not when that next batch is a prefill
    without this request: the same boundary is then seen twice, the ping-pong
    index swapped back, and a finished request files its older snapshot under the newer
    length (a restored state of another prefix, tests/stress_radix_eviction.py). The
    processed batch's own length sees each boundary once, with or without overlap."""
    from sglang.srt.runtime_context import get_exec, get_server_args

    if not batch.spec_algorithm.is_none() or get_server_args().enable_mamba_extra_buffer_lazy():
        return original(processor, req, batch, result, i)
    seq_len = int(batch.seq_lens_cpu[i])
    return (True, seq_len) if seq_len % get_exec().mamba.mamba_track_interval == 0 else (False, 0)


def _input_ids_in_vocabulary(manager, obj, input_ids, *args, **kwargs):
    """Refuse a request whose input_ids leave the vocabulary (HTTP 400, the server keeps
    serving). SGLang 0.5.17 has the check (TokenizerManager._validate_input_ids_in_vocab)
    but never calls it: such an id reaches the embedding and takes the scheduler down, with
    every request in flight (an IndexError on a CPU, a device-side assert on a GPU). Ids
    from SGLang's own tokenizer are always in range, so only given ids are checked."""
    if getattr(obj, "input_ids", None) is None or not input_ids or not _is_ours(manager.model_config.hf_config):
        return None
    vocab = manager.model_config.vocab_size
    lo, hi = min(input_ids), max(input_ids)  # C loops: ~1 ms each at 128K tokens
    if lo < 0 or hi >= vocab:
        raise ValueError(f"input_ids hold token id {lo if lo < 0 else hi}, outside the model's vocabulary "
                         f"[0, {vocab})")
    return None


def _support_triton(original, backend: str) -> bool:
    import torch

    return torch.cuda.is_available() and original(backend)


def _supports_extra_buffer(original, view, model_arch: str) -> bool:
    if model_arch != ARCHITECTURE:
        return original(view, model_arch)
    return view.device == "cpu" or view.linear_attn_backend == "triton"  # the kernels that return chunk states


def _validate_extra_buffer(original, server_args, view, model_arch: str):
    if model_arch != ARCHITECTURE or view.device != "cpu":
        return original(server_args, view, model_arch)
    # SGLang's own checks less its "needs CUDA": the CPU KDA backend snapshots from the recurrence.
    if view.mamba_track_interval % (view.page_size or 1):
        raise ValueError(f"--mamba-track-interval {view.mamba_track_interval} must be a multiple of "
                         f"--page-size {view.page_size}")
    if view.speculative_num_draft_tokens is not None and view.mamba_track_interval < view.speculative_num_draft_tokens:
        raise ValueError(f"--mamba-track-interval {view.mamba_track_interval} must be at least "
                         f"--speculative-num-draft-tokens {view.speculative_num_draft_tokens}")
