"""The CPU backend's kernels compiled ahead of time, for an app that ships without Numba and LLVM.

The same kernel functions as under the JIT (one source of truth): `compile_kernels` hands each one,
with the one signature the backend calls it with, to `numba.pycc`, which writes one extension module
(MODULE) of plain machine code for the build machine's architecture family (LLVM's generic CPU model, so
it runs on any CPU of that family). That module imports without Numba or llvmlite; jit.py uses it when
LNN_CPU_KERNELS=aot, or when Numba is not installed (the packaged lnn-field, packaging/build.sh).

Each kernel file declares its kernels' signatures beside them (AOT_SIGNATURES, above its kernels): the
argument types the backend passes, from the names below (C-contiguous arrays of a fixed dtype, mostly
float32, and rank; int64 and float64 scalars; a 6-tuple of ints), or None for a kernel only called by other
kernels, which is compiled into them. A kernel missing there is an ImportError in the app and refused by
compile_kernels. Compiled code trusts its arguments (a wrong dtype or rank would read out of bounds), so
`compiled_kernel` checks every array and tuple against the signature before each call and raises TypeError
otherwise. tests/runtime/test_cpu_aot.py checks that the JIT compiles exactly these signatures for the test
models, and runs the CPU backend's tests on the compiled module.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

import numpy as np

MODULE = "lnn_cpu_kernels"

A1, A2, A3, A4 = "f4[::1]", "f4[:, ::1]", "f4[:, :, ::1]", "f4[:, :, :, ::1]"
I1, D1, U3 = "i8[::1]", "f8[::1]", "u1[:, :, ::1]"          # int64, float64 and uint8 arrays
I, F, WINDOW = "i8", "f8", "UniTuple(i8, 6)"
ARRAY_DTYPES = {"f4": np.dtype(np.float32), "f8": np.dtype(np.float64), "i8": np.dtype(np.int64),
                "u1": np.dtype(np.uint8)}


def kernel_files() -> list:
    """The files of lnn.runtime.cpu with kernels: those that import `kernel` or `ieee_kernel` from jit.py (read
    from the sources: only the build and the tests ask, never the app)."""
    return sorted(path.stem for path in Path(__file__).parent.glob("*.py") if path.stem != "aot" and re.search(
        r"^from lnn.runtime.cpu.jit import .*\b(ieee_)?kernel\b", path.read_text(encoding="utf-8"), re.M))


def signatures() -> dict:
    """{"<file>.<kernel>": its argument types, or None when it is only called by other kernels}: every kernel
    file's AOT_SIGNATURES."""
    return {f"{name}.{kernel}": arguments for name in kernel_files()
            for kernel, arguments in importlib.import_module(f"lnn.runtime.cpu.{name}").AOT_SIGNATURES.items()}


def kernel_key(function) -> str:
    return f"{function.__module__.rpartition('.')[2]}.{function.__name__}"


def symbol(key: str) -> str:
    return key.replace(".", "__")


def compiled_kernel(function):
    """@kernel when LNN_CPU_KERNELS=aot: the compiled entry point for `function`, behind an argument check."""
    key = kernel_key(function)
    declared = getattr(sys.modules[function.__module__], "AOT_SIGNATURES", {})     # above the file's kernels
    if function.__name__ not in declared:
        raise ImportError(f"kernel {key} has no ahead-of-time signature (add it to AOT_SIGNATURES in its file)")
    signature = declared[function.__name__]
    if signature is None:
        return function                  # compiled into the kernels that call it
    compiled = getattr(importlib.import_module(MODULE), symbol(key))
    checks = [(position, kind) for position, kind in enumerate(signature) if kind not in (I, F)]
    arrays = [(ARRAY_DTYPES[kind[:2]], kind.count(",") + 1) if kind[2:3] == "[" else None for _, kind in checks]
    arity = len(signature)

    def checked(*args):
        if len(args) != arity:
            raise TypeError(f"{key} takes {arity} arguments, got {len(args)}")
        for (position, kind), array in zip(checks, arrays):
            value = args[position]
            if array is None:
                if not (isinstance(value, tuple) and len(value) == 6):
                    raise TypeError(f"{key}: argument {position} must be a tuple of 6 ints")
                continue
            dtype, rank = array
            if not (type(value) is np.ndarray and value.dtype == dtype and value.ndim == rank
                    and value.flags.c_contiguous and value.flags.aligned):
                raise TypeError(f"{key}: argument {position} must be a C-contiguous {dtype} array of rank {rank}")
        return compiled(*args)

    checked.__name__ = checked.__qualname__ = function.__name__
    checked.__doc__ = function.__doc__
    return checked


def jit_kernels() -> dict:
    """{key: Numba dispatcher} for every @kernel of the CPU backend (JIT mode; every file that imports `kernel`)."""
    kernels = {}
    for name in kernel_files():
        module = importlib.import_module(f"lnn.runtime.cpu.{name}")
        for value in vars(module).values():
            if hasattr(value, "py_func") and value.py_func.__module__ == module.__name__:
                kernels[kernel_key(value.py_func)] = value
    return kernels


def missing_compiler() -> str | None:
    """Why numba.pycc cannot build here, or None. It compiles its C sources with the C compiler and Numba's
    runtime (nrt.cpp) as C++, with the compilers distutils takes: $CC and $CXX, else sysconfig's CC and
    CXX. A C compiler alone is not enough (Debian's gcc without g++ has no cc1plus). On Windows, MSVC,
    which is found without PATH and compiles both, is not checked."""
    if os.name == "nt":
        return None
    for variable, language, default in (("CC", "C", "cc"), ("CXX", "C++", "c++")):
        compiler = (os.environ.get(variable) or sysconfig.get_config_var(variable) or default).split()[0]
        if shutil.which(compiler) is None:
            return (f"no {language} compiler: {compiler!r} is not on PATH "
                    f"(numba.pycc needs C and C++ compilers to build the kernel module)")
    return None


def compile_kernels(output_dir: Path, target_cpu: str = "") -> Path:
    """Compile every kernel with a signature into `output_dir`/MODULE.<ext>; needs Numba and a C compiler.

    Run it with the JIT kernels (LNN_CPU_KERNELS unset): their Python functions are what gets compiled.
    target_cpu "" is LLVM's generic model for this architecture (portable); "host" tunes for this CPU.
    A Numba without numba.pycc (pending deprecation, numba issue #8509) is a RuntimeError saying so."""
    try:
        from numba.pycc import CC
    except ImportError as err:
        raise RuntimeError(f"this Numba has no numba.pycc ({err}), which builds the app's compiled kernels: install "
                           f"the Numba that pyproject.toml's app extra pins (pip install -e '.[app]'; packaging/BUILD.md)"
                           ) from None

    problem = missing_compiler()
    if problem:
        raise RuntimeError(problem)
    kernels, declared = jit_kernels(), signatures()
    unlisted = sorted(set(kernels) - set(declared))
    if unlisted:
        raise RuntimeError(f"kernels without an ahead-of-time signature in their file's AOT_SIGNATURES: {unlisted}")
    compiler = CC(MODULE)
    compiler.output_dir = str(output_dir)
    compiler.target_cpu = target_cpu
    for key, arguments in declared.items():
        if arguments is not None:
            compiler.export(symbol(key), f"void({', '.join(arguments)})")(kernels[key].py_func)
    from lnn.runtime.cpu import winograd

    shuffles, winograd.SHUFFLES = winograd.SHUFFLES, False    # (measured with the JIT on AVX-512 and AVX2; the
    try:                                                       # module is built for any CPU of the family: copies)
        with wrappers_release_the_gil():
            compiler.compile()
    finally:
        winograd.SHUFFLES = shuffles
    return Path(output_dir) / compiler.output_file


@contextlib.contextmanager
def wrappers_release_the_gil():
    """numba.pycc's Python wrappers of the exported kernels drop the GIL around each call, as @kernel's nogil does
    under the JIT: the compiled kernels of a split layer, a split batch or two callers' calls then run at once.
    pycc has no option for it: its exports are compiled with Flags() (numba/pycc/compiler.py, the Numba that the
    app extra pins), whose release_gil is set here for the build. Before, the app's 2-thread split of the bundled
    model took as long as one thread (5.66 against 5.40 ms) and now 3.63 against 5.03; a batch of 32 on 2 threads
    56.5 ms, now 47.6, against 82 on one (the 2-core VM, by hand)."""
    from numba.pycc import compiler as pycc_compiler

    plain = pycc_compiler.Flags

    class ReleasingFlags(plain):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.release_gil = True

    pycc_compiler.Flags = ReleasingFlags
    try:
        yield
    finally:
        pycc_compiler.Flags = plain
