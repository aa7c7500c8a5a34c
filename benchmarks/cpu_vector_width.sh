#!/usr/bin/env bash
# lnn's CPU backend compiled with LLVM's own tuning of this host against lnn's (runtime/cpu/jit.py: on an AVX-512
# host, "-prefer-256-bit", so that vectors are 512 bits wide), each side beside the peers in benchmarks/cpu_peers.py.
# LLVM tunes Intel's AVX-512 cores (Skylake-X to Emerald Rapids) to prefer 256-bit vectors; AMD's Zen 4 and 5 are
# not so tuned, and on a host without AVX-512 both sides are the same. The tables are printed, not written
# (docs/BENCHMARKS.md keeps what this printed, by hand). A user's own NUMBA_CPU_FEATURES is what "LLVM's tuning"
# sets here: jit.py leaves it as it is.
#   bash benchmarks/cpu_vector_width.sh [MODELS] [ROUNDS]     (default tomato,leaf_cnn224,leaf_cnn,mnist_mlp and 2;
#                                                              about 1.5 minutes a side on 2 cores of a Xeon)
# Pin it to two cores of a larger machine as `taskset -c 2,3 bash benchmarks/cpu_vector_width.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
models=${1:-tomato,leaf_cnn224,leaf_cnn,mnist_mlp}
rounds=${2:-2}
host_features=$(python3 -c "from numba.core.codegen import get_host_cpu_features; print(get_host_cpu_features())")
python3 -c "import llvmlite.binding as b; print('LLVM names this CPU', b.get_host_cpu_name())"
for side in "LLVM's tuning" "lnn's"; do
    echo "== $side"
    if [ "$side" = "lnn's" ]; then
        env -u NUMBA_CPU_FEATURES python3 benchmarks/cpu_peers.py --rounds "$rounds" --models "$models" --retries 0 2>&1 | grep -v '^round '
    else
        NUMBA_CPU_FEATURES="$host_features" python3 benchmarks/cpu_peers.py --rounds "$rounds" --models "$models" --retries 0 2>&1 | grep -v '^round '
    fi
done
