#!/usr/bin/env bash
# The project's checks on the H200. A device call allows 10 minutes, about 40 s of which go to
# the bootstrap. Each argument is a group of parts run in order (comma-separated); the groups
# run at the same time (the test servers take a quarter of the free GPU memory each), so
# give one call groups whose timeouts each add up to about 550 s. Timings run alone.
# On the device machine, from the project root, with .device-bundle carried:
#   bash benchmarks/h200_checks.sh tiny small tiny-kernels   # three groups at once
#   bash benchmarks/h200_checks.sh bench,timing-decode       # bench preset, then decode timings
#   bash benchmarks/h200_checks.sh tiny-e2e,small-e2e        # any parts named below, in order
# Each pytest run writes $OUT/<part>/pytest.txt and the server logs beside it.
set -u
source launch/h200_env.sh >/dev/null || exit 1
nvidia-smi -L

run() {  # run NAME SECONDS pytest-args...
  local name=$1 seconds=$2
  shift 2
  mkdir -p "$OUT/$name"
  # SIGINT, so that pytest's finally blocks stop the servers a cut test started.
  SGLANG_HYBRID_TEST_LOGS=$OUT/$name timeout -s INT -k 30 "$seconds" python3 -m pytest -q -p no:cacheprovider -rA -s \
    --durations=10 "$@" > "$OUT/$name/pytest.txt" 2>&1
  echo "$name: rc=$?"
  grep -E "^(FAILED|ERROR)|passed|failed|bf16 vs fp32|max \|" "$OUT/$name/pytest.txt" | tail -12
}

timing() {  # timing NAME SECONDS sparse_path_timing-args...
  local name=$1 seconds=$2
  shift 2
  mkdir -p "$OUT/$name"
  timeout "$seconds" python3 benchmarks/sparse_path_timing.py --out "$OUT/$name/sparse_path_timing.json" "$@" \
    > "$OUT/$name/log.txt" 2>&1
  echo "$name: rc=$?"
  tail -3 "$OUT/$name/log.txt" | cut -c1-300
}

prefix_reuse() {  # prefix_reuse GRAPH SECONDS [prefix_reuse.py-args...]
  local graph=$1 seconds=$2 fit=()
  shift 2
  mkdir -p "$OUT/prefix-reuse-bench"
  python3 -m sglang_hybrid.cli make-checkpoint --preset bench --out /tmp/ckpt-bench > /dev/null
  # 256 experts take 94 GB: on an 80 GB card the bench model keeps 96 (same top-8 compute per token).
  [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] \
    && fit=(--json-model-override-args '{"num_experts": 96}')
  timeout "$seconds" python3 benchmarks/prefix_reuse.py --model-path /tmp/ckpt-bench --rounds 3 "${fit[@]}" "$@" \
    --cuda-graph-backend-prefill "$graph" --out "$OUT/prefix-reuse-bench/prefix_reuse_$graph.json" \
    --load-format dummy --context-length 40000 --mem-fraction-static 0.85 > "$OUT/prefix-reuse-bench/log_$graph.txt" 2>&1
  echo "prefix-reuse $graph: rc=$?"; tail -8 "$OUT/prefix-reuse-bench/log_$graph.txt" | cut -c1-300
}

part() {
  case "$1" in
    tiny) part tiny-e2e; part tiny-bf16 ;;
    small) part small-e2e; part small-bf16 ;;
    tiny-kernels) run tiny-kernels 280 tests/test_indexer_topk.py tests/test_sparse_mla_kernel.py tests/test_mxfp8.py tests/test_fp8_kv.py tests/test_gpu.py -k "not bf16_statistically and not bench_preset" ;;
    indexer-kernels) run indexer-kernels 200 tests/test_indexer_topk.py tests/test_sglang_dsa_baseline.py ;;
    tiny-e2e) run tiny-e2e 420 tests/test_engine.py tests/test_server.py --preset tiny ;;
    tiny-bf16) run tiny-bf16 260 tests/test_gpu.py::test_bf16_statistically_tracks_golden --preset tiny ;;
    # The engine's three tiers take ~280 s and the server's first start ~220 s (run 82: together
    # they overran 420 s), so the two halves run side by side.
    small-e2e) part small-engine & part small-server; wait ;;
    small-engine) run small-engine 420 tests/test_engine.py --preset small ;;
    small-server) run small-server 520 tests/test_server.py --preset small ;;
    # Issue 5: prefix reuse against the golden model (fp32), and the fp32 KDA path's snapshots.
    radix-tiny) run radix-tiny 420 tests/test_radix_snapshots.py --preset tiny ;;
    # Issue 6: speculative decoding (draft head, chain drafts, CUDA graphs) against the golden model.
    spec-tiny) run spec-tiny 300 tests/test_speculative.py -k "mixed or perfect" --preset tiny ;;
    spec-tiny-rest) run spec-tiny-rest 280 tests/test_speculative.py -k "random or low_acceptance" --preset tiny ;;
    # Tree drafts (--speculative-eagle-topk 2 and 3) against the golden model, CUDA graphs on.
    spec-tree) run spec-tree 420 tests/test_speculative.py -k "tree and not 16" --preset tiny ;;
    spec-tree-paged) run spec-tree-paged 200 tests/test_speculative.py -k "tree and 16" --preset tiny ;;
    # Each case starts two servers (~210 s): in one call both cases do not fit; [0.0] passed in runs 46-47.
    spec-standalone) run spec-standalone 520 tests/test_speculative.py -k standalone --preset tiny ;;
    spec-standalone-0.3) run spec-standalone-0.3 400 tests/test_speculative.py -k "standalone and 0.3" --preset tiny ;;
    spec-tree-topk3) run spec-tree-topk3 180 tests/test_speculative.py -k "tree and 3-8" --preset tiny ;;
    # Rollback bit for bit (SGLang's gather-scatter), and decode snapshots under speculation.
    spec-snap) run spec-snap 220 tests/test_kda_rollback.py tests/test_speculative.py -k "rollback or snapshots" --preset tiny ;;
    # Decode speedup by acceptance (near-bigram scale) and draft length, cycle cost, rollback copy; small, bf16.
    spec-bench) mkdir -p "$OUT/spec-bench"
                timeout 450 python3 benchmarks/speculative_decode.py --preset small --out "$OUT/spec-bench/spec.json" \
                  --scales 0.003 0.02 0.05 \
                  --mem-fraction-static 0.06 --cuda-graph-max-bs 8 --max-running-requests 8 --sleep-on-idle \
                  > "$OUT/spec-bench/log.txt" 2>&1
                echo "spec-bench: rc=$?"; tail -20 "$OUT/spec-bench/log.txt" | cut -c1-200 ;;
    # The same for tree drafts (topk 2, 3 steps: 7 drafts verified); accept rate counts every tree node.
    spec-bench-tree) mkdir -p "$OUT/spec-bench-tree"
                timeout 300 python3 benchmarks/speculative_decode.py --preset small --out "$OUT/spec-bench-tree/spec.json" \
                  --scales 0.003 0.02 --steps 3 --topks 2 --rollback-batch-sizes 1 \
                  --mem-fraction-static 0.06 --cuda-graph-max-bs 8 --max-running-requests 8 --sleep-on-idle \
                  > "$OUT/spec-bench-tree/log.txt" 2>&1
                echo "spec-bench-tree: rc=$?"; tail -12 "$OUT/spec-bench-tree/log.txt" | cut -c1-200 ;;
    # Tree against chain with a confident head (logits x 8: top-1 probability ~0.6 on small).
    spec-bench-sharp) mkdir -p "$OUT/spec-bench-sharp"
                timeout 420 python3 benchmarks/speculative_decode.py --preset small --out "$OUT/spec-bench-sharp/spec.json" \
                  --scales 0.003 0.02 --logit-scale 8 --steps 3 --topks 1 2 --rollback-batch-sizes 1 \
                  --mem-fraction-static 0.06 --cuda-graph-max-bs 8 --max-running-requests 8 --sleep-on-idle \
                  > "$OUT/spec-bench-sharp/log.txt" 2>&1
                echo "spec-bench-sharp: rc=$?"; tail -14 "$OUT/spec-bench-sharp/log.txt" | cut -c1-200 ;;
    # Where a draft-verify cycle's time goes: GPU busy time per step against wall time, top kernels.
    spec-profile) mkdir -p "$OUT/spec-profile"
                timeout 300 python3 benchmarks/speculative_decode.py --preset small --out "$OUT/spec-profile/spec.json" \
                  --scales 0.003 --steps 2 3 --batch-sizes 1 8 --profile --rollback-batch-sizes 1 \
                  --mem-fraction-static 0.06 --cuda-graph-max-bs 8 --max-running-requests 8 --sleep-on-idle \
                  > "$OUT/spec-profile/log.txt" 2>&1
                echo "spec-profile: rc=$?"; grep -v '^{"config' "$OUT/spec-profile/log.txt" | tail -12 | cut -c1-200
                grep '"gpu_busy' "$OUT/spec-profile/log.txt" | cut -c1-400 ;;
    spec-profile-tree) mkdir -p "$OUT/spec-profile-tree"
                timeout 360 python3 benchmarks/speculative_decode.py --preset small --out "$OUT/spec-profile-tree/spec.json" \
                  --scales 0.003 --logit-scale 8 --steps 3 --topks 1 2 --batch-sizes 1 8 --profile --rollback-batch-sizes 1 \
                  --mem-fraction-static 0.06 --cuda-graph-max-bs 8 --max-running-requests 8 --sleep-on-idle \
                  > "$OUT/spec-profile-tree/log.txt" 2>&1
                echo "spec-profile-tree: rc=$?"; grep -v '^{"config' "$OUT/spec-profile-tree/log.txt" | tail -8 | cut -c1-200
                grep '"gpu_busy' "$OUT/spec-profile-tree/log.txt" | cut -c1-900 ;;
    kda-fp32) run kda-fp32 300 tests/test_gpu.py::test_kda_extend_kernels_fp32_against_reference ;;
    # The served CP path on the GPU (fla's fused and chunked KDA kernels per chunk) against the reference.
    cp-recurrence) run cp-recurrence 230 tests/test_cp_algebra.py -k "gpu_recurrence or gpu_kernels" ;;
    # Not the eviction workload: on small, one of its 48 requests leaves the golden model by
    # more than the fp32 margin with or without the cache (radix-replay; gpu_correctness_h200.md).
    radix-small) run radix-small 280 tests/test_radix_snapshots.py -k "not eviction" --preset small ;;
    # The eviction workload again (small), then each of its prompts cold on a server without the cache.
    radix-replay) run radix-replay 200 tests/test_radix_snapshots.py -k eviction --preset small
                  python3 -m sglang_hybrid.cli make-checkpoint --preset small --out /tmp/ckpt-small-replay > /dev/null
                  timeout 200 python3 benchmarks/radix_replay_cold.py --model-path /tmp/ckpt-small-replay \
                    --workload "$OUT/radix-replay/radix_workload.json" --out "$OUT/radix-replay/replay.json" \
                    --dtype float32 --mem-fraction-static 0.25 --cuda-graph-max-bs 32 --page-size 16 \
                    --chunked-prefill-size 128 --max-total-tokens 1536 > "$OUT/radix-replay/replay_log.txt" 2>&1
                  echo "radix-replay cold: rc=$?"; tail -30 "$OUT/radix-replay/replay_log.txt" | cut -c1-200 ;;
    # TTFT with a 32K cached prefix against cold, bf16 small preset (checkpoint made here).
    prefix-reuse) mkdir -p "$OUT/prefix-reuse"
                  python3 -m sglang_hybrid.cli make-checkpoint --preset small --out /tmp/ckpt-small > /dev/null
                  timeout 230 python3 benchmarks/prefix_reuse.py --model-path /tmp/ckpt-small \
                    --out "$OUT/prefix-reuse/prefix_reuse.json" --mem-fraction-static 0.25 \
                    > "$OUT/prefix-reuse/log.txt" 2>&1
                  echo "prefix-reuse: rc=$?"; tail -16 "$OUT/prefix-reuse/log.txt" | cut -c1-300 ;;
    # The same on the 48B-A3B-class bench config (dummy weights; the whole GPU), then one floor and
    # one warm request profiled (where the per-request floor goes).
    # TTFT over a 32K cached prefix with SGLang's breakable prefill CUDA graph (the default; capturing
    # its 42 buckets took 148 s on the bench model), and eagerly as the baseline: run both on one warm machine.
    prefix-reuse-bench) prefix_reuse breakable 480 --profile ;;
    prefix-reuse-eager) prefix_reuse disabled 250 ;;
    # Multi-turn chat with shared system prompts (SGLang's bench_serving), radix cache on vs off, small bf16.
    multi-turn) mkdir -p "$OUT/multi-turn"
                python3 -m sglang_hybrid.cli make-checkpoint --preset small --out /tmp/ckpt-small-mt > /dev/null
                timeout 540 python3 benchmarks/multi_turn_cache.py --model-path /tmp/ckpt-small-mt \
                  --out "$OUT/multi-turn/multi_turn_cache.json" --mem-fraction-static 0.25 \
                  > "$OUT/multi-turn/log.txt" 2>&1
                echo "multi-turn: rc=$?"; tail -30 "$OUT/multi-turn/log.txt" | cut -c1-200 ;;
    small-bf16) run small-bf16 290 tests/test_gpu.py::test_bf16_statistically_tracks_golden --preset small ;;
    # 300 s: the bench server takes ~95 s to start and its first request compiles the kernels.
    bench) run bench 300 tests/test_gpu.py::test_bench_preset_dummy_weights_answers ;;
    timing-decode) timing timing-decode 400 --kind decode ;;
    timing-prefill) timing timing-prefill 400 --kind prefill ;;
    # Where the indexer's time goes (tile size, pipelining depth, paging, sort work) at the largest decode shape.
    timing-ablate) timing timing-ablate 180 --indexer-only --ablate --case decode:64x131072 --case decode:8x131072 ;;
    # The indexer alone where it is slowest, and prefill's first shape.
    timing-key) timing timing-key 280 --indexer-only --case decode:32x131072 --case decode:64x131072 \
                  --case decode:64x32768 --case decode:8x131072 --case prefill:8192 ;;
    # The indexer's ordering stage alone (Triton radix select + write against torch.topk) at the
    # decode grid's shapes, then the whole indexer where the ordering dominates, against unfused.
    timing-ordering) mkdir -p "$OUT/timing-ordering"
             timeout 150 python3 benchmarks/indexer_breakdown.py --out "$OUT/timing-ordering/ordering.json" \
               > "$OUT/timing-ordering/log.txt" 2>&1
             echo "timing-ordering: rc=$?"; cut -c1-200 "$OUT/timing-ordering/log.txt" | tail -16 ;;
    timing-small-batch) timing timing-small-batch 250 --indexer-only --case decode:1x4096 --case decode:1x32768 \
                  --case decode:8x32768 --case decode:1x131072 --case decode:32x131072 --case decode:64x131072 ;;
    # Issue 4: the KDA layer's CP costs (summary, fold, local prefill, the served kernels) against its
    # plain prefill; fla-core must be in the bundle (README, Test). Alone in a
    # call: fla's kernels compile and autotune for ~200 s before the first case (runs 44, 45).
    cp-cost) mkdir -p "$OUT/cp-cost"
             timeout 540 python3 benchmarks/cp_prefill_cost.py --out "$OUT/cp-cost/cp_prefill_cost.json" \
               > "$OUT/cp-cost/log.txt" 2>&1
             echo "cp-cost: rc=$?"; tail -4 "$OUT/cp-cost/log.txt" | cut -c1-400 ;;
    # The served kernels only, with the served layer's own plain prefill (SGLang's chunk_kda over T) as
    # the baseline; skips fla's pieces and the check (cp_prefill_cost.py --served-only).
    cp-served) mkdir -p "$OUT/cp-served"
             timeout 300 python3 benchmarks/cp_prefill_cost.py --served-only --lengths 32768 131072 \
               --out "$OUT/cp-served/cp_prefill_cost_served.json" > "$OUT/cp-served/log.txt" 2>&1
             echo "cp-served: rc=$?"; tail -3 "$OUT/cp-served/log.txt" | cut -c1-400 ;;
    # Issue 4/7: each CP rank's sparse-layer time (indexer + sparse MLA over its rows), zigzag vs contiguous.
    cp-rank-time) mkdir -p "$OUT/cp-rank-time"
             timeout 300 python3 benchmarks/cp_rank_time.py --out "$OUT/cp-rank-time/cp_rank_time.json" \
               > "$OUT/cp-rank-time/log.txt" 2>&1
             echo "cp-rank-time: rc=$?"; tail -9 "$OUT/cp-rank-time/log.txt" | cut -c1-400 ;;
    # Issue 7, on a host with 2 (multi-gpu-2) or 4 (multi-gpu-4) GPUs: layouts against one GPU, small preset.
    multi-gpu-2|multi-gpu-4) mkdir -p "$OUT/$1"
             python3 -m sglang_hybrid.cli make-checkpoint --preset small --out /tmp/ckpt-small-mg > /dev/null
             layouts="tp1 tp2 cp2"; [ "$1" = multi-gpu-4 ] && layouts="tp1 cp4 cp2xtp2"
             SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 timeout 560 python3 benchmarks/multi_gpu.py \
               --model-path /tmp/ckpt-small-mg --out "$OUT/$1/multi_gpu.json" --layouts $layouts --profile \
               --dtype bfloat16 --context-length 132000 --mem-fraction-static 0.8 > "$OUT/$1/log.txt" 2>&1
             echo "$1: rc=$?"; tail -4 "$OUT/$1/log.txt" | cut -c1-600 ;;
    *) echo "usage: bash benchmarks/h200_checks.sh GROUP... (GROUP: PART[,PART...]; parts are named in this file)" >&2
       exit 2 ;;
  esac
}

[ $# -gt 0 ] || part usage
for group in "$@"; do
  # Each group's report is printed whole once it ends, not interleaved with the others.
  ( for p in ${group//,/ }; do part "$p"; done > "$OUT/.group-$BASHPID.txt" 2>&1; cat "$OUT/.group-$BASHPID.txt"
    rm -f "$OUT/.group-$BASHPID.txt" ) &
done
wait
