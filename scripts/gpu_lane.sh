#!/usr/bin/env bash
# The GPU lane: one script reproduces every GPU figure of docs/ (tests on CUDA, the stress run
# with its racy control, the benchmark, the 2-GPU NCCL context-parallel test).
#
#   OUT=DIR bash scripts/gpu_lane.sh [info] [stress] [bench] [tests] [cp] [compile_debug]
#                                    [sweep] [sweep_base] [host] [decode] [megatron_tests]
#                                    [transformers_layers] [host_grad] [megatron_layers] [serving]
#                                    [transformers_models]
#   (default: the first six, in that order; sweep = benchmarks/sweep.py, the launch-config
#   sweep; sweep_base = its heuristic rows for a package copy in .ab/base, an A/B baseline:
#   copy another commit's src/mlarope there and carry .ab (the current benchmarks/sweep.py runs
#   against it, so the copy must have the internals it imports); host = the host-overhead
#   profile of one decode call, benchmarks/host_profile.py; decode = the benchmark's decode
#   cases, ours only; megatron_tests = Megatron-LM's own MLA RoPE tests against mlarope and
#   Megatron, scripts/megatron_tests.py, with a Megatron-LM checkout in $MEGATRON_LM or
#   .megatron-lm; transformers_layers = one real-size attention layer of every patched
#   transformers family, unpatched and patched, at sequences 4096 and 128,
#   benchmarks/transformers_layers.py; host_grad = host time per call with gradients against
#   transformers' own rotary functions, benchmarks/host_grad.py; megatron_layers = one
#   DeepSeek-V3-size Megatron-Core MLA layer, Megatron's fused RoPE, mlarope's patch and
#   unfused, sbhd and thd, benchmarks/megatron_layers.py (Megatron-LM checkout as for
#   megatron_tests); serving = mlarope.serving's
#   GPU tests, then its benchmark, writing serving.json and serving.md; transformers_models = a
#   whole two-layer transformers model of every default family (default widths, 8 experts), its
#   training step unpatched and with apply_mlarope_to_all()'s defaults at sequences 4096 and
#   128: time, peak memory, GPU time by category, host time, benchmarks/transformers_models.py,
#   writing transformers_models.md and transformers_models.json)
#
# Runs from the repo root with the machine's own python3 (torch and triton preinstalled); the
# package is used from src/ via PYTHONPATH. Wheels in .whl/ (megatron-core for the benchmark)
# are installed into /tmp/site when present. Every step writes its log / JSON under $OUT
# (8 files in all: the device tool brings back at most 8).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared machines (see the device notes in docs/gpu_lane.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(info stress bench tests cp compile_debug)
status=0
for step in "${steps[@]}"; do
  echo "=== $step ($(date -u +%FT%TZ))"
  case "$step" in
    info)
      { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        python3 -m mlarope info; } 2>&1 | tee "$OUT/info.txt" ;;
    tests)
      # TESTS_K: the -k expression (default "not gloo"); TESTS_WORKERS: pytest-xdist workers.
      # -v (no -q, which cancels it) logs every result with its name as it comes; at the limit
      # SIGINT, not SIGTERM, lets pytest still print the -rfE summary of what failed so far.
      timeout -s INT -k 30 "${TESTS_SECONDS:-200}" python3 -m pytest -n "${TESTS_WORKERS:-16}" \
        tests --device cuda -k "${TESTS_K:-not gloo}" -p no:cacheprovider -rfE -v \
        --durations=15 >"$OUT/pytest.log" 2>&1 || status=1
      grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest.log" | tail -30 ;;
    stress)
      python3 -m mlarope stress --trials "${STRESS_TRIALS:-20000}" \
        --control-trials "${CONTROL_TRIALS:-500}" --workers 14 --json "$OUT/stress.json" \
        --max-seconds "${STRESS_SECONDS:-300}" 2>&1 | tail -30 ;;
    bench)
      # Ours, Megatron and the eager reference on every case; torch.compile (slow to compile)
      # on the sbhd case; then one merged table, JSON and plot.
      timeout "${BENCH_SECONDS:-170}" python3 -m mlarope bench \
        --impls mlarope,megatron,reference --out /tmp/bench_main 2>&1 | tail -5
      # BENCH_COMPILE=0 leaves the torch.compile baseline out (its reference is unchanged and
      # compiling it takes up to 100 s of a 10-minute device call).
      merge=(/tmp/bench_main/bench.json)
      if [ "${BENCH_COMPILE:-1}" = 1 ]; then
        timeout 100 python3 -m mlarope bench --cases sbhd,thd4 --impls compile \
          --out /tmp/bench_compile 2>&1 | tail -3
        merge+=(/tmp/bench_compile/bench.json)
      fi
      python3 -m mlarope bench --merge "${merge[@]}" --out "$OUT" 2>&1 | tail -60 ;;
    cp)
      timeout 120 python3 -m pytest -q -m gpu tests/test_context_parallel.py --device cuda \
        -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/cp.log" ;;
    sweep)
      # SWEEP_ARGS: more arguments, e.g. "--heuristic-only --ops q_inplace --cases sbhd".
      # shellcheck disable=SC2086
      timeout "${SWEEP_SECONDS:-280}" python3 benchmarks/sweep.py --label new ${SWEEP_ARGS:-} \
        --json "$OUT/sweep.json" 2>&1 | tail -120 ;;
    sweep_base)
      PYTHONPATH="$PWD/.ab/base:${PYTHONPATH#*:}" timeout 90 python3 benchmarks/sweep.py \
        --label base --heuristic-only --ops q_inplace,kv,kv_no_v,kv_bwd \
        --json "$OUT/sweep_base.json" 2>&1 | tail -20 ;;
    decode)
      # The decode cases alone, ours only: the host-overhead target in a minute.
      timeout 150 python3 -m mlarope bench --cases decode --impls mlarope --out "$OUT/decode" \
        2>&1 | grep -E "host <=|floor|targets" ;;
    host)
      python3 benchmarks/host_profile.py >"$OUT/host.txt" 2>&1; head -20 "$OUT/host.txt" ;;
    megatron_tests)
      # Megatron-LM's own MLA RoPE test file against mlarope.compat.megatron and against
      # Megatron's kernels (20 processes each, the test bodies repeated, the k_pos_emb gradient
      # against fp64), and the Megatron-Core layer test: docs/megatron.md. MEGATRON_LM: a
      # Megatron-LM checkout (default .megatron-lm, an ignored folder carried to the GPU);
      # MEGATRON_ARGS: more arguments, e.g. "--processes 10".
      # shellcheck disable=SC2086
      timeout "${MEGATRON_SECONDS:-560}" python3 scripts/megatron_tests.py \
        --megatron "${MEGATRON_LM:-.megatron-lm}" --out "$OUT" ${MEGATRON_ARGS:-} 2>&1 | tail -90 ;;
    transformers_layers)
      # One real-size transformers attention layer per patched family (bf16, sequences 4096
      # and 128): forward and training step, unpatched and through mlarope, timed in one process
      # and checked against the fp32 layer; one file, transformers_layers.md
      # (docs/transformers.md). LAYERS_ARGS: more arguments, e.g. "--families minicpm3".
      # shellcheck disable=SC2086
      timeout "${LAYERS_SECONDS:-400}" python3 -m benchmarks.transformers_layers \
        --out "$OUT/transformers_layers.md" ${LAYERS_ARGS:-} 2>&1 | grep -E "^\|" | tail -40 ;;
    host_grad)
      # Host time per call with gradients at tiny sizes: every family's rotary functions,
      # transformers' against mlarope's, and the public ops (docs/perf_log.md).
      timeout "${HOST_GRAD_SECONDS:-200}" python3 -m benchmarks.host_grad \
        --out "$OUT/host_grad.md" 2>&1 | tail -60 ;;
    megatron_layers)
      # One Megatron-Core MLASelfAttention at DeepSeek-V3's widths (bf16, batch 1): forward and
      # training step with Megatron's fused RoPE kernels, mlarope's patch and the unfused path,
      # sbhd 4096, thd 4096 / 1 sequence, thd 16384 / 4096 sequences, sbhd 128 (host-bound),
      # checked against the fp32 layer; megatron_layers.md (docs/megatron.md) and the log.
      # MEGATRON_LM: a Megatron-LM checkout (default .megatron-lm, carried), put first on
      # PYTHONPATH; MEGATRON_LAYERS_ARGS: more arguments, e.g. "--cases thd:4096/4096".
      mlm="${MEGATRON_LM:-$PWD/.megatron-lm}"
      if [ ! -d "$mlm/megatron/core" ]; then
        echo "megatron_layers: no Megatron-LM checkout at $mlm (set MEGATRON_LM or carry .megatron-lm)"
        status=1; continue
      fi
      # shellcheck disable=SC2086
      MEGATRON_LM="$mlm" PYTHONPATH="$mlm:$PYTHONPATH" timeout "${MEGATRON_LAYERS_SECONDS:-170}" \
        python3 -m benchmarks.megatron_layers --out "$OUT/megatron_layers.md" \
        ${MEGATRON_LAYERS_ARGS:-} 2>&1 | tee "$OUT/megatron_layers.log" \
        | grep -E "^(megatron_layers|\||Traceback|[A-Za-z.]*Error)" | tail -60 ;;
    serving)
      # mlarope.serving (docs/serving.md): its tests on the GPU (summary only), then the
      # benchmark: prefill and decode per cache format, the unfused sequence, FlashInfer when it
      # imports (docs/benchmarks.md, "Serving"). SERVING_ARGS: more arguments, e.g. "--sweep"
      # (other launch configurations and the integer FP8 encoder; about a minute of compiles).
      # SERVING_TESTS=0 leaves the tests out (when the tests step ran them in the same call).
      if [ "${SERVING_TESTS:-1}" = 1 ]; then
        timeout "${SERVING_TESTS_SECONDS:-150}" python3 -m pytest -q -n 8 --device cuda \
          -p no:cacheprovider -rfE tests/test_serving_*.py 2>&1 | tail -15
        [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
      fi
      # shellcheck disable=SC2086
      timeout "${SERVING_SECONDS:-240}" python3 -m mlarope.tools.bench.serving --out "$OUT" \
        ${SERVING_ARGS:-} 2>&1 | tail -100 ;;
    transformers_models)
      # A whole two-layer model per family (docs/transformers.md, "Whole models"): training
      # step unpatched and patched, peak memory, GPU time by category (GEMM, attention, RoPE,
      # norms, copies and cat, other elementwise, other), host time. The files are rewritten
      # after each row, so a run its timeout cuts keeps what it measured. MODELS_ARGS: more arguments,
      # e.g. "--families deepseek_v3,minicpm3 --sync-check" or "--variants unpatched,patched_all".
      # shellcheck disable=SC2086
      timeout "${MODELS_SECONDS:-400}" python3 -m benchmarks.transformers_models \
        --out "$OUT/transformers_models.md" --json "$OUT/transformers_models.json" \
        ${MODELS_ARGS:-} 2>&1 | grep -E "^(\||transformers_models|Traceback|[A-Za-z.]*Error)" \
        | tail -80 ;;
    compile_debug)
      # Inductor's generated code for the torch.compile tests of the query op (how the CUDA-only
      # compiled-gradient bug was found and its fix checked; docs/gpu_lane.md).
      TORCH_LOGS=output_code timeout 70 python3 -m pytest -q -p no:cacheprovider --device cuda \
        "tests/test_q.py::test_q_torch_compile_fullgraph" > "$OUT/compile_debug.log" 2>&1 \
        || status=1
      tail -5 "$OUT/compile_debug.log" ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
  [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
done
exit $status
