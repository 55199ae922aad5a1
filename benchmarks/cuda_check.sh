#!/usr/bin/env bash
# The device check to run on a CUDA machine (one prepared script, as the workplace's GPU loans are short):
# the headline attn-check in fp16 and bf16, attn-check's kernel mode on every SDPA backend and FlexAttention,
# shift-labels on CUDA, and the CUDA-only tests. Results land in
# $OUT (or ./cuda-check) for the lab reports. Needs the CUDA build of torch 2.13.0 (docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-cuda-check}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
$py -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))" \
  > "$out/torch.txt" 2>&1
for args in "attn-check --device cuda --dtype fp16" "attn-check --device cuda --dtype bf16" \
            "attn-check --device cuda --dtype fp32" "shift-labels --device cuda --dtype fp16"; do
  echo "== tfmoe $args" | tee -a "$out/runs.txt"
  $py -m tfmoe.cli $args run_root="$out/runs" >> "$out/runs.txt" 2>&1
  echo "exit=$?" | tee -a "$out/runs.txt"
done
# attn-check kernel mode (issue 13): each SDPA backend as its own kernel, eager and compiled FlexAttention, on the
# default case matrix in fp16 and bf16 (compiled flex recompiles per shape and mask: a reduced matrix, bounded)
for spec in torch:sdpa torch:sdpa-flash torch:sdpa-efficient torch:sdpa-cudnn torch:sdpa-math torch:flex; do
  for dt in fp16 bf16; do
    echo "== tfmoe attn-check --device cuda --dtype $dt kernel=$spec" | tee -a "$out/runs.txt"
    timeout 300 $py -m tfmoe.cli attn-check --device cuda --dtype $dt kernel=$spec run_root="$out/runs" \
      >> "$out/runs.txt" 2>&1
    echo "exit=$?" | tee -a "$out/runs.txt"
  done
done
echo "== tfmoe attn-check --device cuda --dtype bf16 kernel=torch:flex-compiled (reduced matrix)" | tee -a "$out/runs.txt"
timeout 300 $py -m tfmoe.cli attn-check --device cuda --dtype bf16 kernel=torch:flex-compiled \
  'cases.shapes=[[17,17,64],[128,129,64],[1,239,128],[255,257,59]]' run_root="$out/runs" >> "$out/runs.txt" 2>&1
echo "exit=$?" | tee -a "$out/runs.txt"
$py -m pytest -q -m "cuda or not slow" -k "cuda" tests > "$out/pytest-cuda.txt" 2>&1
echo "pytest exit=$?" | tee -a "$out/runs.txt"
$py -m tfmoe.cli runs --runs-root "$out/runs" --format md > "$out/runs.md" 2>&1
