#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (a lent GPU machine has the
# project's Python dependencies but not its pins: it runs its own torch,
# triton and transformers). Installs this checkout into a scratch directory,
# runs the Triton kernel tests and the GPU engine tests compiled for the GPU
# (TRITON_INTERPRET=0), the stories260K end-to-end tests with the scorer on
# the GPU (and the model-draft ones with the draft model on the GPU too),
# the feature and EAGLE-3 / MTP end-to-end tests with the scorer on the GPU
# (its passes returning target features replay graphs of their own;
# EAGLE3_TESTS: which of those test files), then
# benchmarks/bench_gpu.py on SmolLM2-135M's shapes.
#
#   SPECDEC_MODELS_DIR=DIR OUT=DIR bash scripts/gpu_checks.sh
#
# SPECDEC_MODELS_DIR must hold stories260K (the engine tests' model). Logs
# and the benchmark's JSON go to $OUT (default /tmp/specdec-gpu). WHEELS=DIR:
# wheels installed beside the package first (the machine's own grpcio and
# protobuf may be older than the generated code needs). STEPS: the steps to
# run, of "kernels e2e draft eagle3 bench" (default all). BENCH_ARGS: more
# arguments for bench_gpu.py (e.g. "--dtypes bfloat16").
#
# Time: on a fresh machine every Triton kernel compiles first. A whole run
# takes ~8 minutes on an H200 and more than the 10 minutes of one device
# command on an H100 (2026-11-26: kernels 68 s, the end-to-end tests over
# 150 s, the draft ones ~110 s, bench_gpu over 130 s): split it over two
# commands on the same warm machine, e.g. STEPS="kernels e2e" then
# STEPS="draft bench" (Triton's cache in ~/.triton stays while it is held).
set -u
STEPS=${STEPS:-kernels e2e draft eagle3 bench}
step() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }
OUT=${OUT:-/tmp/specdec-gpu}
mkdir -p "$OUT"
site=$(mktemp -d)
{ if [ -n "${WHEELS:-}" ]; then python3 -m pip install -q --no-index --no-deps --target "$site" "$WHEELS"/*.whl; fi
  python3 -m pip install -q --no-deps --no-build-isolation --target "$site" .; } >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
export PYTHONPATH="$site" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"; } | tee "$OUT/machine.txt"
status=0
step kernels && { timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --timeout 200 \
    tests/test_gpu_engine.py tests/test_kernels_verify.py tests/test_kernels_sampling.py tests/test_kernels_rng.py \
    >"$OUT/tests.log" 2>&1 || status=1
  tail -n 40 "$OUT/tests.log"; }
# the whole stack (gateway, proposer, scorer processes, gRPC on loopback) with the scorer on the GPU
# (Kubernetes discovery's test needs the kubernetes client, which a lent machine may lack: not a GPU check)
no_k8s=$(python3 -c "import kubernetes" 2>/dev/null || echo "not kubernetes")
step e2e && { SPECDEC_TEST_SCORER_ARGS="--device cuda" timeout "${E2E_TIMEOUT:-280}" python3 -m pytest -q -p no:cacheprovider \
    --timeout 240 -k "$no_k8s" tests/test_e2e_stories.py >"$OUT/e2e.log" 2>&1 || status=1
  tail -n 30 "$OUT/e2e.log"; }
# model drafts: the draft proposer's model on the GPU too
step draft && { SPECDEC_TEST_SCORER_ARGS="--device cuda" SPECDEC_TEST_DRAFT_ARGS="--draft-device cuda" timeout "${DRAFT_TIMEOUT:-150}" \
    python3 -m pytest -q -p no:cacheprovider --timeout 140 -m "not slow" --basetemp "$OUT/e2e_draft" \
    tests/test_e2e_draft.py >"$OUT/e2e_draft.log" 2>&1 || status=1  # the services' logs under $OUT/e2e_draft
  tail -n 20 "$OUT/e2e_draft.log"; }
# feature-conditioned drafts: the features a scorer on the GPU returns (against transformers' hidden states; its
# start-up capturing the graphs of test_features.py's layers) and EAGLE-3 and MTP heads fed by it (on the CPU)
step eagle3 && { SPECDEC_TEST_SCORER_ARGS="--device cuda --feature-layers 1,3,5" timeout "${EAGLE3_TIMEOUT:-300}" \
    python3 -m pytest -q -p no:cacheprovider --timeout 200 --basetemp "$OUT/e2e_eagle3" \
    ${EAGLE3_TESTS:-tests/test_features.py tests/test_e2e_eagle3.py} >"$OUT/e2e_eagle3.log" 2>&1 || status=1
  tail -n 20 "$OUT/e2e_eagle3.log"; }
step bench && { timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_gpu.py --shapes smollm2 --fused --out "$OUT/gpu.json" \
    ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1 || status=1
  tail -n 30 "$OUT/bench.log"; }
exit $status
