#!/usr/bin/env bash
# Every GPU benchmark once, in one short run (a few minutes on an H100/H200; keep it under 10):
# the k3 tower (bench.gpu_tower), the MXFP4 kernels and the grouped MoE layer (bench.gpu_mxfp4),
# 12 MP JPEG bytes -> rows through an encoder pool on the card (bench.gpu_encode), and the trunk's
# batched decode at 1, 8 and 32 sequences (bench.decode, a K3-width slice).
#
#   bench/gpu_all.sh [OUTPUT_FILE]        default: gpu-bench-<date>.txt in the current directory
#
# Needs a CUDA build of torch, Triton, and this project's dependencies (pip install -e .);
# PYTHON picks the interpreter, PEAK_TFLOPS the card's dense bf16 peak (989: H100/H200 SXM).
# A failing benchmark is reported and the next one still runs. Paste the output into
# docs/BENCHMARKS.md (the GPU sections).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
out=${1:-gpu-bench-$(date +%Y%m%d-%H%M%S).txt}
unset TRITON_INTERPRET
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$python" -c 'import torch, triton; print("torch", torch.__version__, "CUDA", torch.version.cuda, "triton", triton.__version__)'
  echo "== python -m bench.gpu_tower"
  "$python" -m bench.gpu_tower --device cuda:0 --repeats 5 --tokens 1024,4096,16384 --peak-tflops "${PEAK_TFLOPS:-989}" \
    || echo "== bench.gpu_tower FAILED (exit $?)"
  echo "== python -m bench.gpu_mxfp4"
  "$python" -m bench.gpu_mxfp4 --batches 1,4,16,64,256 --experts 64 --rep-ms 100 || echo "== bench.gpu_mxfp4 FAILED (exit $?)"
  echo "== python -m bench.gpu_encode"
  "$python" -m bench.gpu_encode --device cuda:0 --images 4 --repeats 2 || echo "== bench.gpu_encode FAILED (exit $?)"
  echo "== python -m bench.decode"
  "$python" -m bench.decode --device cuda:0 --preset k3-slice --batches 1,8,32 --steps 64 \
    || echo "== bench.decode FAILED (exit $?)"
} 2>&1 | tee "$out"
