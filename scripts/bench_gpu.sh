#!/usr/bin/env bash
# GPU figures in one call of the device tool (a machine with no network and no model weights):
# random-weight models with the default pair's shapes (and a 7B target), built on the GPU.
#   bash scripts/bench_gpu.sh OUT [cuda]
# 1. pass costs by rows and sessions (specdec bench-kernels): the cost model of a verify row on
#    this GPU, with the worker's row-wise attention and with one SDPA call a session (ablation);
# 2. the three services under load (specdec bench-serve), greedy, with a SYNTHETIC acceptance of
#    0.8 a draft position (random models never agree; the default pair kept 2.7-2.9 of 4 drafts on
#    code: 0.8 to 0.85 a position), speculation on/off, goodput policy and fixed gamma;
# 3. a 7B target (Qwen2.5-Coder-7B's shapes) with the same draft, where time is left.
# Each step writes into OUT as it goes and a failed step does not stop the next.
set -u
out=${1:?OUT}; device=${2:-cuda}
mkdir -p "$out"
specdec() { python3 -m specdec_tools.cli "$@"; }
models=/tmp/specdec-random
mkdir -p $models
step() { echo "=== $* ($(date +%T))"; }

step build models
for name in qwen2.5-coder-1.5b qwen2.5-coder-0.5b; do
  python3 -m specdec_tools.testing.tiny_models $models/$name $name --device $device >/dev/null || exit 1
done

step bench-kernels target 1.5B
specdec bench-kernels --model $models/qwen2.5-coder-1.5b --device $device --modes none --reference '' \
  --rows 1,2,3,5,9,17 --sessions 1,4,16 --rowwise 32,0 --repeats 10 --out "$out/kernels-1.5b" 2>&1 | grep -v "^\[bench-kernels\] |"

step bench-kernels draft 0.5B
specdec bench-kernels --model $models/qwen2.5-coder-0.5b --role draft --draft-vocab 32768 --device $device \
  --modes none --reference '' --rows 1,2,5 --sessions 1,4,16 --repeats 10 --out "$out/kernels-0.5b" 2>&1 | grep -v "^\[bench-kernels\] |"

step bench-serve 1.5B + 0.5B
specdec bench-serve --random qwen2.5-coder-1.5b+qwen2.5-coder-0.5b --device $device --synthetic-acceptance 0.8 \
  --concurrency 1,4,16 --gamma on,off --max-new-tokens 64 --setups default,gamma-policy=fixed \
  --out "$out/serve-1.5b" 2>&1 | grep -v " INFO \|^\[bench-serve\]   "
cat "$out/serve-1.5b/table.md" 2>/dev/null

step 7B
python3 -m specdec_tools.testing.tiny_models $models/qwen2.5-coder-7b qwen2.5-coder-7b --device $device >/dev/null &&
specdec bench-kernels --model $models/qwen2.5-coder-7b --device $device --modes none --reference '' \
  --rows 1,2,3,5,9,17 --sessions 1,4,16 --repeats 10 --out "$out/kernels-7b" 2>&1 | grep -v "^\[bench-kernels\] |"
step done
