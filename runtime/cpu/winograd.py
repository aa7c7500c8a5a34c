"""Winograd F(4x4, 3x3) for conv2d with a 3x3 kernel, stride 1, dilation 1, groups 1 (Lavin & Gray, 2015).

Same result as conv2d.py's columns + product (reference: formats/ops.py Conv2d.forward), with 36
multiplies per 4x4 output tile instead of 144 (4x fewer; F(2x2, 3x3), used before, saved 2.25x):
    U[k, o, c] = (G g[o, c] G^T)[k]                 weight [O, C, 3, 3] -> U [36, O, C], once per layer
    V[k, c, t] = (B^T d[c, t] B)[k]                 d = the tile's 6x6 input patch            (`winograd_input`)
    M[k]       = U[k] @ V[k]                        36 BLAS products [O, C] x [C, T] (`blas_products`: sgemm
                                                    from compiled code, else np.matmul), or
                                                    for a few tiles, dot products (`skinny_products`), or
                                                    small ones in AVX-512 register tiles (`small_products`, or
                                                    `block_products` on U in blocks of 8 rows: weight_blocks)
    y[o, tile] = A^T M[:, o, t] A                   the tile's 4x4 outputs                    (`winograd_output`)
                                                    or their 2x2 maxima (a 2x2/2 max-pool, `winograd_output_pool2`)
with k = 6 * row + column of the 6x6 transform domain, tile t covering conv output rows 4ty..4ty+3
and columns 4tx..4tx+3 from the padded input rows 4ty..4ty+5 and columns 4tx..4tx+5. Cells of a
patch outside the padded input read as 0; outputs outside the conv output are not written. U is
[36, O, C] C-contiguous: each of the 36 products reads its [O, C] block contiguously, as V's [C, T].

Interpolation points (0, 1, -1, 2, -1/2, inf), matrices from `transforms` (Cook-Toom: A^T[i, j] =
p_j^i, G[j] = (1, p_j, p_j^2) / prod_{l != j} (p_j - p_l), B^T solved exactly from the two). The
transforms are exact in real arithmetic; in float32 they round differently from a direct sum. Mean
of the max error over 4x4 outputs relative to the largest output, C=64 Kaiming weights, inputs
|N(0,1)| (measured in float32 with these matrices): this set 1.0e-6; Lavin's (0, +-1, +-2) 1.8e-6;
F(2x2, 3x3) 0.3e-6; F(6x6, 3x3) with (0, +-1, +-2, +-1/2) 4.3e-6 (not used: the error grows, and
the small late layers waste more of 6x6 tiles). The kernels read A^T and B^T as constants (AT32,
BT32); tests/runtime/test_cpu_winograd.py checks them against the matrices and bounds the error
against float64.

The kernels take a channel range (c_first..c_end of the input, o_first..o_end of the output) and
tile rows, so a caller may split one conv's transforms over threads by channels or by rows; the
product splits by output rows of U (U[:, o_first:o_end]).

`blas_product` (c = a @ b, 2-D, sgemm from compiled code) is blas_products' one-product form, for
conv2d.py's columns + GEMM path (conv2d.matrix_product), beside it because both take blas_products_sgemm.
"""

from __future__ import annotations

import functools
from fractions import Fraction

import numpy as np

from lnn.runtime.cpu.aot import A2, A3, I
from lnn.runtime.cpu.jit import (VECTOR_FMA, call_sgemm, gather_tile_columns, ieee_kernel, interleave_rows4, kernel,
                                 load16, load8, sgemm_address, short_loops_kernel, store8, tile_kernel,
                                 wide_tile_kernel)

# Each kernel's ahead-of-time signature (aot.py): the argument types the backend passes; None: called
# only by other kernels, compiled into them.
AOT_SIGNATURES = {
    "winograd_input": (A3, I, I, I, I, I, A2, A3),
    "term": None,
    "bt_row": None,
    "bt_rows8": None,
    "transformed_rows": None,     # the JIT's only (jit.load8, store8; winograd_input calls it where SHUFFLES)
    "blas_products": None,        # the JIT's only (jit.call_sgemm)
    "blas_product": None,         # the JIT's only (jit.call_sgemm)
    "skinny_products": (A3, I, I, A3, I, A3),
    "fma16": None,
    "store16": None,
    "zeros16": None,
    "six_rows": None,
    "four_rows": None,
    "product_tile": None,
    "product_column_tile": None,
    "small_products": None,       # the JIT on an AVX-512 host only (conv2d.py small_products_pay)
    "block_tile": None,
    "block_column_tile": None,
    "block_products": None,       # (the same)
    "fma8": None,
    "zeros8": None,
    "narrow_strip": None,
    "narrow_products": None,      # the JIT on x86-64 with FMA, no AVX-512 only (conv2d.py narrow_tiles_pay)
    "at_row": None,
    "tile_outputs": None,
    "channels_a_pass": None,
    "output_passes": None,
    "winograd_output": (A3, I, I, I, I, I, I, I, I, I, A2, A2),
    "winograd_output_pool2": (A3, I, I, I, I, I, I, I, I, A2, A2),
}

TILE = 4                        # outputs per tile side
POINTS = (0, 1, -1, 2, Fraction(-1, 2))     # the finite interpolation points; the sixth is infinity


def transforms(points=POINTS, m: int = TILE, r: int = 3) -> tuple:
    """(A^T [m, n], G [n, r], B^T [n, n]) float64, n = m + r - 1, for the points and infinity."""
    n = m + r - 1
    p = [Fraction(x) for x in points]
    at = np.zeros((m, n), object)
    g = np.zeros((n, r), object)
    for j, pj in enumerate(p):
        f = np.prod([pj - pl for l, pl in enumerate(p) if l != j])
        at[:, j] = [pj ** i for i in range(m)]
        g[j] = [pj ** k / f for k in range(r)]
    at[:, n - 1], g[n - 1] = [0] * (m - 1) + [1], [0] * (r - 1) + [1]
    # B^T from sum_j A^T[i, j] G[j, k] B^T[j, l] = [l == i + k] for every i, k, l (exactly solvable)
    equations = np.einsum("ij,jk,jJ,lL->iklJL", at.astype(float), g.astype(float), np.eye(n), np.eye(n))
    rhs = np.array([[[float(l == i + k) for l in range(n)] for k in range(r)] for i in range(m)])
    bt = np.linalg.lstsq(equations.reshape(-1, n * n), rhs.ravel(), rcond=None)[0].reshape(n, n)
    return at.astype(float), g.astype(float), np.round(bt, 12)


AT, G, BT = transforms()
AT32, BT32 = AT.astype(np.float32), BT.astype(np.float32)     # constants in the kernels (Numba freezes them)


def transformed_weight(weight: np.ndarray) -> np.ndarray:
    """weight [O, C, 3, 3] -> U [36, O, C] float32 (computed in float64)."""
    u = np.einsum("ij,ocjk,lk->iloc", G, weight.astype(np.float64), G)       # [6, 6, O, C]
    return np.ascontiguousarray(u.reshape(36, *weight.shape[:2]), dtype=np.float32)


BLOCK_ROWS = 8                  # U's rows a block of weight_blocks


def weight_blocks(u: np.ndarray) -> np.ndarray:
    """U [36, O, C] -> [36, ceil(O / 8), C, 8]: U[k, 8b + i, c] at [k, b, c, i], rows past O zero. A register
    tile's 8 broadcasts a channel then come from one pointer (block_tile, block_column_tile)."""
    blocks = -(-u.shape[1] // BLOCK_ROWS)
    padded = np.zeros((36, blocks * BLOCK_ROWS, u.shape[2]), np.float32)
    padded[:, :u.shape[1]] = u
    return np.ascontiguousarray(padded.reshape(36, blocks, BLOCK_ROWS, -1).transpose(0, 1, 3, 2))


def tile_count(size: int) -> int:
    """Tiles along an output axis of `size` cells."""
    return -(-size // TILE)


# From this many tiles a row (TW), winograd_input's second step gathers each tile's 6 columns of E into 36
# rows of the band's tiles and runs over all of them at once (vectorized: a 32x32 image's band has 64 tiles,
# where a tile row had 8); on narrower rows tile by tile, where the gather lost (by hand, 1 thread, against
# tile by tile: 64x12^2, TW 3, 1.5x the time, 128x10^2 1.4x; 64x16^2, TW 4, 0.68x, 64x20^2 0.65x). Before
# the steps below took 6 rows in for 6 out in one loop, the gather lost up to TW 6 (96x12^2 1.6x, 64x16^2
# 1.1x); from TW 6 it won against a second step over each tile row's 4 column phases of E (48x32^2 0.74,
# 64x56^2 0.64, 32x112^2 0.75: rows compiled one vector a step, a tile row's loop of 16 ran in its scalar
# remainder otherwise).
GATHERED_MIN_TILES_W = 4


# winograd_input gathers each tile's 6 columns of E (stride 4) and winograd_output scatters each tile's 4 outputs a
# row into the image row (stride 4) by vector loads and shuffles, 16, 8 or 4 tiles at a time
# (jit.gather_tile_columns, jit.interleave_rows4), where the JIT runs on an x86-64 host with FMA (AVX-512 or AVX2);
# one by one elsewhere (arm64: not measured): LLVM vectorizes neither the strided reads nor the strided stores of a
# loop. By hand, 1 thread, against the copies one by one, the same bytes: winograd_input 0.55x the time on 16x64^2,
# 0.69x on 32x32^2, 0.76x on 64x16^2, 0.64x on 24x64^2, 0.63x on 32x112^2, 0.83x on 64x56^2, whole calls (15
# interleaved rounds of 40) leaf_cnn 0.92x, tomato 0.96x, leaf_cnn224 0.95x, mnist_cnn 1.00x; winograd_output 0.73x
# on 128x16^2, 0.95x on 256x28^2 (7 tiles a row: 3 copied), whole calls leaf_cnn 0.98x, leaf_cnn224 0.97x (the
# pooling output transform's 2 columns a tile so: 0.98-1.00x, not used); the app's ahead-of-time kernels copy one
# by one (aot.compile_kernels). On a Zen 3 VM (AVX2), by hand, the steps of leaf_cnn at 1 thread: winograd_input
# 0.78x, 0.78x and 0.92x the time on its three Winograd convs, winograd_output 0.94x, the whole call 0.96x. Inline
# only: the same copies in a kernel of their own, called from winograd_input per row, ran 1.05-1.39x slower, and
# the shuffles so 1.03-2.6x.
SHUFFLES = VECTOR_FMA


def input_work_shape(tiles_w: int, tile_rows: int) -> tuple:
    """The shape of winograd_input's scratch `work` for bands of at most tile_rows rows of tiles_w tiles (E's
    rows of 4 * tiles_w + 2 columns, and the 2 past them that the shuffled gather reads)."""
    return 48, max(4 * tiles_w + 4, tile_rows * tiles_w)


NO_TERM = np.float32(-0.0)      # x + -0.0 is x for every x: LLVM drops it (x + 0.0 is not: -0.0 + 0.0 is 0.0)


@kernel
def term(coefficient, x):
    """coefficient * x, or where the coefficient is 0, nothing (NO_TERM) rather than 0 * x: inlined with a constant
    coefficient, the sum loses the term (LLVM keeps a product by 0 in IEEE arithmetic: it is NaN for an infinite
    x), where a 1 or -1 folds by itself. The same sums of finite inputs, but for the sign of an exact 0."""
    return coefficient * x if coefficient != 0 else NO_TERM


@kernel
def bt_row(k, x0, x1, x2, x3, x4, x5):
    """sum_i B^T[k, i] x_i without its zero terms (k a constant where it is inlined; `term`). By hand, 1 thread,
    winograd_input on the reference models' and the bundled model's shapes: 0.86-0.95x the time with them gone."""
    return (term(BT32[k, 0], x0) + term(BT32[k, 1], x1) + term(BT32[k, 2], x2) + term(BT32[k, 3], x3)
            + term(BT32[k, 4], x4) + term(BT32[k, 5], x5))


@kernel
def bt_rows8(k, x0, x1, x2, x3, x4, x5):
    """bt_row of each of 8 lanes: x0..x5 and the result 8-tuples (one vector each to the SLP vectorizer)."""
    return (bt_row(k, x0[0], x1[0], x2[0], x3[0], x4[0], x5[0]), bt_row(k, x0[1], x1[1], x2[1], x3[1], x4[1], x5[1]),
            bt_row(k, x0[2], x1[2], x2[2], x3[2], x4[2], x5[2]), bt_row(k, x0[3], x1[3], x2[3], x3[3], x4[3], x5[3]),
            bt_row(k, x0[4], x1[4], x2[4], x3[4], x4[4], x5[4]), bt_row(k, x0[5], x1[5], x2[5], x3[5], x4[5], x5[5]),
            bt_row(k, x0[6], x1[6], x2[6], x3[6], x4[6], x5[6]), bt_row(k, x0[7], x1[7], x2[7], x3[7], x4[7], x5[7]))


@tile_kernel
def transformed_rows(work, v, c, column, count):
    """v[6k + l, c, column + t] = bt_row(l, work[6 + 6k:12 + 6k, t]) for k, l < 6 and t < count rounded down to 8
    (returned: the rest is the caller's): winograd_input's last step, 8 columns a step as vector loads and stores
    straight into v's 36 planes (a loop so written is not vectorized: LLVM's checks that its 12 rows do not overlap
    are too many), at flat offsets into both C-contiguous arrays (no row views: a call a channel, not a view a row).
    Its bt_row sums are not contracted (their own kernel's IEEE arithmetic): the same bytes as the loop."""
    width, plane = work.shape[1], v.shape[1] * v.shape[2]
    done = count - count % 8
    for k in range(6):
        r = (6 + 6 * k) * width
        o = 6 * k * plane + c * v.shape[2] + column
        for t in range(0, done, 8):
            x0, x1, x2 = load8(work, r + t), load8(work, r + width + t), load8(work, r + 2 * width + t)
            x3, x4, x5 = load8(work, r + 3 * width + t), load8(work, r + 4 * width + t), load8(work, r + 5 * width + t)
            store8(v, o + t, bt_rows8(0, x0, x1, x2, x3, x4, x5))
            store8(v, o + plane + t, bt_rows8(1, x0, x1, x2, x3, x4, x5))
            store8(v, o + 2 * plane + t, bt_rows8(2, x0, x1, x2, x3, x4, x5))
            store8(v, o + 3 * plane + t, bt_rows8(3, x0, x1, x2, x3, x4, x5))
            store8(v, o + 4 * plane + t, bt_rows8(4, x0, x1, x2, x3, x4, x5))
            store8(v, o + 5 * plane + t, bt_rows8(5, x0, x1, x2, x3, x4, x5))
    return done


@short_loops_kernel
def winograd_input(image, c_first, c_end, tile_first, tile_rows, column, work, v):
    """image [C, HP, WP] (padded) -> v[:, c, column + (ty - tile_first) * TW + tx] for channels
    c_first..c_end-1, tile rows tile_first..tile_first+tile_rows-1 and all TW = tile_count(WP - 2)
    tile columns; v [36, >= C, >= T], work of input_work_shape (scratch, one per concurrent caller).
    Per channel and tile row: E[k] = sum_i B^T[k, i] image row (4ty + i) (whole rows at once, into
    work rows 0-5), then v[6k + l, c, t] = sum_j B^T[l, j] E[k, 4tx + j]: tile by tile, or, from
    GATHERED_MIN_TILES_W tiles a row, for all of the band's tiles at once after each tile row's E is
    gathered into work rows 6 + 6k + j, column t (the same sums in the same order: the same bytes; by
    vector shuffles where SHUFFLES).
    Both steps read their 6 rows once for the 6 rows they make (`bt_row`), one loop over the row, whose
    every access is to one of two arrays, so LLVM vectorizes it with one runtime alias check: the gathered
    step writes its 6 rows into work rows 42-47, then copies them into v's 6 planes (written there from
    the loop, the kernel took 1.2-2.0x the time of the six loops). Against six loops of 6 rows in and one
    out (by hand, 1 thread, the same bytes): 0.73-0.85x the time on 24x24 to 128x128 images, 0.62-0.71x
    on 14x14 and 16x16 (gathered now), 1.0-1.06x on 8x8 (2 tiles a row). Where SHUFFLES, the gathered step
    stores 8 columns at a time straight into v (transformed_rows, one call a channel) and only the last 1-7 go
    through work rows 42-47: with bt_row's zero terms gone too, by hand on a Zen 3 VM (AVX2), 1 thread, the same
    bytes, 0.78-0.85x the time on 16x64^2 to 192x8^2 (the reference and bundled models' shapes), 0.75-0.8x on
    64x16^2 and 96x16^2 (a call a channel and plane, 0.92-0.96x there)."""
    _, padded_h, padded_w = image.shape
    tiles_w = (padded_w + 1) // 4                  # tile_count(WP - 2)
    span = 4 * tiles_w + 2                         # E's columns: past WP they stay 0
    gathered = tiles_w >= GATHERED_MIN_TILES_W
    work[:6, padded_w:span] = 0
    for c in range(c_first, c_end):
        plane = image[c]
        for ty in range(tile_first, tile_first + tile_rows):
            y = 4 * ty
            inside = min(6, padded_h - y)          # patch rows inside the image; the others read 0
            if inside == 6:
                for x in range(padded_w):
                    x0, x1, x2 = plane[y, x], plane[y + 1, x], plane[y + 2, x]
                    x3, x4, x5 = plane[y + 3, x], plane[y + 4, x], plane[y + 5, x]
                    work[0, x], work[1, x] = bt_row(0, x0, x1, x2, x3, x4, x5), bt_row(1, x0, x1, x2, x3, x4, x5)
                    work[2, x], work[3, x] = bt_row(2, x0, x1, x2, x3, x4, x5), bt_row(3, x0, x1, x2, x3, x4, x5)
                    work[4, x], work[5, x] = bt_row(4, x0, x1, x2, x3, x4, x5), bt_row(5, x0, x1, x2, x3, x4, x5)
            else:
                for k in range(6):
                    e = work[k]
                    e[:padded_w] = 0
                    for i in range(inside):
                        b, row = BT32[k, i], plane[y + i]
                        for x in range(padded_w):
                            e[x] += b * row[x]
            t0 = (ty - tile_first) * tiles_w
            for k in range(6):
                e = work[k]
                if gathered:
                    g = 6 + 6 * k
                    done = gather_tile_columns(e, 0, work, g, t0, tiles_w) if SHUFFLES else 0
                    for tx in range(done, tiles_w):
                        x, t = 4 * tx, t0 + tx
                        work[g, t], work[g + 1, t], work[g + 2, t] = e[x], e[x + 1], e[x + 2]
                        work[g + 3, t], work[g + 4, t], work[g + 5, t] = e[x + 3], e[x + 4], e[x + 5]
                    continue
                for tx in range(tiles_w):
                    x = 4 * tx
                    e0, e1, e2, e3, e4, e5 = e[x], e[x + 1], e[x + 2], e[x + 3], e[x + 4], e[x + 5]
                    for l in range(6):
                        v[6 * k + l, c, column + t0 + tx] = bt_row(l, e0, e1, e2, e3, e4, e5)
        if not gathered:
            continue
        count = tile_rows * tiles_w
        done = transformed_rows(work, v, c, column, count) if SHUFFLES else 0
        rest = count - done
        if rest == 0:
            continue
        for k in range(6):
            g = 6 + 6 * k
            for t in range(rest):
                x0, x1, x2 = work[g, done + t], work[g + 1, done + t], work[g + 2, done + t]
                x3, x4, x5 = work[g + 3, done + t], work[g + 4, done + t], work[g + 5, done + t]
                work[42, t], work[43, t] = bt_row(0, x0, x1, x2, x3, x4, x5), bt_row(1, x0, x1, x2, x3, x4, x5)
                work[44, t], work[45, t] = bt_row(2, x0, x1, x2, x3, x4, x5), bt_row(3, x0, x1, x2, x3, x4, x5)
                work[46, t], work[47, t] = bt_row(4, x0, x1, x2, x3, x4, x5), bt_row(5, x0, x1, x2, x3, x4, x5)
            for l in range(6):
                out, row = v[6 * k + l, c, column + done:column + count], work[42 + l]
                for t in range(rest):
                    out[t] = row[t]


@functools.cache
def blas_products_sgemm() -> np.ndarray | None:
    """blas_products' last argument, one array shared by every step: jit.sgemm_address() in an int64 array of one
    (an array, not an int: a helper program writes a step's ints into its source, and each process has its own
    address, so an int would make every process compile its program again), or None where there is no address."""
    address = sgemm_address()
    return None if address is None else np.array([address], np.int64)


@kernel
def blas_products(u, o_first, o_end, v, channels, tiles, m, sgemm):
    """M[k, :o_end - o_first, :tiles] = U[k, o_first:o_end] @ V[k, :channels, :tiles] for the 36 k: BLAS's sgemm
    (its address sgemm[0]: blas_products_sgemm), as np.matmul computes them, but from compiled code, which a helper
    program can run (programs.py: a plan with a Python call of np.matmul gets none)."""
    rows = o_end - o_first
    for k in range(36):
        call_sgemm(sgemm[0], rows, tiles, channels, u[k, o_first:o_end].ctypes.data, u.strides[1] // 4,
                   v[k].ctypes.data, v.strides[1] // 4, m[k].ctypes.data, m.strides[1] // 4)


@kernel
def blas_product(a, b, c, sgemm):
    """c = a @ b for 2-D float32 arrays whose rows are contiguous (unit column stride; any row pitch): BLAS's
    sgemm (its address sgemm[0]: blas_products_sgemm), the product np.matmul(a, b, out=c) computes, from compiled
    code, which a helper program can run. conv2d.py's columns + GEMM path, where np.matmul kept every plan
    with such a conv from having a program (the bundled model's first conv on arm64 and on x86 without FMA)."""
    call_sgemm(sgemm[0], a.shape[0], b.shape[1], a.shape[1], a.ctypes.data, a.strides[0] // 4, b.ctypes.data,
               b.strides[0] // 4, c.ctypes.data, c.strides[0] // 4)


@ieee_kernel
def skinny_products(u, o_first, o_end, vt, tiles, m):
    """M[k, o - o_first, t] = sum over c of U[k, o, c] * V^T[k, t, c] for o_first <= o < o_end and tiles
    t < `tiles` rounded up to 4: u [36, O, C] (all of U), vt [36, >= that, C] (V transposed; its rows
    past `tiles` 0), m [36, >= o_end - o_first, >= that]. The 36 products of a band with few tiles
    (conv2d.py WINOGRAD_MIN_TILES): BLAS packs each [O, C] block of U for a few columns; here
    every U row is read once for 4 tiles, as sums in registers over C (vectorized: ieee_kernel)."""
    channels = u.shape[2]
    for k in range(36):
        for o in range(o_first, o_end):
            row, out = u[k, o], m[k, o - o_first]
            for t in range(0, tiles, 4):
                v0, v1, v2, v3 = vt[k, t], vt[k, t + 1], vt[k, t + 2], vt[k, t + 3]
                s0 = s1 = s2 = s3 = np.float32(0)
                for c in range(channels):
                    w = row[c]
                    s0 += w * v0[c]
                    s1 += w * v1[c]
                    s2 += w * v2[c]
                    s3 += w * v3[c]
                out[t], out[t + 1], out[t + 2], out[t + 3] = s0, s1, s2, s3


@wide_tile_kernel
def fma16(a, x, w):
    """a + x * w[0:16], a and the result 16-tuples (one AVX-512 register)."""
    return (a[0] + x * w[0], a[1] + x * w[1], a[2] + x * w[2], a[3] + x * w[3], a[4] + x * w[4], a[5] + x * w[5],
            a[6] + x * w[6], a[7] + x * w[7], a[8] + x * w[8], a[9] + x * w[9], a[10] + x * w[10],
            a[11] + x * w[11], a[12] + x * w[12], a[13] + x * w[13], a[14] + x * w[14], a[15] + x * w[15])


@wide_tile_kernel
def store16(a, row):
    """row[0:16] = a (a slice indexed 0..15: see recurrent.py store8)."""
    (row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], row[8], row[9], row[10], row[11], row[12],
     row[13], row[14], row[15]) = a


@wide_tile_kernel
def zeros16():
    """16 float32 zeros: an empty sum of one register."""
    z = np.float32(0)
    return (z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z)


@wide_tile_kernel
def six_rows(u, o, last):
    """Rows o..o + 5 of u, those past `last` as row last (a tile's rows past the end are computed, not stored)."""
    return u[o], u[min(o + 1, last)], u[min(o + 2, last)], u[min(o + 3, last)], u[min(o + 4, last)], u[min(o + 5, last)]


@wide_tile_kernel
def four_rows(u, o, last):
    """six_rows for 4 rows (conv_direct.py's direct_pool_tile)."""
    return u[o], u[min(o + 1, last)], u[min(o + 2, last)], u[min(o + 3, last)]


@wide_tile_kernel
def product_tile(u, o, last, v, t, m):
    """m[o + i, t:t + 32] = sum over c of u[o + i, c] * v[c, t:t + 32] for i < 6 and o + i <= last (rows past
    last are computed as row last and not stored): 12 sums of 16 in registers for the whole loop over c,
    each step 6 broadcasts of u and 2 loads of v."""
    a0 = a1 = b0 = b1 = c0 = c1 = d0 = d1 = e0 = e1 = f0 = f1 = zeros16()
    r0, r1, r2, r3, r4, r5 = six_rows(u, o, last)
    for c in range(u.shape[1]):
        row = v[c]
        w0, w1 = load16(row, t), load16(row, t + 16)
        a0, a1 = fma16(a0, r0[c], w0), fma16(a1, r0[c], w1)
        b0, b1 = fma16(b0, r1[c], w0), fma16(b1, r1[c], w1)
        c0, c1 = fma16(c0, r2[c], w0), fma16(c1, r2[c], w1)
        d0, d1 = fma16(d0, r3[c], w0), fma16(d1, r3[c], w1)
        e0, e1 = fma16(e0, r4[c], w0), fma16(e1, r4[c], w1)
        f0, f1 = fma16(f0, r5[c], w0), fma16(f1, r5[c], w1)
    for i, (left, right) in enumerate(((a0, a1), (b0, b1), (c0, c1), (d0, d1), (e0, e1), (f0, f1))):
        if o + i <= last:
            store16(left, m[o + i, t:t + 16])
            store16(right, m[o + i, t + 16:t + 32])


@wide_tile_kernel
def product_column_tile(u, o, last, v, t, m):
    """product_tile for 16 columns t..t + 15: 6 sums of 16."""
    a = b = c_ = d = e = f = zeros16()
    r0, r1, r2, r3, r4, r5 = six_rows(u, o, last)
    for c in range(u.shape[1]):
        w = load16(v[c], t)
        a, b, c_ = fma16(a, r0[c], w), fma16(b, r1[c], w), fma16(c_, r2[c], w)
        d, e, f = fma16(d, r3[c], w), fma16(e, r4[c], w), fma16(f, r5[c], w)
    for i, row in enumerate((a, b, c_, d, e, f)):
        if o + i <= last:
            store16(row, m[o + i, t:t + 16])


@wide_tile_kernel
def block_tile(block, v, t, m, o, last):
    """m[o + i, t:t + 32] = sum over c of block[c, i] * v[c, t:t + 32] for i < 8 and o + i <= last: 16 sums of 16
    in registers for the whole loop over c, each step 8 broadcasts from one row of the block and 2 loads of v."""
    a0 = a1 = b0 = b1 = c0 = c1 = d0 = d1 = e0 = e1 = f0 = f1 = g0 = g1 = h0 = h1 = zeros16()
    for c in range(block.shape[0]):
        row, r = v[c], block[c]
        w0, w1 = load16(row, t), load16(row, t + 16)
        a0, a1, b0, b1 = fma16(a0, r[0], w0), fma16(a1, r[0], w1), fma16(b0, r[1], w0), fma16(b1, r[1], w1)
        c0, c1, d0, d1 = fma16(c0, r[2], w0), fma16(c1, r[2], w1), fma16(d0, r[3], w0), fma16(d1, r[3], w1)
        e0, e1, f0, f1 = fma16(e0, r[4], w0), fma16(e1, r[4], w1), fma16(f0, r[5], w0), fma16(f1, r[5], w1)
        g0, g1, h0, h1 = fma16(g0, r[6], w0), fma16(g1, r[6], w1), fma16(h0, r[7], w0), fma16(h1, r[7], w1)
    for i, (left, right) in enumerate(((a0, a1), (b0, b1), (c0, c1), (d0, d1), (e0, e1), (f0, f1), (g0, g1),
                                       (h0, h1))):
        if o + i <= last:
            store16(left, m[o + i, t:t + 16])
            store16(right, m[o + i, t + 16:t + 32])


@wide_tile_kernel
def block_column_tile(block, v, t, m, o, last):
    """block_tile for 16 columns t..t + 15: 8 sums of 16."""
    a = b = c_ = d = e = f = g = h = zeros16()
    for c in range(block.shape[0]):
        w, r = load16(v[c], t), block[c]
        a, b, c_, d = fma16(a, r[0], w), fma16(b, r[1], w), fma16(c_, r[2], w), fma16(d, r[3], w)
        e, f, g, h = fma16(e, r[4], w), fma16(f, r[5], w), fma16(g, r[6], w), fma16(h, r[7], w)
    for i, row in enumerate((a, b, c_, d, e, f, g, h)):
        if o + i <= last:
            store16(row, m[o + i, t:t + 16])


@wide_tile_kernel
def block_products(blocks, o_first, o_end, v, channels, count, m):
    """small_products for U in blocks (weight_blocks; o_first a multiple of 8), in register tiles of 8 output
    channels x 32 tiles (block_tile) and, for a last 16 columns, x 16 (block_column_tile): where a block's
    8 broadcasts a channel come from one pointer, small_products' 6 from 6 rows (conv2d.py winograd_blocks)."""
    columns = -(-count // 16) * 16
    last = o_end - o_first - 1
    first_block = o_first // BLOCK_ROWS
    for k in range(36):
        vk, mk = v[k, :channels], m[k]
        for t in range(0, columns - 16, 32):
            for o in range(0, last + 1, BLOCK_ROWS):
                block_tile(blocks[k, first_block + o // BLOCK_ROWS, :channels], vk, t, mk, o, last)
        if columns % 32:
            for o in range(0, last + 1, BLOCK_ROWS):
                block_column_tile(blocks[k, first_block + o // BLOCK_ROWS, :channels], vk, columns - 16, mk, o, last)


@wide_tile_kernel
def small_products(u, o_first, o_end, v, channels, count, m):
    """M[k, o - o_first, t] = sum over c < channels of U[k, o, c] * V[k, c, t] for o_first <= o < o_end and
    t < count rounded up to 16 (V's columns up to there must exist: its T' is; those past count are
    never read after): u [36, O, C], v [36, >= C, T'], m [36, >= o_end - o_first, T']. The 36 products
    in register tiles of 6 output channels x 32 tiles, for an AVX-512 host whose BLAS runs without it
    (conv2d.py small_products_pay has the measures): no BLAS call or packing per product."""
    columns = -(-count // 16) * 16
    last = o_end - o_first - 1
    for k in range(36):
        uk, vk, mk = u[k, o_first:o_end, :channels], v[k, :channels], m[k]
        for t in range(0, columns - 16, 32):
            for o in range(0, last + 1, 6):
                product_tile(uk, o, last, vk, t, mk)
        if columns % 32:
            for o in range(0, last + 1, 6):
                product_column_tile(uk, o, last, vk, columns - 16, mk)


@tile_kernel
def fma8(a, x, w):
    """a + x * w[0:8], a and the result 8-tuples (one AVX2 register)."""
    return (a[0] + x * w[0], a[1] + x * w[1], a[2] + x * w[2], a[3] + x * w[3], a[4] + x * w[4], a[5] + x * w[5],
            a[6] + x * w[6], a[7] + x * w[7])


@tile_kernel
def zeros8():
    """8 float32 zeros: an empty sum of one register."""
    z = np.float32(0)
    return (z, z, z, z, z, z, z, z)


STRIP_POSITIONS = 16            # positions a narrow_strip tile computes at once (2 vectors of 8)


@tile_kernel
def narrow_strip(weight, o, last, rows, offsets, first, count, out, column):
    """out[o + i, column + p] = sum over r of weight[o + i, r] * rows[offsets[r] + first + p] for i < 6 and
    positions p < count rounded up to STRIP_POSITIONS: rows flat, row r from offsets[r] + first (V's rows in
    narrow_products, the shifted rows of an image in conv_direct.py's conv3x3_direct_shifted), out C-contiguous. In 8-lane
    vectors for a host with 16 of them (AVX2): 12 sums of 8 in registers over all the rows r for 16 positions,
    each step 6 broadcasts of the weight and 2 loads of row r; the weight's rows past last are computed as row
    last and stored there again (the same values)."""
    i1, i2, i3, i4, i5 = min(o + 1, last), min(o + 2, last), min(o + 3, last), min(o + 4, last), min(o + 5, last)
    pitch = out.shape[1]
    for p in range(0, count, STRIP_POSITIONS):
        a0 = a1 = b0 = b1 = c0 = c1 = d0 = d1 = e0 = e1 = f0 = f1 = zeros8()
        for r in range(offsets.shape[0]):
            at = offsets[r] + first + p
            w0, w1 = load8(rows, at), load8(rows, at + 8)
            x0, x1, x2, x3, x4, x5 = weight[o, r], weight[i1, r], weight[i2, r], weight[i3, r], weight[i4, r], weight[i5, r]
            a0, a1 = fma8(a0, x0, w0), fma8(a1, x0, w1)
            b0, b1 = fma8(b0, x1, w0), fma8(b1, x1, w1)
            c0, c1 = fma8(c0, x2, w0), fma8(c1, x2, w1)
            d0, d1 = fma8(d0, x3, w0), fma8(d1, x3, w1)
            e0, e1 = fma8(e0, x4, w0), fma8(e1, x4, w1)
            f0, f1 = fma8(f0, x5, w0), fma8(f1, x5, w1)
        for i, (left, right) in enumerate(((a0, a1), (b0, b1), (c0, c1), (d0, d1), (e0, e1), (f0, f1))):
            at = min(o + i, last) * pitch + column + p
            store8(out, at, left)
            store8(out, at + 8, right)


@tile_kernel
def narrow_products(u, o_first, o_end, v, channels, count, m):
    """small_products in register tiles of 6 output channels x 16 tiles, one narrow_strip a strip of 6 channels
    along all the tiles: for an x86-64 host with FMA but no AVX-512 (conv2d.py narrow_tiles_pay). Columns up
    to count rounded up to 16 are computed (V's and M's rows are that long: conv2d.py _tile_stride); m
    C-contiguous."""
    offsets = np.arange(channels) * v.shape[2]
    last = o_end - o_first - 1
    for k in range(36):
        uk, vk, mk = u[k, o_first:o_end], v[k].reshape(-1), m[k]
        for o in range(0, last + 1, 6):
            narrow_strip(uk, o, last, vk, offsets, 0, count, mk, 0)


@kernel
def at_row(a, x0, x1, x2, x3, x4, x5):
    """sum_i A^T[a, i] x_i without its zero terms (a a constant where it is inlined; `term`)."""
    return (term(AT32[a, 0], x0) + term(AT32[a, 1], x1) + term(AT32[a, 2], x2) + term(AT32[a, 3], x3)
            + term(AT32[a, 4], x4) + term(AT32[a, 5], x5))


@short_loops_kernel
def tile_outputs(m, first, count, work):
    """m [36, L] (M's planes as rows: column o * T' + t is M[k, o, t]) -> work rows 24-39: Y[4a + b, c] =
    (A^T M[:, first + c] A)[a, b] for the columns c < count from `first`, all at once: S[4i + b] = sum_l
    A^T[b, l] m[6i + l] (M A, into work rows 0-23), then Y[4a + b] = sum_i A^T[a, i] S[4i + b]. The columns
    may span several output channels' tiles (and the junk columns between them: computed, never read).
    As in winograd_input, each loop reads its 6 rows once for the 4 it makes and indexes from 0 (M's rows
    as views from `first`: indexed first + c, LLVM gathered them), so it is vectorized: 0.5-0.6x the time
    of one loop per row made (by hand, the same bytes)."""
    for i in range(6):
        k = 6 * i
        m0, m1, m2 = m[k, first:first + count], m[k + 1, first:first + count], m[k + 2, first:first + count]
        m3, m4, m5 = m[k + 3, first:first + count], m[k + 4, first:first + count], m[k + 5, first:first + count]
        for t in range(count):
            x0, x1, x2, x3, x4, x5 = m0[t], m1[t], m2[t], m3[t], m4[t], m5[t]
            work[4 * i, t], work[4 * i + 1, t] = at_row(0, x0, x1, x2, x3, x4, x5), at_row(1, x0, x1, x2, x3, x4, x5)
            work[4 * i + 2, t], work[4 * i + 3, t] = at_row(2, x0, x1, x2, x3, x4, x5), at_row(3, x0, x1, x2, x3, x4, x5)
    for b in range(4):
        for t in range(count):
            x0, x1, x2 = work[b, t], work[4 + b, t], work[8 + b, t]
            x3, x4, x5 = work[12 + b, t], work[16 + b, t], work[20 + b, t]
            work[24 + b, t], work[28 + b, t] = at_row(0, x0, x1, x2, x3, x4, x5), at_row(1, x0, x1, x2, x3, x4, x5)
            work[32 + b, t], work[36 + b, t] = at_row(2, x0, x1, x2, x3, x4, x5), at_row(3, x0, x1, x2, x3, x4, x5)


# The output transforms' work rows hold this many columns (or one channel's tiles where they are more):
# tile_outputs then transforms several channels' tiles in one pass where a channel has few. By hand, in
# whole calls, 1 thread: leaf_cnn's conv4 (16 tiles a channel) 0.043 ms against 0.073 one channel a pass,
# tomato's conv4 (16) 0.025 against 0.054 and conv5 (4) 0.034 against 0.086, mnist_cnn's conv2 (49) 0.008
# against 0.017; 1024 columns (work rows past L1) gave back part of it, 0.040, 0.029, 0.064.
OUTPUT_PASS_COLUMNS = 256


def output_work_shape(stride: int) -> tuple:
    """The shape of winograd_output's scratch `work` for M's rows of `stride` columns."""
    return 40, max(stride, OUTPUT_PASS_COLUMNS)


@kernel
def channels_a_pass(stride, count, work_w):
    """How many output channels' tiles tile_outputs transforms in one call: as many as work's rows hold
    (channel o's tiles at columns (o - first channel) * stride + t). Few tiles a channel (small images)
    make short loops; transformed together they run as long ones."""
    return 1 + (work_w - count) // stride


@kernel
def output_passes(m, count, work):
    """(M's planes as rows [36, L], M's row length T', the channels a pass) for the output transforms: a pass
    of channels o_pass.. has channel o's `count` tiles at work columns (o - o_pass) * T' + t."""
    stride = m.shape[2]
    return m.reshape((36, m.shape[1] * stride)), stride, channels_a_pass(stride, count, work.shape[1])


@kernel
def winograd_output(m, o_first, o_end, images, tiles_per_image, tile_first, conv_h, conv_w, y_first, y_end,
                    work, acc):
    """m [36, >= O, T'] -> acc [O, positions] for output channels o_first..o_end-1: conv output
    (image j, y, x) of the band's images j, rows y_first..y_end-1, at position (j * conv_h + y -
    y_first) * conv_w + x; tile t = j * tiles_per_image + (ty - tile_first) * TW + tx holds rows
    4ty..4ty+3 and columns 4tx..4tx+3. work [40, >= T] scratch (one per concurrent caller); the wider,
    the more channels a tile_outputs pass (channels_a_pass). Per pass: tile_outputs, then each channel's Y
    into acc tile row by tile row, indexed in place (views of each row, made for each output row, cost more
    than the copies where the rows are short: by hand on a Zen 3 VM, 1 thread, 0.79-0.9x the time on 128x16^2,
    384x8^2 and 256x28^2; the pooled outputs' 2-column interleave, so indexed, was not vectorized: 1.1-1.2x)."""
    tiles_w = (conv_w + 3) // 4                    # tile_count(conv_w)
    tile_rows = tiles_per_image // tiles_w
    full_w = conv_w // 4                           # tiles with all 4 columns inside
    count = images * tiles_per_image
    planes, stride, per_pass = output_passes(m, count, work)
    for o_pass in range(o_first, o_end, per_pass):
        o_pass_end = min(o_pass + per_pass, o_end)
        tile_outputs(planes, o_pass * stride, (o_pass_end - 1 - o_pass) * stride + count, work)
        for o in range(o_pass, o_pass_end):
            target = acc[o]
            for j in range(images):
                for row in range(tile_rows):
                    y = 4 * (tile_first + row)
                    t0 = (o - o_pass) * stride + j * tiles_per_image + row * tiles_w
                    for a in range(max(0, y_first - y), min(4, y_end - y)):
                        line, r = (j * conv_h + y + a - y_first) * conv_w, 24 + 4 * a
                        # (under 4 tiles the intrinsic does none itself, but its code in this loop cost tomato's 8x8
                        # conv5 50-51 us against 42.7 without it: by hand, 3 alternating pairs of processes)
                        done = interleave_rows4(work, r, t0, target, line, full_w) if SHUFFLES and full_w >= 4 else 0
                        for tx in range(done, full_w):
                            x = line + 4 * tx
                            target[x], target[x + 1] = work[r, t0 + tx], work[r + 1, t0 + tx]
                            target[x + 2], target[x + 3] = work[r + 2, t0 + tx], work[r + 3, t0 + tx]
                        for x in range(4 * full_w, conv_w):
                            target[line + x] = work[r + x % 4, t0 + x // 4]


@kernel
def winograd_output_pool2(m, o_first, o_end, images, tiles_per_image, tile_first, conv_w, out_first, out_end,
                          work, pooled):
    """winograd_output followed by the 2x2/2 unpadded max-pool, without acc: pooled [O, positions] gets
    output row py, column px of the band's image j (rows out_first..out_end-1, out_w = conv_w // 2
    columns) at (j * (out_end - out_first) + py - out_first) * out_w + px, the max of conv outputs
    (2py + dy, 2px + dx) in max_pool_2x2_rows' order (the same bytes). Tile ty holds pooled rows 2ty,
    2ty + 1: per pass of channels, tile_outputs, then each tile's 4 maxima over all its columns at once
    (work rows 0-3: P[2pa + pb] for pooled (2ty + pa, 2tx + pb)), then each channel's P into pooled tile
    row by tile row."""
    tiles_w = (conv_w + 3) // 4
    tile_rows = tiles_per_image // tiles_w
    count = images * tiles_per_image
    out_w = conv_w // 2
    full_w = out_w // 2                            # tiles with both pooled columns inside
    band_rows = out_end - out_first
    planes, stride, per_pass = output_passes(m, count, work)
    for o_pass in range(o_first, o_end, per_pass):
        o_pass_end = min(o_pass + per_pass, o_end)
        columns = (o_pass_end - 1 - o_pass) * stride + count
        tile_outputs(planes, o_pass * stride, columns, work)
        for pa in range(2):
            for pb in range(2):
                top, bottom = work[24 + 8 * pa + 2 * pb], work[28 + 8 * pa + 2 * pb]
                top_right, bottom_right = work[25 + 8 * pa + 2 * pb], work[29 + 8 * pa + 2 * pb]
                out = work[2 * pa + pb]
                for t in range(columns):
                    out[t] = max(max(top[t], top_right[t]), max(bottom[t], bottom_right[t]))
        for o in range(o_pass, o_pass_end):
            target = pooled[o]
            for j in range(images):
                for row in range(tile_rows):
                    py0 = 2 * (tile_first + row)
                    t0 = (o - o_pass) * stride + j * tiles_per_image + row * tiles_w
                    for pa in range(max(0, out_first - py0), min(2, out_end - py0)):
                        line = target[(j * band_rows + py0 + pa - out_first) * out_w:]
                        left, right = work[2 * pa, t0:], work[2 * pa + 1, t0:]
                        for tx in range(full_w):
                            line[2 * tx], line[2 * tx + 1] = left[tx], right[tx]
                        for x in range(2 * full_w, out_w):
                            line[x] = work[2 * pa + x % 2, t0 + x // 2]
