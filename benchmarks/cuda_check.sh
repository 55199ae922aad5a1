#!/usr/bin/env bash
# The device check to run on a CUDA machine, as one prepared script (GPU loans are short): attn-check's kernel mode
# on every SDPA backend and FlexAttention in fp32/fp16/bf16 plus planted bugs, in one process
# (benchmarks/cuda_kernel_battery.py); the headline attn-check and shift-labels on CUDA through the CLI; the
# CUDA-only tests; compiled FlexAttention on a reduced matrix. Steps run in that order (the most telling first),
# each under its own timeout, and a step is skipped, saying so, once less than it needs is left of BUDGET seconds.
# Results land in $OUT (or ./cuda-check): at most 8 files (the run directories as one tarball) for the lab reports.
# Needs the CUDA build of torch (docs/gpu.md); PYTHON picks the interpreter (default .venv/bin/python).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-cuda-check}
budget=${BUDGET:-540}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
export PYTHONUNBUFFERED=1
runs=$(mktemp -d /tmp/cuda-check-runs.XXXX)
exec 4>&1  # the console: a step's own lines go there and to runs.txt, whatever the step's output is sent to

# step NAME NEED MAX CMD...: run CMD under timeout min(MAX, what is left - 10) if at least NEED seconds are left
step() {
  local name=$1 need=$2 max=$3; shift 3
  local left=$((budget - SECONDS))
  if ((left < need)); then echo "== $name: skipped ($left s left of $budget, needs $need)" | tee -a "$out/runs.txt" >&4; return; fi
  local cap=$((left - 10 < max ? left - 10 : max))
  echo "== $name (timeout $cap s, at $SECONDS s)" | tee -a "$out/runs.txt" >&4
  timeout "$cap" "$@"
  echo "exit=$? ($name, at $SECONDS s)" | tee -a "$out/runs.txt" >&4
}

{ nvidia-smi; $py -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(),
torch.cuda.get_device_name(0), torch.backends.cudnn.version())"; $py -V; } > "$out/env.txt" 2>&1

step "kernel battery (every backend x fp32/fp16/bf16, planted bugs)" 120 260 \
  $py benchmarks/cuda_kernel_battery.py --deadline $((budget * 45 / 100)) --out "$out/kernels.jsonl" \
  > "$out/kernels.txt" 2>&1
for args in "attn-check --device cuda --dtype fp16" "attn-check --device cuda --dtype bf16" \
            "attn-check --device cuda --dtype fp32" "shift-labels --device cuda --dtype fp16"; do
  step "tfmoe $args" 40 90 $py -m tfmoe.cli $args run_root="$runs" >> "$out/runs.txt" 2>&1
done
step "pytest -m cuda" 60 150 $py -m pytest -q -p no:cacheprovider -m cuda tests/test_attn_check.py tests/test_attn_kernels.py > "$out/pytest-cuda.txt" 2>&1
step "tfmoe attn-check kernel=torch:flex-compiled bf16 (reduced matrix)" 60 150 \
  $py -m tfmoe.cli attn-check --device cuda --dtype bf16 kernel=torch:flex-compiled \
  'cases.shapes=[[17,17,64],[128,129,64],[1,239,128],[255,257,59]]' run_root="$runs" >> "$out/runs.txt" 2>&1
$py -m tfmoe.cli runs --runs-root "$runs" --format md > "$out/runs.md" 2>&1
tar czf "$out/runs.tar.gz" -C "$runs" . 2>/dev/null
echo "done at $SECONDS s" | tee -a "$out/runs.txt"
