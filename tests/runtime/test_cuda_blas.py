"""runtime/cuda/blas.py (the one GEMM route, capturable) and runtime/cuda/reduce.py (per-channel sums)
against NumPy. Needs CuPy and a GPU (skipped otherwise); the NumPy half of blas.matmul runs everywhere."""

import numpy as np
import pytest

from lnn.runtime.cuda.blas import matmul
from lnn.train.kernels import channel_sums

from conftest import gpu_cupy

SHAPES = [((5, 7), (7, 3)), ((1, 9), (9, 1)), ((3, 4, 6), (3, 6, 2)), ((4, 6), (3, 6, 5))]


def _dtype(dtype):
    """bfloat16 by name (ml_dtypes' type: the module is optional), the others as they are."""
    return pytest.importorskip("ml_dtypes").bfloat16 if dtype == "bfloat16" else dtype


def _operands(rng, a_shape, b_shape, transpose_a, transpose_b, dtype):
    a = rng.normal(size=a_shape).astype(dtype)
    b = rng.normal(size=b_shape).astype(dtype)
    if transpose_a:                                   # the same values, stored transposed
        a = np.ascontiguousarray(np.swapaxes(a, -1, -2)).swapaxes(-1, -2)
    if transpose_b:
        b = np.ascontiguousarray(np.swapaxes(b, -1, -2)).swapaxes(-1, -2)
    return a, b


def test_numpy_matmul_writes_and_accumulates():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 3)), rng.normal(size=(3, 2))
    out = np.ones((4, 2))
    np.testing.assert_allclose(matmul(np, a, b, out.copy()), a @ b)
    np.testing.assert_allclose(matmul(np, a, b, out, accumulate=True), a @ b + 1)


@pytest.mark.parametrize("dtype, rtol", [(np.float32, 1e-5), (np.float64, 1e-12), (np.float16, 2e-2), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("a_shape, b_shape", SHAPES)
@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (True, False), (False, True), (True, True)])
def test_cublas_matmul_matches_numpy(a_shape, b_shape, transpose_a, transpose_b, dtype, rtol):
    cupy = gpu_cupy()
    dtype = _dtype(dtype)
    rng = np.random.default_rng(1)
    a, b = _operands(rng, a_shape, b_shape, transpose_a, transpose_b, dtype)
    expected = np.matmul(a.astype(np.float64), b.astype(np.float64))
    da = cupy.asarray(np.ascontiguousarray(np.swapaxes(a, -1, -2))).swapaxes(-1, -2) if transpose_a else cupy.asarray(a)
    db = cupy.asarray(np.ascontiguousarray(np.swapaxes(b, -1, -2))).swapaxes(-1, -2) if transpose_b else cupy.asarray(b)
    out = cupy.full(expected.shape, 0.5, dtype)
    matmul(cupy, da, db, out, accumulate=True)
    np.testing.assert_allclose(out.get().astype(np.float64), expected + 0.5, rtol=rtol, atol=rtol)
    matmul(cupy, da, db, out)
    np.testing.assert_allclose(out.get().astype(np.float64), expected, rtol=rtol, atol=rtol)


def test_cublas_matmul_is_captured_in_a_cuda_graph():
    cupy = gpu_cupy()
    stream = cupy.cuda.Stream(non_blocking=True)
    a = cupy.random.rand(64, 32, dtype=np.float32)
    b = cupy.random.rand(32, 16, dtype=np.float32)
    out = cupy.zeros((64, 16), np.float32)
    with stream:
        matmul(cupy, a, b, out)                          # creates the handle outside the capture
        stream.begin_capture()
        matmul(cupy, a, b, out)
        graph = stream.end_capture()
        out.fill(0)
        a *= 2
        graph.launch(stream)
        stream.synchronize()
    np.testing.assert_allclose(out.get(), (a @ b).get(), rtol=1e-5)


@pytest.mark.parametrize("shape", [(7, 3), (4, 5, 9, 11), (64, 16, 130, 129)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_gpu_channel_sums_match_numpy(shape, dtype):
    cupy = gpu_cupy()
    dtype = _dtype(dtype)
    rng = np.random.default_rng(2)
    a = (rng.normal(size=shape) * 3 + 1).astype(dtype)
    b = rng.normal(size=shape).astype(dtype)
    shift_a = rng.normal(size=shape[1]).astype(np.float32)
    shift_b = rng.normal(size=shape[1]).astype(np.float32)
    expected = channel_sums(np, a.astype(np.float64), b.astype(np.float64), shift_a.astype(np.float64),
                            shift_b.astype(np.float64))
    got = channel_sums(cupy, cupy.asarray(a), cupy.asarray(b), cupy.asarray(shift_a), cupy.asarray(shift_b))
    scale = np.abs(a.astype(np.float64)).sum() / shape[1]
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g.get(), e, rtol=1e-4, atol=1e-5 * scale)
    again = channel_sums(cupy, cupy.asarray(a), cupy.asarray(b), cupy.asarray(shift_a), cupy.asarray(shift_b))
    assert all((x == y).all() for x, y in zip(got, again))            # deterministic: the same bits
