"""Direct 3x3 convolution for convs with few input channels (a network's first conv on RGB or gray input).

    image [C, HP, WP] (padded), weight [O, C, 3, 3] -> acc[o, column + (y - y_first) * OW + x]
    = sum over c, ky, kx of weight[o, c, ky, kx] * image[c, y + ky, x + kx]       (no bias; OW = WP - 2)

for output channels o_first..o_end-1 and conv rows y_first..y_end-1: stride 1, dilation 1, groups 1
(reference: formats/ops.py Conv2d.forward, as conv2d.py). With C <= 3 the columns matrix of
conv2d.py has only 9C rows, too few for BLAS to reach its rate, and building it copies the image 9C
times; here each output row is one loop over x that reads 3 input rows per channel and LLVM
vectorizes (conv2d.py's rule says when this is used, and what was measured). The channel range and
row range let a caller split the work over threads.
"""

from __future__ import annotations

from lnn.runtime.cpu.aot import A2, A3, A4, I
from lnn.runtime.cpu.jit import kernel

# Each kernel's ahead-of-time signature (aot.py): the argument types the backend passes; None: called
# only by other kernels, compiled into them.
AOT_SIGNATURES = {"conv3x3_direct": (A3, A4, I, I, I, I, I, A2)}


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
