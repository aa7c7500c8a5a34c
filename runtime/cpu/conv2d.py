"""conv2d: x [N, C, H, W], weight [O, C/groups, KH, KW], bias [O] -> y [N, O, OH, OW], then the epilogue
and, when a max-pool follows, that pool too.

Reference: formats/ops.py Conv2d.forward (PyTorch semantics: zero padding, stride, dilation, groups).
    y[n, o, oy, ox] = bias[o] + sum over c in o's group, ky, kx of
                      weight[o, c, ky, kx] * x[n, c, oy*SH - PH + ky*DH, ox*SW - PW + kx*DW]   (0 outside x)

Each image goes through three steps, chosen per layer at load:
  1. columns   the input is zero-padded (padding.py) to [C, HP, WP]; the columns matrix has a row per
               (c, ky, kx) and a column per output position.
               stride 1 with at most SHIFTED_MAX_JUNK of a padded row junk: "shifted rows". With the
               padded image flattened per channel, row (c, ky, kx) is the contiguous run
               image[c].flat[ky*DH*WP + kx*DW :][:L], L = (OH-1)*WP + OW, so `shifted_im2col` is
               C*KH*KW plain copies. Column oy*WP + ox holds output (oy, ox); the WP - OW columns at
               the end of each row are junk, computed and never read.
               other strides, and small images: `im2col` gathers every window; column oy*OW + ox
               holds output (oy, ox).
               1x1, stride 1, unpadded: the image itself is the columns matrix.
  2. product   per group, numpy's BLAS computes W2d[g] @ cols[g], W2d [O, C/G*KH*KW], into acc [O, positions].
     direct    instead of 1-2, grouped convs with few inputs per output (depthwise: C/groups = 1) run
               `conv2d_direct` into acc [O, OH*OW]; 3x3 stride-1 undilated ungrouped convs with at most
               DIRECT_MAX_CHANNELS inputs and at most DIRECT_MAX_OUT_CHANNELS outputs (a small first conv
               on an RGB photo) run `conv3x3_direct` (conv_direct.py) into acc [O, positions], pitch OW.
               A 1x1 stride-1 unpadded conv is one plain GEMM on the image itself (step 1 below).
     winograd  instead of 1-2, 3x3 stride-1 undilated ungrouped convs with at least WINOGRAD_MIN_CHANNELS
               inputs and WINOGRAD_MIN_TILES output tiles, or WINOGRAD_MIN_WHOLE_TILES whole ones (or
               any such conv whose layer asks for "algorithm": "winograd") run Winograd
               F(4x4, 3x3) (winograd.py) into acc [O, positions], pitch OW; "im2col" forces steps 1-2.
               A band of fewer than WINOGRAD_MIN_TILES tiles runs its products as skinny_products.
               Its transformed weight U [36, O, C] is made once, at load (after batch-norm folding), in
               blocks of 8 output channels where its products run as block_products (winograd_blocks).
  3. output    the fused max-pool, if any (`max_pool_2x2_rows`, or `max_pool_rows` for any other window),
               reads acc by position pitch into `pooled` (a Winograd conv's 2x2/2 pool is done by its
               output transform instead, winograd_output_pool2: no acc); `epilogue_rows` applies
               act(v * scale[o] + shift[o]) (activations.py) and writes y[n], or the interior of the
               next conv's zero-padded input.
               Separate kernels, chosen at plan time: a model compiles only those it uses.
Steps 1-3 run on bands (CHUNK_BYTES; larger for Winograd, and at least U's size) so that cols and acc are
still in L2 when read: bands of one image's output rows, or several small images at once (one product for
all of them).
With parts > 1 (backend.py: one image over several threads) the work is first cut into parts, each one
task with its own cols/acc/M scratch (`_parts`): by blocks of output channels (each task all of the
bands, the product of its rows of the weight or of U, its channels' output transform, pool and
epilogue) for Winograd where U outweighs V and M (O*C > (C + O) * tiles), for columns + GEMM with more
output channels than positions and for grouped direct convs on one image; else by the images or each
image's output rows (whole Winograd tile rows after a 2x2 pool). Winograd's V is made once per band, by
tasks of input channels, before the tasks of output channels read it (for skinny products, as one V^T that
each task writes its channels' columns of); the columns, made per task, are
the redundant work a cut by channels costs, the weights read by every task that of a cut by rows.
Max-pool fusion (backend.py): a max-pool right after the conv, when the epilogue is monotone, is
applied to acc before the epilogue: a per-channel bias and a non-decreasing activation commute with
the max, so act(max(v) + b) = max(act(v + b)). The full-size conv output is never written in NCHW.
Batch norm after a conv is folded into weight and bias at load (backend.py).
"""

from __future__ import annotations

import functools
from functools import partial

import numpy as np

from lnn.formats.fold import fold_scale_and_shift
from lnn.runtime.cpu.activations import NONE, RELU, SOFTMAX, Epilogue, activate
from lnn.runtime.cpu.aot import A1, A2, A3, A4, F, I, WINDOW
from lnn.runtime.cpu.conv_direct import (conv3x3_direct, conv3x3_direct_quads, conv3x3_direct_shifted,
                                         conv3x3_direct_tiles, conv3x3_direct_tiles_pool2, shifted_tap_offsets)
from lnn.runtime.cpu.jit import VECTOR_FMA, WIDE_VECTORS, blas_libraries, kernel
from lnn.runtime.cpu.padding import padded, padded_buffer
from lnn.runtime.cpu.parallel import SHARED, parallel_steps, split_range
from lnn.runtime.cpu.winograd import (STRIP_POSITIONS, TILE, blas_product, blas_products, blas_products_sgemm,
                                      block_products,
                                      input_work_shape, narrow_products, output_work_shape, skinny_products,
                                      small_products, tile_count, transformed_weight, weight_blocks, winograd_input,
                                      winograd_output, winograd_output_pool2)

# Each kernel's ahead-of-time signature (aot.py): the argument types the backend passes; None: called
# only by other kernels, compiled into them.
AOT_SIGNATURES = {
    "shifted_im2col": (A3, I, I, I, I, I, I, I, A2),
    "im2col": (A3, I, I, I, I, I, I, I, I, I, I, A2),
    "conv2d_direct": (A3, A4, I, I, I, I, I, A3),
    "max_pool_2x2_rows": (A2, I, I, I, I, A2, I, I, I),
    "max_pool_rows": (A2, I, I, I, I, I, WINDOW, A1, A2, I, I, I),
    "epilogue_rows": (A2, I, I, I, A1, A1, I, F, A4, I, I, I, I, I, I),
    "softmax_channels": (A4, I, I, I, I, I, I),
}

# Below this many multiply-adds per output element a grouped conv runs direct, not as tiny GEMMs.
DIRECT_MAX_TAPS = 32
NO_POOL = ((1, 1), (1, 1), (0, 0))      # a 1x1 window: kernel_size, stride, padding
NO_POOL_WINDOW = (1, 1, 1, 1, 0, 0)     # the same, as the kernels' (KH, KW, SH, SW, PH, PW)
# Columns -> product -> output run in bands of about this many bytes of cols + acc (half an L2 of 2 MiB).
CHUNK_BYTES = 1024 * 1024
# Winograd's bands (V, M and acc) are this many times larger: each band's 36 products read all of U (4x
# the weight) again. 1 thread, ms, bands of 1 / 2 / 4 / 8 MiB (2-core EPYC, 1 MiB L2, busy): C=128 O=256
# 28^2 4.1-4.4 / 3.5-3.6 / 3.2-3.7 / 3.3-3.5; C=64 O=128 56^2 + 2x2 pool 3.6-3.7 / 3.0 / 2.9-3.0 /
# 3.0-3.3; C=32 O=64 112^2 + pool 5.8 / 5.2 / 5.2 / 5.8.
WINOGRAD_CHUNK_SCALE = 4
# ... and at least this many times U's bytes, where U outweighs that: the bundled model's conv5 (192 -> 384 at 8x8,
# U 10.6 MB) took bands of 7 images, so a batch of 8 read U twice (and ran its last image as skinny_products). 1
# thread, the bundled model, ms an image, 6 alternating processes each (2026-12-07, the Zen 3 VM, by hand,
# medians): batch 16 2.07 against 2.23, batch 8 2.12 against 2.24; leaf_cnn224 at batch 8 (its 128 -> 256 layer's
# U 4.7 MB) 9.45 against 9.46.
WINOGRAD_BAND_PER_U = 1.0
# "auto" picks Winograd for eligible convs with at least this many input channels: with fewer, the 36
# products [O, C] x [C, tiles] are too thin for BLAS. F(4x4, 3x3), 1 thread, conv + ReLU + 2x2 max-pool,
# ms, Winograd vs columns + GEMM: C=8 O=16 64^2 0.24 vs 0.20; C=16 O=32 64^2 0.55 vs 0.60, 32^2 0.158 vs
# 0.172; C=32 O=64 32^2 0.39 vs 0.73; C=64 O=128 16^2 0.29 vs 0.60; C=128 O=256 8^2 0.57 vs 0.60.
WINOGRAD_MIN_CHANNELS = 16
# ... and whose output has at least this many 4x4 tiles per image: with fewer, U (4x the weight) is read
# for a few columns. 1 thread, conv + ReLU, ms, Winograd (BLAS products) vs columns + GEMM (2-core EPYC,
# busy): C=128 O=256 8^2 (4 tiles) 0.89 vs 0.64, 12^2 (9) 1.02 vs 1.22, 16^2 2.25 vs 2.29; C=256 O=512
# 8^2 3.68 vs 2.81; C=64 O=128 8^2 0.28 vs 0.17, 12^2 0.27 vs 0.32. A band with fewer tiles than this
# runs its 36 products as skinny_products instead (winograd.py: BLAS packs each [O, C] block of U for a
# few columns). One conv + ReLU, 1 thread, ms, Winograd with skinny_products / with BLAS products /
# columns + GEMM, interleaved: 8^2 (4 tiles) C=16 O=32 0.067 / 0.102 / 0.073, C=64 O=128 0.26 / 0.33 /
# 0.26, C=192 O=384 1.52 / 2.87 / 1.74; 8x16 (8 tiles) C=16 O=32 0.064 / 0.076 / 0.054, C=32 O=64
# 0.095 / 0.090 / 0.091, C=128 O=256 0.89 / 1.09 / 1.33, C=192 O=384 2.12 / 3.20 / 3.43.
WINOGRAD_MIN_TILES = 9
# ... or at least this many, all whole (output height and width multiples of 4), with skinny_products.
# 1 thread, conv + ReLU, ms, Winograd vs columns + GEMM, interleaved (2-core EPYC, shared): 8^2 C=16
# O=32 0.067 vs 0.073, C=64 O=128 0.25 vs 0.28, C=128 O=256 0.67 vs 0.81, C=192 O=384 (the bundled
# model's conv5) 1.10 vs 1.63, C=256 O=512 2.54 vs 3.07; but 6^2 (4 tiles, 56% used) C=64 O=128 0.24 vs 0.18.
WINOGRAD_MIN_WHOLE_TILES = 4
# A band's 36 Winograd products (of 9 tiles or more) run as small_products (winograd.py: register tiles in
# AVX-512, no BLAS call or packing per product) where small_products_pay(), else through BLAS. Measured on the
# Zen 5 VM, whose environment holds OpenBLAS at its AVX2 kernels (OPENBLAS_CORETYPE=Haswell), paired medians
# of 15 interleaved rounds, small_products / np.matmul time for O, C, tiles: 48, 24, 256 (tomato's conv2):
# 0.61; 96, 48, 64: 0.55; 192, 96, 16: 0.65; 32, 16, 256 (leaf_cnn's conv2): 0.70; 64, 32, 196 (leaf_cnn224's
# conv2): 0.77; 128, 64, 98: 0.74; 256, 128, 49: 0.58 (in an earlier run of a first version, larger ones lost:
# 128, 64, 196: 1.20; 64, 32, 784: 1.49). Whole calls, all products small_products against only those up to
# 5e5 or 2e6 multiply-adds each: leaf_cnn224 batch 1 0.78x (2e6 against 5e5); batch 8 / 16 on 1 thread,
# tomato 0.87x / 0.85x; batch 32 on 2 threads, tomato 0.93x and 0.88x, leaf_cnn 0.96x and 0.98x, leaf_cnn224
# 0.94x and 1.01x (two runs). With OpenBLAS's own AVX-512 kernels (OPENBLAS_CORETYPE=SkylakeX) np.matmul was
# the faster on 7 of 9 such shapes (small_products / np.matmul 1.12-1.41).
# Where small_products pays, a Winograd conv of at least WINOGRAD_MIN_TILES tiles an image holds U in blocks of 8
# rows (winograd.weight_blocks) and runs its products as block_products: register tiles of 8 output channels x
# 32 tiles, and x 16 for a last 16 (where small_products had 6 x 16: 6 sums in flight, 7 loads for 6
# multiply-adds; 8 or 12 rows read through row pointers ran no faster, 0.88-1.03x and 2.4x). By hand, paired
# medians of 15 interleaved rounds, the products alone (U in cache), block_products / small_products time for
# O, C, tiles: at 16 tiles 128, 64 (leaf_cnn's conv4) 0.69-0.80, 64, 32 0.71-0.75, 192, 96 (tomato's conv4)
# 0.83-0.88, 256, 128 0.80-0.84, 384, 192 0.73-0.88; at more 32, 16, 256 (leaf_cnn's conv2) 0.83-1.11, 64, 32,
# 64 0.88-1.09, 96, 48, 64 0.84-0.96, 32, 32, 784 0.84. Whole calls, blocks for every such conv against blocks
# for those of at most 16 tiles (by hand, 15-21 interleaved rounds of 40 calls): leaf_cnn 0.95x at 1 and 2
# threads, leaf_cnn224 0.95x and 0.99x, tomato 0.97-1.04x; batch 32 on 2 threads, leaf_cnn 0.99x, tomato 0.94x.
# Convs of fewer tiles keep U [36, O, C] for skinny_products (and small_products for a batch's bands).
# On an x86-64 host with FMA but without AVX-512 (16 vector registers of 8 lanes) those products run as
# narrow_products (narrow_tiles_pay): register tiles of 6 output channels x 16 tiles, one call a strip of 6
# channels along all the tiles. Measured on a Zen 3 VM (AVX2; OpenBLAS at its Haswell kernels), the products alone,
# by hand, medians of 15 interleaved rounds, narrow_products / np.matmul (BLAS on one thread) time for O, C, tiles:
# 32, 16, 256 (leaf_cnn's conv2) 0.79-0.81; 64, 32, 64 0.73-0.75; 128, 64, 16 0.75-0.77; 48, 24, 256 (tomato's
# conv2) 0.80-0.81; 96, 48, 64 0.79-0.81; 192, 96, 16 0.75-0.76; 64, 32, 196 (leaf_cnn224's conv2) 0.87-0.89; 128,
# 64, 49 0.95-1.01; 24, 16, 100 0.70-0.75; larger, 128, 64, 98 (leaf_cnn224's conv3 bands) 1.08, 256, 128, 49 (its
# conv4) 1.08, kept (the whole model as fast either way, and a plan with no BLAS step gets its helper program:
# leaf_cnn224 at 2 threads 5.53 ms a call against 5.89 with those products BLAS's, by hand). One call a tile (not
# inlined by LLVM; forced inline by Numba spilled) gave 0.73-1.08; the six rows of U hoisted out of a loop over
# tiles as arrays, 0.83-1.17 (their pointers spilled in the loop over c where C was 64 or more).
AVX512_BLAS_KERNELS = {"SkylakeX", "Cooperlake", "SapphireRapids"}      # OpenBLAS's cores with AVX-512 kernels


def direct_quads_pay(conv_w: int) -> bool:
    """Whether a small direct conv with rows conv_w wide runs as conv_direct.py's conv3x3_direct_quads: the
    JIT on an x86-64 host with FMA (where it was measured faster; conv_direct.py), rows of at least
    DIRECT_QUADS_MIN_WIDTH."""
    return VECTOR_FMA and conv_w >= DIRECT_QUADS_MIN_WIDTH


def direct_tiles_pay(conv_w: int) -> bool:
    """Whether a small direct conv with rows conv_w wide runs as conv_direct.py's conv3x3_direct_tiles (its
    header has the measures): the JIT on an AVX-512 host (jit.WIDE_VECTORS: its register tiles), rows a
    multiple of 16 wide (its tiles read whole vectors of 16)."""
    return WIDE_VECTORS and conv_w % 16 == 0


def narrow_tiles_pay() -> bool:
    """Whether the register tiles of 8-lane vectors run (winograd.py's narrow_strip): the Winograd products of at
    least WINOGRAD_MIN_TILES tiles as narrow_products, the small direct convs as conv_direct.py's
    conv3x3_direct_shifted (their measures: the comment above AVX512_BLAS_KERNELS, conv_direct.py's header).
    The JIT on an x86-64 host with FMA (jit.VECTOR_FMA) but no AVX-512 (jit.WIDE_VECTORS, whose own tiles run
    there). Not measured on arm64 (emulated only), where BLAS and the direct kernels before stay."""
    return VECTOR_FMA and not WIDE_VECTORS


@functools.cache
def small_products_pay() -> bool:
    """Whether small Winograd products run as small_products in this process: a host with AVX-512 for the
    JIT (jit.WIDE_VECTORS) whose BLAS is OpenBLAS running kernels without it (another BLAS, or OpenBLAS with
    its AVX-512 kernels, is left to do them)."""
    if not WIDE_VECTORS:
        return False
    libraries = blas_libraries()
    return bool(libraries) and all(library.internal_api == "openblas" and
                                   getattr(library, "architecture", None) not in AVX512_BLAS_KERNELS
                                   for library in libraries)


# "auto" runs 3x3 convs with at most this many inputs and outputs direct (conv_direct.py): the
# columns matrix has too few rows (9C) and the product too few (O) for BLAS. Measured on 1 thread
# (2-core EPYC, shared), one conv + ReLU + 2x2 max-pool, ms, direct vs columns + GEMM (banded):
# C=3: O=8 128^2 0.17 vs 0.23, O=16 128^2 0.33 vs 0.35, O=16 224^2 0.95 vs 1.10, O=16 32^2 0.039 vs 0.038;
# C=1 O=16 28^2 0.025 vs 0.024; more outputs lose: C=3 O=24 128^2 0.49 vs 0.47, O=32 224^2 2.0 vs 1.9.
DIRECT_MAX_CHANNELS = 3
DIRECT_MAX_OUT_CHANNELS = 16
# Where conv3x3_direct_quads runs (direct_quads_pay), convs of up to this many outputs run direct. The first
# conv (+ pool + epilogue) of the reference models and the bundled one, 1 thread (Zen 5 VM), ms, quads against
# conv3x3_direct and columns + GEMM: 3 -> 16 at 128^2 0.165 vs 0.196-0.201 (direct before); 3 -> 24 at 128^2
# 0.279 vs 0.362 and 0.341 (GEMM before); 3 -> 32 at 224^2 1.007 vs 1.321 and 1.383 (GEMM before).
DIRECT_QUADS_MAX_OUT_CHANNELS = 32
# Where the narrow tiles run (narrow_tiles_pay), every 3x3 conv too thin for Winograd (fewer than
# WINOGRAD_MIN_CHANNELS inputs) with up to this many outputs runs direct, as conv3x3_direct_shifted, on rows of
# any width. One conv + ReLU, 1 thread, us, shifted against columns + GEMM (Zen 3 VM, by hand, medians of 15):
# C=4 O=16 64^2 76 vs 124; C=8 O=16 64^2 139 vs 206, 128^2 530 vs 790; C=8 O=32 64^2 262 vs 326; C=12 O=24 32^2
# 70 vs 109; C=15 O=32 32^2 123 vs 157; C=3 O=48 96^2 367 vs 534; C=3 O=64 128^2 900 vs 1111; C=8 O=64 64^2 498
# vs 581; C=15 O=64 32^2 226 vs 265; C=15 O=128 16^2 121 vs 153 (more outputs not measured);
# benchmarks/cpu_thin_convs.py runs these beside onnxruntime (BENCHMARKS "cpu_thin_convs").
SHIFTED_MAX_OUT_CHANNELS = 128
# conv3x3_direct_quads on rows at least this wide (narrower: conv3x3_direct, 1 thread, us: C=1 O=16 28^2 6 vs 9,
# C=3 O=16 56^2 44 vs 41, C=1 O=8 64^2 10 vs 11; 128^2 and 224^2 above)
DIRECT_QUADS_MIN_WIDTH = 96
# Stride-1 columns are "shifted rows" (pitch WP) while at most this share of each row is junk (WP - OW
# columns); on narrower images im2col gathers them at pitch OW and the product computes no junk. 1 thread,
# ms, a conv like the bundled model's conv5 (192 -> 384, 8x8, pad 1: 20% junk; it runs Winograd) as columns +
# GEMM, im2col vs shifted: 1.56 vs 1.73.
SHIFTED_MAX_JUNK = 0.125
# A conv cut by output channels over threads (conv2d.plan) is cut on multiples of this many channels.
CHANNEL_ALIGN = 16      # (a multiple of winograd.BLOCK_ROWS: block_products takes whole blocks of U)


def matrix_product(a, b, out):
    """The step out = a @ b (2-D float32): winograd.blas_product where NumPy's BLAS has an address for it and every
    row is contiguous (a helper program can call it), else np.matmul."""
    sgemm = blas_products_sgemm()
    if sgemm is not None and all(array.strides[1] == array.itemsize for array in (a, b, out)):
        return partial(blas_product, a, b, out, sgemm)
    return partial(np.matmul, a, b, out=out)


@kernel
def shifted_im2col(image, kh, kw, dh, dw, start, length, column, cols):
    """image [C, HP, WP] (padded) -> cols[:, column:column + length], cols [C*KH*KW, ...]:
    row (c, ky, kx) = image[c].flat[start + shift:][:length], shift = ky*DH*WP + kx*DW."""
    channels, _, padded_w = image.shape
    for c in range(channels):
        plane = image[c].ravel()
        for ky in range(kh):
            for kx in range(kw):
                shift = start + ky * dh * padded_w + kx * dw
                source = plane[shift:shift + length]
                row = cols[(c * kh + ky) * kw + kx, column:]
                for i in range(length):     # indexing a slice by the loop counter: LLVM vectorizes this copy
                    row[i] = source[i]


@kernel
def im2col(image, kh, kw, sh, sw, dh, dw, first_row, out_h, out_w, column, cols):
    """image [C, H, W] (already padded) -> cols[:, column:column + out_h*OW], cols [C*KH*KW, ...]; row (c, ky, kx),
    column + (oy, ox) for output rows first_row..first_row+out_h-1."""
    channels = image.shape[0]
    for c in range(channels):
        for ky in range(kh):
            for kx in range(kw):
                row = cols[(c * kh + ky) * kw + kx, column:]
                for oy in range(out_h):
                    source = image[c, (first_row + oy) * sh + ky * dh]
                    base = oy * out_w
                    for ox in range(out_w):
                        row[base + ox] = source[ox * sw + kx * dw]


@kernel
def conv2d_direct(image, weight, groups, sh, sw, dh, dw, out):
    """image [C, H, W] (already padded), weight [O, C/groups, KH, KW] -> out [O, OH, OW] (no bias)."""
    out_channels, group_in, kh, kw = weight.shape
    _, out_h, out_w = out.shape
    group_out = out_channels // groups
    for o in range(out_channels):
        first_in = (o // group_out) * group_in
        plane = out[o]
        plane[:, :] = 0
        for ci in range(group_in):
            for ky in range(kh):
                for kx in range(kw):
                    tap = weight[o, ci, ky, kx]
                    for oy in range(out_h):
                        source = image[first_in + ci, oy * sh + ky * dh]
                        target = plane[oy]
                        for ox in range(out_w):
                            target[ox] += tap * source[ox * sw + kx * dw]


# The output kernels below read rows of a band: "row (j, y)" of an [O, positions] source is the run of
# out_w values at position (j * image_rows + y - first_row) * pitch, for image j of the band. In acc,
# image_rows = conv_h (conv rows); in pooled, image_rows = out_end - out_first (output rows).


@kernel
def max_pool_2x2_rows(acc, pitch, first_row, conv_h, images, pooled, out_first, out_end, out_w):
    """The common 2x2/2 unpadded max-pool as one loop with constant strides: for each of the band's
    images j and output rows py in out_first..out_end-1, row (j, py) of pooled = max-pool of acc rows
    (j, 2py) and (j, 2py + 1)."""
    band_rows = out_end - out_first
    for o in range(acc.shape[0]):
        plane = acc[o]
        for j in range(images):
            for py in range(out_first, out_end):
                top = plane[(j * conv_h + 2 * py - first_row) * pitch:]
                bottom = plane[(j * conv_h + 2 * py + 1 - first_row) * pitch:]
                target = pooled[o, (j * band_rows + py - out_first) * out_w:]
                for px in range(out_w):
                    target[px] = max(max(top[2 * px], top[2 * px + 1]), max(bottom[2 * px], bottom[2 * px + 1]))


@kernel
def max_pool_rows(acc, pitch, first_row, conv_h, conv_w, images, pool, rows_max, pooled, out_first, out_end, out_w):
    """Any max-pool, pool = (KH, KW, SH, SW, PH, PW), of acc rows into pooled rows as max_pool_2x2_rows
    does; cells outside the conv output are skipped. Per output row: down the window's rows into
    rows_max [conv_w], then along them."""
    pool_kh, pool_kw, pool_sh, pool_sw, pool_ph, pool_pw = pool
    band_rows = out_end - out_first
    for o in range(acc.shape[0]):
        plane = acc[o]
        for j in range(images):
            for py in range(out_first, out_end):
                top = py * pool_sh - pool_ph
                y_first, y_end = max(top, 0), min(top + pool_kh, conv_h)
                source = plane[(j * conv_h + y_first - first_row) * pitch:]
                for x in range(conv_w):
                    rows_max[x] = source[x]
                for y in range(y_first + 1, y_end):
                    source = plane[(j * conv_h + y - first_row) * pitch:]
                    for x in range(conv_w):
                        rows_max[x] = max(rows_max[x], source[x])
                target = pooled[o, (j * band_rows + py - out_first) * out_w:]
                for px in range(out_w):
                    left = px * pool_sw - pool_pw
                    x_first, x_end = max(left, 0), min(left + pool_kw, conv_w)
                    best = rows_max[x_first]
                    for x in range(x_first + 1, x_end):
                        best = max(best, rows_max[x])
                    target[px] = best


@kernel
def epilogue_rows(src, pitch, first_row, image_rows, scale, shift, code, slope,
                  dst, images, dst_top, dst_left, out_first, out_end, out_w):
    """dst[j, o, dst_top + py, dst_left + px] = act(row (j, py) of src [px] * scale[o] + shift[o]) for the
    band's images j (dst starts at the band's first image), py in out_first..out_end-1, px < out_w;
    act is not softmax (see softmax_channels). ReLU has its own loop: with `activate` inlined into
    it, that loop ran slower."""
    for o in range(src.shape[0]):
        a, b = scale[o], shift[o]
        for j in range(images):
            for py in range(out_first, out_end):
                row = src[o, (j * image_rows + py - first_row) * pitch:]
                target = dst[j, o, dst_top + py, dst_left:]
                if code == RELU:
                    for px in range(out_w):
                        target[px] = max(row[px] * a + b, np.float32(0))
                else:
                    for px in range(out_w):
                        target[px] = activate(row[px] * a + b, code, slope)


@kernel
def softmax_channels(dst, images, dst_top, dst_left, out_first, out_end, out_w):
    """In place over dst[j, :, dst_top + py, dst_left + px] for j < images, py in out_first..out_end-1,
    px < out_w: softmax across channels."""
    channels = dst.shape[1]
    for j in range(images):
        for py in range(dst_top + out_first, dst_top + out_end):
            for px in range(dst_left, dst_left + out_w):
                largest = np.float32(-np.inf)
                for o in range(channels):
                    largest = max(largest, dst[j, o, py, px])
                total = np.float32(0)
                for o in range(channels):
                    e = np.float32(np.exp(dst[j, o, py, px] - largest))
                    dst[j, o, py, px] = e
                    total += e
                for o in range(channels):
                    dst[j, o, py, px] /= total


class Conv2dLayer:
    ops = ("conv2d",)  # the registry ops this layer runs (backend.py LAYERS)

    def __init__(self, node, weights):
        attrs = node.attrs
        self.attrs = attrs
        self.conv_shape = self.out_shape = node.out_shape
        self.weight = np.array(weights[node.param_key("weight")], dtype=np.float32)   # own copy: folding edits it
        out_channels = attrs["out_channels"]
        self.epilogue = Epilogue.identity(out_channels)
        if attrs["bias"]:
            self.epilogue.shift = np.array(weights[node.param_key("bias")], dtype=np.float32)
        self.epilogue.set_activation(attrs["activation"])
        self.pool = NO_POOL      # (kernel_size, stride, padding) of a fused max-pool
        self.output_padding = (0, 0)    # set by backend.py when the next layer is a padded conv
        self._pack_weight()

    @property
    def input_padding(self) -> tuple:
        return self.attrs["padding"]

    def fold(self, scale: np.ndarray, shift: np.ndarray) -> None:
        """Absorb y -> y * scale + shift per output channel (a batch norm) into weight and bias."""
        self.weight, self.epilogue.shift = fold_scale_and_shift(self.weight, self.epilogue.shift, scale, shift)
        self._pack_weight()

    def _pack_weight(self) -> None:
        """The weight in the layout the product reads, at load: for Winograd U [36, O, C] (winograd.py), or where
        the products run as block_products (winograd_blocks), U in blocks [36, O / 8, C, 8]. winograd_blocks:
        every band's products run so (a band of several images too): convs of at least WINOGRAD_MIN_TILES tiles
        an image, where small_products pays (measured: the comment above AVX512_BLAS_KERNELS)."""
        self.winograd_weight = transformed_weight(self.weight) if self.winograd else None
        tiles = tile_count(self.conv_shape[1]) * tile_count(self.conv_shape[2])
        self.winograd_blocks = self.winograd and tiles >= WINOGRAD_MIN_TILES and small_products_pay()
        if self.winograd_blocks:
            self.winograd_weight = weight_blocks(self.winograd_weight)

    def fuse_max_pool(self, pool) -> None:
        """Run the max-pool layer `pool` inside this conv's output step (see the header)."""
        a = pool.attrs
        self.pool = (a["kernel_size"], a["stride"], a["padding"])
        self.out_shape = pool.out_shape

    @property
    def has_pool(self) -> bool:
        return self.pool != NO_POOL

    @property
    def direct(self) -> bool:
        _, group_in, kh, kw = self.weight.shape
        return self.attrs["groups"] > 1 and group_in * kh * kw <= DIRECT_MAX_TAPS

    @property
    def small_direct(self) -> bool:
        a = self.attrs
        if not (a["algorithm"] == "auto" and a["kernel_size"] == (3, 3) and a["stride"] == (1, 1)
                and a["dilation"] == (1, 1) and a["groups"] == 1):
            return False
        if narrow_tiles_pay():
            return a["in_channels"] < WINOGRAD_MIN_CHANNELS and self.conv_shape[0] <= SHIFTED_MAX_OUT_CHANNELS
        return a["in_channels"] <= DIRECT_MAX_CHANNELS and self.conv_shape[0] <= (
            DIRECT_QUADS_MAX_OUT_CHANNELS if direct_quads_pay(self.conv_shape[2]) else DIRECT_MAX_OUT_CHANNELS)

    @property
    def winograd(self) -> bool:
        a = self.attrs
        eligible = (a["kernel_size"] == (3, 3) and a["stride"] == (1, 1) and a["dilation"] == (1, 1)
                    and a["groups"] == 1)
        if a["algorithm"] == "auto":
            _, conv_h, conv_w = self.conv_shape
            tiles = tile_count(conv_h) * tile_count(conv_w)
            whole = conv_h % TILE == 0 and conv_w % TILE == 0
            return (eligible and a["in_channels"] >= WINOGRAD_MIN_CHANNELS
                    and (tiles >= WINOGRAD_MIN_TILES or whole and tiles >= WINOGRAD_MIN_WHOLE_TILES))
        return eligible and a["algorithm"] == "winograd"

    @property
    def pool_2x2(self) -> bool:
        """Whether the fused max-pool is the common 2x2/2 unpadded one."""
        return self.pool == ((2, 2), (2, 2), (0, 0))

    @property
    def winograd_pools(self) -> bool:
        """A Winograd conv whose fused max-pool is 2x2/2 unpadded: its output transform pools (winograd.py
        winograd_output_pool2; its bands and parts hold whole tile rows, _tile_rows_align)."""
        return self.winograd and self.pool_2x2

    @property
    def direct_tiles_pool(self) -> bool:
        """A small direct conv in register tiles whose fused max-pool is 2x2/2 unpadded: the tiles pool
        (conv_direct.py conv3x3_direct_tiles_pool2; a band's conv rows are those of its pooled rows, an even
        count)."""
        return self.small_direct and direct_tiles_pay(self.conv_shape[2]) and self.pool_2x2

    @property
    def product_pools(self) -> bool:
        """Whether the product step writes the max-pooled rows itself (winograd_pools or direct_tiles_pool): no
        max-pool step, no acc."""
        return self.winograd_pools or self.direct_tiles_pool

    @property
    def pointwise(self) -> bool:
        a = self.attrs
        return (a["kernel_size"] == (1, 1) and a["stride"] == (1, 1) and a["padding"] == (0, 0))

    @property
    def flops(self) -> int:
        """Per image, a multiply-add counted 2: what backend.py weighs before splitting the layer."""
        return 2 * self.weight.size * self.conv_shape[1] * self.conv_shape[2]

    def plan(self, src, new_buffer, parts: int = 1):
        """parts > 1: the work is shared out between that many independent tasks (parallel.py), each
        with scratch buffers of its own, writing disjoint rows or channels of the output (`_parts`)."""
        whole_dst, dst = padded_buffer((src.shape[0], *self.out_shape), *self.output_padding, new_buffer)
        image, steps = padded(src, *self.attrs["padding"], 0.0, new_buffer)
        def new_scratch(worker):          # what only this layer's steps use, in that task's block (backend.Plan)
            return partial(new_buffer, scratch=True, worker=worker)

        cuts = self._parts(image.shape[0], image.shape[3], parts)
        if not (self.winograd and cuts[0][1] != (0, self.conv_shape[0])):
            tasks = [[step for band in self._band_steps(image, bands, channels, whole_dst, new_scratch(task))
                      for step in band] for task, (bands, channels) in enumerate(cuts)]
            return dst, steps + parallel_steps(tasks)
        # Winograd by output channels: per band, V by blocks of input channels, then the rest by output channels
        bands = cuts[0][0]
        shared, inputs = self._shared_winograd_input(image, bands, len(cuts), new_scratch)
        per_task = [self._band_steps(image, bands, channels, whole_dst, new_scratch(task), shared)
                    for task, (_, channels) in enumerate(cuts)]
        for index in range(len(bands)):
            steps += parallel_steps(inputs[index]) + parallel_steps([task[index] for task in per_task])
        return dst, steps

    def _parts(self, batch: int, padded_w: int, parts: int) -> list:
        """[(bands, (o_first, o_end)), ...]: one task each. Cut by output channels (each task all of the
        bands, one image per band, a block of the channels): for Winograd where U [36, O, C] outweighs V and M
        [36, C+O, tiles] (its V is made first, split by input channels, then read by every block: plan), so
        that no part reads all of U and the 36 products keep the band's full width (by tile rows otherwise:
        one hand-off a layer instead of two a band, for no more work in all); for columns + GEMM where the
        weights outweigh the columns (out_channels > the batch's positions: a part by rows reads all the
        weights, a part by channels makes all the columns); for a grouped direct conv on fewer images than
        parts. By rows or images (`_bands`) otherwise, or when the channels make one block, or for a softmax
        epilogue (it reads every channel)."""
        out_channels = self.conv_shape[0]
        if parts == 1 or self.epilogue.code == SOFTMAX:
            return [(bands, (0, out_channels)) for bands in self._bands(batch, padded_w, parts)]
        group_out = out_channels // self.attrs["groups"]
        if self.direct:
            by_channels, align = batch < parts, group_out
        else:
            _, conv_h, conv_w = self.conv_shape
            in_channels = self.weight.shape[1]
            if self.winograd:       # U [36, O, C] against V and M [36, C + O, tiles] of the batch
                tiles = tile_count(conv_h) * tile_count(conv_w) * batch
                by_channels = out_channels * in_channels > (in_channels + out_channels) * tiles
            else:
                by_channels = self.attrs["groups"] == 1 and out_channels > conv_h * conv_w * batch
            align = CHANNEL_ALIGN
        blocks = split_range(0, out_channels, parts, align)
        if not by_channels or len(blocks) == 1:
            return [(bands, (0, out_channels)) for bands in self._bands(batch, padded_w, parts)]
        bands = [(n, n + 1, *rows) for first, end, *rows in self._bands(batch, padded_w)[0] for n in range(first, end)]
        return [(bands, block) for block in blocks]

    def _band_steps(self, image, bands: list, channels: tuple, whole_dst, new_scratch, shared=None) -> list:
        """[[step, ...] per band]: steps 1-3 of each band for output channels channels[0]..channels[1]-1,
        with scratch buffers of their own (acc and pooled hold only those channels). A block of the
        channels writes dst[n:n + 1, o_first:o_end], one image per band: a C-contiguous view (its batch
        axis has size 1). shared: Winograd's V, made by earlier steps (_shared_winograd_input)."""
        out_channels, conv_h, conv_w = self.conv_shape
        o_first, o_end = channels
        whole = (o_first, o_end) == (0, out_channels)
        per_band = []
        e = self.epilogue
        out_w = self.out_shape[2]
        rows_max = new_scratch((conv_w,))
        pooled = new_scratch((o_end - o_first, max((band[1] - band[0]) * (band[3] - band[2]) for band in bands) * out_w))
        product = self._product(image, bands, channels, new_scratch, shared, pooled)
        pool = (*self.pool[0], *self.pool[1], *self.pool[2])
        code = NONE if e.code == SOFTMAX else e.code
        scale, shift = e.scale[o_first:o_end], e.shift[o_first:o_end]
        for band in bands:
            n_first, n_end, out_first, out_end, y_first, _ = band
            images, rows = n_end - n_first, (out_first, out_end, out_w)
            steps = []
            per_band.append(steps)
            acc, pitch = product(band, steps)
            if pool == NO_POOL_WINDOW:
                source = (acc, pitch, y_first, conv_h)
            else:
                source = (pooled, out_w, out_first, out_end - out_first)
                if self.product_pools:
                    pass                        # the product wrote pooled
                elif self.pool_2x2:
                    steps.append(partial(max_pool_2x2_rows, acc, pitch, y_first, conv_h, images, pooled, *rows))
                else:
                    steps.append(partial(max_pool_rows, acc, pitch, y_first, conv_h, conv_w, images, pool, rows_max,
                                         pooled, *rows))
            band_dst = whole_dst[n_first:] if whole else whole_dst[n_first:n_end, o_first:o_end]
            steps.append(partial(epilogue_rows, *source, scale, shift, code, e.slope,
                                 band_dst, images, *self.output_padding, *rows))
            if e.code == SOFTMAX:
                steps.append(partial(softmax_channels, band_dst, images, *self.output_padding, *rows))
        return per_band

    def _bands(self, batch: int, padded_w: int, parts: int = 1) -> list:
        """[[(first, end image, first, end output row, first, end conv row), ...] per part]: what one
        product step covers, so that its columns matrix and product stay within CHUNK_BYTES (still in
        L2 when read): several whole images when they are small, else bands of one image's rows. With
        parts > 1 the images, or when fewer than parts, each image's output rows, are cut into parts
        first. Bands and parts of a Winograd conv hold whole tile rows where a pool allows it."""
        out_h = self.out_shape[1]
        conv_h = self.conv_shape[1]
        if self.direct:
            return [[(n, n + 1, 0, out_h, 0, conv_h) for n in range(start, stop)]
                    for start, stop in split_range(0, batch, parts)]
        out_channels, in_channels = self.weight.shape[:2]
        if self.small_direct:  # acc
            column_bytes = out_channels * 4
        elif self.winograd:    # V and M (36 values per 4x4 outputs) + acc
            column_bytes = 9 * (in_channels + out_channels) + 4 * out_channels     # bytes: 2.25 + 2.25 + 1 floats
        else:                  # cols + acc
            column_bytes = (self.weight[0].size * self.attrs["groups"] + out_channels) * 4
        image_bytes = column_bytes * padded_w * conv_h
        chunk = CHUNK_BYTES * (WINOGRAD_CHUNK_SCALE if self.winograd else 1)
        if self.winograd:
            chunk = max(chunk, int(WINOGRAD_BAND_PER_U * self.winograd_weight.nbytes))
        if 2 * image_bytes <= chunk and not self.pointwise and batch >= parts:
            group = chunk // image_bytes
            return [[(n, min(n + group, stop), 0, out_h, 0, conv_h) for n in range(start, stop, group)]
                    for start, stop in split_range(0, batch, parts)]
        (kh, _), (sh, _), (ph, _) = self.pool
        align = self._tile_rows_align()
        rows_per_band = -(-out_h // -(-image_bytes // chunk))
        rows_per_band = -(-rows_per_band // align) * align
        pieces = [(n, first, end) for n in range(batch)                 # (image, output rows) per part
                  for first, end in split_range(0, out_h, -(-parts // batch), align)]
        return [[(n, n + 1, first, min(first + rows_per_band, end),
                  max(first * sh - ph, 0), min((min(first + rows_per_band, end) - 1) * sh - ph + kh, conv_h))
                 for n, top, end in pieces[start:stop] for first in range(top, end, rows_per_band)]
                for start, stop in split_range(0, len(pieces), parts)]

    def _tile_rows_align(self) -> int:
        """Output rows per Winograd tile row (so that bands and parts cut between tile rows and none is
        computed twice): TILE, TILE / stride after a pool whose window is its stride, else 1."""
        if not self.winograd:
            return 1
        (kh, _), (sh, _), (ph, _) = self.pool
        return TILE // sh if kh == sh and ph == 0 and TILE % sh == 0 else 1

    def _product(self, image, bands: list, channels: tuple, new_scratch, shared=None, pooled=None):
        """f(band, steps) -> (acc, pitch): appends the steps that fill acc [o_end - o_first, positions]
        with conv rows y_first..y_end-1 of the band's images, output channels o_first..o_end-1
        (`channels`; a block of whole groups): (image n_first + j, y, x) at position
        (j * conv_h + y - y_first) * pitch + x; when product_pools, they fill `pooled` instead, as the 2x2
        max-pool step would. Kernels get whole buffers, or blocks of their first axis, not column views: a view
        is a non-contiguous array type, which Numba would compile a second time."""
        a = self.attrs
        out_channels, conv_h, conv_w = self.conv_shape
        o_first, o_end = channels
        geometry = (*a["stride"], *a["dilation"])
        group_out = out_channels // a["groups"]
        groups = (o_end - o_first) // group_out if a["groups"] > 1 else 1      # groups > 1: whole groups
        weight = self.weight[o_first:o_end]
        if self.direct:
            raw = new_scratch((o_end - o_first, conv_h, conv_w))
            acc = raw.reshape(o_end - o_first, -1)
            group_in = weight.shape[1]
            inputs = slice(o_first // group_out * group_in, o_end // group_out * group_in)

            def direct(band, steps):
                steps.append(partial(conv2d_direct, image[band[0], inputs], weight, groups, *geometry, raw))
                return acc, conv_w
            return direct

        if self.small_direct:
            return self._small_direct_product(image, bands, weight, new_scratch, pooled)
        if self.winograd:
            return self._winograd_product(image, bands, channels, new_scratch, shared, pooled)
        weight2d = weight.reshape(groups, (o_end - o_first) // groups, -1)
        rows = weight2d.shape[2] * groups
        shifted = (a["stride"] == (1, 1) and not self.pointwise
                   and image.shape[3] - conv_w <= SHIFTED_MAX_JUNK * image.shape[3])
        pitch = image.shape[3] if shifted else conv_w

        def positions(band):
            n_first, n_end, _, _, y_first, y_end = band
            return ((n_end - n_first - 1) * conv_h + y_end - y_first - 1) * pitch + conv_w

        most = -(-max(positions(band) for band in bands) // 16) * 16     # rows start 64-byte aligned
        acc_buffer = new_scratch((o_end - o_first, most))
        if not self.pointwise:
            cols_buffer = new_scratch((rows, most))     # the columns between two images: junk, never read

        def gemm(band, steps):
            n_first, n_end, _, _, y_first, y_end = band
            count = positions(band)
            if self.pointwise:
                cols = image[n_first].reshape(rows, -1)[:, y_first * pitch:y_first * pitch + count]
            else:
                cols = cols_buffer[:, :count]
                for n in range(n_first, n_end):
                    column = (n - n_first) * conv_h * pitch
                    if shifted:
                        steps.append(partial(shifted_im2col, image[n], *a["kernel_size"], *a["dilation"],
                                             y_first * pitch, (y_end - y_first - 1) * pitch + conv_w, column, cols_buffer))
                    else:
                        steps.append(partial(im2col, image[n], *a["kernel_size"], *geometry, y_first, y_end - y_first,
                                             conv_w, column, cols_buffer))
            grouped_acc = acc_buffer[:, :count].reshape(groups, -1, count)
            for g in range(groups):
                steps.append(matrix_product(weight2d[g], cols[g * (rows // groups):(g + 1) * (rows // groups)],
                                            grouped_acc[g]))
            return acc_buffer, pitch
        return gemm

    def _small_direct_product(self, image, bands: list, weight, new_scratch, pooled):
        """The product step of _product as `conv3x3_direct`: conv rows y_first..y_end-1 of the band's
        images into acc, pitch OW (WP where narrow_tiles_pay: conv3x3_direct_shifted), for the output
        channels of `weight` (a block of self.weight); when direct_tiles_pool, their 2x2 maxima into `pooled`
        instead (pitch OW / 2), as the max-pool step would."""
        out_channels = weight.shape[0]
        _, conv_h, conv_w = self.conv_shape
        if self.direct_tiles_pool:
            out_w = self.out_shape[2]

            def pooling(band, steps):
                n_first, n_end, out_first, out_end, y_first, _ = band
                for n in range(n_first, n_end):         # 2 conv rows a pooled row (an odd last row is dropped)
                    steps.append(partial(conv3x3_direct_tiles_pool2, image[n], weight, 0, out_channels, y_first,
                                         y_first + 2 * (out_end - out_first), (n - n_first) * (out_end - out_first) * out_w,
                                         pooled))
                return pooled, out_w
            return pooling
        if narrow_tiles_pay() and image.flags.c_contiguous:     # (its rows read as one flat image)
            padded_w = image.shape[3]
            acc = new_scratch((out_channels, max((band[1] - band[0]) * conv_h * padded_w for band in bands)
                                              + STRIP_POSITIONS))
            flat_weight = np.ascontiguousarray(weight.reshape(out_channels, -1))
            offsets = shifted_tap_offsets(*image.shape[1:])

            def shifted(band, steps):
                n_first, n_end, _, _, y_first, y_end = band
                for n in range(n_first, n_end):
                    steps.append(partial(conv3x3_direct_shifted, image[n].reshape(-1), flat_weight, offsets, padded_w,
                                         y_first, y_end, (n - n_first) * conv_h * padded_w, acc))
                return acc, padded_w
            return shifted
        acc = new_scratch((out_channels, max((band[1] - band[0]) * conv_h * conv_w for band in bands)))
        direct = (conv3x3_direct_tiles if direct_tiles_pay(conv_w) else
                  conv3x3_direct_quads if direct_quads_pay(conv_w) else conv3x3_direct)

        def product(band, steps):
            n_first, n_end, _, _, y_first, y_end = band
            for n in range(n_first, n_end):
                steps.append(partial(direct, image[n], weight, 0, out_channels, y_first, y_end,
                                     (n - n_first) * conv_h * conv_w, acc))
            return acc, conv_w
        return product

    def _band_tiles(self, band) -> tuple:
        """(first tile row, tile rows, images) of a band."""
        n_first, n_end, _, _, y_first, y_end = band
        tile_first = y_first // TILE
        return tile_first, tile_count(y_end) - tile_first, n_end - n_first

    @staticmethod
    def _tile_stride(columns: int) -> int:
        """V's and M's row length for `columns` tiles: 16 times an odd number (see _winograd_product)."""
        stride = -(-columns // 16) * 16
        return stride + 16 * (stride // 16 % 2 == 0)

    def _winograd_input_scratch(self, in_channels: int, bands: list, new_scratch) -> tuple:
        """(V [36, C + 1, T'] for the largest of the bands, and the shape of winograd_input's `work`). V's columns
        past a band's tiles hold junk (small_products reads up to 16 of them into columns of M never read)."""
        tiles_w = tile_count(self.conv_shape[2])
        band_tiles = [self._band_tiles(band) for band in bands]
        v_buffer = new_scratch((36, in_channels + 1,
                                self._tile_stride(max(rows * tiles_w * images for _, rows, images in band_tiles))))
        return v_buffer, input_work_shape(tiles_w, max(rows for _, rows, _ in band_tiles))

    def _skinny(self, bands: list) -> tuple:
        """(V^T's rows, or None, and whether every band's products are skinny_products): the bands of fewer than
        WINOGRAD_MIN_TILES tiles, where U is not in blocks, run them; V^T holds the most tiles of those, rounded
        up to 4."""
        tiles_w = tile_count(self.conv_shape[2])
        counts = [rows * tiles_w * images for _, rows, images in map(self._band_tiles, bands)]
        skinny = [] if self.winograd_blocks else [count for count in counts if count < WINOGRAD_MIN_TILES]
        return (-(-max(skinny) // 4) * 4 if skinny else None), len(skinny) == len(counts)

    def _shared_winograd_input(self, image, bands: list, parts: int, new_scratch) -> tuple:
        """(shared, [[task, ...] per band]): V of one band at a time, made by `parts` tasks of input channels
        each, which run before the band's tasks of output channels that read it (a conv cut by output channels
        makes each V once, not once per part). shared: V [36, C + 1, T'], or, where every band's products are
        skinny, V^T [36, T, C] as skinny_products reads it: each task makes V of its channels in a buffer of
        its own and writes their columns of V^T (the bundled model's 8x8 conv5 on 2 threads, by hand: where the
        two cores shared no L3, split calls 1.28-1.31 ms against 1.32-1.36 with V shared and each product task
        copying all of it into a V^T of its own, as a row of V holds 4 tiles in a 64-byte line; the same
        otherwise). new_scratch(worker): the new_buffer of that worker's scratch."""
        in_channels = image.shape[1]
        tiles_w = tile_count(self.conv_shape[2])
        skinny_columns, transposed = self._skinny(bands)
        if not transposed:
            shared, work_shape = self._winograd_input_scratch(in_channels, bands, new_scratch(SHARED))
        else:
            shared = new_scratch(SHARED)((36, skinny_columns, in_channels))   # rows past the tiles: junk, as V's
        tasks = [[] for _ in bands]
        for task, (c_first, c_end) in enumerate(split_range(0, in_channels, parts)):
            if not transposed:
                v_buffer, source, first, end = shared, image, c_first, c_end
            else:                       # V of this task's channels only, as channels 0..
                v_buffer, work_shape = self._winograd_input_scratch(c_end - c_first, bands, new_scratch(task))
                source, first, end = image[:, c_first:c_end], 0, c_end - c_first
            work = new_scratch(task)(work_shape)
            for steps, band in zip(tasks, bands):
                tile_first, tile_rows, images = self._band_tiles(band)
                steps.append([partial(winograd_input, source[n], first, end, tile_first, tile_rows,
                                      (n - band[0]) * tile_rows * tiles_w, work, v_buffer)
                              for n in range(band[0], band[1])])
                if transposed:
                    count = tile_rows * tiles_w * images
                    steps[-1].append(partial(np.copyto, shared[:, :count, c_first:c_end],
                                             v_buffer[:, :end, :count].transpose(0, 2, 1)))
        return shared, tasks

    def _winograd_product(self, image, bands: list, channels: tuple, new_scratch, shared=None, pooled=None):
        """The product step of _product as Winograd F(4x4, 3x3): conv rows y_first..y_end-1 of the
        band's images into acc, pitch OW, from the tile rows that cover them (winograd.py), for output
        channels o_first..o_end-1 (U[:, o_first:o_end]: each of the 36 products reads its block).
        shared: V (or V^T) of _shared_winograd_input, which earlier steps fill: no input transform here.
        winograd_pools: the output transform also max-pools each tile's 2x2 blocks, into `pooled`
        (pitch OW / 2; no acc: 30-40% less time than the output transform and the pool step apart).

        V and M are [36, rows + 1, T'] buffers used as [36, rows, T]: the spare row and T' (16 times an
        odd number) keep the 36 planes off the same cache sets (with power-of-two plane strides the
        F(2x2, 3x3) input transform ran 8x slower)."""
        _, conv_h, conv_w = self.conv_shape
        o_first, o_end = channels
        out_channels = o_end - o_first
        in_channels = image.shape[1]
        tiles_w = tile_count(conv_w)
        skinny_columns, every_band_skinny = self._skinny(bands)
        shared_transposed = shared is not None and every_band_skinny
        if shared is None:
            v_buffer, work_shape = self._winograd_input_scratch(in_channels, bands, new_scratch)
            input_work = new_scratch(work_shape)      # the kernel's scratch (winograd.py)
        elif not shared_transposed:
            v_buffer = shared
        if skinny_columns is not None:
            vt_buffer = shared if shared_transposed else new_scratch((36, skinny_columns, in_channels))
        # M's rows as long as V's, or where every band's products are skinny, as their columns: the output
        # transform's passes span more channels (tomato's 8x8 conv5, 4 tiles: 0.034 ms instead of 0.057, by hand)
        stride = skinny_columns if every_band_skinny else v_buffer.shape[2]
        m_buffer = new_scratch((36, out_channels + 1, stride))
        output_work = new_scratch(output_work_shape(stride))
        if not self.winograd_pools:
            acc = new_scratch((out_channels, max((band[1] - band[0]) * conv_h * conv_w for band in bands)))

        def product(band, steps):
            n_first, n_end, out_first, out_end, y_first, y_end = band
            tile_first, tile_rows, images = self._band_tiles(band)
            per_image = tile_rows * tiles_w
            count = per_image * images
            if shared is None:
                for n in range(n_first, n_end):
                    steps.append(partial(winograd_input, image[n], 0, in_channels, tile_first, tile_rows,
                                         (n - n_first) * per_image, input_work, v_buffer))
            if self.winograd_blocks:
                steps.append(partial(block_products, self.winograd_weight, o_first, o_end, v_buffer, in_channels,
                                     count, m_buffer))
            elif count < WINOGRAD_MIN_TILES:
                if not shared_transposed:
                    transposed = v_buffer[:, :in_channels, :count].transpose(0, 2, 1)
                    steps.append(partial(np.copyto, vt_buffer[:, :count], transposed))
                steps.append(partial(skinny_products, self.winograd_weight, o_first, o_end, vt_buffer, count, m_buffer))
            elif small_products_pay():
                steps.append(partial(small_products, self.winograd_weight, o_first, o_end, v_buffer, in_channels,
                                     count, m_buffer))
            elif narrow_tiles_pay():
                steps.append(partial(narrow_products, self.winograd_weight, o_first, o_end, v_buffer, in_channels,
                                     count, m_buffer))
            elif (sgemm := blas_products_sgemm()) is not None:
                steps.append(partial(blas_products, self.winograd_weight, o_first, o_end, v_buffer, in_channels, count,
                                     m_buffer, sgemm))
            else:
                steps.append(partial(np.matmul, self.winograd_weight[:, o_first:o_end], v_buffer[:, :in_channels, :count],
                                     out=m_buffer[:, :out_channels, :count]))
            if self.winograd_pools:
                steps.append(partial(winograd_output_pool2, m_buffer, 0, out_channels, images, per_image, tile_first,
                                     conv_w, out_first, out_end, output_work, pooled))
                return pooled, self.out_shape[2]
            steps.append(partial(winograd_output, m_buffer, 0, out_channels, images, per_image, tile_first, conv_h,
                                 conv_w, y_first, y_end, output_work, acc))
            return acc, conv_w
        return product
