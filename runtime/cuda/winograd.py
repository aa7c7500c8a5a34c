"""Winograd F(2x2, 3x3) convolution on the GPU, chosen by a conv2d layer's "algorithm": "winograd".

Shapes and reference semantics (formats/ops.py conv2d, as PyTorch): x [N, C, H, W], weight [O, C, 3, 3],
bias [O] -> y [N, O, OH, OW] = act(bias + cross-correlation of x, zero-padded by (ph, pw) <= 2, with the
weight); stride 1, dilation 1, groups 1. Output tiles of 2x2 (TH = ceil(OH/2) x TW = ceil(OW/2) per
image, T = N*TH*TW in all; edge tiles keep what fits), each from a 4x4 input patch:
  weight    U [16, O, C] = G g G^T          (or, for the input gradient, of the flipped weight: [16, C, O])
  input     V [16, C, T] = B^T d B
  product   M [16, O, T] = U[e] @ V[e] for each of the 16 entries e (one batched GEMM: cuBLAS)
  output    y = A^T m A (+ bias, relu) for each tile
with G = [[1,0,0],[1/2,1/2,1/2],[1/2,-1/2,1/2],[0,0,1]], B^T = [[1,0,-1,0],[0,1,1,0],[0,-1,1,0],[0,1,0,-1]],
A^T = [[1,1,1,0],[0,1,-1,-1]] (Lavin & Gray). All transforms and the product are float32. The input
gradient of such a conv is the same convolution of dy with the flipped, transposed weight and padding
2 - p, so it runs here too. The weight gradient is the forward's transposed (Lavin & Gray's eq. for
dg): for every tile the input transform V = B^T d B and dy's W = A dy A^T (the 2x2 block of dy, 0 past
the edge), then
  products  P [16, O, C] = sum over tiles of W[e] V[e]^T (16 GEMMs whose reduction runs over tiles)
  weight    dg = G^T P G,    bias: the sum of dy per channel (reduce.py)
16 products of [O, C] are too few GEMM blocks for a GPU, so each chunk's tiles are cut into S pieces
(`splits`) and the 16 S products summed by the final transform. The batch goes through in chunks of
images whose V and M take about as much as the conv's own input and output for the whole batch (at
least MIN_CHUNK_BYTES): Winograd's scratch stays the size of the activations around it. V, M and P are
the caller's flat buffers (the trainer's plan pool; the inference plan's buffers), sized by
`workspace_shapes` and `backward_workspace_shapes`.
"auto" picks Winograd on the GPU when input and output channels are both >= 32: measured on an H200
(benchmarks/gpu_step_profile.py --algorithm winograd), it halved leaf_cnn's 32->64 and 64->128 layers
and lost 3x on its 3->16 layer (transforms and V, M traffic dominate with few channels).
"""

from __future__ import annotations

import numpy as np

from lnn.runtime.cuda.blas import matmul
from lnn.runtime.cuda.conv_gemm import ceil_div

THREADS = 256
MIN_CHUNK_BYTES = 8 * 2 ** 20       # V and M of one chunk of images take about max(this, x + y of the batch)
AUTO_MIN_CHANNELS = 32              # "auto" picks Winograd when both channel counts reach this
WEIGHT_GRADIENT_MIN_INTENSITY = 32  # "auto" takes Winograd's weight gradient from this C*O/(C+O) (weight_gradient_chosen)
GEMM_BLOCKS = 512                   # the weight gradient's products are split until about this many 64x64 blocks
MIN_SPLIT_TILES = 512               # ... each piece summing at least this many tiles

SOURCE = r"""
extern "C" {

// weight [O, C, 3, 3] -> u [16, O, C] = G g G^T; transposed_flipped: u [16, C, O] of g[a][b] = w[o, c, 2-a, 2-b]
__global__ void lnn_winograd_weight(const float* __restrict__ weight, float* __restrict__ u, int out_channels,
                                    int channels, int transposed_flipped) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= out_channels * channels) return;
    const int o = i / channels, c = i % channels;
    const float* w = weight + (long long)i * 9;
    float g[3][3];
    for (int a = 0; a < 3; ++a)
        for (int b = 0; b < 3; ++b) g[a][b] = transposed_flipped ? w[(2 - a) * 3 + (2 - b)] : w[a * 3 + b];
    float t[4][3];
    for (int b = 0; b < 3; ++b) {
        t[0][b] = g[0][b];
        t[1][b] = 0.5f * (g[0][b] + g[1][b] + g[2][b]);
        t[2][b] = 0.5f * (g[0][b] - g[1][b] + g[2][b]);
        t[3][b] = g[2][b];
    }
    const int rows = transposed_flipped ? channels : out_channels;
    const int cols = transposed_flipped ? out_channels : channels;
    const long long at = transposed_flipped ? (long long)c * out_channels + o : (long long)o * channels + c;
    for (int r = 0; r < 4; ++r) {
        const float e[4] = {t[r][0], 0.5f * (t[r][0] + t[r][1] + t[r][2]), 0.5f * (t[r][0] - t[r][1] + t[r][2]),
                            t[r][2]};
        for (int s = 0; s < 4; ++s) u[(long long)(r * 4 + s) * rows * cols + at] = e[s];
    }
}

// A transform's thread: channel c and tile t of channels x S * TS, where t = s * TS + ts (S = splits pieces
// of TS = split_tiles; a tile past the batch's T is padding), t's image n and tile row and column, and where
// its 16 values go in [16, S, channels, TS]: at + e * stride
struct LnnWinogradTile {
    long long t, n, at, stride;
    int c, th, tw;
    bool padding, past_end;
    __device__ LnnWinogradTile(int batch, int channels, int tiles_h, int tiles_w, int splits, long long split_tiles) {
        const long long padded = splits * split_tiles;
        const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
        past_end = i >= channels * padded;
        t = i % padded;
        c = (int)(i / padded);
        tw = (int)(t % tiles_w);
        th = (int)((t / tiles_w) % tiles_h);
        n = t / ((long long)tiles_w * tiles_h);
        padding = t >= (long long)batch * tiles_h * tiles_w;
        stride = channels * padded;
        at = ((t / split_tiles) * channels + c) * split_tiles + t % split_tiles;
    }
};

// x [N, C, H, W] -> v [16, S, C, TS]: the 4x4 patch at (2 th - pad_h, 2 tw - pad_w) (0 outside), B^T d B;
// padding tiles are 0. The forward and input gradient take S = 1, TS = T: v [16, C, T].
__global__ void lnn_winograd_input(const float* __restrict__ x, float* __restrict__ v, int batch, int channels,
                                   int height, int width, int tiles_h, int tiles_w, int pad_h, int pad_w,
                                   int splits, long long split_tiles) {
    const LnnWinogradTile tile(batch, channels, tiles_h, tiles_w, splits, split_tiles);
    if (tile.past_end) return;
    const float* plane = x + (tile.n * channels + tile.c) * (long long)height * width;
    const int h0 = 2 * tile.th - pad_h, w0 = 2 * tile.tw - pad_w;
    float d[4][4];
    for (int a = 0; a < 4; ++a)
        for (int b = 0; b < 4; ++b) {
            const int h = h0 + a, w = w0 + b;
            d[a][b] = (!tile.padding && h >= 0 && h < height && w >= 0 && w < width)
                          ? plane[(long long)h * width + w] : 0.0f;
        }
    float r[4][4];
    for (int b = 0; b < 4; ++b) {
        r[0][b] = d[0][b] - d[2][b];
        r[1][b] = d[1][b] + d[2][b];
        r[2][b] = d[2][b] - d[1][b];
        r[3][b] = d[1][b] - d[3][b];
    }
    float* out = v + tile.at;
    for (int a = 0; a < 4; ++a) {
        out[(a * 4 + 0) * tile.stride] = r[a][0] - r[a][2];
        out[(a * 4 + 1) * tile.stride] = r[a][1] + r[a][2];
        out[(a * 4 + 2) * tile.stride] = r[a][2] - r[a][1];
        out[(a * 4 + 3) * tile.stride] = r[a][1] - r[a][3];
    }
}

// m [16, O, T] -> y [N, O, OH, OW]: A^T m A, + bias[o] when has_bias, relu when asked
__global__ void lnn_winograd_output(const float* __restrict__ m, const float* __restrict__ bias, float* __restrict__ y,
                                    int batch, int out_channels, int out_h, int out_w, int tiles_h, int tiles_w,
                                    int has_bias, int relu) {
    const long long tiles = (long long)batch * tiles_h * tiles_w;
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= out_channels * tiles) return;
    const long long t = i % tiles;
    const int o = (int)(i / tiles);
    const int tw = (int)(t % tiles_w), th = (int)((t / tiles_w) % tiles_h);
    const long long n = t / ((long long)tiles_w * tiles_h);
    const long long stride = (long long)out_channels * tiles;
    const float* in = m + (long long)o * tiles + t;
    float s[2][4];
    for (int b = 0; b < 4; ++b) {
        const float m0 = in[(0 * 4 + b) * stride], m1 = in[(1 * 4 + b) * stride];
        const float m2 = in[(2 * 4 + b) * stride], m3 = in[(3 * 4 + b) * stride];
        s[0][b] = m0 + m1 + m2;
        s[1][b] = m1 - m2 - m3;
    }
    const float shift = has_bias ? bias[o] : 0.0f;
    float* plane = y + (n * out_channels + o) * (long long)out_h * out_w;
    for (int a = 0; a < 2; ++a) {
        const float value[2] = {s[a][0] + s[a][1] + s[a][2] + shift, s[a][1] - s[a][2] - s[a][3] + shift};
        const int h = 2 * th + a;
        if (h >= out_h) continue;
        for (int b = 0; b < 2; ++b) {
            const int w = 2 * tw + b;
            if (w < out_w) plane[(long long)h * out_w + w] = relu ? fmaxf(value[b], 0.0f) : value[b];
        }
    }
}

// dy [N, O, OH, OW] -> w [16, S, O, TS]: the 2x2 block of dy at (2 th, 2 tw) (0 past the edge), A dy A^T;
// tiles laid out as lnn_winograd_input's (padding tiles are 0)
__global__ void lnn_winograd_output_gradient(const float* __restrict__ dy, float* __restrict__ w, int batch,
                                             int out_channels, int out_h, int out_w, int tiles_h, int tiles_w,
                                             int splits, long long split_tiles) {
    const LnnWinogradTile tile(batch, out_channels, tiles_h, tiles_w, splits, split_tiles);
    if (tile.past_end) return;
    const float* plane = dy + (tile.n * out_channels + tile.c) * (long long)out_h * out_w;
    float d[2][2];
    for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 2; ++b) {
            const int h = 2 * tile.th + a, w = 2 * tile.tw + b;
            d[a][b] = (!tile.padding && h < out_h && w < out_w) ? plane[(long long)h * out_w + w] : 0.0f;
        }
    float r[4][2];                                  // A d, A = [[1, 0], [1, 1], [1, -1], [0, -1]]
    for (int b = 0; b < 2; ++b) {
        r[0][b] = d[0][b];
        r[1][b] = d[0][b] + d[1][b];
        r[2][b] = d[0][b] - d[1][b];
        r[3][b] = -d[1][b];
    }
    float* out = w + tile.at;
    for (int a = 0; a < 4; ++a) {
        out[(a * 4 + 0) * tile.stride] = r[a][0];
        out[(a * 4 + 1) * tile.stride] = r[a][0] + r[a][1];
        out[(a * 4 + 2) * tile.stride] = r[a][0] - r[a][1];
        out[(a * 4 + 3) * tile.stride] = -r[a][1];
    }
}

// products [16, S, O, C] -> dweight [O, C, 3, 3] (+)= G^T m G, m = the sum of the S pieces
__global__ void lnn_winograd_weight_gradient(const float* __restrict__ products, float* __restrict__ dweight,
                                             int out_channels, int channels, int splits, int accumulate) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= out_channels * channels) return;
    const long long pairs = (long long)out_channels * channels;
    float m[4][4];
    for (int e = 0; e < 16; ++e) {
        float sum = 0.0f;
        for (int s = 0; s < splits; ++s) sum += products[((long long)e * splits + s) * pairs + i];
        m[e / 4][e % 4] = sum;
    }
    float t[3][4];                                  // G^T m, G = [[1, 0, 0], [1/2, 1/2, 1/2], [1/2, -1/2, 1/2], [0, 0, 1]]
    for (int b = 0; b < 4; ++b) {
        t[0][b] = m[0][b] + 0.5f * (m[1][b] + m[2][b]);
        t[1][b] = 0.5f * (m[1][b] - m[2][b]);
        t[2][b] = 0.5f * (m[1][b] + m[2][b]) + m[3][b];
    }
    float* g = dweight + (long long)i * 9;
    for (int a = 0; a < 3; ++a) {
        const float row[3] = {t[a][0] + 0.5f * (t[a][1] + t[a][2]), 0.5f * (t[a][1] - t[a][2]),
                              0.5f * (t[a][1] + t[a][2]) + t[a][3]};
        for (int b = 0; b < 3; ++b) g[a * 3 + b] = accumulate ? g[a * 3 + b] + row[b] : row[b];
    }
}
}
"""


def supported(attrs: dict) -> bool:
    """A 3x3, stride-1, undilated, ungrouped conv with padding at most 2 (its input gradient then too)."""
    (ph, pw) = attrs["padding"]
    return (tuple(attrs["kernel_size"]) == (3, 3) and tuple(attrs["stride"]) == (1, 1)
            and tuple(attrs["dilation"]) == (1, 1) and attrs["groups"] == 1 and ph <= 2 and pw <= 2)


def chosen(attrs: dict, channels: int, out_channels: int) -> bool:
    """Whether a conv2d runs Winograd on the GPU: "winograd", or "auto" with both channel counts >= 32."""
    wanted = attrs["algorithm"] == "winograd" or (attrs["algorithm"] == "auto" and channels >= AUTO_MIN_CHANNELS
                                                  and out_channels >= AUTO_MIN_CHANNELS)
    return wanted and supported(attrs)


def weight_gradient_chosen(attrs: dict, channels: int, out_channels: int) -> bool:
    """Whether a conv that runs Winograd also takes its weight gradient from it: "winograd", or "auto" where
    the products' work per transformed value, C*O/(C+O), reaches WEIGHT_GRADIENT_MIN_INTENSITY (else the
    halo kernel of conv_gemm.py). On an H200 at batch 256 (gpu_conv_layers) Winograd's took 4.19 ms on
    leaf_cnn224's 32->64 layer (21) against the halo kernel's 3.83, and 0.69 / 0.95 on the tomato model's
    48->96 (32), 2.19 / 4.32 on 64->128, 1.62 / 5.03 on 128->256."""
    return chosen(attrs, channels, out_channels) and (
        attrs["algorithm"] == "winograd"
        or channels * out_channels >= WEIGHT_GRADIENT_MIN_INTENSITY * (channels + out_channels))


def tiles(out_h: int, out_w: int) -> tuple:
    return ceil_div(out_h, 2), ceil_div(out_w, 2)


def chunk_images(channels: int, out_channels: int, in_hw: tuple, out_hw: tuple, batch: int) -> int:
    """Images per chunk: V and M of a chunk take about max(MIN_CHUNK_BYTES, the batch's x and y bytes)."""
    tiles_h, tiles_w = tiles(*out_hw)
    per_image = 4 * 16 * (channels + out_channels) * tiles_h * tiles_w
    budget = max(MIN_CHUNK_BYTES, 4 * batch * (channels * in_hw[0] * in_hw[1] + out_channels * out_hw[0] * out_hw[1]))
    return max(1, min(batch, budget // per_image))


def workspace_shapes(channels: int, out_channels: int, in_hw: tuple, out_hw: tuple, batch: int) -> tuple:
    """(V shape, M shape) for a batch: flat buffers holding [16, C, T] and [16, O, T] of one chunk."""
    tiles_h, tiles_w = tiles(*out_hw)
    count = chunk_images(channels, out_channels, in_hw, out_hw, batch) * tiles_h * tiles_w
    return (16 * channels * count,), (16 * out_channels * count,)


def splits(channels: int, out_channels: int, count: int) -> int:
    """Pieces S that the weight gradient cuts a chunk's reduction over `count` tiles into: its 16 [O, C]
    products alone are too few GEMM blocks for a GPU (leaf_cnn224's 64->128 layer: 32 of 64x64)."""
    blocks = 16 * ceil_div(out_channels, 64) * ceil_div(channels, 64)
    return max(1, min(ceil_div(GEMM_BLOCKS, blocks), count // MIN_SPLIT_TILES))


def weight_gradient_layout(channels: int, out_channels: int, in_hw: tuple, out_hw: tuple, batch: int) -> tuple:
    """(images a chunk, S, S * TS): the weight gradient's chunks are the forward's, their tiles cut into S
    pieces of TS (the last padded with zeros)."""
    tiles_h, tiles_w = tiles(*out_hw)
    images = chunk_images(channels, out_channels, in_hw, out_hw, batch)
    count = images * tiles_h * tiles_w
    pieces = splits(channels, out_channels, count)
    return images, pieces, pieces * ceil_div(count, pieces)


def backward_workspace_shapes(channels: int, out_channels: int, in_hw: tuple, out_hw: tuple, batch: int) -> tuple:
    """(O side, C side, products) flat buffers of a layer's backward. The input gradient's V [16, O, T] and
    M [16, C, T] (workspace_shapes of the flipped conv) are, in the weight gradient before it, dy's and x's
    transforms [16, S, O, TS] and [16, S, C, TS]; its products are [16, S, O, C]."""
    (o_side,), (c_side,) = workspace_shapes(out_channels, channels, out_hw, in_hw, batch)
    _, pieces, padded = weight_gradient_layout(channels, out_channels, in_hw, out_hw, batch)
    return ((max(o_side, 16 * out_channels * padded),), (max(c_side, 16 * channels * padded),),
            (16 * pieces * out_channels * channels,))


_MODULE = None


def _module():
    global _MODULE
    if _MODULE is None:
        import cupy

        _MODULE = cupy.RawModule(code=SOURCE)
    return _MODULE


class WinogradKernels:
    """One 3x3 conv layer's Winograd launches. Holds its transformed weights (forward, and with
    `backward` the input gradient's); V and M come from the caller (workspace_shapes). The 16 products
    are one strided-batched GEMM (blas.matmul, which CUDA-graph capture accepts)."""

    def __init__(self, attrs: dict, in_shape, out_shape, backward: bool = True):
        import cupy

        self.cupy = cupy
        self.channels, self.height, self.width = in_shape
        self.out_channels, self.out_h, self.out_w = out_shape
        self.pad_h, self.pad_w = attrs["padding"]
        self.u = cupy.empty((16, self.out_channels, self.channels), np.float32)
        self.u_flipped = cupy.empty((16, self.channels, self.out_channels), np.float32) if backward else None
        self.no_bias = cupy.zeros(1, np.float32)
        self.no_shift = cupy.zeros(self.out_channels, np.float32) if backward else None
        module = _module()
        self._weight = module.get_function("lnn_winograd_weight")
        self._input = module.get_function("lnn_winograd_input")
        self._output = module.get_function("lnn_winograd_output")
        self._output_gradient = module.get_function("lnn_winograd_output_gradient")
        self._weight_gradient = module.get_function("lnn_winograd_weight_gradient")

    def transform_weight(self, weight, flipped: bool = False):
        """U from weight [O, C, 3, 3] (the flipped, transposed one for the input gradient)."""
        pairs = self.out_channels * self.channels
        self._weight((ceil_div(pairs, THREADS),), (THREADS,),
                     (weight, self.u_flipped if flipped else self.u, np.int32(self.out_channels),
                      np.int32(self.channels), np.int32(flipped)))

    def _input_transform(self, x, v, tiles_hw: tuple, pad_h: int, pad_w: int, pieces: int, split_tiles: int):
        """v [16 S, C, TS] = B^T d B of x [n, C, H, W]'s tiles, cut into S = pieces of TS = split_tiles
        (lnn_winograd_input; the forward and input gradient: S = 1, TS = their count)."""
        n, channels, height, width = x.shape
        self._input((ceil_div(channels * pieces * split_tiles, THREADS),), (THREADS,),
                    (x, v, *(np.int32(a) for a in (n, channels, height, width, *tiles_hw, pad_h, pad_w, pieces)),
                     np.int64(split_tiles)))

    def _convolve(self, x, u, bias, y, v, m, pad_h, pad_w, relu):
        """Chunk by chunk of images: V = input transform, M = U @ V (16 products), y = output transform."""
        n, channels = x.shape[:2]
        out_channels, out_h, out_w = y.shape[1:]
        tiles_h, tiles_w = tiles(out_h, out_w)
        per_image = tiles_h * tiles_w
        images = min(n, v.size // (16 * channels * per_image), m.size // (16 * out_channels * per_image))
        if images < 1:
            raise ValueError(f"Winograd buffers {v.shape}, {m.shape} are too small for {x.shape} -> {y.shape}")
        for start in range(0, n, images):
            chunk = min(images, n - start)
            count = chunk * per_image
            v_chunk = v[:16 * channels * count].reshape(16, channels, count)
            m_chunk = m[:16 * out_channels * count].reshape(16, out_channels, count)
            self._input_transform(x[start:start + chunk], v_chunk, (tiles_h, tiles_w), pad_h, pad_w, 1, count)
            matmul(self.cupy, u, v_chunk, m_chunk)
            self._output((ceil_div(out_channels * count, THREADS),), (THREADS,),
                         (m_chunk, self.no_bias if bias is None else bias, y[start:start + chunk],
                          *(np.int32(a) for a in (chunk, out_channels, out_h, out_w, tiles_h, tiles_w,
                                                  bias is not None, relu))))

    def forward(self, x, weight, bias, y, v, m, relu: bool = False, weight_ready: bool = False):
        """y [N, O, OH, OW] = act(conv(x) + bias); V and M (workspace_shapes) are scratch.
        weight_ready: U already holds this weight's transform (inference: done once)."""
        if not weight_ready:
            self.transform_weight(weight)
        self._convolve(x, self.u, bias, y, v, m, self.pad_h, self.pad_w, relu)

    def input_gradient(self, dy, weight, dx, v, m):
        """dx [N, C, H, W] = conv(dy, flipped transposed weight, padding 2 - p); V and M from
        workspace_shapes(O, C, (OH, OW), (H, W), N)."""
        self.transform_weight(weight, flipped=True)
        self._convolve(dy, self.u_flipped, None, dx, v, m, 2 - self.pad_h, 2 - self.pad_w, False)

    def weight_gradient(self, dy, x, dweight, dbias, accumulate: bool, w, v, products):
        """dweight [O, C, 3, 3] and dbias [O] (None: no bias) from dy [N, O, OH, OW] and x: written, or added
        with accumulate. Chunk by chunk of images: W = dy's transform, V = x's, products (+)= W @ V^T (16 S
        products of [O, TS] @ [TS, C], one batched GEMM), then dweight (+)= G^T (sum of the S pieces) G.
        w, v, products: the flat buffers of backward_workspace_shapes (w and v are the input gradient's V, M)."""
        from lnn.runtime.cuda.reduce import channel_sums

        n = x.shape[0]
        channels, out_channels = self.channels, self.out_channels
        tiles_h, tiles_w = tiles(self.out_h, self.out_w)
        images, pieces, padded = weight_gradient_layout(channels, out_channels, (self.height, self.width),
                                                        (self.out_h, self.out_w), n)
        needs = {"w": (w, 16 * out_channels * padded), "v": (v, 16 * channels * padded),
                 "products": (products, 16 * pieces * out_channels * channels)}
        for name, (buffer, size) in needs.items():
            if buffer.size < size:
                raise ValueError(f"the Winograd weight gradient's {name} needs {size} floats, not {buffer.size}")
        sums = products[:16 * pieces * out_channels * channels].reshape(16 * pieces, out_channels, channels)
        for start in range(0, n, images):
            chunk = min(images, n - start)
            split_tiles = ceil_div(chunk * tiles_h * tiles_w, pieces)
            w_chunk = w[:16 * pieces * out_channels * split_tiles].reshape(16 * pieces, out_channels, split_tiles)
            v_chunk = v[:16 * pieces * channels * split_tiles].reshape(16 * pieces, channels, split_tiles)
            self._output_gradient((ceil_div(out_channels * pieces * split_tiles, THREADS),), (THREADS,),
                                  (dy[start:start + chunk], w_chunk,
                                   *(np.int32(a) for a in (chunk, out_channels, self.out_h, self.out_w, tiles_h,
                                                           tiles_w, pieces)), np.int64(split_tiles)))
            self._input_transform(x[start:start + chunk], v_chunk, (tiles_h, tiles_w), self.pad_h, self.pad_w,
                                  pieces, split_tiles)
            matmul(self.cupy, w_chunk, v_chunk.transpose(0, 2, 1), sums, accumulate=start > 0)
        self._weight_gradient((ceil_div(out_channels * channels, THREADS),), (THREADS,),
                              (sums, dweight, *(np.int32(a) for a in (out_channels, channels, pieces, accumulate))))
        if dbias is not None:
            dy_sums, _ = channel_sums(dy, dy, self.no_shift, self.no_shift)
            if accumulate:
                dbias += dy_sums
            else:
                dbias[...] = dy_sums
