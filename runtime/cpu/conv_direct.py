"""Direct 3x3 convolution for convs with few input channels (a network's first conv on RGB or gray input; where
the 8-lane register tiles run, every conv too thin for Winograd: conv3x3_direct_shifted below).

    image [C, HP, WP] (padded), weight [O, C, 3, 3] -> acc[o, column + (y - y_first) * OW + x]
    = sum over c, ky, kx of weight[o, c, ky, kx] * image[c, y + ky, x + kx]       (no bias; OW = WP - 2)

for output channels o_first..o_end-1 and conv rows y_first..y_end-1: stride 1, dilation 1, groups 1
(reference: formats/ops.py Conv2d.forward, as conv2d.py). With C <= 3 the columns matrix of
conv2d.py has only 9C rows, too few for BLAS to reach its rate, and building it copies the image 9C
times; here each output row is one loop over x that reads 3 input rows per channel and LLVM
vectorizes (conv2d.py's rule says when this is used, and what was measured). The channel range and
row range let a caller split the work over threads.

conv3x3_direct_quads computes the same, four output channels at a time: each vector of an input row's 9
taps is loaded once for four sums, where conv3x3_direct loads it once per output channel (its loop is
bound by loads, not multiply-adds), and its multiply-adds are fused (jit.fused_kernel). One thread, 128x128
and 224x224 outputs from 3 channels, 16 to 32 outputs, the kernel alone: 1.2-1.3x faster than conv3x3_direct
with AVX-512 (whole layers, conv2d.py: 0.73-0.82x the time), 1.1-1.3x compiled for AVX2 only, slower compiled
for SSE2 without FMA and on rows under ~64 wide; so conv2d.py uses it only
with the JIT on an FMA host (jit.VECTOR_FMA), on wide rows. Results differ from conv3x3_direct only by
the rounding a fused multiply-add saves.

conv3x3_direct_tiles computes the same in register tiles of 6 output channels x 32 columns (12 AVX-512
registers of sums, kept over all 9C taps and stored once; winograd.py's product_tile with the columns
matrix read in place from the image rows), for the JIT on an AVX-512 host and rows a multiple of 16 wide
(conv2d.py direct_tiles_pay). One thread, 3 input channels, a band of rows as the plan runs it, the kernel
alone against conv3x3_direct_quads: 0.65-0.89x the time for 6 to 36 outputs at 128 and 224 wide (0.34-0.40
ns an output against 0.44-0.55); whole models at one thread, interleaved, leaf_cnn 0.92x, the bundled
model 0.89-0.92x, leaf_cnn224 0.95x (by hand). Its sums run in another order than conv3x3_direct's.

conv3x3_direct_shifted computes the same in 8-lane register tiles of 6 output channels x 16 positions (12 sums
of 8 in AVX2 registers over all 9C taps), for an x86-64 host with FMA but no AVX-512 (conv2d.py
narrow_tiles_pay): winograd.py's narrow_strip with the columns matrix read in place as shifted rows (the
row of tap (c, ky, kx) is the flat image from c * HP * WP + ky * WP + kx), so its positions run at pitch WP:
acc[o, column + (y - y_first) * WP + x], the columns x >= OW junk, and the last tile's up to 15 past the band's
last output. One thread, a band as the plan runs it, the kernel alone against conv3x3_direct_quads (by hand,
Zen 3 VM): 3 -> 16 at 128 wide 0.64-0.67x the time, 3 -> 24 at 128 0.58x, 3 -> 32 at 224 0.75x (75-89 GFLOP/s
against 51-56); against conv3x3_direct on narrower rows, 1 -> 32 and 1 -> 16 at 28 wide 0.37-0.41x, 3 -> 16 at
32 and 56 wide 0.49-0.58x; against the columns GEMM from 4 to 15 inputs, conv2d.py SHIFTED_MAX_OUT_CHANNELS. Its
sums run in another order than conv3x3_direct's.

conv3x3_direct_tiles_pool2 is conv3x3_direct_tiles followed by a 2x2/2 unpadded max-pool (conv2d.py's
max_pool_2x2_rows; the same sums, the same maxima in its order: the same bytes), without acc: its register
tiles hold 4 output channels x 2 conv rows x 32 columns (a last 16 columns: 6 x 2 x 16), and each tile stores
its 4 x 16 maxima into pooled [O, positions], row py of the band at column + (py - the band's first) * OW / 2.
A network's first conv is followed by a pool (leaf_cnn, leaf_cnn224, the bundled model), and its acc was the
largest buffer a call wrote (the bundled model: 0.8 MB a band). One thread, a band of 3-channel rows as the
plan runs it, against conv3x3_direct_tiles then max_pool_2x2_rows, by hand, with tiles of 6 x 2 x 16: 3 -> 24
at 128 wide 0.75x the time (0.62x after 16 MB were touched), 3 -> 16 at 128 0.83x (0.92x), 3 -> 32 at 224
0.75x (0.77x). The 4 x 2 x 32 tiles then, against those: 3 -> 16 at 128 0.85-0.87x, 3 -> 32 at 224 0.82-0.86x,
3 -> 24 at 128 0.93-1.00x (a load of the image for 4 multiply-adds instead of 8 loads for 12, and no rows
computed past the last channel where 4 divides the count); whole models at one thread 0.96-0.98x (by hand).
"""

from __future__ import annotations

import numpy as np

from lnn.runtime.cpu.aot import A2, A3, A4, I
from lnn.runtime.cpu.jit import fused_kernel, kernel, load16, tile_kernel, wide_tile_kernel
from lnn.runtime.cpu.winograd import fma16, four_rows, narrow_strip, six_rows, store16, zeros16

# Each kernel's ahead-of-time signature (aot.py): the argument types the backend passes; None: called
# only by other kernels, compiled into them.
AOT_SIGNATURES = {"conv3x3_direct": (A3, A4, I, I, I, I, I, A2),
                  "conv3x3_direct_quads": None,      # the JIT on an FMA host only (conv2d.py direct_quads_pay)
                  "conv3x3_direct_tiles": None,      # the JIT on an AVX-512 host only (conv2d.py direct_tiles_pay)
                  "conv3x3_direct_tiles_pool2": None,    # the same
                  "direct_tile": None,
                  "direct_column_tile": None,
                  "direct_pool_tile": None,
                  "store_pooled8": None,
                  "conv3x3_direct_shifted": None}    # conv2d.py narrow_tiles_pay: x86-64, FMA, no AVX-512


@kernel
def conv3x3_direct(image, weight, o_first, o_end, y_first, y_end, column, acc):
    """See the header: acc [O, positions] rows y_first..y_end-1 of output channels o_first..o_end-1."""
    channels, _, padded_w = image.shape
    conv_w = padded_w - 2
    for y in range(y_first, y_end):                # the 3C input rows stay in L1 across all o
        at = column + (y - y_first) * conv_w
        for o in range(o_first, o_end):
            out = acc[o, at:at + conv_w]
            for c in range(channels):
                w00, w01, w02 = weight[o, c, 0, 0], weight[o, c, 0, 1], weight[o, c, 0, 2]
                w10, w11, w12 = weight[o, c, 1, 0], weight[o, c, 1, 1], weight[o, c, 1, 2]
                w20, w21, w22 = weight[o, c, 2, 0], weight[o, c, 2, 1], weight[o, c, 2, 2]
                r0, r1, r2 = image[c, y], image[c, y + 1], image[c, y + 2]
                if c == 0:
                    for x in range(conv_w):
                        out[x] = (w00 * r0[x] + w01 * r0[x + 1] + w02 * r0[x + 2] + w10 * r1[x] + w11 * r1[x + 1]
                                  + w12 * r1[x + 2] + w20 * r2[x] + w21 * r2[x + 1] + w22 * r2[x + 2])
                else:
                    for x in range(conv_w):
                        out[x] += (w00 * r0[x] + w01 * r0[x + 1] + w02 * r0[x + 2] + w10 * r1[x] + w11 * r1[x + 1]
                                   + w12 * r1[x + 2] + w20 * r2[x] + w21 * r2[x + 1] + w22 * r2[x + 2])


@fused_kernel
def conv3x3_direct_quads(image, weight, o_first, o_end, y_first, y_end, column, acc):
    """conv3x3_direct (the header), four output channels per pass over a row; the last o_end - o_first
    mod 4 channels by conv3x3_direct. Written out tap by tap, so that LLVM vectorizes each row's loop over
    x with the 36 weights held out of it."""
    channels, _, padded_w = image.shape
    conv_w = padded_w - 2
    for y in range(y_first, y_end):
        at = column + (y - y_first) * conv_w
        o = o_first
        while o + 3 < o_end:
            out0, out1 = acc[o, at:at + conv_w], acc[o + 1, at:at + conv_w]
            out2, out3 = acc[o + 2, at:at + conv_w], acc[o + 3, at:at + conv_w]
            for c in range(channels):
                a0, a1, a2 = weight[o, c, 0, 0], weight[o, c, 0, 1], weight[o, c, 0, 2]
                a3, a4, a5 = weight[o, c, 1, 0], weight[o, c, 1, 1], weight[o, c, 1, 2]
                a6, a7, a8 = weight[o, c, 2, 0], weight[o, c, 2, 1], weight[o, c, 2, 2]
                b0, b1, b2 = weight[o + 1, c, 0, 0], weight[o + 1, c, 0, 1], weight[o + 1, c, 0, 2]
                b3, b4, b5 = weight[o + 1, c, 1, 0], weight[o + 1, c, 1, 1], weight[o + 1, c, 1, 2]
                b6, b7, b8 = weight[o + 1, c, 2, 0], weight[o + 1, c, 2, 1], weight[o + 1, c, 2, 2]
                c0, c1, c2 = weight[o + 2, c, 0, 0], weight[o + 2, c, 0, 1], weight[o + 2, c, 0, 2]
                c3, c4, c5 = weight[o + 2, c, 1, 0], weight[o + 2, c, 1, 1], weight[o + 2, c, 1, 2]
                c6, c7, c8 = weight[o + 2, c, 2, 0], weight[o + 2, c, 2, 1], weight[o + 2, c, 2, 2]
                d0, d1, d2 = weight[o + 3, c, 0, 0], weight[o + 3, c, 0, 1], weight[o + 3, c, 0, 2]
                d3, d4, d5 = weight[o + 3, c, 1, 0], weight[o + 3, c, 1, 1], weight[o + 3, c, 1, 2]
                d6, d7, d8 = weight[o + 3, c, 2, 0], weight[o + 3, c, 2, 1], weight[o + 3, c, 2, 2]
                r0, r1, r2 = image[c, y], image[c, y + 1], image[c, y + 2]
                if c == 0:                     # the first channel writes acc, the others add to it
                    for x in range(conv_w):
                        t0, t1, t2, t3, t4, t5 = r0[x], r0[x + 1], r0[x + 2], r1[x], r1[x + 1], r1[x + 2]
                        t6, t7, t8 = r2[x], r2[x + 1], r2[x + 2]
                        out0[x] = a0 * t0 + a1 * t1 + a2 * t2 + a3 * t3 + a4 * t4 + a5 * t5 + a6 * t6 + a7 * t7 + a8 * t8
                        out1[x] = b0 * t0 + b1 * t1 + b2 * t2 + b3 * t3 + b4 * t4 + b5 * t5 + b6 * t6 + b7 * t7 + b8 * t8
                        out2[x] = c0 * t0 + c1 * t1 + c2 * t2 + c3 * t3 + c4 * t4 + c5 * t5 + c6 * t6 + c7 * t7 + c8 * t8
                        out3[x] = d0 * t0 + d1 * t1 + d2 * t2 + d3 * t3 + d4 * t4 + d5 * t5 + d6 * t6 + d7 * t7 + d8 * t8
                else:
                    for x in range(conv_w):
                        t0, t1, t2, t3, t4, t5 = r0[x], r0[x + 1], r0[x + 2], r1[x], r1[x + 1], r1[x + 2]
                        t6, t7, t8 = r2[x], r2[x + 1], r2[x + 2]
                        out0[x] += a0 * t0 + a1 * t1 + a2 * t2 + a3 * t3 + a4 * t4 + a5 * t5 + a6 * t6 + a7 * t7 + a8 * t8
                        out1[x] += b0 * t0 + b1 * t1 + b2 * t2 + b3 * t3 + b4 * t4 + b5 * t5 + b6 * t6 + b7 * t7 + b8 * t8
                        out2[x] += c0 * t0 + c1 * t1 + c2 * t2 + c3 * t3 + c4 * t4 + c5 * t5 + c6 * t6 + c7 * t7 + c8 * t8
                        out3[x] += d0 * t0 + d1 * t1 + d2 * t2 + d3 * t3 + d4 * t4 + d5 * t5 + d6 * t6 + d7 * t7 + d8 * t8
            o += 4
        if o < o_end:
            conv3x3_direct(image, weight, o, o_end, y, y + 1, at, acc)


def shifted_tap_offsets(channels: int, padded_h: int, padded_w: int) -> np.ndarray:
    """[9C] int64: where the shifted row of each tap (c, ky, kx) starts in the flat padded image (c-major, as
    the weight's [O, C, 3, 3] flattens)."""
    c, ky, kx = np.meshgrid(np.arange(channels), np.arange(3), np.arange(3), indexing="ij")
    return (c * padded_h * padded_w + ky * padded_w + kx).reshape(-1).astype(np.int64)


@tile_kernel
def conv3x3_direct_shifted(image, weight, offsets, padded_w, y_first, y_end, column, acc):
    """The header's conv3x3_direct_shifted: image the flat padded image [C * HP * WP] (up to STRIP_POSITIONS - 1
    floats past its end are read, into junk), weight [O, 9C] (the conv's, flattened), offsets
    shifted_tap_offsets(C, HP, WP); conv rows y_first..y_end-1 into acc[o, column + (y - y_first) * WP + x], acc
    [O, >= column + that + STRIP_POSITIONS] (winograd.py's narrow_strip)."""
    count = (y_end - y_first - 1) * padded_w + padded_w - 2
    last = weight.shape[0] - 1
    for o in range(0, last + 1, 6):
        narrow_strip(weight, o, last, image, offsets, y_first * padded_w, count, acc, column)


@wide_tile_kernel
def direct_tile(image, weight, o, last, y0, x0, y1, x1, out, at, pool):
    """For output channels o + i, i < 6 and o + i <= last (rows past last are computed as row last and not
    stored), the conv outputs of row y0, columns x0..x0 + 15 and of row y1, columns x1..x1 + 15 in 12 sums of
    16 kept in registers over all C x 9 taps, each tap 6 broadcasts of the weights and 2 loads of shifted
    input rows (winograd.py's product_tile, with the columns matrix read in place). Stored once: pool false,
    one row side by side (y1 = y0, x1 = x0 + 16) into out[o + i, at + x0:at + x0 + 32]; pool true, two rows
    (y1 = y0 + 1, x1 = x0) as their 2x2 maxima into out[o + i, at + x0 / 2:at + x0 / 2 + 8]."""
    a0 = a1 = b0 = b1 = c0 = c1 = d0 = d1 = e0 = e1 = f0 = f1 = zeros16()
    r0, r1, r2, r3, r4, r5 = six_rows(weight, o, last)
    for c in range(image.shape[0]):
        for ky in range(3):
            first, second = image[c, y0 + ky], image[c, y1 + ky]
            for kx in range(3):
                w0, w1 = load16(first, x0 + kx), load16(second, x1 + kx)
                a0, a1 = fma16(a0, r0[c, ky, kx], w0), fma16(a1, r0[c, ky, kx], w1)
                b0, b1 = fma16(b0, r1[c, ky, kx], w0), fma16(b1, r1[c, ky, kx], w1)
                c0, c1 = fma16(c0, r2[c, ky, kx], w0), fma16(c1, r2[c, ky, kx], w1)
                d0, d1 = fma16(d0, r3[c, ky, kx], w0), fma16(d1, r3[c, ky, kx], w1)
                e0, e1 = fma16(e0, r4[c, ky, kx], w0), fma16(e1, r4[c, ky, kx], w1)
                f0, f1 = fma16(f0, r5[c, ky, kx], w0), fma16(f1, r5[c, ky, kx], w1)
    for i, (left, right) in enumerate(((a0, a1), (b0, b1), (c0, c1), (d0, d1), (e0, e1), (f0, f1))):
        if o + i <= last:
            if pool:
                store_pooled8(left, right, out[o + i, at + x0 // 2:at + x0 // 2 + 8])
            else:
                store16(left, out[o + i, at + x0:at + x0 + 16])
                store16(right, out[o + i, at + x1:at + x1 + 16])


@wide_tile_kernel
def direct_column_tile(image, weight, o, last, y, x, acc, at):
    """direct_tile for the 16 columns x..x + 15: 6 sums of 16."""
    a = b = c_ = d = e = f = zeros16()
    r0, r1, r2, r3, r4, r5 = six_rows(weight, o, last)
    for c in range(image.shape[0]):
        for ky in range(3):
            row = image[c, y + ky]
            for kx in range(3):
                w = load16(row, x + kx)
                a, b, c_ = fma16(a, r0[c, ky, kx], w), fma16(b, r1[c, ky, kx], w), fma16(c_, r2[c, ky, kx], w)
                d, e, f = fma16(d, r3[c, ky, kx], w), fma16(e, r4[c, ky, kx], w), fma16(f, r5[c, ky, kx], w)
    for i, out in enumerate((a, b, c_, d, e, f)):
        if o + i <= last:
            store16(out, acc[o + i, at + x:at + x + 16])


@wide_tile_kernel
def conv3x3_direct_tiles(image, weight, o_first, o_end, y_first, y_end, column, acc):
    """conv3x3_direct (the header) in register tiles of 6 output channels x 32 columns (direct_tile; a last
    16 by direct_column_tile), for rows a multiple of 16 wide (OW % 16 == 0): each tile's sums stay in
    registers over all the taps and are stored once, where conv3x3_direct_quads adds each input channel's
    taps into acc."""
    conv_w = image.shape[2] - 2
    last = o_end - 1
    for y in range(y_first, y_end):
        at = column + (y - y_first) * conv_w
        for x in range(0, conv_w - 16, 32):
            for o in range(o_first, o_end, 6):
                direct_tile(image, weight, o, last, y, x, y, x + 16, acc, at, False)
        if conv_w % 32:
            for o in range(o_first, o_end, 6):
                direct_column_tile(image, weight, o, last, y, conv_w - 16, acc, at)


@wide_tile_kernel
def store_pooled8(top, bottom, row):
    """row[j] = max(max(top[2j], top[2j + 1]), max(bottom[2j], bottom[2j + 1])) for j < 8: the 2x2 maxima of
    two rows of 16 (max_pool_2x2_rows' order; constant indices: a tuple indexed by a loop variable is not
    kept in registers)."""
    row[0] = max(max(top[0], top[1]), max(bottom[0], bottom[1]))
    row[1] = max(max(top[2], top[3]), max(bottom[2], bottom[3]))
    row[2] = max(max(top[4], top[5]), max(bottom[4], bottom[5]))
    row[3] = max(max(top[6], top[7]), max(bottom[6], bottom[7]))
    row[4] = max(max(top[8], top[9]), max(bottom[8], bottom[9]))
    row[5] = max(max(top[10], top[11]), max(bottom[10], bottom[11]))
    row[6] = max(max(top[12], top[13]), max(bottom[12], bottom[13]))
    row[7] = max(max(top[14], top[15]), max(bottom[14], bottom[15]))


@wide_tile_kernel
def direct_pool_tile(image, weight, o, last, y, x, out, at):
    """For output channels o + i, i < 4 and o + i <= last (rows past last computed as row last, not stored),
    the conv outputs of rows y and y + 1, columns x..x + 31, in 16 sums of 16 kept in registers over all
    C x 9 taps (each tap 4 broadcasts of the weights and 4 loads of shifted input rows: one load for 4
    multiply-adds, where direct_tile's 6 x 2 tile needs 8 loads for 12), stored as their 2x2 maxima into
    out[o + i, at + x / 2:at + x / 2 + 16]."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = zeros16()
    r0, r1, r2, r3 = four_rows(weight, o, last)
    for c in range(image.shape[0]):
        for ky in range(3):
            top, bottom = image[c, y + ky], image[c, y + 1 + ky]
            for kx in range(3):
                p, q = load16(top, x + kx), load16(top, x + kx + 16)
                s, t = load16(bottom, x + kx), load16(bottom, x + kx + 16)
                w = r0[c, ky, kx]
                a0, a1, a2, a3 = fma16(a0, w, p), fma16(a1, w, q), fma16(a2, w, s), fma16(a3, w, t)
                w = r1[c, ky, kx]
                b0, b1, b2, b3 = fma16(b0, w, p), fma16(b1, w, q), fma16(b2, w, s), fma16(b3, w, t)
                w = r2[c, ky, kx]
                c0, c1, c2, c3 = fma16(c0, w, p), fma16(c1, w, q), fma16(c2, w, s), fma16(c3, w, t)
                w = r3[c, ky, kx]
                d0, d1, d2, d3 = fma16(d0, w, p), fma16(d1, w, q), fma16(d2, w, s), fma16(d3, w, t)
    at += x // 2
    for i, (left, right, left_below, right_below) in enumerate(((a0, a1, a2, a3), (b0, b1, b2, b3),
                                                                (c0, c1, c2, c3), (d0, d1, d2, d3))):
        if o + i <= last:
            store_pooled8(left, left_below, out[o + i, at:at + 8])
            store_pooled8(right, right_below, out[o + i, at + 8:at + 16])


@wide_tile_kernel
def conv3x3_direct_tiles_pool2(image, weight, o_first, o_end, y_first, y_end, column, pooled):
    """conv3x3_direct_tiles then the 2x2/2 unpadded max-pool (the header), for conv rows y_first..y_end-1 (an
    even count) of output channels o_first..o_end-1 and rows a multiple of 16 wide: pooled row
    (y - y_first) / 2 of the band at column + that * OW / 2. In tiles of 4 channels x 2 rows x 32 columns
    (direct_pool_tile), a last 16 columns as direct_tile's 6 x 2 x 16."""
    conv_w = image.shape[2] - 2
    last = o_end - 1
    for y in range(y_first, y_end, 2):
        at = column + (y - y_first) // 2 * (conv_w // 2)
        for x in range(0, conv_w - 16, 32):
            for o in range(o_first, o_end, 4):
                direct_pool_tile(image, weight, o, last, y, x, pooled, at)
        if conv_w % 32:
            for o in range(o_first, o_end, 6):
                direct_tile(image, weight, o, last, y, conv_w - 16, y + 1, conv_w - 16, pooled, at, True)
