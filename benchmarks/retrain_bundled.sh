#!/usr/bin/env bash
# Train the bundled tomato model's recipe, examples/tomato_leaf.json (the field recipe: background replacement,
# lighting, blur, scale and the rest, with outlier exposure), on the GPU machine, in one command:
#   python3 benchmarks/prepare_gpu_data.py          (here, once: writes .devdata/gpu, ~38 MiB)
#   bash benchmarks/retrain_bundled.sh              (there, carry .devdata/gpu; extra arguments go to lnn-train)
# Trains on .devdata/gpu/tomato with the fit part of .devdata/gpu/outliers, writes runs/bundled/ (checkpoints,
# metrics.jsonl, curves.png, model.bin of the best validation epoch) and copies model.bin, metrics.jsonl,
# curves.png and train.log to $OUT (default runs/bundled_out); prints the best validation accuracy and the
# epoch times. If the command is cut off (a 600 s limit), running it again on the same machine continues
# after the last finished epoch (--resume). Measured on the H200 with 16 cores (2026-12-01): 280 epochs at
# about 1.7 s each (4,000 rows: 3,200 tomato + 800 outlier) while a second run shared the cores, about 8 minutes
# for both. The validation accuracy printed is on the re-encoded copies; lnn-eval RUN_DIR/model.bin --data
# folder:../shared/data/tomato --split val gives it on the original files, and lnn-eval --fit-gate (the
# model card's "retrain" line) makes the bundled file
# (LNN_AUGMENT_PROCESSES=0 bash benchmarks/retrain_bundled.sh augments in threads instead).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-.devdata/gpu}
RUN=${RUN:-runs/bundled}
OUT=${OUT:-runs/bundled_out}
mkdir -p "$OUT" "$RUN"
pkg=$(mktemp -d) && ln -s "$(pwd)" "$pkg/lnn"
export PYTHONPATH="$pkg" PYTHONUNBUFFERED=1 LNN_CACHE_DIR=${LNN_CACHE_DIR:-$(pwd)/.devdata/cache}
started=$(date +%s)
python3 -m lnn.tools.train "${DESCRIPTION:-examples/tomato_leaf.json}" --data "folder:$DATA/tomato" --outliers "$DATA/outliers" \
    --out "$RUN" --device cuda --quiet --resume "$@" 2>&1 | tee -a "$OUT/train.log"
echo "wall time of this call: $(( $(date +%s) - started )) s" | tee -a "$OUT/train.log"
python3 - "$RUN/metrics.jsonl" <<'EOF' | tee -a "$OUT/train.log"
import json, statistics, sys
history = [json.loads(line) for line in open(sys.argv[1])]
best = max(history, key=lambda entry: entry["val_accuracy"])
times = [entry["epoch_s"] for entry in history]
print(f"{len(history)} epochs; best validation accuracy {best['val_accuracy']:.4f} at epoch {best['epoch']} "
      f"(train accuracy {best['train_accuracy']:.4f}, loss {best['train_loss']:.4f}); last epoch "
      f"val {history[-1]['val_accuracy']:.4f}")
print(f"epoch time: median {statistics.median(times):.2f} s, min {min(times):.2f} s, max {max(times):.2f} s, "
      f"{history[-1]['images_per_s']:.0f} rows/s in the last epoch")
EOF
cp "$RUN/model.bin" "$RUN/metrics.jsonl" "$RUN/curves.png" "$OUT/" 2>/dev/null || true
