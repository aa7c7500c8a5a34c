"""runtime/cuda/conv_gemm.py's CUDA source compiles, without a GPU, with the nvcc of the machine (skipped
without one): one instance of every kernel template for float32, float16 and bfloat16 (the tensor-core
twins for the 16-bit types, the CUDA-core halo kernels for float32), for sm_80 (the first card with mma
.bf16), with no register spills."""

import re
import shutil
import subprocess

import pytest

from lnn.runtime.cuda import conv_gemm


def first_of_each_template(names: list) -> list:
    seen, out = set(), []
    for name in names:
        family = name.split("<")[0]
        if family not in seen:
            seen.add(family)
            out.append(name)
    return out


@pytest.mark.slow
def test_every_conv_kernel_template_compiles_for_each_type(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    names = []
    for kind in ("float", "unsigned short", "lnn_bf16"):
        names += first_of_each_template(conv_gemm.kernel_names(kind, tensor_core=kind != "float"))
    source = tmp_path / "conv_gemm.cu"
    source.write_text(conv_gemm.SOURCE + conv_gemm.TENSOR_CORE_SOURCE + "\nvoid* lnn_instances[] = {\n"
                      + ",\n".join(f"    (void*)&{name}" for name in names) + "\n};\n")
    done = subprocess.run([nvcc, "-std=c++17", "-arch=sm_80", "-cubin", "-Xptxas", "-v", "-o",
                           str(tmp_path / "conv_gemm.cubin"), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert log.count("Compiling entry function") == len(names) == 3 * 5 + 3 + 2 * 5
    assert "I8lnn_bf16" in log                                           # the bfloat16 instances (mangled)
    assert re.findall(r"(\d+) bytes spill stores", log) == ["0"] * len(names)
