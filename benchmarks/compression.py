"""Weight compression: size, accuracy and CPU latency of fp32 / fp16 / int8 .bin files, and int8 GEMM vs float BLAS.

    python benchmarks/compression.py            (a few minutes; needs ../shared/data/{mnist,tomato})

Models: examples/trained/mnist_cnn.bin on the 10,000 MNIST test images, and the bundled
models/tomato_leaf.bin on the validation side of lnn-train's split of ../shared/data/tomato (the
photos lnn-eval evaluates by default). Each is encoded as lnn-export writes it (--fp16, --int8) and
measured on the Numba backend: file size and its ratio to fp32, top-1 accuracy (lnn-export's own
calibration code), and latency at batch 1 with 1 thread (median, on a real preprocessed image).

int8 kernels or dequantize at load: lnn dequantizes int8 weights to float32 when a model loads,
so its convolutions stay float BLAS products. The second table measures the alternative at its core:
a Numba int8 x int8 -> int32 matrix product (the loop LLVM vectorizes) against float32 BLAS (1 thread),
for the im2col products of the tomato model's convolutions at batch 1. It leaves out what a real int8
path would add (quantizing each layer's input, requantizing outputs), so it favours int8.
Writes the "compression" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_latency import median_ms  # noqa: E402
from report import SHARED, machine_line, markdown_table, update_section  # noqa: E402

from lnn.formats.binfile import encode_bin, fp16_dtypes, int8_dtypes, parse_bin_bytes, read_bin  # noqa: E402
from lnn.runtime import Session  # noqa: E402
from lnn.tools.export import calibration_set, accuracy  # noqa: E402

DATA = SHARED / "data"
MODELS = [("mnist_cnn", REPO / "examples" / "trained" / "mnist_cnn.bin", f"mnist:{DATA / 'mnist'}"),
          ("tomato_leaf", REPO / "models" / "tomato_leaf.bin", f"folder:{DATA / 'tomato'}")]
COMMAND = "python benchmarks/compression.py"


def variants(bin_model) -> dict:
    """kind -> .bin bytes, as lnn-export writes them from this fp32 model, without the test vectors (their
    inputs, 384 KiB for the tomato model, are the same in every variant: the weights are what is compared)."""
    from lnn.runtime.vectors import without_test_vectors

    model = bin_model.model
    tensors, metadata = without_test_vectors(bin_model.tensors, bin_model.metadata)
    return {"fp32": encode_bin(model, tensors, metadata),
            "fp16": encode_bin(model, tensors, metadata, fp16_dtypes(model)),
            "int8": encode_bin(model, tensors, metadata, int8_dtypes(model))}


def model_rows() -> list:
    from lnn.runtime.cpu import BACKEND as CpuBackend

    rows = []
    for name, path, calibration in MODELS:
        source = read_bin(path)
        images, true_columns, what = calibration_set(calibration, source.model)
        encoded = variants(source)
        for kind, data in encoded.items():
            bin_model = parse_bin_bytes(data, f"{name} {kind}")
            top1 = accuracy(Session(bin_model, device="cpu"), images, true_columns)
            one_thread = CpuBackend(bin_model.model, bin_model.weights_fp32(), threads=1)
            x = first_input(Session(bin_model, device="numpy"), images[0])
            latency = median_ms(one_thread.run, x)
            row = [name, kind, f"{len(data):,}", f"{len(data) / len(encoded['fp32']):.3f}", f"{top1:.2%}",
                   f"{latency:.3f}"]
            print(" | ".join(row), f"({len(images)} images of {what})", flush=True)
            rows.append(row)
    return rows


def first_input(session, image: np.ndarray) -> np.ndarray:
    """uint8 [C, H, W] in the model's colour order (a calibration image) -> a preprocessed batch of one."""
    color = session.model.preprocess["color"]
    pixels = image[0] if color == "gray" else image.transpose(1, 2, 0)
    return session.prepare_image(pixels, "bgr" if color == "gray" else color)[None]


def int8_gemm_kernel():
    import numba

    @numba.njit(cache=True, boundscheck=False)
    def int8_gemm(a, b, out):
        """a int8 [M, K] @ b int8 [K, N] -> out int32 [M, N], accumulating in int32."""
        rows, depth = a.shape
        columns = b.shape[1]
        for i in range(rows):
            for j in range(columns):
                out[i, j] = 0
            for k in range(depth):
                a_ik = np.int32(a[i, k])
                for j in range(columns):
                    out[i, j] += a_ik * np.int32(b[k, j])

    return int8_gemm


def gemm_rows() -> list:
    """Per conv of the tomato model: the im2col product at batch 1, float32 BLAS vs Numba int8 -> int32."""
    from threadpoolctl import threadpool_limits

    int8_gemm = int8_gemm_kernel()
    rng = np.random.default_rng(0)
    rows = []
    model = read_bin(MODELS[1][1]).model
    for node in model.nodes:
        if node.op != "conv2d":
            continue
        kh, kw = node.attrs["kernel_size"]
        m, k = node.out_shape[0], node.in_shape[0] // node.attrs["groups"] * kh * kw
        n = node.out_shape[1] * node.out_shape[2]
        a32, b32 = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
        a8, b8 = rng.integers(-127, 128, (m, k), dtype=np.int8), rng.integers(-127, 128, (k, n), dtype=np.int8)
        out = np.empty((m, n), np.int32)
        expected = a8.astype(np.int64) @ b8.astype(np.int64)
        int8_gemm(a8, b8, out)
        assert np.array_equal(out, expected), "int8 GEMM wrong"
        with threadpool_limits(1, user_api="blas"):
            float_ms = median_ms(lambda _: a32 @ b32, None)
        int8_ms = median_ms(lambda _: int8_gemm(a8, b8, out), None)
        row = [node.name, f"[{m}, {k}] x [{k}, {n}]", f"{float_ms:.3f}", f"{int8_ms:.3f}", f"{int8_ms / float_ms:.2f}"]
        print(" | ".join(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    started = time.perf_counter()
    rows = model_rows()
    gemm = gemm_rows()
    body = "\n\n".join([
        "## Weight compression (fp32 / fp16 / int8)",
        f"`{COMMAND}` — {machine_line()}.",
        "Each model re-encoded as `lnn-export --fp16` / `--int8` write it. Accuracy: top-1 on the 10,000 MNIST "
        "test images (mnist_cnn) and on the validation split of ../shared/data/tomato that lnn-eval uses "
        "(tomato_leaf), on the Numba backend. Latency: Numba backend, batch 1, 1 thread, median ms on a real "
        "preprocessed image. int8 and fp16 weights are widened to float32 when the model loads, so the "
        "latencies should match fp32; differences between them are timing noise.",
        markdown_table(["model", "weights", "bytes", "size / fp32", "accuracy", "latency ms"], rows),
        "### int8 kernel vs dequantize-at-load",
        "The im2col products of tomato_leaf's convolutions at batch 1: float32 BLAS (NumPy `@`, 1 thread) against a "
        "Numba int8 x int8 -> int32 loop (vectorized by LLVM, checked exact against int64). Ratio above 1: int8 is "
        "slower. This is why lnn dequantizes int8 weights at load and runs float kernels (docs/ARCHITECTURE.md).",
        markdown_table(["conv", "product", "float32 BLAS ms", "int8 Numba ms", "int8 / float"], gemm),
        f"Run time {time.perf_counter() - started:.0f} s.",
    ])
    update_section("compression", body)


if __name__ == "__main__":
    main()
