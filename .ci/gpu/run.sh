#!/bin/bash
# The GPU check, in one call (a lent GPU machine gives a session about 15 minutes): every stage in order of
# value, each under its own timeout, all within DEADLINE seconds; output to $OUT/log.txt (or ./gpu-check.log).
#
#   here:   bash .ci/gpu/prepare.sh            # only where the GPU machine lacks the default model (no network)
#   there:  DEADLINE=600 bash .ci/gpu/run.sh   # ONLY="kernels e2e" runs a subset
#
# In one session's 15 minutes of device time, two calls fit, the machine kept warm between them (carry .gpu;
# it goes back after 30 s idle, so issue the second call at once):
#   1. DEADLINE=380 ONLY="setup kernels e2e ckpt graphs" bash .ci/gpu/run.sh
#   2. DEADLINE=420 ONLY="graphs_sync vs_hf" bash .ci/gpu/run.sh
# The workload stages run with async scheduling unless they say otherwise (unset, it is on on CUDA; graphs_sync
# turns it off). What each stage checks, how long it took on an H100 and an H200, and what they measured:
# docs/gpu.md. CKPT is where the ckpt stage writes the random Qwen3-0.6B-shaped checkpoint the later stages
# read (build/ is git-ignored, so a warm machine keeps it between calls).
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
[[ -d .gpu/cache ]] && export MINIVLLM_CACHE=$PWD/.gpu/cache          # from prepare.sh
CKPT=${CKPT:-build/qwen3-0.6b}; DEADLINE=${DEADLINE:-600}; T0=$(date +%s); ONLY=${ONLY:-all}; OUT=${OUT:-.}
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
stage() {   # stage NAME TIMEOUT MIN_SECONDS_LEFT cmd...
  local name=$1 t=$2 min=$3; shift 3
  [[ $ONLY != all && " $ONLY " != *" $name "* ]] && return
  local l=$(left); if (( l < min )); then echo "=== $name SKIPPED ($l s left)"; return; fi
  (( t > l - 5 )) && t=$(( l - 5 ))
  echo "=== $name (timeout $t s) $(date +%T)"; local s=$(date +%s)
  timeout -k 5 "$t" "$@"; echo "=== $name rc=$? in $(( $(date +%s) - s )) s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
PT="python3 -m pytest -q -o addopts= -p no:cacheprovider -rfEs"
[[ -n $MINIVLLM_CACHE ]] && stage setup 60 20 python3 .ci/gpu/default_model.py
stage kernels 150 60 $PT -n 8 tests/test_kernels.py tests/test_kv_cache_fp8.py -k "not engine and (test_kernels or triton)" \
  --deselect tests/test_kernels.py::test_engine_with_triton_backend_gives_the_torch_backends_greedy_tokens
stage e2e 240 60 $PT -s tests/test_gpu.py tests/test_cuda_graph.py \
  tests/test_kernels.py::test_engine_with_triton_backend_gives_the_torch_backends_greedy_tokens \
  "tests/test_async_scheduling.py::test_on_a_gpu_the_batch_ahead_is_issued_and_sampled_without_waiting"
stage ckpt 60 30 python3 -m minivllm.model.random_checkpoint qwen3-0.6b $CKPT
stage profile 90 40 python3 .ci/gpu/profile_step.py $CKPT
stage profile_native 60 30 env MINIVLLM_CUSTOM_OPS=none python3 .ci/gpu/profile_step.py $CKPT
stage kbench 60 25 python3 -m minivllm.bench kernels --kernel-dtype bf16 --json "$OUT/kernels_bf16.json"
NANO="--model $CKPT --num-requests 256 --input-len-min 100 --input-len-max 1024 --output-len-min 100 --output-len-max 1024 --decode-batch 64"
stage graphs 120 60 python3 -m minivllm.bench $NANO --json "$OUT/offline_graphs.json"
stage graphs_sync 120 60 python3 -m minivllm.bench $NANO --no-async-scheduling --json "$OUT/offline_graphs_sync.json"
stage eager 120 60 python3 -m minivllm.bench $NANO --enforce-eager --json "$OUT/offline_eager.json"
stage graphs_native 120 60 env MINIVLLM_CUSTOM_OPS=none python3 -m minivllm.bench $NANO --json "$OUT/offline_graphs_native.json"
stage vs_hf 400 200 python3 -m minivllm.bench $NANO $VS_HF_FLAGS --compare hf --hf-batch-size 64 --json "$OUT/offline_vs_hf.json"
echo "=== done in $(( $(date +%s) - T0 )) s"
