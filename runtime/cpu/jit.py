"""The one place Numba is configured and imported; every kernel file takes `kernel` from here.

Before `import numba`:
  - NUMBA_CACHE_DIR is pointed at a writable per-user folder (see cache.py) unless the user set
    it; when no writable folder can be had, kernels compile without a cache and one warning says so.
  - NUMBA_THREADING_LAYER is set to "workqueue" unless the user set it (the OpenMP layer was seen
    stalling whole processes on 2 cores).
The same values are also written into numba.config, in case Numba was imported earlier.

Kernels are serial (`parallel=True` doubles compile time and pays only for large work that BLAS
does not already thread), so Numba's thread pool is never started: the backend's `threads` option
splits one image's layers, or a large batch, over its own helper threads (backend.py, parallel.py). Numba compiles each kernel on its first call, so a model compiles only
the kernels it uses.

LNN_CPU_KERNELS=aot (the default when Numba is not installed, as in the packaged lnn-field) takes the
kernels from the ahead-of-time compiled module instead (aot.py): no Numba import, no compile, no cache.

It also defines the JIT's intrinsics (LLVM IR that Numba inlines where a kernel calls them; None under the
ahead-of-time kernels): the atomic loads, stores and counters, sched_yield, the CPU's spin-wait hint
(spin_pause) and the monotonic clock (monotonic_ns: the spins' time limits) that the crew's spins, programs.py's
helper programs and linear.py's chains use, the Winograd
transforms' vector shuffles (gather_tile_columns, interleave_rows4), the register tiles' vector loads and
stores (load16, load8, store8), a call of a compiled kernel by its address (call_at, for programs.py's
helper programs), and a call of BLAS's cblas_sgemm by its address (call_sgemm, sgemm_address: winograd.py's
blas_products and blas_product).

On a host with AVX-512, Numba's target features turn off LLVM's preference for 256-bit vectors (below).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import time
import warnings

from lnn.runtime.cpu.cache import ensure_writable, numba_cache_dir

KERNELS = os.environ.get("LNN_CPU_KERNELS") or ("jit" if importlib.util.find_spec("numba") else "aot")
if KERNELS not in ("jit", "aot"):
    raise ImportError(f"LNN_CPU_KERNELS must be jit or aot, not {KERNELS!r}")

if KERNELS == "aot":
    from lnn.runtime.cpu.aot import compiled_kernel as kernel  # noqa: F401  (what the kernel files import)
    from lnn.runtime.cpu.aot import compiled_kernel as ieee_kernel  # noqa: F401
    from lnn.runtime.cpu.aot import compiled_kernel as tile_kernel  # noqa: F401
    from lnn.runtime.cpu.aot import compiled_kernel as wide_tile_kernel  # noqa: F401
    from lnn.runtime.cpu.aot import compiled_kernel as fused_kernel  # noqa: F401
    from lnn.runtime.cpu.aot import compiled_kernel as short_loops_kernel  # noqa: F401
    WIDE_VECTORS = False        # (wide tiles are for the JIT on an AVX-512 host)
    VECTOR_FMA = False          # (kernels written for fused multiply-adds: the JIT on a host that has them)

    CACHE_ENABLED = False
    gather_tile_columns = interleave_rows4 = None   # (the JIT's intrinsics: winograd.py copies instead)
    load16 = load8 = store8 = None                  # (the register tiles' vector loads and stores: the JIT's only)
    spin_while_equal = hand_off = None     # (the crew's spins use the JIT's intrinsics: the locks hand off instead)
    load_acquire = store_release = compare_and_swap = fetch_add = sched_yield = spin_pause = monotonic_ns = None   # (JIT)
    call_at = array_at = compiled_address = None    # (programs.py's calls of compiled kernels: the JIT's only)
    call_sgemm = None                    # (BLAS from compiled code: the JIT's only)
else:
    CACHE_DIR = numba_cache_dir()
    _problem = ensure_writable(CACHE_DIR)
    CACHE_ENABLED = _problem is None
    if CACHE_ENABLED:
        os.environ.setdefault("NUMBA_CACHE_DIR", str(CACHE_DIR))
    else:
        warnings.warn(f"lnn: cannot write the Numba kernel cache: {_problem}; kernels will be compiled "
                      f"again in every process (set LNN_CACHE_DIR to a writable folder)", RuntimeWarning, stacklevel=2)
    THREADING_LAYER = os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

    import llvmlite.binding  # noqa: E402
    import numba  # noqa: E402  (must follow the environment set-up above)
    from numba.core.compiler_lock import global_compiler_lock  # noqa: E402

    if CACHE_ENABLED:
        numba.config.CACHE_DIR = str(CACHE_DIR)
    numba.config.THREADING_LAYER = THREADING_LAYER

    def kernel(function):
        """@kernel: a serial, cached (when the cache is writable), nopython Numba function that releases the GIL.

        Keep kernels under 20 arguments: with 20, Numba 0.68's dispatcher leaked ~200 bytes per call here."""
        return numba.njit(cache=CACHE_ENABLED, nogil=True)(function)

    def fused_kernel(function):
        """@fused_kernel: a @kernel whose float multiply-adds may be fused into one instruction (fastmath
        "contract" only: no reassociation, NaN and infinity keep their meaning). Without it LLVM keeps every
        a * b + c as a multiply and an add. The ahead-of-time module compiles it as a @kernel."""
        return numba.njit(cache=CACHE_ENABLED, nogil=True, fastmath={"contract"})(function)

    def ieee_kernel(function):
        """@ieee_kernel: a @kernel whose float division follows IEEE 754 (x / 0 is inf or nan) instead of
        raising ZeroDivisionError, and whose float sums may be reassociated and multiply-adds fused
        (fastmath "reassoc" and "contract" only: NaN and infinity keep their meaning). Without the
        division check in the way LLVM vectorizes loops that divide (recurrent.py's tanh_ratio: 0.7
        instead of 2.5 ns a value); reassociation lets it vectorize sums over a loop.
        The ahead-of-time module compiles it as a @kernel (same results up to rounding, slower)."""
        return numba.njit(cache=CACHE_ENABLED, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})(function)

    # LLVM's SLP vectorizer (off by default in Numba since its PR 8852, for miscompilations reported then)
    # is switched on only while a @tile_kernel compiles; at most 8 lanes a vector: otherwise it made one
    # 96-lane "vector" of a tile's sums, split back into registers by shuffles (ten times as slow).
    # @wide_tile_kernel: 16 lanes, one AVX-512 register (WIDE_VECTORS: this host has them).
    _slp_lanes = [8]            # the -slp-max-vf in force (compiles nest: a kernel compiles the ones it calls)
    llvmlite.binding.set_option("lnn", "-slp-max-vf=8")
    _host_features = llvmlite.binding.get_host_cpu_features().flatten()
    WIDE_VECTORS = "+avx512f" in _host_features
    # LLVM tunes Intel's AVX-512 cores (Skylake-X to Emerald Rapids, not AMD's Zen 4 and 5) to prefer 256-bit
    # vectors: there every vectorized loop and register tile ran at half width. On 2 cores of an Emerald Rapids
    # host, one thread (benchmarks/cpu_vector_width.sh, docs/BENCHMARKS.md): the bundled model 4.012 -> 2.054 ms,
    # leaf_cnn 1.253 -> 0.760, leaf_cnn224 9.479 -> 6.563 (onnxruntime 3.05-3.13, 0.88-0.90, 9.68-13.30). Numba
    # takes its target's features from here at its first compile (a user's own NUMBA_CPU_FEATURES is kept).
    if WIDE_VECTORS and numba.config.CPU_FEATURES is None:
        from numba.core.codegen import get_host_cpu_features as _numba_host_features  # noqa: E402
        numba.config.CPU_FEATURES = _numba_host_features() + ",-prefer-256-bit"
    # x86-64 with FMA (AVX2 or AVX-512): where conv_direct.py's blocked kernel was measured faster
    VECTOR_FMA = "+fma" in _host_features

    def _compiled_under(dispatcher, settings):
        """The dispatcher, each of whose compiles runs inside the context manager `settings()`, under Numba's
        compiler lock (no other compile sees what it switches)."""
        compile_signature = dispatcher.compile

        def compile_under(signature):
            with global_compiler_lock, settings():
                return compile_signature(signature)

        dispatcher.compile = compile_under
        return dispatcher

    def _slp_kernel(function, lanes: int):
        @contextlib.contextmanager
        def slp_vectorized():
            numba.config.SLP_VECTORIZE, saved = 1, numba.config.SLP_VECTORIZE
            _slp_lanes.append(lanes)
            llvmlite.binding.set_option("lnn", f"-slp-max-vf={lanes}")
            try:
                yield
            finally:
                numba.config.SLP_VECTORIZE = saved
                _slp_lanes.pop()
                llvmlite.binding.set_option("lnn", f"-slp-max-vf={_slp_lanes[-1]}")

        return _compiled_under(numba.njit(cache=CACHE_ENABLED, nogil=True, error_model="numpy",
                                          fastmath={"contract"})(function), slp_vectorized)

    def tile_kernel(function):
        """@tile_kernel: a @kernel for register-tiled code (recurrent.py's panel_product): its sums are written
        as separate scalars (tuples of 8), which LLVM's SLP vectorizer, switched on while this kernel and the
        kernels it inlines compile, packs into vector registers; float multiply-adds may be fused ("contract")
        but not reassociated (with "reassoc" the loop vectorizer takes the scalars as a hundred reductions
        over the inner loop instead, and spills them) and division follows IEEE 754, as in @ieee_kernel,
        whose kernels it may call. The ahead-of-time module compiles it as a @kernel."""
        return _slp_kernel(function, 8)

    def wide_tile_kernel(function):
        """@tile_kernel for tuples of 16 (one 16-lane vector each, an AVX-512 register): for hosts where
        WIDE_VECTORS (on others its tiles would not fit the registers)."""
        return _slp_kernel(function, 16)

    _one_vector_compiles = [0]  # @short_loops_kernel compiles under way (they nest: a kernel compiles those it calls)

    @contextlib.contextmanager
    def _one_vector_a_step():
        _one_vector_compiles[0] += 1
        llvmlite.binding.set_option("lnn", "-force-vector-interleave=1")
        try:
            yield
        finally:
            _one_vector_compiles[0] -= 1
            if not _one_vector_compiles[0]:            # the outermost: LLVM's own choice again
                llvmlite.binding.set_option("lnn", "-force-vector-interleave=0")

    def short_loops_kernel(function):
        """@short_loops_kernel: a @kernel whose vectorized loops take one vector a step. By default LLVM's loop
        vectorizer interleaves up to 4 vectors a step (64 floats with AVX-512), and a loop shorter than that
        runs as scalars in its remainder: winograd_input's loops over a tile row's 16 tiles did. The same
        results; the ahead-of-time module compiles it as a @kernel."""
        return _compiled_under(numba.njit(cache=CACHE_ENABLED, nogil=True)(function), _one_vector_a_step)


    from numba import types  # noqa: E402
    from numba.core import cgutils  # noqa: E402
    from numba.core.callconv import excinfo_t  # noqa: E402
    from numba.extending import intrinsic  # noqa: E402

    @intrinsic
    def _load_acquire(typingctx, array, index):
        """array[index] of an int64 array as an atomic load (acquire): read from memory on every call, so a
        loop waiting for another thread's store is not reduced to one read."""
        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            return builder.load_atomic(builder.gep(data, [args[1]]), "acquire", 8)
        return types.int64(array, types.intp), codegen

    @intrinsic
    def _compare_and_swap(typingctx, array, index, expected, new):
        """array[index] = new if it equals `expected` (int64 array, one atomic step, acquire-release): True
        when it did."""
        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            swapped = builder.cmpxchg(builder.gep(data, [args[1]]), args[2], args[3], "acq_rel", "acquire")
            return builder.extract_value(swapped, 1)
        return types.boolean(array, types.intp, types.int64, types.int64), codegen

    @intrinsic
    def _fetch_add(typingctx, array, index, value):
        """array[index] += value as one atomic step (int64 array, acquire-release); the value before."""
        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            return builder.atomic_rmw("add", builder.gep(data, [args[1]]), args[2], "acq_rel")
        return types.int64(array, types.intp, types.int64), codegen

    @intrinsic
    def _sched_yield(typingctx):
        """The C library's sched_yield(): the CPU to another runnable thread, if one waits for it (linked by
        name, so the cached kernel holds no address)."""
        def codegen(context, builder, signature, args):
            function = cgutils.get_or_insert_function(builder.module, llvmlite.ir.FunctionType(
                llvmlite.ir.IntType(32), []), "sched_yield")
            builder.call(function, [])
            return context.get_dummy_value()
        return types.none(), codegen

    _I64 = llvmlite.ir.IntType(64)
    _CLOCK = getattr(time, "CLOCK_MONOTONIC", None)      # its number in this C library (1 on Linux, 6 on macOS)

    @intrinsic
    def _monotonic_ns(typingctx):
        """The C library's clock_gettime(CLOCK_MONOTONIC) in nanoseconds (a struct timespec of two 64-bit fields:
        64-bit Linux and macOS); the spins' time limits (spin_while_equal, hand_off, programs.py's and linear.py's
        helpers' lingers). Linked by name, as sched_yield."""
        def codegen(context, builder, signature, args):
            timespec = llvmlite.ir.LiteralStructType([_I64, _I64])
            function = cgutils.get_or_insert_function(builder.module, llvmlite.ir.FunctionType(
                llvmlite.ir.IntType(32), [llvmlite.ir.IntType(32), timespec.as_pointer()]), "clock_gettime")
            now = cgutils.alloca_once(builder, timespec)
            builder.call(function, [llvmlite.ir.IntType(32)(_CLOCK), now])
            seconds = builder.load(builder.gep(now, [llvmlite.ir.IntType(32)(0), llvmlite.ir.IntType(32)(0)]))
            nanoseconds = builder.load(builder.gep(now, [llvmlite.ir.IntType(32)(0), llvmlite.ir.IntType(32)(1)]))
            return builder.add(builder.mul(seconds, _I64(1_000_000_000)), nanoseconds)
        return types.int64(), codegen

    # the CPU's spin-wait hint as an LLVM intrinsic and its arguments: x86's pause, arm64's isb (sy)
    _PAUSE = {"x86_64": ("llvm.x86.sse2.pause", ()), "aarch64": ("llvm.aarch64.isb", (15,)),
              "arm64": ("llvm.aarch64.isb", (15,))}.get(llvmlite.binding.get_default_triple().split("-")[0])

    @intrinsic
    def _spin_pause(typingctx):
        """The CPU's spin-wait hint (nothing on other CPUs): a short delay that keeps the thread on its CPU, where
        sched_yield hands it to any other runnable thread there for up to its time slice."""
        def codegen(context, builder, signature, args):
            if _PAUSE is not None:
                name, constants = _PAUSE
                int32 = llvmlite.ir.IntType(32)
                function = cgutils.get_or_insert_function(builder.module, llvmlite.ir.FunctionType(
                    llvmlite.ir.VoidType(), [int32] * len(constants)), name)
                builder.call(function, [int32(value) for value in constants])
            return context.get_dummy_value()
        return types.none(), codegen

    def _in_groups(builder, count, emit, widest: int = 16):
        """Emits emit(lanes, first) for tiles first..first + lanes - 1 of `count` (an i64): groups of `widest`
        (16 or 8) while that many remain, then one of 8 (after 16) and one of 4 where that many remain; the
        tiles done (an i64)."""
        groups = builder.sdiv(count, llvmlite.ir.Constant(_I64, widest))
        with cgutils.for_range(builder, groups) as loop:
            emit(widest, builder.mul(loop.index, llvmlite.ir.Constant(_I64, widest)))
        done = builder.mul(groups, llvmlite.ir.Constant(_I64, widest))
        for lanes in (8, 4)[widest == 8:]:
            fits = builder.icmp_signed(">=", builder.sub(count, done), llvmlite.ir.Constant(_I64, lanes))
            with builder.if_then(fits):
                emit(lanes, done)
            done = builder.select(fits, builder.add(done, llvmlite.ir.Constant(_I64, lanes)), done)
        return done

    def _vector_at(builder, array, index, lanes):
        """A <lanes x float> pointer to array's element `index` (flat, from its own data pointer: LLVM keeps
        what it knows of the array's aliasing, which an address made from an integer loses)."""
        pointer = builder.gep(array.data, [index])
        return builder.bitcast(pointer, llvmlite.ir.VectorType(llvmlite.ir.FloatType(), lanes).as_pointer())

    def _shuffled(builder, vector, indices, other=None):
        """The elements of `vector` (and after them `other`'s) at `indices`, as one vector."""
        mask = llvmlite.ir.Constant(llvmlite.ir.VectorType(llvmlite.ir.IntType(32), len(indices)), indices)
        return builder.shuffle_vector(vector, vector if other is None else other, mask)

    def _joined(builder, first, second):
        """first's elements then second's (two vectors of one length)."""
        return _shuffled(builder, first, list(range(2 * first.type.count)), second)

    @intrinsic
    def gather_tile_columns(typingctx, src, start, dst, row, column, count):
        """dst[row + j, column + i] = src[start + 4i + j] for j < 6 and i < the tiles done (returned: count
        rounded down to 4, the last 1-3 are the caller's), float32, dst C-contiguous: the 6 columns of each
        Winograd tile of a row, the tiles 4 apart (winograd.py winograd_input), as vector loads and shuffles
        16 (with AVX-512), 8 or 4 tiles at a time, where a loop copies them one by one (LLVM does not vectorize
        its stride-4 reads). 8 at a time as 4x4 transpositions (emit_transposed): by hand on a Zen 3 VM (AVX2),
        1 thread, winograd_input 0.73-0.78x the time on 16x64^2 to 48x32^2 and 0.93-1.0x on 16^2 and 8^2 images
        (the same bytes) against LLVM's lowering of one stride-4 shuffle (permutes and blends) 16 or 8 tiles at
        a time. Reads src up to 2 past the last tile's columns."""
        def codegen(context, builder, signature, args):
            source = context.make_array(signature.args[0])(context, builder, args[0])
            target = context.make_array(signature.args[2])(context, builder, args[2])
            row_length = builder.extract_value(target.shape, 1)

            def store(j, value, first):
                index = builder.add(builder.mul(builder.add(args[3], llvmlite.ir.Constant(_I64, j)), row_length),
                                    builder.add(args[4], first))
                builder.store(value, _vector_at(builder, target, index, value.type.count), align=4)

            def emit(lanes, first):
                at = builder.add(args[1], builder.mul(first, llvmlite.ir.Constant(_I64, 4)))
                if lanes == 8:
                    return emit_transposed(at, first)
                tiles = builder.load(_vector_at(builder, source, at, 4 * lanes), align=4)          # columns 0-3
                next_at = builder.add(at, llvmlite.ir.Constant(_I64, 4))
                next_tiles = builder.load(_vector_at(builder, source, next_at, 4 * lanes), align=4)  # 4-5
                for j in range(6):
                    store(j, _shuffled(builder, tiles if j < 4 else next_tiles, [4 * i + j % 4 for i in range(lanes)]),
                          first)

            def emit_transposed(at, first):
                """8 tiles as a 4x4 transposition in each 128-bit half (tiles i and i + 4 in one register):
                unpack and shufps only, where LLVM lowers the 8-lane stride-4 shuffle to permutes and blends."""
                quads = [builder.load(_vector_at(builder, source, builder.add(at, llvmlite.ir.Constant(_I64, 4 * i)), 4),
                                      align=4) for i in range(9)]                    # each tile's columns 0-3, and the next's
                pairs = [_joined(builder, quads[i], quads[i + 4]) for i in range(5)]  # tiles i, i + 4
                low, high = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
                firsts, seconds = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
                for shift in (0, 1):                          # columns 0-3 of tiles 0-7; then 4-5: 0-1 of tiles 1-8
                    a, b, c, d = pairs[shift:shift + 4]
                    ab, cd = _shuffled(builder, a, low, b), _shuffled(builder, c, low, d)
                    store(4 * shift, _shuffled(builder, ab, firsts, cd), first)
                    store(4 * shift + 1, _shuffled(builder, ab, seconds, cd), first)
                    if shift == 0:
                        ab, cd = _shuffled(builder, a, high, b), _shuffled(builder, c, high, d)
                        store(2, _shuffled(builder, ab, firsts, cd), first)
                        store(3, _shuffled(builder, ab, seconds, cd), first)
            return _in_groups(builder, args[5], emit, 16 if WIDE_VECTORS else 8)
        return types.intp(src, types.intp, dst, types.intp, types.intp, types.intp), codegen

    @intrinsic
    def interleave_rows4(typingctx, src, row, column, dst, start, count):
        """dst[start + 4i + r] = src[row + r, column + i] for r < 4 and i < the tiles done (returned: count rounded
        down to 4, the last 1-3 are the caller's), float32, src C-contiguous: each tile's 4 outputs into a row,
        from 4 rows of tiles (winograd.py winograd_output), as vector loads and shuffles 16, 8 or 4 tiles at a
        time (LLVM does not vectorize a loop's stride-4 stores)."""
        def codegen(context, builder, signature, args):
            source = context.make_array(signature.args[0])(context, builder, args[0])
            target = context.make_array(signature.args[3])(context, builder, args[3])
            row_length = builder.extract_value(source.shape, 1)

            def emit(lanes, first):
                rows = []
                for r in range(4):
                    index = builder.add(builder.mul(builder.add(args[1], llvmlite.ir.Constant(_I64, r)), row_length),
                                        builder.add(args[2], first))
                    rows.append(builder.load(_vector_at(builder, source, index, lanes), align=4))
                halves = [_joined(builder, rows[0], rows[1]), _joined(builder, rows[2], rows[3])]
                value = _shuffled(builder, _joined(builder, *halves), [(e % 4) * lanes + e // 4 for e in range(4 * lanes)])
                at = builder.add(args[4], builder.mul(first, llvmlite.ir.Constant(_I64, 4)))
                builder.store(value, _vector_at(builder, target, at, 4 * lanes), align=4)
            return _in_groups(builder, args[5], emit)
        return types.intp(src, types.intp, types.intp, dst, types.intp, types.intp), codegen

    def _require_contiguous(array) -> None:
        """The vector loads and stores address an array's elements by flat offsets from its data pointer: a
        C-contiguous array only (a typing error, at compile time, for any other)."""
        if not (isinstance(array, types.Array) and array.layout == "C" and array.dtype == types.float32):
            raise numba.core.errors.TypingError(f"a C-contiguous float32 array, not {array}")

    def _vector_load(lanes: int):
        """An intrinsic load(row, offset) -> (row[offset], ..., row[offset + lanes - 1]) of a float32 row as a
        tuple (one vector register to the SLP vectorizer): one vector load, no index checks. The register
        tiles' slices row[a:a + 16] cost LLVM a clamp of both bounds on every use (some 10 scalar instructions
        a slice, 4 slices for 16 multiply-adds in conv_direct.py's first-conv tiles). By hand, load16 against
        slices, the same bytes: conv_direct.py's tiles 0.82-0.86x the time (178-182 GFLOP/s on 3 -> 16 to
        3 -> 32), winograd.py's block_products 0.91-1.00x and small_products 0.84-0.98x; whole calls at 1
        thread leaf_cnn 0.95x, tomato 0.94x, leaf_cnn224 0.96x, at 2 threads 0.98x, 0.95x, 0.99x, batch 32
        leaf_cnn 0.95x (15 interleaved rounds)."""
        tuple_type = types.UniTuple(types.float32, lanes)

        @intrinsic
        def load(typingctx, row, offset):
            _require_contiguous(row)

            def codegen(context, builder, signature, args):
                array = context.make_array(signature.args[0])(context, builder, args[0])
                vector = builder.load(_vector_at(builder, array, args[1], lanes), align=4)
                return context.make_tuple(builder, tuple_type, [
                    builder.extract_element(vector, llvmlite.ir.Constant(llvmlite.ir.IntType(32), i))
                    for i in range(lanes)])
            return tuple_type(row, types.intp), codegen
        return load

    load16 = _vector_load(16)   # one AVX-512 register (the wide tiles)
    load8 = _vector_load(8)     # one AVX2 register (the narrow tiles: winograd.py's narrow_products)

    @intrinsic
    def store8(typingctx, row, offset, value):
        """row[offset:offset + 8] = value (an 8-tuple) of a float32 row: one vector store, no index checks."""
        _require_contiguous(row)

        def codegen(context, builder, signature, args):
            array = context.make_array(signature.args[0])(context, builder, args[0])
            vector = llvmlite.ir.Constant(llvmlite.ir.VectorType(llvmlite.ir.FloatType(), 8), None)
            for i in range(8):
                vector = builder.insert_element(vector, builder.extract_value(args[2], i),
                                                llvmlite.ir.Constant(llvmlite.ir.IntType(32), i))
            builder.store(vector, _vector_at(builder, array, args[1], 8), align=4)
            return context.get_dummy_value()
        return types.none(row, types.intp, types.UniTuple(types.float32, 8)), codegen

    @intrinsic
    def _store_release(typingctx, array, index, value):
        """array[index] = value, an int64 array, as an atomic store (release)."""
        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            builder.store_atomic(args[2], builder.gep(data, [args[1]]), "release", 8)
            return context.get_dummy_value()
        return types.none(array, types.intp, types.int64), codegen

    def spin_while_equal(flags, index, value, hot, mark, marked, linger_ns):
        """Without the GIL: first flags[mark] = marked (when mark >= 0), then wait while flags[index] == value,
        yielding the CPU between reads (a thread woken onto this CPU runs); when hot >= 0, only while
        flags[hot] != 0, or for `linger_ns` nanoseconds more (at least one yield) once it is 0. True when
        flags[index] changed. parallel.py's crew waits with it during a call instead of blocking; a helper says
        "done" from here (mark), so it holds no GIL when the caller, seeing it, wants the GIL (a thread that
        waits for the GIL sleeps, and wakes 30-80 us later on the 2-core VM)."""
        if mark >= 0:
            _store_release(flags, mark, marked)
        linger_end = -1
        while _load_acquire(flags, index) == value:
            if hot >= 0 and _load_acquire(flags, hot) == 0:
                if linger_ns <= 0:
                    return False
                now = _monotonic_ns()
                if linger_end < 0:
                    linger_end = now + linger_ns
                elif now >= linger_end:
                    return False
            _sched_yield()
        return True

    def hand_off(flags, helpers, stride, given, started, wait_ns, margin_ns):
        """Without the GIL: give each of the first `helpers` helpers its next task (flags[stride * i + given] += 1:
        its count of tasks given), then wait until each has taken it (flags[stride * i + started], its count of
        tasks started, caught up), at most `wait_ns` nanoseconds in all, then yield `margin_ns` more, at least
        once (the helper, which took the GIL to start its task, drops it again when its first kernel starts).
        parallel.py's Crew.run: the caller holds no GIL while the helpers take it, so neither sleeps waiting for
        it (30-80 us here)."""
        for i in range(helpers):
            _store_release(flags, stride * i + given, flags[stride * i + given] + 1)
        give_up = _monotonic_ns() + wait_ns
        for i in range(helpers):
            while _load_acquire(flags, stride * i + started) != flags[stride * i + given] and _monotonic_ns() < give_up:
                _sched_yield()
        margin_end = _monotonic_ns() + margin_ns
        _sched_yield()
        while _monotonic_ns() < margin_end:
            _sched_yield()

    @intrinsic
    def _call_at(typingctx, address, arguments):
        """Calls the compiled kernel at `address` (compiled_address: Numba's own calling convention, for exactly
        the types of the tuple `arguments`, returning None) with the tuple's values; an exception it raises
        goes on up from here. programs.py's helper programs call each step's kernel so, the same machine
        code a call from Python runs, without compiling it again into the program (the bundled model's
        program: 2.5 s to compile so, 12 s with its kernels compiled in) and without its address in the
        cached program (the address is an argument: each process passes its own). It uses Numba's call
        convention helpers (numba.core.callconv, not a public API: a Numba that changed them would fail the
        program's compile, and programs.build keeps the Python hand-off then, with a warning;
        tests/runtime/test_cpu_threads.py checks the calls, their bytes and a raised exception)."""
        argument_types = tuple(arguments.types)

        def codegen(context, builder, signature, args):
            call_conv = context.call_conv
            values = [builder.extract_value(args[1], i) for i in range(len(argument_types))]
            function = builder.inttoptr(args[0], call_conv.get_function_type(types.none, argument_types).as_pointer())
            result_type = call_conv.get_return_type(types.none).pointee
            result = cgutils.alloca_once(builder, result_type)
            builder.store(cgutils.get_null_value(result_type), result)
            exception = cgutils.alloca_once(builder, llvmlite.ir.PointerType(excinfo_t))
            packed = list(call_conv._get_arg_packer(argument_types).as_arguments(builder, values))
            code = builder.call(function, [result, exception] + packed)
            status = call_conv._get_return_status(builder, code, builder.load(exception))
            with cgutils.if_unlikely(builder, status.is_error):
                call_conv.return_status_propagate(builder, status)
            return context.get_dummy_value()
        return types.none(address, arguments), codegen

    @intrinsic
    def _array_at(typingctx, address, shape, strides, array_type):
        """The array of type `array_type` (a numba Array type, passed as a global of the program's source) whose
        data start at `address`, with the tuples `shape` and `strides` (bytes): a view without a reference to
        what owns the memory (as numba.carray makes), for programs.py's step callers: a one-thread program holds
        its steps' arrays as addresses in an int64 table, not as Python objects (a tuple of typed lists of arrays
        took 39 us to pass, a call). The owner must outlive the call: the plan holds its arrays."""
        made = array_type.instance_type

        def codegen(context, builder, signature, args):
            from numba.np.arrayobj import populate_array

            view = context.make_array(made)(context, builder)
            populate_array(view, data=builder.inttoptr(args[0], view.data.type), shape=args[1], strides=args[2],
                           itemsize=context.get_constant(types.intp, context.get_abi_sizeof(
                               context.get_data_type(made.dtype))), meminfo=None)
            return view._getvalue()
        return made(address, shape, strides, array_type), codegen

    @intrinsic
    def call_sgemm(typingctx, address, rows, columns, inner, a, lda, b, ldb, c, ldc):
        """C[rows, columns] = A[rows, inner] @ B[inner, columns], float32 row-major, through the C function at
        `address`: ILP64 CBLAS's cblas_sgemm (sgemm_address), with the matrices' first elements' addresses and
        their row pitches in elements (all int64). winograd.py's blas_products calls BLAS so, from compiled code
        that a helper program can run, where np.matmul is a Python call."""
        int32, int64 = llvmlite.ir.IntType(32), llvmlite.ir.IntType(64)
        single, pointer = llvmlite.ir.FloatType(), llvmlite.ir.FloatType().as_pointer()
        function_type = llvmlite.ir.FunctionType(llvmlite.ir.VoidType(), [int32, int32, int32, int64, int64, int64,
                                                                          single, pointer, int64, pointer, int64,
                                                                          single, pointer, int64])

        def codegen(context, builder, signature, args):
            function = builder.inttoptr(args[0], function_type.as_pointer())
            row_major, no_transpose = (llvmlite.ir.Constant(int32, value) for value in (101, 111))
            one, zero = llvmlite.ir.Constant(single, 1.0), llvmlite.ir.Constant(single, 0.0)
            a, b, c = (builder.inttoptr(args[index], pointer) for index in (4, 6, 8))
            builder.call(function, [row_major, no_transpose, no_transpose, args[1], args[2], args[3], one, a, args[5],
                                    b, args[7], zero, c, args[9]])
            return context.get_dummy_value()
        return types.none(*(types.int64,) * 10), codegen

    def compiled_address(dispatcher, args: tuple) -> int | None:
        """The address of `dispatcher`'s compiled code for exactly the types of `args` (compiled, or loaded from
        the cache, here if it was not yet) for call_at; None where it returns a value or is no Numba kernel."""
        if not isinstance(dispatcher, numba.core.registry.CPUDispatcher):
            return None
        signature = tuple(numba.typeof(value) for value in args)
        if signature not in dispatcher.overloads:
            dispatcher.compile(signature)
        compiled = dispatcher.overloads[signature]
        if compiled.signature.return_type != types.none:
            return None
        return compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name)

    spin_while_equal = (None if sys.platform == "win32" or _CLOCK is None       # no sched_yield, clock_gettime
                        else numba.njit(cache=CACHE_ENABLED, nogil=True)(spin_while_equal))
    hand_off = None if spin_while_equal is None else numba.njit(cache=CACHE_ENABLED, nogil=True)(hand_off)
    # for kernels that hand work between threads themselves (linear.py's chain); None where there is no spin
    (load_acquire, store_release, compare_and_swap, fetch_add, sched_yield, spin_pause, monotonic_ns, call_at,
     array_at) = ((None,) * 9 if spin_while_equal is None else
                  (_load_acquire, _store_release, _compare_and_swap, _fetch_add, _sched_yield, _spin_pause,
                   _monotonic_ns, _call_at, _array_at))


def blas_libraries() -> list:
    """threadpoolctl's controllers of the BLAS libraries loaded in this process, NumPy's among them (inspected
    anew on each call: a BLAS loaded later, by SciPy say, is found too)."""
    import numpy  # noqa: F401  (its BLAS loaded: threadpoolctl lists only loaded libraries)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas").lib_controllers


@functools.cache
def sgemm_address() -> int | None:
    """The address of cblas_sgemm in the ILP64 OpenBLAS that NumPy loaded (its wheels' scipy-openblas64:
    scipy_cblas_sgemm64_), for call_sgemm; None without the JIT, or where NumPy's BLAS is another (np.matmul
    stays in the plans there)."""
    if call_sgemm is None:
        return None
    import ctypes

    for library in blas_libraries():
        if library.internal_api != "openblas":
            continue
        try:
            handle = ctypes.CDLL(library.filepath)
        except OSError:
            continue
        for name in ("scipy_cblas_sgemm64_", "cblas_sgemm64_"):
            function = getattr(handle, name, None)
            if function is not None:
                return ctypes.cast(function, ctypes.c_void_p).value
    return None
