#!/usr/bin/env bash
# GPU figures in one call of the device tool (a machine with no network and no model weights):
# random-weight models with the default pair's shapes (and a 7B target), built on the GPU.
#   bash scripts/bench_gpu.sh OUT [STEP,...]     (default: passes-1.5b,passes-0.5b,serve-1.5b,serve-7b, ~8 min)
# PASSES_ARGS: more arguments for every passes step (e.g. "--sessions 1,16 --repeats 10": shorter)
# Steps:
#   passes-0.5b, passes-1.5b, passes-7b: pass costs by sessions and rows (scripts/bench_gpu_passes.py),
#     the eager pass over DynamicCaches against the static pass over KV pages, eager and from CUDA
#     graphs; exactness of the graph path;
#   serve-1.5b: the three services under load (specdec bench serve), greedy, with a SYNTHETIC
#     acceptance of 0.8 a draft position (random models never agree; the default pair kept 2.7-2.9
#     of 4 drafts on code: 0.8 to 0.85 a position), speculation on/off, goodput policy and fixed
#     gamma, the workers on CUDA graphs (their default);
#   serve-1.5b-eager: the same at one client with --cuda-graphs off (the ablation);
#   serve-7b: a 7B target with the 0.5B draft, one and four clients;
#   head-1.5b: a feature head's (EAGLE-3) draft step against the 1.5B target's captured pass and the
#     0.5B draft's step, 1/4/16 sessions (specdec bench head: c, docs/benchmarks/feature-heads);
#   tests-cuda: the tests that need a GPU (pytest -k cuda, ~1-2 min; not in the default: run it in a
#     second call while the machine is warm): the captured pass against the lean pass, chained
#     drafts against eager ones, choices on the device against the host's, the step loop.
# Each step writes into OUT as it goes and a failed step does not stop the next; everything ends
# up in OUT/results.tar.gz and OUT/log.txt (the device tool brings back few files).
set -u
out=${1:?OUT}
steps=${2:-passes-1.5b,passes-0.5b,head-1.5b,serve-1.5b,serve-7b}
mkdir -p "$out/r"
exec > >(tee -a "$out/log.txt") 2>&1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
models=/tmp/specdec-random
mkdir -p $models
step() { echo "=== $* ($(date +%T))"; }
pack() { tar -C "$out" -czf "$out/results.tar.gz" r; }
trap pack EXIT
want() { [[ ",$steps," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

build() {  # build NAME: the random model's directory, once
  [ -d $models/$1 ] || python3 -m specdec_tools.testing.tiny_models $models/$1 $1 --device cuda >/dev/null
}
step build models
build qwen2.5-coder-0.5b && build qwen2.5-coder-1.5b || exit 1
if [[ $steps == *7b* ]]; then build qwen2.5-coder-7b & fi

passes() {  # passes NAME ARGS...: scripts/bench_gpu_passes.py on one model
  local name=$1; shift
  step passes $name
  timeout 240 python3 scripts/bench_gpu_passes.py $models/qwen2.5-coder-$name --out "$out/r/passes-$name.md" "$@" \
    ${PASSES_ARGS:-} 2>&1 | grep -v "Loading weights"
}
serve() {  # serve NAME TARGET LEVELS SETUPS: specdec bench serve with the 0.5B draft
  step bench-serve $1
  # no pipe: the services inherit the output (a pipe held open by them kept a timeout waiting)
  timeout 300 python3 -m specdec_tools.cli bench serve --target $models/qwen2.5-coder-$2 \
    --draft $models/qwen2.5-coder-0.5b --device cuda --synthetic-acceptance 0.8 --concurrency $3 --gamma on,off \
    --max-new-tokens 64 --setups $4 --out "$out/r/serve-$1" >"$out/r/serve-$1.log" 2>&1
  cat "$out/r/serve-$1/table.md" 2>/dev/null || tail -20 "$out/r/serve-$1.log"
  pack
}

if want tests-cuda; then
  step tests-cuda
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -k cuda tests/specdec/worker/test_paged.py \
    tests/specdec/test_coupled_noise.py tests/orchestrator/test_steps.py >"$out/r/tests-cuda.log" 2>&1
  tail -30 "$out/r/tests-cuda.log"
fi
want passes-1.5b && passes 1.5b --sessions 1,4,16 --rows 1,2,5,8
want serve-7b && wait && serve 7b 7b 1,4 default,gamma-policy=fixed
want passes-0.5b && passes 0.5b --role draft --draft-vocab 32768 --rows 1,2,5
if want head-1.5b; then
  step bench-head 1.5b
  timeout 240 python3 -m specdec_tools.cli bench head --target $models/qwen2.5-coder-1.5b \
    --draft $models/qwen2.5-coder-0.5b --device cuda --rounds 3 --out "$out/r/head-1.5b" 2>&1 | grep -v "Loading weights"
  pack
fi
want serve-1.5b && serve 1.5b 1.5b 1,4,16 default,gamma-policy=fixed
want serve-1.5b-eager && (export SPECDEC_TARGET_CUDA_GRAPHS=off SPECDEC_DRAFT_CUDA_GRAPHS=off; serve 1.5b-eager 1.5b 1 gamma-policy=fixed)
want passes-7b && wait && passes 7b --rows 1,5,8 --repeats 10
step done
