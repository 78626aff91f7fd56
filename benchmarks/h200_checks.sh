#!/usr/bin/env bash
# The project's checks on the H200. A device call allows 10 minutes, about 40 s of which go to
# the bootstrap: give one call parts whose timeouts add up to about 550 s.
# On the device machine, from the project root, with .device-bundle carried:
#   bash benchmarks/h200_checks.sh tiny-kernels    # kernel tests (bf16 and FP8 too)
#   bash benchmarks/h200_checks.sh tiny            # tiny end to end (server, Engine), bf16 vs golden
#   bash benchmarks/h200_checks.sh small           # small end to end, bf16 vs golden
#   bash benchmarks/h200_checks.sh bench timing    # bench preset on dummy weights; sparse path timings
#   bash benchmarks/h200_checks.sh tiny-e2e small-e2e   # or any list of the parts named below
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

part() {
  case "$1" in
    tiny-kernels) run tiny-kernels 280 tests/test_indexer_topk.py tests/test_sparse_mla_kernel.py tests/test_mxfp8.py tests/test_fp8_kv.py tests/test_gpu.py -k "not bf16_statistically and not bench_preset" ;;
    tiny-e2e) run tiny-e2e 300 tests/test_engine.py tests/test_server.py --preset tiny ;;
    tiny-bf16) run tiny-bf16 260 tests/test_gpu.py::test_bf16_statistically_tracks_golden --preset tiny ;;
    small-e2e) run small-e2e 240 tests/test_server.py --preset small ;;
    small-bf16) run small-bf16 290 tests/test_gpu.py::test_bf16_statistically_tracks_golden --preset small ;;
    bench) run bench 200 tests/test_gpu.py::test_bench_preset_dummy_weights_answers ;;
    timing) mkdir -p "$OUT/timing"
            timeout 400 python3 benchmarks/sparse_path_timing.py --out "$OUT/timing/sparse_path_timing.json" \
              > "$OUT/timing/log.txt" 2>&1; echo "timing: rc=$?"; tail -3 "$OUT/timing/log.txt" ;;
    *) echo "usage: bash benchmarks/h200_checks.sh {tiny|small|timing|PART...}" >&2; exit 2 ;;
  esac
}

[ $# -gt 0 ] || part usage
for name in "$@"; do
  case "$name" in
    tiny) for p in tiny-e2e tiny-bf16; do part $p; done ;;
    small) for p in small-e2e small-bf16; do part $p; done ;;
    *) part "$name" ;;
  esac
done
