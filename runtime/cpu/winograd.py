"""Winograd F(2x2, 3x3) for conv2d with a 3x3 kernel, stride 1, dilation 1, groups 1 (Lavin & Gray, 2015).

Same result as conv2d.py's columns + product (reference: formats/ops.py Conv2d.forward), with 16
multiplies per 2x2 output tile instead of 36 (2.25x fewer):
    U[k, o, c] = (G g[o, c] G^T)[k]                       weight [O, C, 3, 3] -> U [16, O, C], once at load
    V[k, c, t] = (B^T d[c, t] B)[k]                       d = the tile's 4x4 input patch  (`winograd_input`)
    M[k]       = U[k] @ V[k]                              16 BLAS products [O, C] x [C, T] (np.matmul)
    y[o, tile] = A^T M[:, o, t] A                         the tile's 2x2 outputs          (`winograd_output`)
with k = 4 * row + column of the 4x4 transform domain, tile t covering conv output rows 2ty, 2ty+1 and
columns 2tx, 2tx+1 from the padded input rows 2ty..2ty+3 and columns 2tx..2tx+3. Cells of a patch
outside the padded input (the last tile row/column when the conv output is odd) read as 0; outputs
outside the conv output are not written. The transforms are exact in real arithmetic; in float32
they round differently from a direct sum (errors of order 1e-6 relative here).
"""

from __future__ import annotations

import numpy as np

from lnn.runtime.cpu.jit import kernel

G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])


def transformed_weight(weight: np.ndarray) -> np.ndarray:
    """weight [O, C, 3, 3] -> U [16, O, C] float32 (computed in float64)."""
    u = np.einsum("ij,ocjk,lk->ilo c".replace(" ", ""), G, weight.astype(np.float64), G)    # [4, 4, O, C]
    return np.ascontiguousarray(u.reshape(16, *weight.shape[:2]), dtype=np.float32)


def tile_count(size: int) -> int:
    """Tiles along an output axis of `size` cells."""
    return (size + 1) // 2


@kernel
def padded_cell(plane, y, x):
    """plane[y, x], or 0 past the bottom or right edge of plane."""
    return plane[y, x] if y < plane.shape[0] and x < plane.shape[1] else np.float32(0)


@kernel
def winograd_input(image, tile_first, tile_rows, column, v):
    """image [C, HP, WP] (padded) -> v[:, c, column + (ty - tile_first) * TW + tx] for tile rows
    tile_first..tile_first+tile_rows-1 and all TW = tile_count(WP - 2) tile columns.
    (Indexes, not slices: a slice costs a reference count update, as much as a tile's arithmetic.)"""
    channels, padded_h, padded_w = image.shape
    tiles_w = (padded_w - 1) // 2
    for c in range(channels):
        plane = image[c]
        for ty in range(tile_first, tile_first + tile_rows):
            y = 2 * ty
            full_w = (padded_w - 2) // 2 if y + 4 <= padded_h else 0   # tiles with all 16 cells inside
            t0 = column + (ty - tile_first) * tiles_w
            for tx in range(tiles_w):
                x = 2 * tx
                if tx < full_w:
                    d00, d01, d02, d03 = plane[y, x], plane[y, x + 1], plane[y, x + 2], plane[y, x + 3]
                    d10, d11, d12, d13 = plane[y + 1, x], plane[y + 1, x + 1], plane[y + 1, x + 2], plane[y + 1, x + 3]
                    d20, d21, d22, d23 = plane[y + 2, x], plane[y + 2, x + 1], plane[y + 2, x + 2], plane[y + 2, x + 3]
                    d30, d31, d32, d33 = plane[y + 3, x], plane[y + 3, x + 1], plane[y + 3, x + 2], plane[y + 3, x + 3]
                else:
                    d00, d01 = padded_cell(plane, y, x), padded_cell(plane, y, x + 1)
                    d02, d03 = padded_cell(plane, y, x + 2), padded_cell(plane, y, x + 3)
                    d10, d11 = padded_cell(plane, y + 1, x), padded_cell(plane, y + 1, x + 1)
                    d12, d13 = padded_cell(plane, y + 1, x + 2), padded_cell(plane, y + 1, x + 3)
                    d20, d21 = padded_cell(plane, y + 2, x), padded_cell(plane, y + 2, x + 1)
                    d22, d23 = padded_cell(plane, y + 2, x + 2), padded_cell(plane, y + 2, x + 3)
                    d30, d31 = padded_cell(plane, y + 3, x), padded_cell(plane, y + 3, x + 1)
                    d32, d33 = padded_cell(plane, y + 3, x + 2), padded_cell(plane, y + 3, x + 3)
                # B^T d: rows a, b, e, f
                a0, a1, a2, a3 = d00 - d20, d01 - d21, d02 - d22, d03 - d23
                b0, b1, b2, b3 = d10 + d20, d11 + d21, d12 + d22, d13 + d23
                e0, e1, e2, e3 = d20 - d10, d21 - d11, d22 - d12, d23 - d13
                f0, f1, f2, f3 = d10 - d30, d11 - d31, d12 - d32, d13 - d33
                # (B^T d) B
                t = t0 + tx
                v[0, c, t], v[1, c, t], v[2, c, t], v[3, c, t] = a0 - a2, a1 + a2, a2 - a1, a1 - a3
                v[4, c, t], v[5, c, t], v[6, c, t], v[7, c, t] = b0 - b2, b1 + b2, b2 - b1, b1 - b3
                v[8, c, t], v[9, c, t], v[10, c, t], v[11, c, t] = e0 - e2, e1 + e2, e2 - e1, e1 - e3
                v[12, c, t], v[13, c, t], v[14, c, t], v[15, c, t] = f0 - f2, f1 + f2, f2 - f1, f1 - f3


@kernel
def winograd_output(m, images, tiles_per_image, tile_first, conv_h, conv_w, y_first, y_end, acc):
    """m [16, O, T] -> acc [O, positions]: conv output (image j, y, x) of the band's images j, rows
    y_first..y_end-1, at position (j * conv_h + y - y_first) * conv_w + x; tile t = j * tiles_per_image
    + (ty - tile_first) * TW + tx holds rows 2ty, 2ty+1 and columns 2tx, 2tx+1."""
    tiles_w = (conv_w + 1) // 2
    pairs = conv_w // 2                     # tiles whose two columns are both inside the output
    tile_rows = tiles_per_image // tiles_w
    for o in range(acc.shape[0]):
        for j in range(images):
            for row in range(tile_rows):
                y = 2 * (tile_first + row)
                t0 = j * tiles_per_image + row * tiles_w
                # A^T m: the top (p) and bottom (q) rows of the tile, each then times A
                if y >= y_first:
                    top = (j * conv_h + y - y_first) * conv_w
                    for tx in range(pairs):
                        t = t0 + tx
                        p0 = m[0, o, t] + m[4, o, t] + m[8, o, t]
                        p1 = m[1, o, t] + m[5, o, t] + m[9, o, t]
                        p2 = m[2, o, t] + m[6, o, t] + m[10, o, t]
                        p3 = m[3, o, t] + m[7, o, t] + m[11, o, t]
                        acc[o, top + 2 * tx] = p0 + p1 + p2
                        acc[o, top + 2 * tx + 1] = p1 - p2 - p3
                    if pairs < tiles_w:
                        t = t0 + pairs
                        acc[o, top + 2 * pairs] = (m[0, o, t] + m[4, o, t] + m[8, o, t] + m[1, o, t] + m[5, o, t]
                                                   + m[9, o, t] + m[2, o, t] + m[6, o, t] + m[10, o, t])
                if y + 1 < y_end:
                    bottom = (j * conv_h + y + 1 - y_first) * conv_w
                    for tx in range(pairs):
                        t = t0 + tx
                        q0 = m[4, o, t] - m[8, o, t] - m[12, o, t]
                        q1 = m[5, o, t] - m[9, o, t] - m[13, o, t]
                        q2 = m[6, o, t] - m[10, o, t] - m[14, o, t]
                        q3 = m[7, o, t] - m[11, o, t] - m[15, o, t]
                        acc[o, bottom + 2 * tx] = q0 + q1 + q2
                        acc[o, bottom + 2 * tx + 1] = q1 - q2 - q3
                    if pairs < tiles_w:
                        t = t0 + pairs
                        acc[o, bottom + 2 * pairs] = (m[4, o, t] - m[8, o, t] - m[12, o, t] + m[5, o, t] - m[9, o, t]
                                                      - m[13, o, t] + m[6, o, t] - m[10, o, t] - m[14, o, t])
