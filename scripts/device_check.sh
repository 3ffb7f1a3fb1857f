#!/usr/bin/env bash
# The prepared GPU check, for a session that is lent an accelerator (the `device` tool):
#   run(command="bash scripts/device_check.sh", timeout_s=600)
# On the device machine (torch and Triton preinstalled, nothing reachable): installs kvblend
# without dependencies into /tmp/kvb, then
#   1. python -m blend.evals.check_device --device cuda   the engine's invariants on the GPU, and
#      blend@0.15 with the Triton kernels against the CPU's torch path (tiny model, no data files);
#   2. python -m blend.evals.check_offsets --device cuda  each Triton kernel on views of a 128k-token,
#      32-layer token-major KV buffer (8.6e9 fp16 elements, 17 GB): rows past 2**31 elements;
#   3. python -m blend.evals.bench_kernels --device cuda  each kernel's error against the torch
#      reference and its time against the torch path, at 4k and 16k tokens.
# Everything lands in $OUT (the tool brings it back): device.txt, check_device.{log,json},
# check_offsets.{log,json}, bench_kernels.log, kernels.json. Exit status: non-zero if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/device_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/kvb . 2>&1 | tail -3
export PYTHONPATH=/tmp/kvb
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
} | tee "$OUT/device.txt"
rc=0
timeout 240 python3 -m blend.evals.check_device --device cuda --json "$OUT/check_device.json" 2>&1 \
  | tee "$OUT/check_device.log" || rc=1
timeout 120 python3 -m blend.evals.check_offsets --device cuda --json "$OUT/check_offsets.json" 2>&1 \
  | tee "$OUT/check_offsets.log" || rc=1
timeout 200 python3 -m blend.evals.bench_kernels --device cuda --json "$OUT/kernels.json" --tokens 4096 16384 2>&1 \
  | tee "$OUT/bench_kernels.log" || rc=1
exit $rc
