"""The CPU backend's 3x3 paths against float64 convolution: Winograd F(4x4, 3x3) (runtime/cpu/winograd.py)
and the direct kernel for few input channels (runtime/cpu/conv_direct.py).

Error bound (float32 kernels vs the float64 sum): |y - y64| <= ERROR_BOUND * (|w| * |x|), the conv of
the absolute values, elementwise. Measured on these cases: Winograd up to 2.6e-6 of it (padding 2, where
the border sums are small), the direct kernel 1.2e-7, columns + GEMM 2.4e-7.
"""

import numpy as np
import pytest

from lnn.formats.model import parse_model
from lnn.runtime.cpu.jit import sgemm_address

ERROR_BOUND = 1e-5

# (batch, in channels, height, width, out channels, padding): odd sizes, outputs narrower than a
# tile, many channels, padding 0-2, 4 tiles with many channels (skinny_products)
CASES = [(1, 16, 9, 11, 7, 1), (2, 67, 13, 6, 33, 0), (1, 20, 5, 3, 5, 1), (3, 24, 17, 19, 40, 2),
         (1, 130, 8, 8, 9, 1), (1, 16, 4, 21, 12, 0)]
SKINNY_CASE = (1, 128, 8, 8, 260, 1)        # 4 tiles: skinny_products, also when cut in 2 by channels
CASES.append(SKINNY_CASE)


def conv64(x, weight, padding):
    """float64 reference: y[n, o, y, x] = sum over c, ky, kx of weight[o, c, ky, kx] * x_padded[n, c, y + ky, x + kx]."""
    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))     # [N, C, OH, OW, 3, 3]
    return np.einsum("ncyxij,ocij->noyx", windows, weight.astype(np.float64))


def one_conv(x, weight, padding, algorithm):
    from lnn.runtime.cpu import BACKEND

    batch, channels, height, width = x.shape
    model = parse_model({"input_shape": [channels, height, width], "layers": [
        {"type": "conv2d", "out_channels": weight.shape[0], "kernel_size": 3, "padding": padding, "bias": False,
         "algorithm": algorithm}]})
    backend = BACKEND(model, {model.nodes[0].param_key("weight"): weight})
    return backend, backend.run(x)


def check_bound(got, x, weight, padding):
    error = np.abs(got - conv64(x, weight, padding))
    scale = conv64(np.abs(x), np.abs(weight), padding)
    assert (error <= ERROR_BOUND * scale + 1e-30).all(), float((error / scale).max())


def test_transforms_are_exact_in_float64():
    from lnn.runtime.cpu.winograd import POINTS, transforms

    rng = np.random.default_rng(0)
    for points in (POINTS, (0, 1, -1, 2, -2)):
        at, g, bt = transforms(points)
        assert at.shape == (4, 6) and g.shape == (6, 3) and bt.shape == (6, 6)
        for _ in range(5):
            kernel, patch = rng.standard_normal((3, 3)), rng.standard_normal((6, 6))
            winograd = at @ ((g @ kernel @ g.T) * (bt @ patch @ bt.T)) @ at.T
            direct = np.array([[(kernel * patch[y:y + 3, x:x + 3]).sum() for x in range(4)] for y in range(4)])
            np.testing.assert_allclose(winograd, direct, rtol=0, atol=1e-12)


@pytest.mark.parametrize("width", [9, 37])       # 2 tiles a row: tile by tile; 9: gathered, the band's tiles at once
def test_kernels_compute_the_matrices(width):
    """Full tiles and tiles past the image's bottom and right edges through winograd_input; random M
    through winograd_output."""
    from lnn.runtime.cpu.winograd import (AT, BT, GATHERED_MIN_TILES_W, input_work_shape, winograd_input,
                                          winograd_output)

    rng = np.random.default_rng(1)
    tiles_w = (width + 1) // 4
    assert (tiles_w >= GATHERED_MIN_TILES_W) == (width > 9)
    image = rng.standard_normal((2, 9, width)).astype(np.float32)        # tile rows 0-5 and 4-9 (9 is past)
    v = np.zeros((36, 2, 2 * tiles_w), np.float32)
    winograd_input(image, 0, 2, 0, 2, 0, np.zeros(input_work_shape(tiles_w, 2), np.float32), v)
    padded = np.pad(image.astype(np.float64), ((0, 0), (0, 1), (0, 4 * tiles_w + 2 - width)))
    for c in range(2):
        for t in range(2 * tiles_w):
            y, x = 4 * (t // tiles_w), 4 * (t % tiles_w)
            expected = BT @ padded[c, y:y + 6, x:x + 6] @ BT.T
            np.testing.assert_allclose(v[:, c, t], expected.ravel(), rtol=0, atol=1e-5 * np.abs(expected).max())
    m = rng.standard_normal((36, 3, 2)).astype(np.float32)
    acc = np.zeros((3, 4 * 7), np.float32)
    winograd_output(m, 0, 3, 1, 2, 0, 4, 7, 0, 4, np.zeros((40, 2), np.float32), acc)
    for o in range(3):
        tiles = [AT @ m[:, o, t].astype(np.float64).reshape(6, 6) @ AT.T for t in range(2)]
        expected = np.concatenate(tiles, axis=1)[:, :7]                  # the second tile's last column is past
        np.testing.assert_allclose(acc[o].reshape(4, 7), expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_input_transform_compiled_one_vector_a_step_gives_the_same_bytes():
    """winograd_input is a @short_loops_kernel (jit.py): the loops over a tile row of 16 tiles vectorized
    instead of left to their scalar remainder, the same sums in the same order as compiled by default."""
    numba = pytest.importorskip("numba")
    from lnn.runtime.cpu import jit
    from lnn.runtime.cpu.winograd import input_work_shape, tile_count, winograd_input

    if jit.KERNELS != "jit":
        pytest.skip("the ahead-of-time kernels are compiled as plain @kernel")
    default_compile = numba.njit(nogil=True)(winograd_input.py_func)
    image = np.random.default_rng(4).standard_normal((5, 66, 66)).astype(np.float32)
    tiles_w = tile_count(64)
    outputs = []
    for function in (winograd_input, default_compile):
        v = np.full((36, 5, tiles_w * tiles_w), np.nan, np.float32)
        function(image, 0, 5, 0, tiles_w, 0, np.zeros(input_work_shape(tiles_w, tiles_w), np.float32), v)
        outputs.append(v)
    assert not np.isnan(outputs[0]).any()
    assert outputs[0].tobytes() == outputs[1].tobytes()


@pytest.mark.parametrize("products", ["blas", "small", "narrow"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "n{}c{}h{}w{}o{}p{}".format(*c))
def test_winograd_matches_float64_convolution(case, products, monkeypatch):
    """Each way of a band's 36 products: BLAS, small_products and narrow_products (on any host here; the backend
    takes them where conv2d.small_products_pay() or narrow_tiles_pay())."""
    from lnn.runtime.cpu import conv2d

    monkeypatch.setattr(conv2d, "small_products_pay", lambda: products == "small")
    monkeypatch.setattr(conv2d, "narrow_tiles_pay", lambda: products == "narrow")
    batch, channels, height, width, out_channels, padding = case
    rng = np.random.default_rng(sum(case))
    x = rng.standard_normal((batch, channels, height, width)).astype(np.float32)
    weight = (rng.standard_normal((out_channels, channels, 3, 3)) * np.sqrt(2 / (9 * channels))).astype(np.float32)
    backend, got = one_conv(x, weight, padding, "winograd")
    assert backend.layers[0].winograd
    check_bound(got, x, weight, padding)
    from lnn.runtime.cpu import winograd
    from lnn.runtime.cpu.parallel import all_steps

    kernels = [getattr(step, "func", None) for step in all_steps(backend._plan(batch, backend.threads).steps)]
    if case == SKINNY_CASE:
        assert winograd.skinny_products in kernels
    elif backend.layers[0].winograd_blocks is False:
        blas = winograd.blas_products if sgemm_address() is not None else np.matmul
        chosen = {"blas": blas, "small": winograd.small_products, "narrow": winograd.narrow_products}[products]
        assert chosen in kernels or winograd.skinny_products in kernels


@pytest.mark.parametrize("shape", [(48, 24, 256, 0, 48), (50, 7, 37, 3, 47), (13, 5, 16, 0, 13), (6, 3, 40, 1, 2),
                                   (64, 32, 95, 32, 64)], ids=lambda s: "o{}c{}t{}_{}to{}".format(*s))
def test_small_products_are_the_36_products(shape):
    """small_products against np.matmul: output channels o_first..o_end-1 of U (not a multiple of its 6-row tiles),
    tiles not a multiple of 16 or 32; nothing written past its rows or past the tiles rounded up to 16."""
    from lnn.runtime.cpu.winograd import small_products

    check_36_products(small_products, lambda u: u, shape)


@pytest.mark.parametrize("shape", [(128, 64, 16, 0, 128), (50, 7, 13, 16, 47), (13, 5, 9, 0, 13), (24, 3, 48, 8, 17),
                                   (32, 16, 256, 0, 32), (64, 32, 95, 32, 64)],
                         ids=lambda s: "o{}c{}t{}_{}to{}".format(*s))
def test_block_products_are_the_36_products(shape):
    """block_products, U in blocks of 8 rows (weight_blocks), as small_products: o_first a multiple of 8, o_end
    not always."""
    from lnn.runtime.cpu.winograd import block_products, weight_blocks

    u = np.arange(36 * 13 * 3, dtype=np.float32).reshape(36, 13, 3)
    blocks = weight_blocks(u)
    assert blocks.shape == (36, 2, 3, 8) and blocks[5, 1, 2, 3] == u[5, 11, 2] and (blocks[:, 1, :, 5:] == 0).all()
    check_36_products(block_products, weight_blocks, shape)


def test_avx512_hosts_compile_512_bit_vectors():
    """Where the wide tiles run (jit.WIDE_VECTORS), the kernels are compiled for 512-bit vectors: LLVM's tuning of
    Intel's AVX-512 cores prefers 256 bits, which halved every vector and made the models 1.5-2.5x slower."""
    import numba

    from lnn.runtime.cpu import jit

    if not jit.WIDE_VECTORS:
        pytest.skip("this host has no AVX-512")

    @numba.njit(fastmath=True)
    def add_twice(x, y):
        for i in range(x.shape[0]):
            y[i] += 2.0 * x[i]

    add_twice(np.ones(256, np.float32), np.zeros(256, np.float32))
    assembly = "".join(add_twice.inspect_asm().values())
    assert "zmm" in assembly, "the loop was vectorized without 512-bit registers"


@pytest.mark.parametrize("shape", [(48, 24, 256, 0, 48), (50, 7, 37, 3, 47), (13, 5, 16, 0, 13), (6, 3, 40, 1, 2),
                                   (64, 32, 95, 32, 64), (32, 16, 9, 0, 32), (7, 4, 24, 0, 7)],
                         ids=lambda s: "o{}c{}t{}_{}to{}".format(*s))
def test_narrow_products_are_the_36_products(shape):
    """narrow_products (6 x 16 tiles of 8-lane vectors) as small_products: tiles a multiple of 16, of 8 and of
    neither, rows not a multiple of 6."""
    from lnn.runtime.cpu.winograd import narrow_products

    check_36_products(narrow_products, lambda u: u, shape)


@pytest.mark.parametrize("shape", [(48, 24, 256, 0, 48), (50, 7, 37, 3, 47), (13, 5, 9, 0, 13), (64, 32, 95, 32, 64)],
                         ids=lambda s: "o{}c{}t{}_{}to{}".format(*s))
def test_blas_products_are_np_matmuls_bytes(shape):
    """blas_products (NumPy's BLAS called from compiled code, where it has an ILP64 cblas_sgemm) as the 36 products,
    and the same bytes as np.matmul of the same blocks (one sgemm each)."""
    from lnn.runtime.cpu.winograd import blas_products, blas_products_sgemm

    if sgemm_address() is None:
        pytest.skip("NumPy's BLAS here has no ILP64 cblas_sgemm (or no JIT)")
    sgemm = blas_products_sgemm()
    made = []

    def products(u, o_first, o_end, v, channels, tiles, m):
        blas_products(u, o_first, o_end, v, channels, tiles, m, sgemm)
        made.append((u, o_first, o_end, v, channels, tiles, m))

    check_36_products(products, lambda u: u, shape)
    u, o_first, o_end, v, channels, tiles, m = made[0]
    assert np.array_equal(m[:, :o_end - o_first, :tiles], np.matmul(u[:, o_first:o_end], v[:, :channels, :tiles]))


def check_36_products(products, layout, shape):
    """products(layout(U), o_first, o_end, V, channels, tiles, M) against np.matmul in float64, and nothing of M
    written past its rows or past the tiles rounded up to 16."""
    from lnn.runtime.cpu.conv2d import Conv2dLayer

    out_channels, channels, tiles, o_first, o_end = shape
    stride = Conv2dLayer._tile_stride(tiles)
    rng = np.random.default_rng(sum(shape))
    u = rng.standard_normal((36, out_channels, channels)).astype(np.float32)
    v = np.zeros((36, channels + 1, stride), np.float32)
    v[:, :channels, :tiles] = rng.standard_normal((36, channels, tiles))
    m = np.full((36, o_end - o_first + 1, stride), 7.0, np.float32)
    products(layout(u), o_first, o_end, v, channels, tiles, m)
    expected = np.matmul(u[:, o_first:o_end].astype(np.float64), v[:, :channels, :tiles].astype(np.float64))
    np.testing.assert_allclose(m[:, :o_end - o_first, :tiles], expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    columns = -(-tiles // 16) * 16
    assert (m[:, o_end - o_first:] == 7).all() and (m[:, :, columns:] == 7).all()


@pytest.mark.parametrize("size", [(16, 16), (12, 13), (9, 20), (30, 37)])
def test_winograd_convs_run_block_products(monkeypatch, size):
    """Where small_products pays, a Winograd conv of at least WINOGRAD_MIN_TILES tiles an image holds U in blocks
    and runs block_products: one image, a batch whose band holds several images, and one image split over 2
    threads by output channels."""
    from lnn.runtime.cpu import BACKEND, conv2d
    from lnn.runtime.cpu.parallel import all_steps
    from lnn.runtime.cpu.winograd import block_products

    monkeypatch.setattr(conv2d, "small_products_pay", lambda: True)
    rng = np.random.default_rng(sum(size))
    x = rng.standard_normal((5, 24, *size)).astype(np.float32)
    weight = (rng.standard_normal((40, 24, 3, 3)) * np.sqrt(2 / (9 * 24))).astype(np.float32)
    model = parse_model({"input_shape": [24, *size], "layers": [
        {"type": "conv2d", "out_channels": 40, "kernel_size": 3, "padding": 1, "bias": False}]})
    backend = BACKEND(model, {model.nodes[0].param_key("weight"): weight}, threads=2)
    backend.task_flops = 0                                   # one image's conv split by output channels
    layer = backend.layers[0]
    assert layer.winograd_blocks and layer.winograd_weight.shape == (36, 5, 24, 8)
    for batch in (1, 5):
        steps = all_steps(backend._plan(batch, backend.threads).steps)
        assert block_products in [getattr(step, "func", None) for step in steps]
        check_bound(backend.run(x[:batch]), x[:batch], weight, 1)


@pytest.mark.parametrize("products", ["blas", "small", "narrow"])
def test_skinny_convs_cut_by_channels_share_one_transposed_v(products, monkeypatch):
    """A conv of 4 tiles an image cut by output channels over 2 and 3 threads (on each host's way of the other
    products): each task of input channels makes V of its channels and writes their columns of one shared V^T,
    which every product task's skinny_products reads without a copy of its own; the same bytes as one thread,
    one image and a batch of two."""
    from lnn.runtime.cpu import BACKEND, conv2d
    from lnn.runtime.cpu.parallel import Parallel
    from lnn.runtime.cpu.winograd import skinny_products, winograd_input

    monkeypatch.setattr(conv2d, "small_products_pay", lambda: products == "small")
    monkeypatch.setattr(conv2d, "narrow_tiles_pay", lambda: products == "narrow")

    batch, channels, height, width, out_channels, padding = SKINNY_CASE
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, channels, height, width)).astype(np.float32)
    weight = (rng.standard_normal((out_channels, channels, 3, 3)) * np.sqrt(2 / (9 * channels))).astype(np.float32)
    _, alone = one_conv(x[:1], weight, padding, "winograd")
    _, pair = one_conv(x, weight, padding, "winograd")
    model = parse_model({"input_shape": [channels, height, width], "layers": [
        {"type": "conv2d", "out_channels": out_channels, "kernel_size": 3, "padding": padding, "bias": False}]})
    for threads in (2, 3):
        backend = BACKEND(model, {model.nodes[0].param_key("weight"): weight}, threads=threads)
        backend.task_flops = 0                                   # one image's conv split by output channels
        for images, expected in ((1, alone), (2, pair)):
            split = [step for step in backend._plan(images, threads).steps if type(step) is Parallel]
            inputs, products = split[0], split[1]
            assert len(inputs.tasks) == threads == len(products.tasks)
            assert all([getattr(step, "func", None) for step in task][-1] is np.copyto for task in inputs.tasks)
            assert all(winograd_input in [getattr(step, "func", None) for step in task] for task in inputs.tasks)
            for task in products.tasks:
                kernels = [getattr(step, "func", None) for step in task]
                assert skinny_products in kernels and np.copyto not in kernels
                read = task[kernels.index(skinny_products)].args[3]
                assert all(np.shares_memory(read, copy[-1].args[0]) for copy in inputs.tasks)
            got = backend._plan(images, threads).run(x[:images]).copy()      # its steps one after the other
            assert got.tobytes() == expected.tobytes(), (threads, images)
            check_bound(got, x[:images], weight, padding)


def test_winograd_bands_hold_at_least_u(monkeypatch):
    """A Winograd band holds at least U's bytes (each band's products read all of U again): under a tiny
    CHUNK_BYTES, a conv whose U outweighs two images' V, M and acc computes both in one band; without that
    floor, in bands of rows."""
    from lnn.runtime.cpu import conv2d

    monkeypatch.setattr(conv2d, "CHUNK_BYTES", 1024)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 64, 8, 8)).astype(np.float32)
    weight = rng.standard_normal((128, 64, 3, 3)).astype(np.float32)      # U: 36 x 128 x 64 floats, 1.2 MB
    backend, got = one_conv(x, weight, 1, "winograd")
    assert backend.layers[0]._bands(2, 10) == [[(0, 2, 0, 8, 0, 8)]]
    check_bound(got, x, weight, 1)
    monkeypatch.setattr(conv2d, "WINOGRAD_BAND_PER_U", 0)
    assert len(backend.layers[0]._bands(2, 10)[0]) > 2


def test_winograd_in_row_bands_matches_float64(monkeypatch):
    """Bands cut between tile rows, and (as after a pool whose window is not its stride) bands whose
    first and last conv rows fall inside a tile (partial tile rows at both ends)."""
    from lnn.runtime.cpu import conv2d

    monkeypatch.setattr(conv2d, "CHUNK_BYTES", 1024)       # Winograd bands of 4 KiB
    monkeypatch.setattr(conv2d, "WINOGRAD_BAND_PER_U", 0)    # (not U's size either)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 8, 23, 10)).astype(np.float32)
    weight = rng.standard_normal((6, 8, 3, 3)).astype(np.float32)
    backend, got = one_conv(x, weight, 1, "winograd")
    bands = [band for part in backend.layers[0]._bands(2, 12) for band in part]
    assert len(bands) > 2 and all(band[4] % 4 == 0 for band in bands)
    check_bound(got, x, weight, 1)
    monkeypatch.setattr(conv2d.Conv2dLayer, "_tile_rows_align", lambda layer: 1)
    backend, got = one_conv(x, weight, 1, "winograd")
    bands = [band for part in backend.layers[0]._bands(2, 12) for band in part]
    assert any(band[4] % 4 for band in bands) and any(band[5] % 4 for band in bands)
    check_bound(got, x, weight, 1)


@pytest.mark.parametrize("shuffles", [True, False])
@pytest.mark.parametrize("tiles_w", [4, 6, 9, 16, 29, 31])
def test_gathered_input_transform_gives_the_tile_by_tile_bytes(tiles_w, shuffles, monkeypatch):
    """From GATHERED_MIN_TILES_W tiles a row, winograd_input's second step runs over the band's tiles at once
    after a gather: the same sums in the same order as tile by tile (compiled here with the threshold out of
    reach), on a band of 3 tile rows that starts at row 1 and a last tile row past the image. Widths that take
    each of the shuffled gather's 16, 8 and 4 tiles at a time and 1-3 last ones, and the last step's 8 columns
    at a time straight into v and 1-7 last ones (where winograd.SHUFFLES); without SHUFFLES (arm64, the app's
    ahead-of-time kernels) the gather and the last step go through work rows, column by column."""
    numba = pytest.importorskip("numba")
    from lnn.runtime.cpu import jit, winograd
    from lnn.runtime.cpu.winograd import input_work_shape, winograd_input

    if jit.KERNELS != "jit":
        pytest.skip("the ahead-of-time kernels are compiled once")
    image = np.random.default_rng(6).standard_normal((3, 4 * 4 + 1, 4 * tiles_w + 2)).astype(np.float32)

    def transformed(function):
        v = np.full((36, 4, 5 + 3 * tiles_w), np.nan, np.float32)
        function(image, 1, 3, 1, 3, 5, np.zeros(input_work_shape(tiles_w, 3), np.float32), v)
        return v

    if not shuffles:
        monkeypatch.setattr(winograd, "SHUFFLES", False)
    gathered = transformed(winograd_input if shuffles else numba.njit(nogil=True)(winograd_input.py_func))
    monkeypatch.setattr(winograd, "GATHERED_MIN_TILES_W", 10**6)
    tile_by_tile = transformed(numba.njit(nogil=True)(winograd_input.py_func))    # Numba freezes the globals now
    assert not np.isnan(gathered[:, 1:3, 5:]).any() and np.isnan(gathered[:, 0]).all()
    assert np.isnan(gathered[:, :, :5]).all() and np.isnan(gathered[:, 3]).all()
    assert gathered.tobytes() == tile_by_tile.tobytes()


@pytest.mark.parametrize("count", [3, 4, 13, 16, 29, 40])
def test_shuffle_intrinsics_move_the_columns_of_each_tile(count):
    """jit.gather_tile_columns and interleave_rows4 (on any host the JIT runs on) against numpy: the tiles
    done are count rounded down to 4 (16, 8 and 4 at a time), and nothing else of dst is written."""
    numba = pytest.importorskip("numba")
    from lnn.runtime.cpu import jit

    if jit.KERNELS != "jit":
        pytest.skip("the intrinsics are the JIT's")
    done = count - count % 4
    rng = np.random.default_rng(count)
    def compiled(intrinsic):
        return numba.njit(lambda *args: intrinsic(*args))

    gather = compiled(jit.gather_tile_columns)
    src = rng.standard_normal(3 + 4 * count + 4).astype(np.float32)
    dst = np.full((9, count + 5), np.nan, np.float32)
    assert gather(src, 3, dst, 2, 5, count) == done
    i, j = np.meshgrid(np.arange(done), np.arange(6))
    np.testing.assert_array_equal(dst[2:8, 5:5 + done], src[3 + 4 * i + j])
    dst[2:8, 5:5 + done] = np.nan
    assert np.isnan(dst).all()
    interleave = compiled(jit.interleave_rows4)
    src = rng.standard_normal((7, count + 5)).astype(np.float32)
    dst = np.full(3 + 4 * count + 4, np.nan, np.float32)
    assert interleave(src, 1, 2, dst, 3, count) == done
    np.testing.assert_array_equal(dst[3:3 + 4 * done], src[1:5, 2:2 + done].T.ravel())
    dst[3:3 + 4 * done] = np.nan
    assert np.isnan(dst).all()


def test_load16_is_the_16_values_from_an_offset():
    """jit.load16 (the register tiles' vector load, on any host the JIT runs on) against numpy."""
    numba = pytest.importorskip("numba")
    from lnn.runtime.cpu import jit

    if jit.KERNELS != "jit":
        pytest.skip("the intrinsics are the JIT's")

    @numba.njit
    def loaded(row, offset):
        values = jit.load16(row, offset)
        out = np.empty(16, np.float32)
        for i in range(16):
            out[i] = values[i]
        return out

    row = np.random.default_rng(16).standard_normal(53).astype(np.float32)
    for offset in (0, 1, 5, 37):
        np.testing.assert_array_equal(loaded(row, offset), row[offset:offset + 16])


@pytest.mark.parametrize("width", [14, 38])      # conv 12 or 36 wide: 3 tiles a row (tile by tile) or 9 (gathered)
def test_winograd_kernels_split_by_channels_and_rows(width):
    """What a caller splitting one conv over threads does: channel ranges and tile-row ranges give the same V and acc."""
    from lnn.runtime.cpu.winograd import input_work_shape, tile_count, winograd_input, winograd_output

    rng = np.random.default_rng(3)
    image = rng.standard_normal((10, 15, width)).astype(np.float32)     # conv 13 high: 4 tile rows
    tiles_w, tile_rows = tile_count(width - 2), tile_count(13)
    count = tiles_w * tile_rows
    whole, split = np.zeros((36, 10, count), np.float32), np.zeros((36, 10, count), np.float32)
    winograd_input(image, 0, 10, 0, tile_rows, 0, np.zeros(input_work_shape(tiles_w, tile_rows), np.float32), whole)
    for c_first, c_end, first, rows in ((0, 4, 0, 2), (0, 4, 2, 2), (4, 10, 0, 4)):
        work = np.zeros(input_work_shape(tiles_w, rows), np.float32)
        winograd_input(image, c_first, c_end, first, rows, first * tiles_w, work, split)
    np.testing.assert_array_equal(split, whole)
    m = rng.standard_normal((36, 5, count)).astype(np.float32)
    conv_w = width - 2
    acc_whole, acc_split = np.zeros((5, 13 * conv_w), np.float32), np.zeros((5, 13 * conv_w), np.float32)
    winograd_output(m, 0, 5, 1, count, 0, 13, conv_w, 0, 13, np.zeros((40, count), np.float32), acc_whole)
    for o_first, o_end in ((0, 2), (2, 5)):
        winograd_output(m, o_first, o_end, 1, count, 0, 13, conv_w, 0, 13, np.zeros((40, count), np.float32), acc_split)
    np.testing.assert_array_equal(acc_split, acc_whole)


@pytest.mark.parametrize("case", [(1, 3, 30, 17, 16, 1), (2, 1, 9, 8, 5, 0), (1, 2, 6, 40, 16, 2),
                                  (2, 3, 7, 32, 16, 1), (2, 3, 9, 50, 11, 0)],      # rows of 32 and 48: tiles
                         ids=lambda c: "n{}c{}h{}w{}o{}p{}".format(*c))
def test_direct_matches_float64_convolution(case):
    batch, channels, height, width, out_channels, padding = case
    rng = np.random.default_rng(sum(case))
    x = rng.standard_normal((batch, channels, height, width)).astype(np.float32)
    weight = rng.standard_normal((out_channels, channels, 3, 3)).astype(np.float32)
    backend, got = one_conv(x, weight, padding, "auto")
    assert backend.layers[0].small_direct
    check_bound(got, x, weight, padding)


def test_direct_kernel_splits_by_channels_and_rows():
    from lnn.runtime.cpu.conv_direct import conv3x3_direct

    rng = np.random.default_rng(4)
    image, weight = rng.standard_normal((3, 12, 11)).astype(np.float32), rng.standard_normal((7, 3, 3, 3)).astype(np.float32)
    whole, split = np.zeros((7, 10 * 9), np.float32), np.zeros((7, 10 * 9), np.float32)
    conv3x3_direct(image, weight, 0, 7, 0, 10, 0, whole)
    for o_first, o_end, y_first, y_end in ((0, 3, 0, 10), (3, 7, 0, 4), (3, 7, 4, 10)):
        conv3x3_direct(image, weight, o_first, o_end, y_first, y_end, y_first * 9, split)
    np.testing.assert_array_equal(split, whole)


@pytest.mark.parametrize("kernel,channels,out_channels,width",
                         [("quads", 3, 32, 130), ("quads", 1, 7, 100), ("quads", 2, 6, 33),
                          ("tiles", 3, 32, 130), ("tiles", 1, 7, 50), ("tiles", 2, 13, 18)],
                         ids=lambda v: str(v))
def test_blocked_direct_kernels_match_one_channel_kernel(kernel, channels, out_channels, width):
    """conv3x3_direct_quads (4 channels a pass, the rest one by one) and conv3x3_direct_tiles (tiles of 6
    channels x 32 columns, a last 16; rows a multiple of 16) against conv3x3_direct (FMA rounding and the
    order of the sums only), split by channels and rows as threads split them, writing nothing outside the
    rows and channels asked for."""
    from lnn.runtime.cpu import conv_direct

    blocked = {"quads": conv_direct.conv3x3_direct_quads, "tiles": conv_direct.conv3x3_direct_tiles}[kernel]
    rng = np.random.default_rng(out_channels)
    image = rng.standard_normal((channels, 12, width)).astype(np.float32)
    weight = rng.standard_normal((out_channels, channels, 3, 3)).astype(np.float32)
    conv_w = width - 2
    expected, got = np.zeros((out_channels, 10 * conv_w), np.float32), np.full((out_channels, 10 * conv_w), np.nan, np.float32)
    conv_direct.conv3x3_direct(image, weight, 0, out_channels, 0, 10, 0, expected)
    for o_first, o_end, y_first, y_end in ((0, 5, 0, 10), (5, out_channels, 0, 3), (5, out_channels, 3, 10)):
        if o_end > o_first:
            before = got.copy()
            blocked(image, weight, o_first, o_end, y_first, y_end, y_first * conv_w, got)
            outside = np.ones_like(got, bool)
            outside[o_first:o_end, y_first * conv_w:y_end * conv_w] = False
            np.testing.assert_array_equal(got[outside], before[outside])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_direct_tiles_pool2_is_direct_tiles_then_pool():
    """conv3x3_direct_tiles_pool2 gives the bytes of conv3x3_direct_tiles then max_pool_2x2_rows, for a split of
    the output channels (7: a last tile of 3 channels, and in the last 16 of the 48 columns, of one) and a band
    of rows starting below the first, written at a column offset, and writes nothing else."""
    from lnn.runtime.cpu.conv2d import max_pool_2x2_rows
    from lnn.runtime.cpu.conv_direct import conv3x3_direct_tiles, conv3x3_direct_tiles_pool2

    rng = np.random.default_rng(11)
    channels, out_channels, conv_h, conv_w = 3, 13, 10, 48
    image = rng.standard_normal((channels, conv_h + 2, conv_w + 2)).astype(np.float32)
    weight = rng.standard_normal((out_channels, channels, 3, 3)).astype(np.float32)
    acc = np.zeros((out_channels, conv_h * conv_w), np.float32)
    conv3x3_direct_tiles(image, weight, 0, out_channels, 0, conv_h, 0, acc)
    out_w, column = conv_w // 2, 5 * conv_w // 2
    for o_first, o_end, out_first, out_end in ((0, 7, 0, 5), (7, out_channels, 1, 4)):
        expected = np.zeros((out_channels, conv_h * out_w), np.float32)
        max_pool_2x2_rows(acc, conv_w, 0, conv_h, 1, expected[:, column:], out_first, out_end, out_w)
        got = np.full_like(expected, np.nan)
        conv3x3_direct_tiles_pool2(image, weight[o_first:o_end], 0, o_end - o_first, 2 * out_first, 2 * out_end,
                                   column, got[o_first:o_end])
        written = np.zeros_like(got, bool)
        written[o_first:o_end, column:column + (out_end - out_first) * out_w] = True
        np.testing.assert_array_equal(got[written], expected[written])
        assert np.isnan(got[~written]).all()


@pytest.mark.parametrize("height", [16, 15])
def test_direct_tiles_pool_where_they_pay(height, monkeypatch):
    """With jit.WIDE_VECTORS, a small direct conv rows a multiple of 16 wide followed by a 2x2/2 max-pool runs
    through conv3x3_direct_tiles_pool2 (no max-pool step; an odd last conv row is dropped, as the pool drops
    it) and matches the NumPy reference, also split over 2 threads."""
    from lnn.runtime.cpu import BACKEND, conv2d
    from lnn.runtime.cpu.parallel import all_steps
    from lnn.runtime.reference import NumpyBackend

    monkeypatch.setattr(conv2d, "WIDE_VECTORS", True)
    model = parse_model({"input_shape": [3, height, 32], "layers": [
        {"type": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1, "activation": "relu"},
        {"type": "maxpool2d", "kernel_size": 2}]})
    rng = np.random.default_rng(height)
    weights = {key: rng.standard_normal(shape).astype(np.float32) for key, shape in model.param_shapes().items()}
    x = rng.standard_normal((2, 3, height, 32)).astype(np.float32)
    expected = NumpyBackend(model, weights).run(x)
    for threads in (1, 2):
        backend = BACKEND(model, weights, threads=threads)
        backend.task_flops = 0
        got = backend.run(x)
        kernels = {getattr(step, "func", None) for step in all_steps(backend._plan(2, threads).steps)}
        assert conv2d.conv3x3_direct_tiles_pool2 in kernels and conv2d.max_pool_2x2_rows not in kernels
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


def test_wide_small_convs_run_direct_quads_where_they_pay(monkeypatch):
    """With jit.VECTOR_FMA, a 3-channel conv of up to DIRECT_QUADS_MAX_OUT_CHANNELS outputs on wide rows runs
    direct, through conv3x3_direct_quads (or the tiles of this host's vectors), and matches float64
    convolution; without it, columns + GEMM."""
    from lnn.runtime.cpu import conv2d

    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 3, 9, conv2d.DIRECT_QUADS_MIN_WIDTH)).astype(np.float32)
    weight = rng.standard_normal((conv2d.DIRECT_QUADS_MAX_OUT_CHANNELS, 3, 3, 3)).astype(np.float32)
    for fma in (True, False):
        monkeypatch.setattr(conv2d, "VECTOR_FMA", fma)
        backend, got = one_conv(x, weight, 1, "auto")
        layer = backend.layers[0]
        assert layer.small_direct == fma
        if fma:
            steps = backend._plan(1).steps
            kernel = (conv2d.conv3x3_direct_tiles if conv2d.direct_tiles_pay(conv2d.DIRECT_QUADS_MIN_WIDTH)
                      else conv2d.conv3x3_direct_shifted if conv2d.narrow_tiles_pay() else conv2d.conv3x3_direct_quads)
            assert any(getattr(step, "func", None) is kernel for step in steps)
        check_bound(got, x, weight, 1)


@pytest.mark.parametrize("shape", [(3, 16, 9, 128, 2, 9), (3, 13, 7, 33, 0, 7), (1, 32, 28, 28, 5, 28),
                                   (2, 5, 6, 8, 1, 4), (3, 1, 4, 5, 0, 4)],
                         ids=lambda s: "c{}o{}h{}w{}_rows{}to{}".format(*s))
def test_shifted_direct_is_the_direct_conv(shape):
    """conv3x3_direct_shifted against conv3x3_direct: output channels not a multiple of its 6-row tiles, rows not a
    multiple of its 16 positions, a band in the middle and one at the image's end, the image at the end of its
    buffer (the 16 floats after it NaN: only junk outputs read them); nothing written outside the band's
    positions and the 16 after them."""
    from lnn.runtime.cpu.conv_direct import conv3x3_direct, conv3x3_direct_shifted, shifted_tap_offsets

    channels, out_channels, conv_h, conv_w, y_first, y_end = shape
    padded_h, padded_w = conv_h + 2, conv_w + 2
    rng = np.random.default_rng(sum(shape))
    buffer = np.full(channels * padded_h * padded_w + 16, np.nan, np.float32)
    image = buffer[:-16].reshape(channels, padded_h, padded_w)
    image[...] = rng.standard_normal(image.shape)
    weight = rng.standard_normal((out_channels, channels, 3, 3)).astype(np.float32)
    expected = np.zeros((out_channels, conv_h * conv_w), np.float32)
    conv3x3_direct(image, weight, 0, out_channels, y_first, y_end, 0, expected)
    column, rows = 7, y_end - y_first
    acc = np.full((out_channels, column + rows * padded_w + 16 + 5), 7.0, np.float32)
    conv3x3_direct_shifted(image.reshape(-1), np.ascontiguousarray(weight.reshape(out_channels, -1)),
                           shifted_tap_offsets(channels, padded_h, padded_w), padded_w, y_first, y_end, column, acc)
    got = acc[:, column:column + rows * padded_w].reshape(out_channels, rows, padded_w)[:, :, :conv_w]
    np.testing.assert_allclose(got.reshape(out_channels, -1), expected[:, :rows * conv_w], rtol=0, atol=2e-5)
    assert (acc[:, :column] == 7).all() and (acc[:, column + rows * padded_w + 16:] == 7).all()


@pytest.mark.parametrize("channels", [(3, 20), (11, 70)], ids=lambda c: "c{}o{}".format(*c))
@pytest.mark.parametrize("size", [(16, 128), (9, 28), (5, 7)])
def test_small_convs_run_shifted_where_it_pays(size, channels, monkeypatch):
    """Where conv2d.narrow_tiles_pay (an x86-64 host with FMA, no AVX-512: forced here), a conv too thin for
    Winograd runs through conv3x3_direct_shifted, with and without a 2x2 max-pool after it, on 1 and 2 threads
    (by rows, or by output channels where they outnumber the positions: 70 on 5x7), for one image and for bands
    of several images (the small sizes), and matches the NumPy reference."""
    from lnn.runtime.cpu import BACKEND, conv2d
    from lnn.runtime.cpu.parallel import all_steps
    from lnn.runtime.reference import NumpyBackend

    monkeypatch.setattr(conv2d, "VECTOR_FMA", True)
    monkeypatch.setattr(conv2d, "WIDE_VECTORS", False)
    height, width = size
    in_channels, out_channels = channels
    rng = np.random.default_rng(height * width)
    for pool in (False, True):
        layers = [{"type": "conv2d", "out_channels": out_channels, "kernel_size": 3, "padding": 1, "activation": "relu"}]
        layers += [{"type": "maxpool2d", "kernel_size": 2}] if pool else []
        model = parse_model({"input_shape": [in_channels, height, width], "layers": layers})
        weights = {key: (rng.standard_normal(shape) / np.sqrt(3 * in_channels)).astype(np.float32)
                   for key, shape in model.param_shapes().items()}
        x = rng.standard_normal((3, in_channels, height, width)).astype(np.float32)
        expected = NumpyBackend(model, weights).run(x)
        for threads, batch in ((1, 1), (1, 3), (2, 1), (2, 3)):
            backend = BACKEND(model, weights, threads=threads)
            backend.task_flops = 0
            got = backend.run(x[:batch])
            if threads == 1 or batch == 1:                 # (2 threads, 3 images: a plan of each thread's images)
                plan = backend._plan(batch, threads)
                assert conv2d.conv3x3_direct_shifted in {getattr(step, "func", None) for step in all_steps(plan.steps)}
            np.testing.assert_allclose(got, expected[:batch], rtol=0, atol=1e-4)


def test_shifted_direct_needs_a_contiguous_image(monkeypatch):
    """An unpadded thin conv whose input is a view into a larger buffer (another consumer's padded copy) is no flat
    image (its reshape would be a copy made at plan time): it runs the kernels before instead, and reads the input as
    it is when the steps run."""
    from lnn.runtime.cpu import BACKEND, conv2d
    from lnn.runtime.cpu.parallel import all_steps
    from lnn.runtime.reference import NumpyBackend

    monkeypatch.setattr(conv2d, "VECTOR_FMA", True)
    monkeypatch.setattr(conv2d, "WIDE_VECTORS", False)
    model = parse_model({"input_shape": [5, 9, 20], "layers": [
        {"type": "conv2d", "out_channels": 12, "kernel_size": 3, "padding": 0, "activation": "relu"}]})
    rng = np.random.default_rng(13)
    weights = {key: rng.standard_normal(shape).astype(np.float32) for key, shape in model.param_shapes().items()}
    framed = rng.standard_normal((1, 5, 11, 22)).astype(np.float32)
    x = framed[:, :, 1:10, 1:21]                                  # not C-contiguous
    layer = BACKEND(model, weights).layers[0]
    assert layer.small_direct
    new_buffer = (lambda shape, scratch=False, worker=0: np.zeros(shape, np.float32))
    out, steps = layer.plan(x, new_buffer)
    kernels = {getattr(step, "func", None) for step in all_steps(steps)}
    assert conv2d.conv3x3_direct_shifted not in kernels
    framed[...] = rng.standard_normal(framed.shape)                # new input after planning, as every call has
    for step in all_steps(steps):
        step()
    np.testing.assert_allclose(out, NumpyBackend(model, weights).run(np.ascontiguousarray(x)), rtol=0, atol=1e-4)
    contiguous_out, contiguous_steps = layer.plan(np.ascontiguousarray(x), new_buffer)
    assert conv2d.conv3x3_direct_shifted in {getattr(step, "func", None) for step in all_steps(contiguous_steps)}


@pytest.mark.parametrize("wide", [True, False])
def test_direct_tiles_run_on_rows_a_multiple_of_16_where_they_pay(wide, monkeypatch):
    """With jit.WIDE_VECTORS, a small direct conv whose rows are a multiple of 16 wide runs through
    conv3x3_direct_tiles; rows of another width, or a host without AVX-512, keep the kernels before."""
    from lnn.runtime.cpu import conv2d

    monkeypatch.setattr(conv2d, "WIDE_VECTORS", wide)
    rng = np.random.default_rng(8)
    weight = rng.standard_normal((16, 3, 3, 3)).astype(np.float32)
    for width, multiple in ((112, True), (104, False)):
        x = rng.standard_normal((1, 3, 6, width)).astype(np.float32)
        backend, got = one_conv(x, weight, 1, "auto")
        kernels = {getattr(step, "func", None) for step in backend._plan(1).steps}
        assert (conv2d.conv3x3_direct_tiles in kernels) == (wide and multiple)
        check_bound(got, x, weight, 1)


def test_algorithm_rule_for_small_convs():
    from lnn.runtime.cpu import BACKEND, conv2d

    # on 12-wide rows: up to DIRECT_MAX_CHANNELS inputs and DIRECT_MAX_OUT_CHANNELS outputs, or where the narrow
    # tiles run (conv3x3_direct_shifted), every conv too thin for Winograd with up to SHIFTED_MAX_OUT_CHANNELS
    narrow = conv2d.narrow_tiles_pay()
    inputs = conv2d.WINOGRAD_MIN_CHANNELS - 1 if narrow else conv2d.DIRECT_MAX_CHANNELS
    most = conv2d.SHIFTED_MAX_OUT_CHANNELS if narrow else conv2d.DIRECT_MAX_OUT_CHANNELS

    def layer(channels, out_channels, **attrs):
        model = parse_model({"input_shape": [channels, 12, 12], "layers": [
            {"type": "conv2d", "out_channels": out_channels, "kernel_size": 3, "padding": 1, **attrs}]})
        weights = {key: np.ones(shape, np.float32) for key, shape in model.param_shapes().items()}
        return BACKEND(model, weights).layers[0]

    assert layer(inputs, most).small_direct
    assert not layer(inputs + 1, most).small_direct
    assert not layer(inputs, most + 1).small_direct
    assert not layer(3, 16, stride=2).small_direct
    assert not layer(3, 16, algorithm="im2col").small_direct
    forced = layer(3, 16, algorithm="winograd")
    assert forced.winograd and not forced.small_direct


def test_winograd_weight_is_packed_at_load_after_batch_norm_folding():
    from lnn.runtime.cpu import BACKEND
    from lnn.runtime.cpu.winograd import transformed_weight, weight_blocks
    from lnn.runtime.reference import NumpyBackend

    model = parse_model({"input_shape": [16, 10, 9], "layers": [
        {"type": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1, "algorithm": "winograd"},
        {"type": "batchnorm"}]})
    rng = np.random.default_rng(5)
    weights = {key: (rng.uniform(0.5, 1.5, shape) if key.endswith("running_var") else rng.standard_normal(shape))
               .astype(np.float32) for key, shape in model.param_shapes().items()}
    backend = BACKEND(model, weights)
    layer = backend.layers[0]
    expected = transformed_weight(layer.weight)                                             # the folded weight
    if layer.winograd_blocks:                                   # 9 tiles, on a host where small_products pays
        expected = weight_blocks(expected)
    assert len(backend.layers) == 1 and layer.winograd_weight.shape == expected.shape
    np.testing.assert_array_equal(layer.winograd_weight, expected)
    x = rng.standard_normal((2, 16, 10, 9)).astype(np.float32)
    np.testing.assert_allclose(backend.run(x), NumpyBackend(model, weights).run(x), rtol=0, atol=1e-4)


@pytest.mark.parametrize("conv_h, conv_w", [(13, 10), (16, 36)])
def test_output_with_pool_is_output_then_pool(conv_h, conv_w):
    """winograd_output_pool2 gives the bytes of winograd_output then max_pool_2x2_rows, for two images
    and for a band of tile rows starting below the first (odd sizes: the last row and column dropped)."""
    from lnn.runtime.cpu.conv2d import max_pool_2x2_rows
    from lnn.runtime.cpu.winograd import tile_count, winograd_output, winograd_output_pool2

    rng = np.random.default_rng(4)
    tiles_w, tile_rows = tile_count(conv_w), tile_count(conv_h)
    out_h, out_w = conv_h // 2, conv_w // 2
    for images, tile_first, out_first, out_end in ((2, 0, 0, out_h), (1, 1, 2, out_h)):
        per_image = (tile_rows - tile_first) * tiles_w
        m = rng.standard_normal((36, 3, images * per_image)).astype(np.float32)
        y_first, y_end = 2 * out_first, conv_h
        acc = np.zeros((3, images * conv_h * conv_w), np.float32)
        work = np.zeros((40, images * per_image), np.float32)
        winograd_output(m, 0, 3, images, per_image, tile_first, conv_h, conv_w, y_first, y_end, work, acc)
        expected = np.zeros((3, images * (out_end - out_first) * out_w), np.float32)
        max_pool_2x2_rows(acc, conv_w, y_first, conv_h, images, expected, out_first, out_end, out_w)
        got = np.full_like(expected, np.nan)
        winograd_output_pool2(m, 0, 3, images, per_image, tile_first, conv_w, out_first, out_end, work, got)
        np.testing.assert_array_equal(got, expected)


def test_output_transforms_in_passes_of_channels():
    """Several output channels' tiles in one tile_outputs pass (a work wider than M's rows) give the bytes of
    one channel a pass, with or without the pool; M's junk columns between channels (NaN here) are never
    stored."""
    from lnn.runtime.cpu.winograd import channels_a_pass, winograd_output, winograd_output_pool2

    rng = np.random.default_rng(6)
    conv_h = conv_w = 8                                  # 2 x 2 tiles
    count, stride, channels = 4, 7, 9
    m = np.full((36, channels + 1, stride), np.nan, np.float32)
    m[:, :channels, :count] = rng.standard_normal((36, channels, count))
    results = []
    for work_w in (count, 2 * stride + count, 256):
        per_pass = channels_a_pass(stride, count, work_w)
        assert per_pass == {count: 1, 2 * stride + count: 3, 256: 37}[work_w]
        work = np.zeros((40, work_w), np.float32)
        acc = np.full((channels, conv_h * conv_w), np.nan, np.float32)
        pooled = np.full((channels, conv_h * conv_w // 4), np.nan, np.float32)
        winograd_output(m, 1, channels, 1, count, 0, conv_h, conv_w, 0, conv_h, work, acc)
        winograd_output_pool2(m, 1, channels, 1, count, 0, conv_w, 0, conv_h // 2, work, pooled)
        assert np.isnan(acc[0]).all() and not np.isnan(acc[1:]).any() and not np.isnan(pooled[1:]).any()
        results.append(acc.tobytes() + pooled.tobytes())
    assert results[1] == results[0] and results[2] == results[0]
