#!/usr/bin/env bash
# Build the lnn-field app as one folder: dist/lnn-field/lnn-field (lnn-field.exe on Windows).
# Run from anywhere, in a Python environment with lnn's dependencies and `pip install pyinstaller`
# (or `pip install -e '.[app]'`). Output: packaging/dist/lnn-field/. See packaging/BUILD.md.
set -euo pipefail
PACKAGING="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$PACKAGING")"
WORK="${LNN_BUILD_DIR:-$PACKAGING/build}"
DIST="${LNN_DIST_DIR:-$PACKAGING/dist}"
PYTHON="${PYTHON:-python3}"

# lnn's folders are the package itself, so PyInstaller gets a plain (not editable) copy to analyse.
rm -rf "$WORK/site"
"$PYTHON" -m pip install -q --no-deps --no-build-isolation --target "$WORK/site" "$REPO"
LNN_SITE="$WORK/site" "$PYTHON" -m PyInstaller --noconfirm --clean --log-level WARN \
    --workpath "$WORK/pyinstaller" --distpath "$DIST" "$PACKAGING/lnn-field.spec"
# libllvmlite.so ships with its symbol table (about 18 MB); stripping it is safe, unlike the auditwheel-patched
# libraries of NumPy and OpenCV, which PyInstaller's strip option breaks.
LLVMLITE="$(find "$DIST/lnn-field" -name 'libllvmlite.so' -o -name 'libllvmlite.dylib' | head -1)"
if [ -n "$LLVMLITE" ] && command -v strip >/dev/null; then
    if [ "$(uname)" = Darwin ]; then strip -x "$LLVMLITE"; else strip --strip-unneeded "$LLVMLITE"; fi
fi
echo "built $DIST/lnn-field ($(du -sh "$DIST/lnn-field" | cut -f1))"
