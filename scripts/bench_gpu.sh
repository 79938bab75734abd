#!/usr/bin/env bash
# GPU figures in one call of the device tool (a machine with no network and no model weights):
# random-weight models with the default pair's shapes (and a 7B target), built on the GPU.
#   bash scripts/bench_gpu.sh OUT
# 1. pass costs by sessions and rows (scripts/bench_gpu_passes.py): the eager pass over DynamicCaches
#    against the static pass over KV pages, eager and from CUDA graphs; exactness of the graph path;
# 2. the three services under load (specdec bench-serve), greedy, with a SYNTHETIC acceptance of
#    0.8 a draft position (random models never agree; the default pair kept 2.7-2.9 of 4 drafts on
#    code: 0.8 to 0.85 a position), speculation on/off, goodput policy and fixed gamma, the workers
#    on CUDA graphs (their default), then one level with --cuda-graphs off (the ablation);
# 3. a 7B target's passes (Qwen2.5-Coder-7B's shapes), where time is left.
# Each step writes into OUT as it goes and a failed step does not stop the next; everything ends
# up in OUT/results.tar.gz and OUT/log.txt (the device tool brings back few files).
set -u
out=${1:?OUT}
mkdir -p "$out/r"
exec > >(tee -a "$out/log.txt") 2>&1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
specdec() { python3 -m specdec_tools.cli "$@"; }
models=/tmp/specdec-random
mkdir -p $models
step() { echo "=== $* ($(date +%T))"; }
pack() { tar -C "$out" -czf "$out/results.tar.gz" r; }
trap pack EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

step build models
for name in qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
  python3 -m specdec_tools.testing.tiny_models $models/$name $name --device cuda >/dev/null || exit 1
done

step passes draft 0.5B
timeout 240 python3 scripts/bench_gpu_passes.py $models/qwen2.5-coder-0.5b --role draft --draft-vocab 32768 \
  --rows 1,2,5 --out "$out/r/passes-0.5b.md" 2>&1 | grep -v "Loading weights"
graphs=${PIPESTATUS[0]}

step passes target 1.5B
timeout 240 python3 scripts/bench_gpu_passes.py $models/qwen2.5-coder-1.5b --out "$out/r/passes-1.5b.md" 2>&1 \
  | grep -v "Loading weights"
target_graphs=${PIPESTATUS[0]}
[ "$graphs" = 0 ] && graphs=$target_graphs
if [ "$graphs" != 0 ]; then
  echo "the graph path failed: serving with --cuda-graphs off"
  export SPECDEC_TARGET_CUDA_GRAPHS=off SPECDEC_DRAFT_CUDA_GRAPHS=off
fi

step bench-serve 1.5B + 0.5B
# no pipe: the services inherit the output (a pipe held open by them kept a timeout waiting)
timeout 300 python3 -m specdec_tools.cli bench-serve --random qwen2.5-coder-1.5b+qwen2.5-coder-0.5b --device cuda \
  --synthetic-acceptance 0.8 --concurrency 1,4,16 --gamma on,off --max-new-tokens 64 \
  --setups default,gamma-policy=fixed --out "$out/r/serve-1.5b" >"$out/r/serve-1.5b.log" 2>&1
cat "$out/r/serve-1.5b/table.md" 2>/dev/null || tail -20 "$out/r/serve-1.5b.log"
pack

step bench-serve ablation: --cuda-graphs off, one client
SPECDEC_TARGET_CUDA_GRAPHS=off SPECDEC_DRAFT_CUDA_GRAPHS=off timeout 120 python3 -m specdec_tools.cli bench-serve \
  --random qwen2.5-coder-1.5b+qwen2.5-coder-0.5b --device cuda --synthetic-acceptance 0.8 --concurrency 1 \
  --gamma on,off --max-new-tokens 64 --setups gamma-policy=fixed --out "$out/r/serve-1.5b-eager" \
  >"$out/r/serve-1.5b-eager.log" 2>&1
cat "$out/r/serve-1.5b-eager/table.md" 2>/dev/null || tail -20 "$out/r/serve-1.5b-eager.log"
pack

step 7B passes
python3 -m specdec_tools.testing.tiny_models $models/qwen2.5-coder-7b qwen2.5-coder-7b --device cuda >/dev/null &&
timeout 200 python3 scripts/bench_gpu_passes.py $models/qwen2.5-coder-7b --rows 1,5,8 --repeats 10 \
  --out "$out/r/passes-7b.md" 2>&1 | grep -v "Loading weights"
step done
