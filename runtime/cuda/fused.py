"""CuPy-only kernels that replace generic ones of kernels.py on the GPU, one launch each (same results).

epilogue_in_place:  y [N, C, P] float32, in place:  y = act(y * scale[c] + shift[c])
epilogue_from_gemm: src [C, N, P] (a conv's GEMM output) -> y [N, C, P]:  y = act(src * scale[c] + shift[c])
    act: none, relu, relu6, leaky_relu (slope), sigmoid, tanh, as formats/ops.py ACTIVATIONS (softmax is
    not element-wise: the backend runs kernels.activation_forward after an epilogue without activation).
    This is a conv's or linear's bias + activation (scale 1), a batch norm's affine, an activation layer.
im2col: x [N, C, H, W] -> cols [C, KH, KW, N, OH, OW] with zero padding read in place (no padded copy);
    the same cols as kernels.im2col.
maxpool2d: x [N, C, H, W] -> y [N, C, OH, OW], max over the window's cells inside the image (the
    reference pads with -inf, and padding <= half the kernel keeps every window non-empty).
`i` and `n` are reserved names in ElementwiseKernel bodies. Importing this module imports CuPy; the
kernels compile on first use (CuPy caches them on disk).
"""

from __future__ import annotations

import cupy

# Activation codes passed to the epilogue kernels; softmax has none (see above).
ACTIVATION_CODES = {None: 0, "relu": 1, "relu6": 2, "leaky_relu": 3, "sigmoid": 4, "tanh": 5}

_ACTIVATE = r"""
__device__ __forceinline__ float lnn_activate(float v, int code, float slope) {
    switch (code) {
        case 1: return fmaxf(v, 0.0f);
        case 2: return fminf(fmaxf(v, 0.0f), 6.0f);
        case 3: return v >= 0.0f ? v : v * slope;
        case 4: { const float e = expf(-fabsf(v)); return v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e); }
        case 5: return tanhf(v);
        default: return v;
    }
}
"""

epilogue_in_place = cupy.ElementwiseKernel(
    "raw float32 scale, raw float32 shift, int32 channels, int32 positions, int32 code, float32 slope",
    "float32 y",
    "const int c = (int)((i / positions) % channels);"
    "y = lnn_activate(y * scale[c] + shift[c], code, slope);",
    "lnn_epilogue_in_place", preamble=_ACTIVATE)

epilogue_from_gemm = cupy.ElementwiseKernel(
    "raw float32 src, raw float32 scale, raw float32 shift, int32 batch, int32 channels, int32 positions, "
    "int32 code, float32 slope",
    "float32 y",
    "const long long p = i % positions;"
    "const long long image_channel = i / positions;"
    "const int c = (int)(image_channel % channels);"
    "const long long image = image_channel / channels;"
    "y = lnn_activate(src[((long long)c * batch + image) * positions + p] * scale[c] + shift[c], code, slope);",
    "lnn_epilogue_from_gemm", preamble=_ACTIVATE)

_im2col = cupy.ElementwiseKernel(
    "raw float32 x, int32 batch, int32 channels, int32 height, int32 width, int32 out_h, int32 out_w, "
    "int32 kernel_h, int32 kernel_w, int32 stride_h, int32 stride_w, int32 pad_h, int32 pad_w, "
    "int32 dilation_h, int32 dilation_w",
    "float32 cols",
    "long long t = i;"
    "const int ow = (int)(t % out_w); t /= out_w;"
    "const int oh = (int)(t % out_h); t /= out_h;"
    "const int image = (int)(t % batch); t /= batch;"
    "const int kw = (int)(t % kernel_w); t /= kernel_w;"
    "const int kh = (int)(t % kernel_h);"
    "const int c = (int)(t / kernel_h);"
    "const int h = oh * stride_h - pad_h + kh * dilation_h;"
    "const int w = ow * stride_w - pad_w + kw * dilation_w;"
    "cols = (h >= 0 && h < height && w >= 0 && w < width)"
    "    ? x[(((long long)image * channels + c) * height + h) * width + w] : 0.0f;",
    "lnn_im2col")

_maxpool2d = cupy.ElementwiseKernel(
    "raw float32 x, int32 height, int32 width, int32 out_h, int32 out_w, int32 kernel_h, int32 kernel_w, "
    "int32 stride_h, int32 stride_w, int32 pad_h, int32 pad_w",
    "float32 y",
    "const int ow = (int)(i % out_w);"
    "const int oh = (int)((i / out_w) % out_h);"
    "const long long plane = (i / out_w / out_h) * (long long)height * width;"
    "float best = __int_as_float(0xff800000);"   # -inf, without math headers
    "for (int a = 0; a < kernel_h; ++a) {"
    "    const int h = oh * stride_h - pad_h + a;"
    "    if (h < 0 || h >= height) continue;"
    "    for (int b = 0; b < kernel_w; ++b) {"
    "        const int w = ow * stride_w - pad_w + b;"
    "        if (w < 0 || w >= width) continue;"
    "        best = fmaxf(best, x[plane + (long long)h * width + w]);"
    "    }"
    "}"
    "y = best;",
    "lnn_maxpool2d")


def im2col(x, attrs, cols):
    """kernels.im2col without the padded copy: x [N, C, H, W] -> cols [C, KH, KW, N, OH, OW]."""
    n, c, h, w = x.shape
    oh, ow = cols.shape[4:]
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = attrs["kernel_size"], attrs["stride"], attrs["padding"], attrs["dilation"]
    return _im2col(x, n, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, cols)


def maxpool2d(x, attrs, out):
    """kernels.maxpool2d_forward in one launch: x [N, C, H, W] -> out [N, C, OH, OW]."""
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel_size"], attrs["stride"], attrs["padding"]
    return _maxpool2d(x, x.shape[2], x.shape[3], out.shape[2], out.shape[3], kh, kw, sh, sw, ph, pw, out)
