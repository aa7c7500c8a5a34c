"""The CPU backend's kernels compiled ahead of time, for an app that ships without Numba and LLVM.

The same kernel functions as under the JIT (one source of truth): `compile_kernels` hands each one,
with the one signature the backend calls it with, to `numba.pycc`, which writes one extension module
(MODULE) of plain machine code for the build machine's architecture family (LLVM's generic CPU model, so
it runs on any CPU of that family). That module imports without Numba or llvmlite; jit.py uses it when
LNN_CPU_KERNELS=aot, or when Numba is not installed (the packaged lnn-field, packaging/build.sh).

SIGNATURES lists every kernel the backend calls from Python, with the argument types it passes:
float32 C-contiguous arrays of a fixed rank, int64 and float64 scalars, a 6-tuple of ints.
INLINE_ONLY kernels are only called by other kernels and are compiled into them. compile_kernels
refuses to build when a kernel of the backend is in neither.
Compiled code trusts its arguments (a wrong dtype or rank would read out of bounds), so `compiled_kernel`
checks every array and tuple against the signature before each call and raises TypeError otherwise.
tests/runtime/test_cpu_aot.py checks that the JIT compiles exactly these signatures for the test models,
and runs the CPU backend's tests on the compiled module.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import sysconfig
from pathlib import Path

import numpy as np

MODULE = "lnn_cpu_kernels"
KERNEL_MODULES = ("activations", "conv2d", "conv_direct", "layernorm", "linear", "pool", "recurrent", "winograd")   # files of lnn.runtime.cpu with kernels

A1, A2, A3, A4 = "f4[::1]", "f4[:, ::1]", "f4[:, :, ::1]", "f4[:, :, :, ::1]"
I, F, WINDOW = "i8", "f8", "UniTuple(i8, 6)"
SIGNATURES = {
    "activations.affine_activation": (A3, A1, A1, I, F, A3),
    "conv2d.shifted_im2col": (A3, I, I, I, I, I, I, I, A2),
    "conv2d.im2col": (A3, I, I, I, I, I, I, I, I, I, I, A2),
    "conv2d.conv2d_direct": (A3, A4, I, I, I, I, I, A3),
    "conv2d.max_pool_2x2_rows": (A2, I, I, I, I, A2, I, I, I),
    "conv2d.max_pool_rows": (A2, I, I, I, I, I, WINDOW, A1, A2, I, I, I),
    "conv2d.epilogue_rows": (A2, I, I, I, A1, A1, I, F, A4, I, I, I, I, I, I),
    "conv2d.softmax_channels": (A4, I, I, I, I, I, I),
    "conv_direct.conv3x3_direct": (A3, A4, I, I, I, I, I, A2),
    "layernorm.layernorm_rows": (A2, A1, A1, F, A2),
    "linear.linear_rows": (A2, A2, A1, A1, I, F, A2),
    "pool.maxpool2d": (A4, I, I, I, I, A4),
    "pool.avgpool2d": (A4, I, I, I, I, A2, A4),
    "pool.global_avg_pool": (A3, A2),
    "pool.global_max_pool": (A3, A2),
    "recurrent.lstm_cell": (A2, A2, A1, A2, A2, I),
    "recurrent.gru_cell": (A2, A2, A1, A1, A2, A2, I),
    "recurrent.lstm_sequence": (A3, I, A2, A1, A2, A2, A3, I, I),
    "recurrent.gru_sequence": (A3, I, A2, A1, A1, A2, A2, A3, I, I),
    "winograd.winograd_input": (A3, I, I, I, I, I, A2, A3),
    "winograd.winograd_output": (A3, I, I, I, I, I, I, I, I, I, A2, A2),
}
INLINE_ONLY = {"activations.activate", "recurrent.tanh_ratio", "recurrent.sigmoid_ratio", "recurrent.recurrent_product"}


def kernel_key(function) -> str:
    return f"{function.__module__.rpartition('.')[2]}.{function.__name__}"


def symbol(key: str) -> str:
    return key.replace(".", "__")


def compiled_kernel(function):
    """@kernel when LNN_CPU_KERNELS=aot: the compiled entry point for `function`, behind an argument check."""
    key = kernel_key(function)
    if key in INLINE_ONLY:
        return function                  # compiled into the kernels that call it
    if key not in SIGNATURES:
        raise ImportError(f"kernel {key} has no ahead-of-time signature (add it to lnn.runtime.cpu.aot.SIGNATURES)")
    compiled = getattr(importlib.import_module(MODULE), symbol(key))
    checks = [(position, kind) for position, kind in enumerate(SIGNATURES[key]) if kind not in (I, F)]
    ranks = [kind.count(",") + 1 if kind.startswith("f4[") else None for _, kind in checks]
    arity = len(SIGNATURES[key])

    def checked(*args):
        if len(args) != arity:
            raise TypeError(f"{key} takes {arity} arguments, got {len(args)}")
        for (position, kind), rank in zip(checks, ranks):
            value = args[position]
            if rank is None:
                if not (isinstance(value, tuple) and len(value) == 6):
                    raise TypeError(f"{key}: argument {position} must be a tuple of 6 ints")
            elif not (type(value) is np.ndarray and value.dtype == np.float32 and value.ndim == rank
                      and value.flags.c_contiguous and value.flags.aligned):
                raise TypeError(f"{key}: argument {position} must be a C-contiguous float32 array of rank {rank}")
        return compiled(*args)

    checked.__name__ = checked.__qualname__ = function.__name__
    checked.__doc__ = function.__doc__
    return checked


def jit_kernels() -> dict:
    """{key: Numba dispatcher} for every @kernel of the CPU backend (JIT mode; every file that imports `kernel`)."""
    files = sorted(path.stem for path in Path(__file__).parent.glob("*.py") if path.stem != "aot"
                   and re.search(r"^from lnn.runtime.cpu.jit import .*\bkernel\b", path.read_text(encoding="utf-8"), re.M))
    if files != sorted(KERNEL_MODULES):
        raise RuntimeError(f"KERNEL_MODULES {sorted(KERNEL_MODULES)} must list the files with kernels: {files}")
    kernels = {}
    for name in KERNEL_MODULES:
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
    """Compile every kernel in SIGNATURES into `output_dir`/MODULE.<ext>; needs Numba and a C compiler.

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
    kernels = jit_kernels()
    unlisted = sorted(set(kernels) - set(SIGNATURES) - INLINE_ONLY)
    if unlisted:
        raise RuntimeError(f"kernels without an ahead-of-time signature in lnn.runtime.cpu.aot.SIGNATURES: {unlisted}")
    compiler = CC(MODULE)
    compiler.output_dir = str(output_dir)
    compiler.target_cpu = target_cpu
    for key, arguments in SIGNATURES.items():
        compiler.export(symbol(key), f"void({', '.join(arguments)})")(kernels[key].py_func)
    compiler.compile()
    return Path(output_dir) / compiler.output_file
