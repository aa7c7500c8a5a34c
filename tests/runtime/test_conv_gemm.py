"""Implicit-GEMM (runtime/cuda/conv_gemm.py) and Winograd (runtime/cuda/winograd.py) convolutions on the
GPU against a float64 NumPy convolution.

The sizing helpers run everywhere; the kernels need CuPy and a GPU (skipped otherwise; run on the GPU
machine by benchmarks/gpu_check.sh). Shapes cover channel counts off the tile sizes (16/32/64 rows,
64 k-columns), kernels 1x1, 3x3, 5x5 and 2x3, padding 0 up to kernel-1, with and without bias, and
forwards on both sides of the direct kernel's rule (at most 4 input channels).
"""

import sys

import numpy as np
import pytest

from lnn.formats.model import parse_model
from lnn.runtime.cuda import conv_gemm, winograd
from lnn.train.plan import Plan, plan_memory

from conftest import gpu_cupy

# (batch, in channels, height, width, out channels, kernel (h, w), padding (h, w), bias)
CASES = [
    (2, 3, 9, 11, 5, (3, 3), (1, 1), True),
    (3, 16, 12, 12, 32, (3, 3), (1, 1), True),
    (2, 33, 7, 9, 70, (3, 3), (0, 0), False),
    (4, 8, 6, 6, 16, (1, 1), (0, 0), True),
    (1, 7, 10, 8, 130, (5, 5), (2, 2), True),
    (2, 5, 8, 9, 17, (2, 3), (1, 2), False),
    (300, 1, 6, 6, 8, (3, 3), (1, 1), True),
    (5, 20, 4, 4, 24, (3, 3), (1, 1), True),
    (3, 4, 10, 7, 24, (5, 5), (2, 2), False),       # the direct forward at its limit (100 taps), two channel blocks
    # the halo kernels' staging widths (halo_vector): 8 with partial row, channel and output blocks; 1 (odd
    # widths; no padding: x 2 wider than y); padding 2 (x 12 wide: 4 forward, outputs 14 wide: 1 backward); 8 on
    # the 8-wide tile
    (3, 24, 10, 16, 40, (3, 3), (1, 1), True),
    (2, 17, 9, 13, 20, (3, 3), (1, 1), False),
    (2, 16, 9, 18, 24, (3, 3), (0, 0), True),
    (1, 16, 6, 12, 16, (3, 3), (2, 2), True),
    (2, 16, 8, 8, 24, (3, 3), (1, 1), True),
]


def attrs_of(kernel, padding, bias):
    return {"kernel_size": kernel, "stride": (1, 1), "padding": padding, "dilation": (1, 1), "groups": 1,
            "bias": bias}


def reference_conv(x, weight, bias, padding):
    """float64 forward and the backward of a given dy, by explicit sums over the window offsets."""
    n, c, h, w = x.shape
    o, _, kh, kw = weight.shape
    ph, pw = padding
    oh, ow = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
    padded = np.zeros((n, c, h + 2 * ph, w + 2 * pw))
    padded[:, :, ph:ph + h, pw:pw + w] = x
    y = np.zeros((n, o, oh, ow))
    for a in range(kh):
        for b in range(kw):
            y += np.einsum("oc,nchw->nohw", weight[:, :, a, b], padded[:, :, a:a + oh, b:b + ow])
    if bias is not None:
        y += bias.reshape(1, -1, 1, 1)

    def backward(dy):
        dweight = np.zeros(weight.shape)
        dpadded = np.zeros(padded.shape)
        for a in range(kh):
            for b in range(kw):
                dweight[:, :, a, b] = np.einsum("nohw,nchw->oc", dy, padded[:, :, a:a + oh, b:b + ow])
                dpadded[:, :, a:a + oh, b:b + ow] += np.einsum("oc,nohw->nchw", weight[:, :, a, b], dy)
        return dweight, dy.sum(axis=(0, 2, 3)), dpadded[:, :, ph:ph + h, pw:pw + w]
    return y, backward


def test_support_rule():
    assert conv_gemm.supported(attrs_of((3, 3), (1, 1), True))
    assert conv_gemm.supported(attrs_of((1, 1), (0, 0), True))
    assert not conv_gemm.supported(attrs_of((3, 3), (3, 3), True))          # padding beyond kernel - 1
    assert not conv_gemm.supported(dict(attrs_of((3, 3), (1, 1), True), stride=(2, 2)))
    assert not conv_gemm.supported(dict(attrs_of((3, 3), (1, 1), True), dilation=(2, 2)))
    assert not conv_gemm.supported(dict(attrs_of((3, 3), (1, 1), True), groups=2))


def test_direct_forward_rule():
    assert conv_gemm.direct_forward(attrs_of((3, 3), (1, 1), True), 3)
    assert conv_gemm.direct_forward(attrs_of((5, 5), (2, 2), True), 4)               # 100 taps
    assert not conv_gemm.direct_forward(attrs_of((3, 3), (1, 1), True), 5)
    assert not conv_gemm.direct_forward(attrs_of((7, 7), (3, 3), True), 3)           # 147 taps
    # amp: a direct forward needs no arranged forward weights, only the input gradient's (and the window table)
    assert conv_gemm.scratch_bytes(attrs_of((3, 3), (1, 1), True), (4, 16, 16), (8, 16, 16), np.float16) == \
        4 * 3 * 36 + 2 * conv_gemm.arranged_elements(4, 8)


def test_halo_kernels_load_whole_aligned_vectors():
    wide, narrow = conv_gemm.halo_tile(16), conv_gemm.halo_tile(4)
    assert conv_gemm.halo_vectors(wide) == [8, 4, 1] and conv_gemm.halo_vectors(narrow) == [4, 1]
    assert conv_gemm.halo_vector(wide, 16, 16, 0, 64) == 8
    assert conv_gemm.halo_vector(narrow, 16, 0) == 4                    # no wider than the tile
    assert conv_gemm.halo_vector(wide, 28, 28, 0, 0) == 4
    assert conv_gemm.halo_vector(wide, 16, 18, 0, 0) == 1               # no padding: x is 2 wider
    assert conv_gemm.halo_vector(wide, 16, 16, 0, 4) == 4               # x starts 4 elements past an alignment
    assert conv_gemm.halo_vector(wide, 16, 16, 3, 0) == 1
    assert conv_gemm.halo_vector(wide, 13, 13, 0, 0) == 1


def test_window_table_matches_the_nchw_offsets():
    table = conv_gemm.window_table(3, 5, 7, 2, 3)
    k = 0
    for c in range(3):
        for a in range(2):
            for b in range(3):
                assert tuple(table[:, k]) == (c * 35 + a * 7 + b, a, b)
                k += 1


@pytest.mark.parametrize("columns", [1, 31, 256, 257, 5000, 1 << 20])
@pytest.mark.parametrize("limit", [1, 7, 176])
def test_weight_gradient_chunks_cover_every_position_once(columns, limit):
    chunk, chunks = conv_gemm.chunking(columns, limit)
    assert 1 <= chunks <= limit and chunk % conv_gemm.WGRAD_STEP == 0
    assert (chunks - 1) * chunk < columns <= chunks * chunk


def test_gpu_plan_drops_the_im2col_workspaces_and_needs_less_memory():
    model = parse_model({"input_shape": [3, 32, 32], "layers": [
        {"type": "conv2d", "out_channels": 16, "kernel_size": 3, "padding": 1, "activation": "relu"},
        {"type": "conv2d", "out_channels": 8, "kernel_size": 3, "stride": 2},
        {"type": "global_avg_pool"}, {"type": "linear", "out_features": 4}],
        "loss": "cross_entropy", "optimizer": {"type": "sgd", "lr": 0.1}})
    gpu, cpu = Plan(model, 64, implicit_conv=True), Plan(model, 64)
    assert [name for name in gpu.buffers if name.startswith("ws:0:")] == ["ws:0:wgrad_partial"]   # no im2col
    assert any(name.startswith("ws:1:") for name in gpu.buffers)             # stride 2 keeps im2col
    assert gpu.conv_scratch > 0 and cpu.conv_scratch == 0
    gpu_report = plan_memory(model, 64)
    assert gpu_report["gemm_workspace"] > 0 == plan_memory(model, 64, gpu=False)["gemm_workspace"]
    assert gpu_report["peak"] - gpu_report["gemm_workspace"] < plan_memory(model, 64, gpu=False)["peak"]   # cuBLAS's is fixed


def test_bf16_scratch_is_counted_as_fp16():
    bfloat16 = pytest.importorskip("ml_dtypes").bfloat16
    for kernel, padding in (((3, 3), (1, 1)), ((1, 1), (0, 0)), ((5, 5), (2, 2))):
        attrs = attrs_of(kernel, padding, True)
        shapes = ((32, 16, 16), (48, 16, 16))
        bf16, fp16, fp32 = (conv_gemm.scratch_bytes(attrs, *shapes, dtype=dtype)
                            for dtype in (bfloat16, np.float16, np.float32))
        assert bf16 == fp16 != fp32                             # 2-byte weights (3x3: the halo kernels' arranged ones)
    assert [name for name in conv_gemm.kernel_names("lnn_bf16", True) if "mma" in name][0] == \
        "lnn_conv_igemm_mma<lnn_bf16, 16, 128>"


class FakeCupy:
    """Enough of CuPy for ConvKernels' host side on a machine without it: arrays are NumPy's, a RawModule
    records its name expressions, and a launch records the kernel it asked for (which must be one of them)."""

    def __init__(self, capability):
        import types

        self.launched = []
        self.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(compute_capability=str(capability)))
        self.asarray, self.empty = np.asarray, np.empty
        self.zeros = lambda shape, dtype: np.zeros(shape, dtype).view(DeviceLike)

    def RawModule(self, code, options, name_expressions):
        fake, names = self, set(name_expressions)

        class Module:
            def get_function(self, name):
                assert name in names, f"{name} is not among the module's name expressions"
                return lambda grid, block, args: fake.launched.append(name)
        return Module()


class DeviceLike(np.ndarray):
    """A NumPy array with CuPy's `.data.ptr` (the launches read where arrays start)."""

    @property
    def data(self):
        import types

        return types.SimpleNamespace(ptr=self.ctypes.data)


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
@pytest.mark.parametrize("capability", [80, 75])
@pytest.mark.parametrize("kernel, padding, channels, size", [((3, 3), (1, 1), 16, 16), ((3, 3), (1, 1), 16, 8),
                                                         ((3, 3), (1, 1), 16, 4),
                                                         ((3, 3), (1, 1), 4, 16), ((1, 1), (0, 0), 16, 16)])
def test_16_bit_layers_launch_their_own_instances(monkeypatch, kernel, padding, channels, size, capability, precision):
    """Every launch of a bfloat16 (float16) ConvKernels names a lnn_bf16 (unsigned short) instance its module
    holds: the tensor-core halo kernels for 3x3 (their weight gradient from 16 channels on maps wider than 4),
    the gather ones for 1x1, CUDA-core below 8.0 (where the trainer refuses bfloat16, but the kernels exist)."""
    dtype = pytest.importorskip("ml_dtypes").bfloat16 if precision == "bfloat16" else np.float16
    kind = conv_gemm.c_type(dtype)
    fake = FakeCupy(capability)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(conv_gemm, "_MODULES", {})
    attrs = attrs_of(kernel, padding, True)
    kernels = conv_gemm.ConvKernels(attrs, (channels, size, size), (8, size, size), dtype=dtype)
    x, dy = fake.zeros((2, channels, size, size), dtype), fake.zeros((2, 8, size, size), dtype)
    weight, bias = fake.zeros((8, channels) + kernel, dtype), fake.zeros(8, dtype)
    kernels.forward(x, weight, bias, dy)
    kernels.weight_gradient(dy, x, weight, bias, accumulate=True)
    kernels.input_gradient(dy, weight, x)
    assert fake.launched and all(name.startswith(f"{name.split('<')[0]}<{kind}") for name in fake.launched)
    families = {name.split("<")[0] for name in fake.launched}
    tensor_cores, halo = capability >= 80, capability >= 80 and kernel == (3, 3)
    assert ("lnn_conv3x3_mma" in families) == halo and ("lnn_conv3x3_arrange" in families) == halo
    assert ("lnn_conv3x3_wgrad_mma" in families) == (halo and channels >= 16 and size > 4)
    assert ("lnn_conv_igemm_mma" in families) == (tensor_cores and not halo)
    assert ("lnn_conv_igemm" in families) == (not tensor_cores)
    assert ("lnn_conv_direct" in families) == (channels <= conv_gemm.DIRECT_MAX_CHANNELS)


@pytest.mark.parametrize("capability", [90, 75])
@pytest.mark.parametrize("channels, size, halo_wgrad", [(16, 16, True), (33, 7, True), (16, 4, False), (8, 16, False),
                                                       (3, 16, False)])
def test_float32_3x3_layers_run_the_cuda_core_halo_kernels(monkeypatch, capability, channels, size, halo_wgrad):
    """A float32 3x3 layer runs on halo tiles on any card: forward (but for the direct kernel's few input
    channels) and input gradient as lnn_conv3x3_cuda_cores on the transposed weights, the weight gradient as
    lnn_conv3x3_wgrad_cuda_cores from 16 input channels on outputs wider than 4 (else the gather kernel); no
    window tables or flipped weights for the input gradient."""
    fake = FakeCupy(capability)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(conv_gemm, "_MODULES", {})
    kernels = conv_gemm.ConvKernels(attrs_of((3, 3), (1, 1), True), (channels, size, size), (40, size, size))
    x, dy = fake.zeros((2, channels, size, size), np.float32), fake.zeros((2, 40, size, size), np.float32)
    weight, bias = fake.zeros((40, channels, 3, 3), np.float32), fake.zeros(40, np.float32)
    kernels.forward(x, weight, bias, dy)
    kernels.weight_gradient(dy, x, weight, bias, accumulate=False)
    kernels.input_gradient(dy, weight, x)
    families = [name.split("<")[0] for name in fake.launched]
    forward = (["lnn_conv_direct"] if channels <= conv_gemm.DIRECT_MAX_CHANNELS
               else ["lnn_conv3x3_transpose", "lnn_conv3x3_cuda_cores"])
    assert families == forward + ["lnn_conv3x3_wgrad_cuda_cores" if halo_wgrad else "lnn_conv_wgrad",
                                  "lnn_conv_wgrad_reduce", "lnn_conv3x3_transpose", "lnn_conv3x3_cuda_cores"]
    assert kernels.halo_wgrad == halo_wgrad and kernels.cuda_core_halo and not kernels.halo
    assert not hasattr(kernels, "flipped") and not hasattr(kernels, "table_dx")
    if halo_wgrad:
        assert fake.launched[len(forward)] == conv_gemm.cuda_core_wgrad_name(64, conv_gemm.halo_tile(size),
                                                                             4 if size % 4 == 0 else 1)
    for bm, (channel_block, groups) in conv_gemm.CUDA_CORE_WGRAD_BLOCKS.items():
        assert bm // 4 * channel_block * groups == conv_gemm.THREADS


# --------------------------------------------------------------------------- on the GPU

@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"k{c[5][0]}{c[5][1]}p{c[6][0]}")
def test_forward_and_backward_match_float64_numpy(case):
    cupy = gpu_cupy()
    n, c, h, w, o, kernel, padding, bias = case
    rng = np.random.default_rng(sum(case[:5]))
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    weight = (rng.standard_normal((o, c) + kernel) / np.sqrt(c * kernel[0] * kernel[1])).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32) if bias else None
    y_ref, backward = reference_conv(x.astype(np.float64), weight.astype(np.float64), b, padding)
    dy = rng.standard_normal(y_ref.shape).astype(np.float32)
    dweight_ref, dbias_ref, dx_ref = backward(dy.astype(np.float64))

    kernels = conv_gemm.ConvKernels(attrs_of(kernel, padding, bias), (c, h, w), y_ref.shape[1:])
    gx, gw, gdy = cupy.asarray(x), cupy.asarray(weight), cupy.asarray(dy)
    gb = None if b is None else cupy.asarray(b)
    y = cupy.full(y_ref.shape, np.nan, np.float32)
    kernels.forward(gx, gw, gb, y)
    np.testing.assert_allclose(y.get(), y_ref, rtol=1e-4, atol=1e-4)
    relu_y = cupy.full(y_ref.shape, np.nan, np.float32)
    kernels.forward(gx, gw, gb, relu_y, relu=True)
    np.testing.assert_allclose(relu_y.get(), np.maximum(y_ref, 0), rtol=1e-4, atol=1e-4)

    dweight = cupy.full(weight.shape, np.nan, np.float32)
    dbias = None if b is None else cupy.full(o, np.nan, np.float32)
    dx = cupy.full(x.shape, np.nan, np.float32)
    kernels.weight_gradient(gdy, gx, dweight, dbias, accumulate=False)
    kernels.input_gradient(gdy, gw, dx)
    scale = np.sqrt(n * y_ref.shape[2] * y_ref.shape[3])
    np.testing.assert_allclose(dweight.get(), dweight_ref, rtol=1e-4, atol=1e-4 * scale)
    np.testing.assert_allclose(dx.get(), dx_ref, rtol=1e-4, atol=1e-4)
    if b is not None:
        np.testing.assert_allclose(dbias.get(), dbias_ref, rtol=1e-4, atol=1e-4 * scale)

    kernels.weight_gradient(gdy, gx, dweight, dbias, accumulate=True)       # adds
    np.testing.assert_allclose(dweight.get(), 2 * dweight_ref, rtol=1e-4, atol=2e-4 * scale)
    if b is not None:
        np.testing.assert_allclose(dbias.get(), 2 * dbias_ref, rtol=1e-4, atol=2e-4 * scale)


def test_smaller_batches_reuse_the_layer_kernels():
    cupy = gpu_cupy()
    rng = np.random.default_rng(3)
    kernels = conv_gemm.ConvKernels(attrs_of((3, 3), (1, 1), True), (4, 8, 8), (6, 8, 8))
    weight = rng.standard_normal((6, 4, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(6).astype(np.float32)
    for n in (64, 5, 1):
        x = rng.standard_normal((n, 4, 8, 8)).astype(np.float32)
        y_ref, backward = reference_conv(x.astype(np.float64), weight.astype(np.float64), bias, (1, 1))
        y = cupy.empty(y_ref.shape, np.float32)
        kernels.forward(cupy.asarray(x), cupy.asarray(weight), cupy.asarray(bias), y)
        np.testing.assert_allclose(y.get(), y_ref, rtol=1e-4, atol=1e-4)
        dy = rng.standard_normal(y_ref.shape).astype(np.float32)
        dweight, dbias = cupy.zeros((6, 4, 3, 3), np.float32), cupy.zeros(6, np.float32)
        kernels.weight_gradient(cupy.asarray(dy), cupy.asarray(x), dweight, dbias, accumulate=False)
        dweight_ref, dbias_ref, _ = backward(dy.astype(np.float64))
        np.testing.assert_allclose(dweight.get(), dweight_ref, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(dbias.get(), dbias_ref, rtol=1e-4, atol=1e-3)


def view_into_larger_buffer(cupy, values, offset: int):
    """A device copy of `values` that starts `offset` elements into a larger buffer of their dtype."""
    buffer = cupy.zeros(values.size + 8, values.dtype)
    view = buffer[offset:offset + values.size].reshape(values.shape)
    view[...] = cupy.asarray(values)
    return view


@pytest.mark.parametrize("offset, vec", [(0, 8), (4, 4), (1, 1)])
def test_halo_kernels_on_arrays_that_start_anywhere(offset, vec):
    """x, dy, y and dx as views `offset` elements into larger buffers (a micro-batch of a batch): the staging
    loads narrow to what the start allows, and the float16 results are the same."""
    cupy = gpu_cupy()
    rng = np.random.default_rng(offset)
    shape_x, shape_y = (3, 16, 16, 16), (3, 32, 16, 16)
    kernels = conv_gemm.ConvKernels(attrs_of((3, 3), (1, 1), True), shape_x[1:], shape_y[1:], dtype=np.float16)
    if not kernels.halo_wgrad:
        pytest.skip("no tensor cores: the halo kernels do not run")

    def placed(values):
        return view_into_larger_buffer(cupy, values, offset)

    x = rng.standard_normal(shape_x).astype(np.float16)
    weight = (rng.standard_normal((32, 16, 3, 3)) / 12).astype(np.float16)
    dy = rng.standard_normal(shape_y).astype(np.float16)
    gx, gdy, y, dx = placed(x), placed(dy), placed(np.zeros(shape_y, np.float16)), placed(np.zeros(shape_x, np.float16))
    assert conv_gemm.halo_vector(conv_gemm.halo_tile(16), 16, *(conv_gemm.element_start(a) for a in (gdy, gx))) == vec
    y_ref, backward = reference_conv(x.astype(np.float64), weight.astype(np.float64), None, (1, 1))
    dweight_ref, dbias_ref, dx_ref = backward(dy.astype(np.float64))
    dweight, dbias = cupy.empty((32, 16, 3, 3), np.float16), cupy.empty(32, np.float16)
    gw = cupy.asarray(weight)
    kernels.forward(gx, gw, None, y)
    kernels.weight_gradient(gdy, gx, dweight, dbias, accumulate=False)
    kernels.input_gradient(gdy, gw, dx)
    scale = np.sqrt(3 * 16 * 16)
    np.testing.assert_allclose(y.get().astype(np.float64), y_ref, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(dx.get().astype(np.float64), dx_ref, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(dweight.get().astype(np.float64), dweight_ref, rtol=2e-3, atol=2e-3 * scale)
    np.testing.assert_allclose(dbias.get().astype(np.float64), dbias_ref, rtol=2e-3, atol=2e-3 * scale)


@pytest.mark.parametrize("offset, vec", [(0, 4), (2, 1), (1, 1)])
def test_float32_halo_weight_gradient_on_arrays_that_start_anywhere(offset, vec):
    """lnn_conv3x3_wgrad_cuda_cores reads dy by float4 only where dy's start and rows allow it; the weight
    gradient is the same from views `offset` elements into larger buffers."""
    cupy = gpu_cupy()
    rng = np.random.default_rng(10 + offset)
    shape_x, shape_y = (3, 20, 12, 16), (3, 24, 12, 16)
    kernels = conv_gemm.ConvKernels(attrs_of((3, 3), (1, 1), True), shape_x[1:], shape_y[1:])
    assert kernels.halo_wgrad

    def placed(values):
        return view_into_larger_buffer(cupy, values, offset)

    x, dy = rng.standard_normal(shape_x).astype(np.float32), rng.standard_normal(shape_y).astype(np.float32)
    weight = rng.standard_normal((24, 20, 3, 3)).astype(np.float32)
    gx, gdy = placed(x), placed(dy)
    assert conv_gemm.halo_vector(kernels.wgrad_tile, 16, conv_gemm.element_start(gdy),
                                 choices=conv_gemm.CUDA_CORE_VECTORS) == vec
    _, backward = reference_conv(x.astype(np.float64), weight.astype(np.float64), None, (1, 1))
    dweight_ref, dbias_ref, _ = backward(dy.astype(np.float64))
    dweight, dbias = cupy.empty((24, 20, 3, 3), np.float32), cupy.empty(24, np.float32)
    kernels.weight_gradient(gdy, gx, dweight, dbias, accumulate=False)
    scale = np.sqrt(3 * 12 * 16)
    np.testing.assert_allclose(dweight.get(), dweight_ref, rtol=1e-4, atol=1e-4 * scale)
    np.testing.assert_allclose(dbias.get(), dbias_ref, rtol=1e-4, atol=1e-4 * scale)


# --------------------------------------------------------------------------- Winograd F(2x2, 3x3)

WINOGRAD_CASES = [      # (batch, in channels, height, width, out channels, padding)
    (2, 3, 9, 11, 5, (1, 1)),
    (3, 16, 12, 12, 32, (1, 1)),
    (2, 33, 7, 9, 20, (0, 0)),
    (1, 7, 10, 8, 13, (2, 2)),
    (4, 5, 6, 7, 6, (0, 2)),
]


def test_winograd_rule_and_buffer_sizes():
    assert winograd.supported(attrs_of((3, 3), (1, 1), True))
    assert winograd.supported(attrs_of((3, 3), (2, 0), True))
    assert not winograd.supported(attrs_of((5, 5), (2, 2), True))
    assert not winograd.supported(dict(attrs_of((3, 3), (1, 1), True), stride=(2, 2)))
    auto, forced = dict(attrs_of((3, 3), (1, 1), True), algorithm="auto"), dict(attrs_of((3, 3), (1, 1), True),
                                                                                 algorithm="winograd")
    assert winograd.chosen(auto, 32, 64) and not winograd.chosen(auto, 16, 32) and not winograd.chosen(auto, 64, 16)
    assert winograd.chosen(forced, 3, 16) and not winograd.chosen(dict(auto, algorithm="im2col"), 64, 64)
    # the weight gradient too where "winograd" asks, or its products' work per transformed value reaches 32
    assert winograd.weight_gradient_chosen(forced, 3, 16) and winograd.weight_gradient_chosen(auto, 48, 96)
    assert not winograd.weight_gradient_chosen(auto, 32, 64) and not winograd.weight_gradient_chosen(auto, 16, 512)
    assert winograd.workspace_shapes(3, 8, (9, 12), (7, 10), 2) == ((16 * 3 * 2 * 4 * 5,), (16 * 8 * 2 * 4 * 5,))
    # a large batch goes through in chunks whose V and M take about the conv's x and y for the batch
    v, m = winograd.workspace_shapes(64, 128, (16, 16), (16, 16), 256)
    activations = 4 * 256 * (64 + 128) * 16 * 16
    assert 4 * (v[0] + m[0]) <= activations < 4 * (v[0] + m[0]) * 2
    # the weight gradient cuts a chunk's tiles into pieces until its products make enough GEMM blocks
    assert winograd.splits(64, 128, 50176) == winograd.GEMM_BLOCKS // (16 * 2 * 1)       # leaf_cnn224, 56x56
    assert winograd.splits(256, 512, 10 ** 6) == 1 and winograd.splits(64, 128, 600) == 1  # enough blocks; few tiles
    images, pieces, padded = winograd.weight_gradient_layout(3, 8, (9, 12), (7, 10), 3)
    assert (images, pieces, padded) == (3, 1, 3 * 4 * 5)
    for case in [(64, 128, (56, 56), (56, 56), 256), (3, 8, (9, 12), (7, 10), 2), (48, 96, (32, 32), (32, 32), 7)]:
        o_side, c_side, products = winograd.backward_workspace_shapes(*case)
        images, pieces, padded = winograd.weight_gradient_layout(*case)
        flipped_v, flipped_m = winograd.workspace_shapes(case[1], case[0], case[3], case[2], case[4])
        count = images * np.prod(winograd.tiles(*case[3]))
        assert padded % pieces == 0 and count <= padded < count + pieces
        assert o_side[0] >= max(flipped_v[0], 16 * case[1] * padded)
        assert c_side[0] >= max(flipped_m[0], 16 * case[0] * padded)
        assert products == (16 * pieces * case[0] * case[1],)


def test_winograd_layers_plan_their_buffers_and_only_compute_them_when_needed():
    model = parse_model({"input_shape": [3, 16, 16], "layers": [
        {"type": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1, "algorithm": "winograd"},
        {"type": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 1, "algorithm": "winograd"},
        {"type": "global_avg_pool"}],
        "loss": "cross_entropy", "optimizer": {"type": "sgd", "lr": 0.1}})
    plan = Plan(model, 8, implicit_conv=True)
    # the first layer computes no dx, but its weight gradient uses the backward's buffers too
    assert {f"ws:{i}:winograd_{name}" for i in (0, 1) for name in ("v", "m", "v_b", "m_b", "products")} <= set(
        plan.buffers)
    assert not any("wgrad_partial" in name for name in plan.buffers)    # no implicit-GEMM weight gradient
    # "auto" on 32 -> 64 -> 32 channels: Winograd's forward and input gradient, the halo kernel's weight gradient
    model = parse_model({"input_shape": [32, 8, 8], "layers": [
        {"type": "conv2d", "out_channels": 64, "kernel_size": 3, "padding": 1},
        {"type": "conv2d", "out_channels": 32, "kernel_size": 3, "padding": 1}, {"type": "global_avg_pool"}],
        "loss": "cross_entropy", "optimizer": {"type": "sgd", "lr": 0.1}})
    plan = Plan(model, 8, implicit_conv=True)
    assert {"ws:0:winograd_v", "ws:0:wgrad_partial", "ws:1:winograd_v_b", "ws:1:winograd_m_b"} <= set(plan.buffers)
    assert not any("winograd_products" in name for name in plan.buffers)
    assert "ws:0:winograd_v_b" not in plan.buffers                      # the first layer computes no dx


# (bytes, tiles): the default chunks and pieces; chunks of one image, each cut into pieces of 4 tiles (the last padded)
@pytest.mark.parametrize("chunk_bytes, split_tiles", [(winograd.MIN_CHUNK_BYTES, winograd.MIN_SPLIT_TILES), (1, 4)],
                         ids=["default", "small"])
@pytest.mark.parametrize("case", WINOGRAD_CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"p{c[5][0]}{c[5][1]}")
def test_winograd_forward_and_gradients_match_float64_numpy(case, chunk_bytes, split_tiles, monkeypatch):
    cupy = gpu_cupy()
    monkeypatch.setattr(winograd, "MIN_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(winograd, "MIN_SPLIT_TILES", split_tiles)
    n, c, h, w, o, padding = case
    rng = np.random.default_rng(sum(case[:5]))
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    weight = (rng.standard_normal((o, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
    bias = rng.standard_normal(o).astype(np.float32)
    y_ref, backward = reference_conv(x.astype(np.float64), weight.astype(np.float64), bias, padding)
    dy = rng.standard_normal(y_ref.shape).astype(np.float32)
    dweight_ref, dbias_ref, dx_ref = backward(dy.astype(np.float64))

    attrs = attrs_of((3, 3), padding, True)
    kernels = winograd.WinogradKernels(attrs, (c, h, w), y_ref.shape[1:])
    v_shape, m_shape = winograd.workspace_shapes(c, o, (h, w), y_ref.shape[2:], n)
    y = cupy.full(y_ref.shape, np.nan, np.float32)
    kernels.forward(cupy.asarray(x), cupy.asarray(weight), cupy.asarray(bias), y, cupy.empty(v_shape, np.float32),
                    cupy.empty(m_shape, np.float32), relu=True)
    np.testing.assert_allclose(y.get(), np.maximum(y_ref, 0), rtol=1e-4, atol=1e-4)

    # the backward's buffers: the weight gradient (written, then added) and the input gradient after it
    v_b, m_b, products = (cupy.full(shape, np.nan, np.float32)
                          for shape in winograd.backward_workspace_shapes(c, o, (h, w), y_ref.shape[2:], n))
    dweight, dbias = cupy.full(weight.shape, np.nan, np.float32), cupy.full(o, np.nan, np.float32)
    scale = np.sqrt(n * y_ref.shape[2] * y_ref.shape[3])            # dweight and dbias sum this many products
    for accumulate, times in ((False, 1), (True, 2)):
        kernels.weight_gradient(cupy.asarray(dy), cupy.asarray(x), dweight, dbias, accumulate, v_b, m_b, products)
        np.testing.assert_allclose(dweight.get(), times * dweight_ref, rtol=1e-4, atol=1e-5 * scale)
        np.testing.assert_allclose(dbias.get(), times * dbias_ref, rtol=1e-4, atol=1e-5 * scale)
    dx = cupy.full(x.shape, np.nan, np.float32)
    kernels.input_gradient(cupy.asarray(dy), cupy.asarray(weight), dx, v_b, m_b)
    np.testing.assert_allclose(dx.get(), dx_ref, rtol=1e-4, atol=1e-4)


# amp's 16-bit types and their tolerance: 4x the type's unit roundoff (float16 2^-11, bfloat16 2^-9)
HALF_PRECISIONS = [pytest.param("float16", 2e-3, id="fp16"), pytest.param("bfloat16", 8e-3, id="bf16")]


@pytest.mark.parametrize("precision, tol", HALF_PRECISIONS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"k{c[5][0]}{c[5][1]}p{c[6][0]}")
def test_16_bit_kernels_match_float64_numpy_on_16_bit_inputs(case, precision, tol):
    """amp: float16 or bfloat16 in and out, float32 accumulation (on tensor cores where the card has them: every
    tile size, both weight-gradient widths and the 3x3 halo kernels, with under and over 16 input channels, are
    among the cases); against float64 on the same (rounded) inputs, the error is the type's output rounding."""
    cupy = gpu_cupy()
    dtype = np.float16 if precision == "float16" else pytest.importorskip("ml_dtypes").bfloat16
    n, c, h, w, o, kernel, padding, bias = case
    rng = np.random.default_rng(sum(case[:5]) + 1)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    weight = (rng.standard_normal((o, c) + kernel) / np.sqrt(c * kernel[0] * kernel[1])).astype(dtype)
    b = rng.standard_normal(o).astype(dtype) if bias else None
    y_ref, backward = reference_conv(x.astype(np.float64), weight.astype(np.float64),
                                     None if b is None else b.astype(np.float64), padding)
    dy = rng.standard_normal(y_ref.shape).astype(dtype)
    dweight_ref, dbias_ref, dx_ref = backward(dy.astype(np.float64))
    kernels = conv_gemm.ConvKernels(attrs_of(kernel, padding, bias), (c, h, w), y_ref.shape[1:], dtype=dtype)
    assert kernels.tensor_cores == (int(cupy.cuda.Device().compute_capability) >= 80)
    assert kernels.halo == (kernels.tensor_cores and kernel == (3, 3))
    gx, gw, gdy = cupy.asarray(x), cupy.asarray(weight), cupy.asarray(dy)
    y = cupy.empty(y_ref.shape, dtype)
    kernels.forward(gx, gw, None if b is None else cupy.asarray(b), y)
    np.testing.assert_allclose(y.get().astype(np.float64), y_ref, rtol=tol, atol=tol)
    dweight = cupy.empty(weight.shape, dtype)
    dbias = None if b is None else cupy.empty(o, dtype)
    dx = cupy.empty(x.shape, dtype)
    kernels.weight_gradient(gdy, gx, dweight, dbias, accumulate=False)
    kernels.input_gradient(gdy, gw, dx)
    scale = np.sqrt(n * y_ref.shape[2] * y_ref.shape[3])
    np.testing.assert_allclose(dweight.get().astype(np.float64), dweight_ref, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(dx.get().astype(np.float64), dx_ref, rtol=tol, atol=tol)
    if b is not None:
        np.testing.assert_allclose(dbias.get().astype(np.float64), dbias_ref, rtol=tol, atol=tol * scale)
