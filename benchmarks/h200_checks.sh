#!/usr/bin/env bash
# The project's checks on the H200, one device call per stage (each under 10 minutes).
# On the device machine, from the project root, with .device-bundle carried:
#   bash benchmarks/h200_checks.sh tiny     # kernel tests (bf16 too), tiny end to end, Engine, bf16 vs golden
#   bash benchmarks/h200_checks.sh small    # small end to end, bf16 vs golden, bench preset on dummy weights
# Each pytest run writes $OUT/<stage>-<part>/pytest.txt and the server logs beside it.
set -u
source launch/h200_env.sh >/dev/null || exit 1
nvidia-smi -L

run() {  # run NAME SECONDS pytest-args...
  local name=$1 seconds=$2
  shift 2
  mkdir -p "$OUT/$name"
  SGLANG_HYBRID_TEST_LOGS=$OUT/$name timeout "$seconds" python3 -m pytest -q -p no:cacheprovider -rA -s \
    --durations=10 "$@" > "$OUT/$name/pytest.txt" 2>&1
  echo "$name: rc=$?"
  grep -E "^(FAILED|ERROR)|passed|failed|bf16 vs fp32|max \|" "$OUT/$name/pytest.txt" | tail -12
}

case "${1:-}" in
  tiny)
    run tiny-kernels 90 tests/test_indexer_topk.py tests/test_sparse_mla_kernel.py
    run tiny-e2e 300 tests/test_engine.py tests/test_server.py --preset tiny
    run tiny-bf16 150 tests/test_gpu.py::test_bf16_statistically_tracks_golden --preset tiny
    ;;
  small)
    run small-e2e 240 tests/test_server.py --preset small
    run small-bf16 140 tests/test_gpu.py::test_bf16_statistically_tracks_golden --preset small
    run bench 200 tests/test_gpu.py::test_bench_preset_dummy_weights_answers
    ;;
  *)
    echo "usage: bash benchmarks/h200_checks.sh {tiny|small}" >&2
    exit 2
    ;;
esac
