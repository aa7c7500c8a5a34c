#!/usr/bin/env bash
# One call on the GPU machine: every GPU test (tests/runtime holds test_cuda_backend.py and
# test_conv_gemm.py), then the GPU benchmarks. Results go under $OUT (8 files).
#   bash benchmarks/gpu_check.sh            (MNIST read from $MNIST, default .devdata/mnist; the
#                                             reference models from $LNN_SHARED, default .devdata/shared)
# The package is put on the path through a symlink named lnn (no install, no network needed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
MNIST=${MNIST:-.devdata/mnist}
export LNN_SHARED=${LNN_SHARED:-$(pwd)/.devdata/shared}
mkdir -p "$OUT"
pkg=$(mktemp -d) && ln -s "$(pwd)" "$pkg/lnn"
export PYTHONPATH="$pkg" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv > "$OUT/nvidia-smi.csv"
python3 -m pytest -q -p no:cacheprovider tests/train/test_gpu.py tests/train/test_cuda_graph.py tests/runtime 2>&1 | tee "$OUT/gpu_tests.log"
python3 benchmarks/gpu_train.py --mnist "$MNIST" --out runs/gpu_train 2>&1 | tee "$OUT/gpu_train.log"
python3 benchmarks/gpu_infer.py 2>&1 | tee "$OUT/gpu_infer.log"
python3 benchmarks/gpu_train_step.py 2>&1 | tee "$OUT/gpu_train_step.log"
python3 benchmarks/gpu_step_profile.py --side lnn --models leaf_cnn tomato_leaf --batches 256 2>&1 | tee "$OUT/gpu_step_profile.log"
cp docs/BENCHMARKS.md runs/gpu_train/gpu_train.json "$OUT/"
