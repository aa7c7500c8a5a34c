#!/usr/bin/env bash
# One call on the GPU machine: every GPU test (tests/runtime holds the CUDA inference, blas and conv tests;
# tests/train the graph-vs-eager-vs-NumPy training cases), then the GPU benchmarks. Results go under $OUT.
#   bash benchmarks/gpu_check.sh            (MNIST read from $MNIST, default .devdata/mnist; the reference
#                                             models from $LNN_SHARED, default .devdata/shared; the tomato
#                                             photos from .devdata/gpu: benchmarks/prepare_gpu_data.py)
# The package is put on the path through a symlink named lnn (no install, no network needed).
# About 12 minutes on an H200: more than one device call allows, so STAGES picks (default: all):
#   STAGES="tests" or "tests step" or "step accuracy" ...; "lstm" (not in the default: a few minutes)
#   runs benchmarks/gpu_lstm_step.py, the conv1d + LSTM step against PyTorch's cuDNN LSTM; "bf16" (not in the
#   default either: "tests" and "step" cover it) runs only the bfloat16 tests and step sides, in a few minutes.
# amp bf16 needs ml_dtypes on the GPU machine (NumPy has no bfloat16; CuPy 14 takes ml_dtypes' type): without it
# the bf16 tests skip and the "lnn bf16" side fails with one line saying so. Wheels in .devdata/wheels (here:
# `pip download ml_dtypes simplejpeg --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 -d .devdata/wheels`; simplejpeg decodes lnn's JPEGs, and the GPU machine lacks it) are
# installed beside the package first, for a machine without a network.
# The first call on a fresh machine compiles every kernel (CuPy's cache is empty): the tests stage took over
# 170 s that way on the H200, 60-80 s warm. "accuracy" trains the bundled recipe (280 epochs) three times, each
# side until its first epoch at 97% (about 4-5 minutes a side): a finished side is kept in $TTA_RESULTS
# (default .devdata/tta; carry it to the next call) and not run again.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
MNIST=${MNIST:-.devdata/mnist}
STAGES=${STAGES:-tests train infer step conv profile accuracy}
export LNN_SHARED=${LNN_SHARED:-$(pwd)/.devdata/shared}
mkdir -p "$OUT"
pkg=$(mktemp -d) && ln -s "$(pwd)" "$pkg/lnn"
export PYTHONPATH="$pkg" PYTHONUNBUFFERED=1
if compgen -G ".devdata/wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-deps --target "$pkg/site" .devdata/wheels/*.whl && export PYTHONPATH="$pkg:$pkg/site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv > "$OUT/nvidia-smi.csv"
for stage in $STAGES; do
    case $stage in
        tests) python3 -m pytest -q -p no:cacheprovider tests/train/test_gpu.py tests/train/test_cuda_graph.py tests/runtime \
                   tests/formats/test_recurrent.py tests/formats/test_series_goldens.py 2>&1 | tee "$OUT/gpu_tests.log" ;;
        train) python3 benchmarks/gpu_train.py --mnist "$MNIST" --out runs/gpu_train 2>&1 | tee "$OUT/gpu_train.log" ;;
        infer) python3 benchmarks/gpu_infer.py 2>&1 | tee "$OUT/gpu_infer.log" ;;
        step) python3 benchmarks/gpu_train_step.py 2>&1 | tee "$OUT/gpu_train_step.log" ;;
        conv) python3 benchmarks/gpu_conv_layers.py 2>&1 | tee "$OUT/gpu_conv_layers.log" ;;
        profile) python3 benchmarks/gpu_step_profile.py --side lnn --models leaf_cnn tomato_leaf --batches 256 2>&1 | tee "$OUT/gpu_step_profile.log" ;;
        accuracy) python3 benchmarks/tomato_time_to_accuracy.py --stop-at-target --results "${TTA_RESULTS:-.devdata/tta}" 2>&1 \
                      | tee "$OUT/tomato_time_to_accuracy.log"
                  cp -r "${TTA_RESULTS:-.devdata/tta}" "$OUT/tta_results" 2>/dev/null ;;
        lstm) python3 benchmarks/gpu_lstm_step.py 2>&1 | tee "$OUT/gpu_lstm_step.log" ;;
        bf16) python3 -m pytest -q -p no:cacheprovider -k "bf16 or bfloat16" tests/train/test_gpu.py \
                  tests/train/test_cuda_graph.py tests/runtime 2>&1 | tee "$OUT/gpu_bf16_tests.log"
              python3 benchmarks/gpu_train_step.py --out "$OUT/bf16_step" \
                  --sides "lnn fp32" "lnn amp" "lnn bf16" "torch amp cl" "torch bf16 amp cl" 2>&1 \
                  | tee "$OUT/gpu_bf16_step.log" ;;
        *) echo "gpu_check.sh: unknown stage $stage (tests train infer step conv profile accuracy lstm bf16)"; exit 2 ;;
    esac
done
cp docs/BENCHMARKS.md "$OUT/"
