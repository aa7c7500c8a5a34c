#!/usr/bin/env bash
# Build the lnn-field app as one folder: dist/lnn-field/lnn-field (lnn-field.exe on Windows).
# Run from anywhere, in a Python environment with lnn's dependencies and `pip install pyinstaller`
# (or `pip install -e '.[app]'`), with C and C++ compilers (Numba's AOT compiler builds the kernels with them).
# Output: packaging/dist/lnn-field/. See packaging/BUILD.md.
set -euo pipefail
PACKAGING="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$PACKAGING")"
WORK="${LNN_BUILD_DIR:-$PACKAGING/build}"
DIST="${LNN_DIST_DIR:-$PACKAGING/dist}"
PYTHON="${PYTHON:-python3}"

# lnn's folders are the package itself, so PyInstaller gets a plain (not editable) copy to analyse.
rm -rf "$WORK/site" "$WORK/kernels"
"$PYTHON" -m pip install -q --no-deps --no-build-isolation --target "$WORK/site" "$REPO"
# The CPU backend's kernels, compiled ahead of time from that copy: the app then needs neither Numba nor LLVM.
PYTHONPATH="$WORK/site" LNN_CPU_KERNELS=jit NUMBA_CACHE_DIR="$WORK/numba-cache" "$PYTHON" -c \
    "import sys; from lnn.runtime.cpu.aot import compile_kernels; compile_kernels(sys.argv[1])" "$WORK/kernels"
LNN_SITE="$WORK/site" LNN_KERNELS="$WORK/kernels" "$PYTHON" -m PyInstaller --noconfirm --clean --log-level WARN \
    --workpath "$WORK/pyinstaller" --distpath "$DIST" "$PACKAGING/lnn-field.spec"
echo "built $DIST/lnn-field ($(du -sh "$DIST/lnn-field" | cut -f1))"
