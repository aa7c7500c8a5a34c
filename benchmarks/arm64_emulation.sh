#!/usr/bin/env bash
# lnn on arm64 (the Raspberry Pi's architecture) under emulation, on a Debian/Ubuntu x86-64 host, as root:
#
#     sudo benchmarks/arm64_emulation.sh        # not in CI; 28-38 minutes from nothing on 2 cores, most of it
#                                               # tests/runtime under emulation (BENCHMARKS.md)
#
# 1. a Debian bookworm arm64 root, made once with `debootstrap --foreign` and its second stage run under
#    qemu-user-static (binfmt_misc), in $LNN_ARM64_DIR/root (default /tmp/lnn-arm64/root; reused when there,
#    with the venv below: delete $LNN_ARM64_DIR to start over);
# 2. a venv there with lnn's dependencies from PyPI (aarch64 wheels: NumPy, Numba, OpenCV, PyInstaller...),
#    lnn itself installed editable from a copy of this working tree (tracked and unignored files, fresh each run);
# 3. tests/runtime inside the root;
# 4. benchmarks/arm64_compare.py on the host and in the root (four reference models, the bundled model on the
#    sample leaves, numpy and cpu backends), then the comparison (target: within 1e-5 of x86-64);
# 5. lnn-infer on the sample leaves on both sides, and the field app built in the root (packaging/build.sh)
#    answering `--cli` on them: the answers are compared with the host's lnn-infer.
# Prints each stage and its time; the log goes to $LNN_ARM64_DIR/arm64_emulation.log and, when every stage
# ran, into the arm64_emulation section of docs/BENCHMARKS.md.
# Needs: debootstrap, qemu-user-static, binfmt-support (apt-get install ...), a network to the Debian mirror and
# PyPI, ../shared/reference_models (or $LNN_SHARED), and lnn importable by $PYTHON (default: .venv/bin/python).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${LNN_ARM64_DIR:-/tmp/lnn-arm64}"
ROOT="$WORK/root"
SHARED="$(cd "${LNN_SHARED:-$REPO/../shared}" 2>/dev/null && pwd -P || true)"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
MIRROR="${LNN_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES=python3,python3-venv,python3-dev,python3-tk,gcc,g++,binutils,ca-certificates
LOG="$WORK/arm64_emulation.log"
VENV=/opt/venv            # inside the root
SRC=/opt/lnn              # inside the root; /opt/shared beside it is the shared data, read-only
# The root's processes start with a clean environment: the host's pip settings (find-links, local indexes)
# name x86-64 files; the host's CA bundle (copied in) is what HTTPS to PyPI is checked against here.
IN_ROOT=(chroot "$ROOT" /usr/bin/env -i HOME=/root PATH="$VENV/bin:/usr/bin:/bin:/usr/sbin:/sbin" LANG=C.UTF-8
         PIP_CERT=/etc/ssl/lnn-host-ca.pem PIP_DISABLE_PIP_VERSION_CHECK=1 LNN_SHARED=/opt/shared)

die() { echo "arm64_emulation: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (debootstrap, chroot and mount need it)"
for tool in debootstrap update-binfmts chroot qemu-aarch64-static; do
    command -v "$tool" >/dev/null || die "missing $tool: apt-get install debootstrap qemu-user-static binfmt-support"
done
[ -n "$SHARED" ] && [ -f "$SHARED/reference_models/leaf_cnn.samples.npz" ] \
    || die "no reference models in ${LNN_SHARED:-$REPO/../shared}/reference_models (set LNN_SHARED)"
[ -x "$PYTHON" ] || PYTHON=python3
"$PYTHON" -c "import lnn.runtime.cpu, cv2" 2>/dev/null \
    || die "$PYTHON cannot import lnn with its cpu backend and OpenCV (set PYTHON, or make .venv as the README says)"
HOST_CA="$("$PYTHON" -c "import ssl; print(ssl.get_default_verify_paths().cafile or '')")"
HOST_CA="${PIP_CERT:-${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}}"
[ -f "$HOST_CA" ] || die "no CA bundle at $HOST_CA (set PIP_CERT to the host's CA bundle)"

mkdir -p "$WORK"
exec > >(tee "$LOG") 2>&1
START=$SECONDS
stage() {  # stage NAME COMMAND...: run it, print its time; on failure, the last lines of its log
    local name="$1" began=$SECONDS; shift
    echo "== $name ..."
    if ! "$@" >"$WORK/$name.log" 2>&1; then
        tail -n 25 "$WORK/$name.log"
        die "stage $name failed after $((SECONDS - began)) s (log: $WORK/$name.log)"
    fi
    TOOK=$((SECONDS - began))
    echo "   $name: $TOOK s"
}
made() {  # made NAME: true, saying so, when an earlier run did stage NAME (its marker holds the seconds it took)
    [ -e "$ROOT/.lnn-$1" ] || return 1
    echo "   $1: reused ($(cat "$ROOT/.lnn-$1") s when it was made)"
}
echo "arm64 under emulation: root $ROOT, host $(uname -m) $(nproc) cores, $(date -u '+%Y-%m-%d %H:%M UTC')"

# binfmt_misc: the kernel runs aarch64 binaries through qemu; F (fix binary) makes that work inside chroot.
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc \
    || die "cannot mount binfmt_misc (in a container, the host must allow it)"
update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
grep -q enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null \
    || die "qemu-aarch64 is not registered in binfmt_misc (update-binfmts --enable qemu-aarch64 failed)"

if ! made debootstrap_first; then
    rm -rf "$ROOT"; mkdir -p "$ROOT"
    stage debootstrap_first debootstrap --foreign --arch=arm64 --variant=minbase --include="$PACKAGES" \
        bookworm "$ROOT" "$MIRROR"
    echo "$TOOK" > "$ROOT/.lnn-debootstrap_first"
fi
if ! made debootstrap_second; then
    stage debootstrap_second chroot "$ROOT" /debootstrap/debootstrap --second-stage
    echo "$TOOK" > "$ROOT/.lnn-debootstrap_second"
fi
echo "   root: $(chroot "$ROOT" uname -m), $(chroot "$ROOT" python3 --version), $(du -sh "$ROOT" | cut -f1)"

MOUNTS=()
cleanup() { local i; for ((i=${#MOUNTS[@]}-1; i>=0; i--)); do umount -l "${MOUNTS[i]}" 2>/dev/null || true; done; }
trap cleanup EXIT
bind() {  # bind SOURCE TARGET [ro]
    mkdir -p "$2"; mount --bind "$1" "$2"; MOUNTS+=("$2")
    [ "${3:-}" != ro ] || mount -o remount,bind,ro "$2"
}
mountpoint -q "$ROOT/proc" || { mount -t proc proc "$ROOT/proc"; MOUNTS+=("$ROOT/proc"); }
mountpoint -q "$ROOT/sys" || { mount -t sysfs sysfs "$ROOT/sys"; MOUNTS+=("$ROOT/sys"); }
mountpoint -q "$ROOT/dev" || bind /dev "$ROOT/dev"
mountpoint -q "$ROOT/opt/shared" || bind "$SHARED" "$ROOT/opt/shared" ro
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
cp "$HOST_CA" "$ROOT/etc/ssl/lnn-host-ca.pem"

# A fresh copy of the working tree each run (what git would commit, uncommitted changes included).
copy_tree() {
    rm -rf "$ROOT$SRC"; mkdir -p "$ROOT$SRC"
    git -C "$REPO" ls-files -z --cached --others --exclude-standard \
        | (cd "$REPO" && tar --null --ignore-failed-read -T - -cf -) | tar -C "$ROOT$SRC" -xf -
}
stage copy_tree copy_tree
if ! made venv; then
    stage venv "${IN_ROOT[@]}" sh -c "python3 -m venv $VENV && pip install -q pytest hypothesis -e '$SRC[app]'"
    echo "$TOOK" > "$ROOT/.lnn-venv"
fi
"${IN_ROOT[@]}" python -c "import platform, numpy, numba, cv2, PyInstaller
print('   in the root:', platform.machine(), 'Python', platform.python_version(), 'NumPy', numpy.__version__,
      'Numba', numba.__version__, 'OpenCV', cv2.__version__, 'PyInstaller', PyInstaller.__version__)"

# A failing test is reported at the end; the comparisons still run.
stage tests_runtime "${IN_ROOT[@]}" sh -c "cd $SRC && python -m pytest -q -p no:cacheprovider tests/runtime || true"
TESTS="$(grep -E '^=* ?[0-9]+ (passed|failed|skipped|errors?)' "$WORK/tests_runtime.log" | tail -1 | tr -d '=')"
echo "   tests/runtime: ${TESTS:-no summary line (log: $WORK/tests_runtime.log)}"

stage outputs_x86 "$PYTHON" "$REPO/benchmarks/arm64_compare.py" outputs "$WORK/x86_64.npz"
stage outputs_arm64 "${IN_ROOT[@]}" python "$SRC/benchmarks/arm64_compare.py" outputs /tmp/arm64.npz
cp "$ROOT/tmp/arm64.npz" "$WORK/arm64.npz"
echo "== compare"
COMPARED=0
"$PYTHON" "$REPO/benchmarks/arm64_compare.py" compare "$WORK/x86_64.npz" "$WORK/arm64.npz" || COMPARED=$?

# The same answers as text, on the sample leaves: lnn-infer on both sides, and the field app's --cli against
# lnn-infer with the app's image library (Pillow: the app leaves OpenCV out).
LEAVES="examples/leaves/*.jpg"
(cd "$REPO" && "$PYTHON" -m lnn.tools.infer --device cpu $LEAVES) > "$WORK/infer_x86_64.txt"
(cd "$REPO" && LNN_IMAGE_LIBRARY=pillow "$PYTHON" -m lnn.tools.infer --device cpu $LEAVES) > "$WORK/pillow_x86_64.txt"
stage infer_arm64 "${IN_ROOT[@]}" sh -c "cd $SRC && python -m lnn.tools.infer --device cpu $LEAVES > /tmp/infer.txt"
cp "$ROOT/tmp/infer.txt" "$WORK/infer_arm64.txt"
stage field_build "${IN_ROOT[@]}" sh -c "cd $SRC && PYTHON=python packaging/build.sh"
echo "   $(tail -1 "$WORK/field_build.log")"
stage field_cli "${IN_ROOT[@]}" sh -c "cd $SRC && packaging/dist/lnn-field/lnn-field --cli --device cpu $LEAVES > /tmp/field.txt"
cp "$ROOT/tmp/field.txt" "$WORK/field_arm64.txt"
ANSWERS=0
same_text() {  # same_text ARM64 X86-64 WHAT
    if cmp -s "$WORK/$2.txt" "$WORK/$1.txt"; then
        echo "   $1: the same text as $3 on x86-64 ($(grep -c . "$WORK/$1.txt") lines)"
    else
        echo "   $1 differs from $3 on x86-64:"; diff "$WORK/$2.txt" "$WORK/$1.txt" | head -20; ANSWERS=1
    fi
}
same_text infer_arm64 infer_x86_64 "lnn-infer"
same_text field_arm64 pillow_x86_64 "lnn-infer with Pillow"
grep -m1 -A3 late_blight "$WORK/field_arm64.txt" | sed 's/^/   /'

echo "total: $((SECONDS - START)) s"
VERDICT="arm64: all checks passed"
[[ "$TESTS" =~ passed && ! "$TESTS" =~ failed|error ]] || VERDICT="arm64_emulation: tests/runtime did not pass in the root"
[ "$ANSWERS" = 0 ] || VERDICT="arm64_emulation: arm64 answers differ from x86-64's (see above)"
[ "$COMPARED" = 0 ] || VERDICT="arm64_emulation: arm64 outputs are not within 1e-5 of x86-64's (see the table above)"
echo "$VERDICT"
sleep 1    # tee has written the log
"$PYTHON" "$REPO/benchmarks/arm64_compare.py" section "$LOG" >/dev/null
[ "$VERDICT" = "arm64: all checks passed" ]
