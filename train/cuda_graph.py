"""The whole training step as one CUDA graph: captured once, replayed per batch (CuPy stream capture).

Why: the eager CuPy step is many small launches plus a host sync per step (launch-bound). The static
plan allocates nothing inside a step, so the step can be recorded once and replayed.

What one replay does, for a batch of exactly plan.batch_size uint8 images (other batches take the
eager path, which shares every parameter, gradient and optimizer buffer with this one):
  normalize   x_u8 [N, C, H, W] -> act:-1 = x * (scale / std[c]) - mean[c] / std[c]   (as Trainer._load_input)
  forward     linear  y [N, O] = x [N, I] @ W.T (cuBLAS) then y = act(y + b)          (fused.epilogue_in_place)
              conv2d  implicit GEMM y = relu(conv(x) + b) in one kernel (runtime/cuda/conv_gemm.py) when
                      conv_gemm.supported; Winograd where winograd.chosen() (runtime/cuda/winograd.py, its
                      16 products through cublasSgemmStridedBatched); else cols = im2col(x) (fused.im2col);
                      gemm [O, N*P] = W [O, K] @ cols [K, N*P] (cuBLAS); y [N, O, P] = act(gemm + b)
                                                                                (fused.epilogue_from_gemm)
              maxpool2d y and argmax (the winning kernel offset, first on ties)
              global_avg_pool y [N, C] = mean over H*W;  flatten: a view (no work)
  loss        softmax cross-entropy forward+backward in one kernel, one thread per row:
              dlogits = (softmax(z) - onehot(label)) / N; per-row loss and argmax==label
  backward    relu: dy *= (y > 0) in place, or done by the next layer (layers.PoolUndoingRelu): a max pool
              (dy kept where the pool's y > 0) or a global average pool (dx = 0 where its x <= 0);
              linear: dW = dy.T @ x, db = sum_n dy, dx = dy @ W;
              conv2d: implicit GEMM (conv_gemm: dW and db from split partial sums, dx = the forward on dy
              with the flipped weight, or Winograd's where chosen), else dy -> [O, N*P], db,
              cols = im2col(x), dW = dy @ cols.T, dcols = W.T @ dy, dx = col2im (a gather: no atomics);
              maxpool2d: tiled windows (kernel == stride, no padding) write each window's cells from one
              thread, else dx gathers dy where argmax points at the cell.
              Gradients are WRITTEN (the eager path zeroes and adds: the same for one micro-batch).
  statistics  stats = [loss sum, correct rows, global gradient L2 norm] on the device (two-pass
              deterministic reductions); read only when the caller asks (DeviceStepResult).
  optimizer   one kernel over the flat parameter buffer: optional clipping by the device norm, then
              SGD (momentum, nesterov, weight decay) or Adam/AdamW, as train/optim.py (PyTorch semantics).
Per-step host values (learning rate, first-step flag, Adam bias corrections) go through a small
device buffer copied from a ring of pinned host slots before each replay.
GEMMs call cublasSgemm_v2 through ctypes on a cuBLAS handle of our own (the libcublas CuPy loaded),
bound to our stream and given a pre-allocated workspace: CuPy's own cuBLAS calls refuse stream capture.
The first step runs the same launches eagerly (compiling kernels, loading cuBLAS modules), checked by
a synchronize; the second captures, with a CuPy allocator that refuses any allocation meanwhile.
Any failure raises GraphFailure with a one-line reason; the Trainer then uses its eager path.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from lnn.formats.errors import LnnError
from lnn.runtime.cuda.conv_gemm import ceil_div

GRAPH_OPS = ("linear", "conv2d", "maxpool2d", "global_avg_pool", "flatten")
GRAPH_OPTIMIZERS = ("sgd", "adam", "adamw")
CUBLAS_WORKSPACE_BYTES = 32 * 2 ** 20     # NVIDIA's recommendation for Hopper
THREADS = 256
REDUCE_CHUNK = 4096                         # elements per reduction block (first pass)
MAX_REDUCE_CHUNKS = 256
PINNED_SLOTS = 64                           # ring of host slots for the per-step scalars
SCALARS = 8


class GraphFailure(LnnError):
    """The graph path cannot run; the message is one line saying why."""


def unsupported_reason(model, config, optimizer_config: dict, amp: bool, dtype) -> str | None:
    """None when the graph step can run this training setup, else why not (no GPU needed)."""
    if amp:
        return "mixed precision (amp) runs eagerly"
    if np.dtype(dtype) != np.float32:
        return f"dtype {np.dtype(dtype).name} (the graph step is float32)"
    if model.loss != "cross_entropy":
        return f"loss {model.loss} (the graph step has cross_entropy)"
    if config.accumulate != 1:
        return "gradient accumulation (accumulate > 1)"
    if optimizer_config["type"] not in GRAPH_OPTIMIZERS:
        return f"optimizer {optimizer_config['type']}"
    if not model.takes_images:
        return "no preprocess block (the graph step takes uint8 images)"
    for node in model.nodes:
        where = f"layer {node.index} ({node.op})"
        if node.op not in GRAPH_OPS:
            return f"{where}: op not in the graph step ({', '.join(GRAPH_OPS)})"
        activation = node.attrs.get("activation")
        if activation and activation.get("type") != "relu":
            return f"{where}: activation {activation.get('type')} (the graph step fuses relu only)"
        if node.op == "conv2d" and node.attrs["groups"] != 1:
            return f"{where}: grouped convolution"
        if node.op == "maxpool2d" and math.prod(node.attrs["kernel_size"]) > 255:
            return f"{where}: a window over 255 cells"
    return None


def reduce_chunks(elements: int) -> int:
    """Blocks of the first reduction pass over `elements` values of one channel."""
    return max(1, min(MAX_REDUCE_CHUNKS, ceil_div(elements, REDUCE_CHUNK)))


KERNELS = r"""
__device__ __forceinline__ float block_sum(float value) {
    __shared__ float partial[256];
    partial[threadIdx.x] = value;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
        __syncthreads();
    }
    return partial[0];
}

extern "C" {

// out [N, C, P] = x_u8 * multiplier[c] - offset[c]
__global__ void lnn_normalize_u8(const unsigned char* x, const float* multiplier, const float* offset,
                                 float* out, long long total, int channels, long long positions) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int c = (int)((i / positions) % channels);
    out[i] = __fsub_rn(__fmul_rn((float)x[i], multiplier[c]), offset[c]);
}

// x [N*C planes, H, W] -> y, argmax [planes, OH, OW]; padding cells are -inf; first maximum wins
__global__ void lnn_maxpool_forward(const float* x, float* y, unsigned char* argmax, long long total,
                                    int height, int width, int out_h, int out_w, int kernel_h, int kernel_w,
                                    int stride_h, int stride_w, int pad_h, int pad_w) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int ow = (int)(i % out_w);
    const int oh = (int)((i / out_w) % out_h);
    const float* plane = x + (i / out_w / out_h) * (long long)height * width;
    float best = __int_as_float(0xff800000);
    int winner = 0;
    for (int a = 0; a < kernel_h; ++a) {
        const int h = oh * stride_h - pad_h + a;
        for (int b = 0; b < kernel_w; ++b) {
            const int w = ow * stride_w - pad_w + b;
            if (h < 0 || h >= height || w < 0 || w >= width) continue;
            const float v = plane[h * width + w];
            if (v > best) { best = v; winner = a * kernel_w + b; }
        }
    }
    y[i] = best;
    argmax[i] = (unsigned char)winner;
}

// Tiled windows (kernel == stride, no padding, H = OH * KH, W = OW * KW): each input cell is in exactly one
// window, so one thread per window writes all its cells: dy at the argmax cell, 0 elsewhere. relu_mask:
// the layer before ends in relu, undone here (layers.PoolUndoingRelu): dy dropped where the pool's y <= 0.
__global__ void lnn_maxpool_backward_tiled(const float* dy, const unsigned char* argmax, const float* y, float* dx,
                                           long long total, int out_h, int out_w, int kernel_h, int kernel_w,
                                           int relu_mask) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int ow = (int)(i % out_w);
    const int oh = (int)((i / out_w) % out_h);
    const long long plane = i / out_w / out_h;
    const int width = out_w * kernel_w, height = out_h * kernel_h;
    const long long corner = (plane * height + (long long)oh * kernel_h) * width + (long long)ow * kernel_w;
    const int winner_a = argmax[i] / kernel_w, winner_b = argmax[i] % kernel_w;
    const float g = (relu_mask && !(y[i] > 0.0f)) ? 0.0f : dy[i];
    for (int a = 0; a < kernel_h; ++a)
        for (int b = 0; b < kernel_w; ++b)
            dx[corner + (long long)a * width + b] = (a == winner_a && b == winner_b) ? g : 0.0f;
}

// dx [planes, H, W] = sum of dy over the windows whose argmax is this cell
__global__ void lnn_maxpool_backward(const float* dy, const unsigned char* argmax, float* dx, long long total,
                                     int height, int width, int out_h, int out_w, int kernel_h, int kernel_w,
                                     int stride_h, int stride_w, int pad_h, int pad_w) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int w = (int)(i % width);
    const int h = (int)((i / width) % height);
    const long long plane = (i / width / height) * (long long)out_h * out_w;
    float sum = 0.0f;
    for (int a = 0; a < kernel_h; ++a) {
        const int hs = h + pad_h - a;
        if (hs < 0 || hs % stride_h) continue;
        const int oh = hs / stride_h;
        if (oh >= out_h) continue;
        for (int b = 0; b < kernel_w; ++b) {
            const int ws = w + pad_w - b;
            if (ws < 0 || ws % stride_w) continue;
            const int ow = ws / stride_w;
            if (ow >= out_w) continue;
            const long long o = plane + (long long)oh * out_w + ow;
            if (argmax[o] == a * kernel_w + b) sum += dy[o];
        }
    }
    dx[i] = sum;
}

// x [planes, P] -> y [planes] (mean);  backward: dx [planes, P] = dy[plane] / P
__global__ void lnn_global_avg_pool_forward(const float* x, float* y, long long planes, int positions) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= planes) return;
    float sum = 0.0f;
    for (int p = 0; p < positions; ++p) sum += x[i * positions + p];
    y[i] = sum / (float)positions;
}

// relu_mask: the layer before ends in relu, undone here (layers.PoolUndoingRelu): dx = 0 where x <= 0
__global__ void lnn_global_avg_pool_backward(const float* dy, const float* x, float* dx, long long total,
                                             int positions, int relu_mask) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    dx[i] = (relu_mask && !(x[i] > 0.0f)) ? 0.0f : dy[i / positions] / (float)positions;
}

// dy = y > 0 ? dy : 0 (relu backward from the output, in place)
__global__ void lnn_relu_backward(float* dy, const float* y, long long total) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    dy[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

// x [N, C, P] -> out [C, N, P]
__global__ void lnn_nchw_to_cnp(const float* x, float* out, long long total, int batch, int channels,
                                long long positions) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    const long long p = i % positions;
    const long long t = i / positions;
    const int image = (int)(t % batch);
    const int c = (int)(t / batch);
    out[i] = x[((long long)image * channels + c) * positions + p];
}

// cols [C, KH, KW, N, OH, OW] -> dx [N, C, H, W]: every cell gathers the window entries that read it
__global__ void lnn_col2im(const float* cols, float* dx, long long total, int batch, int channels, int height,
                           int width, int out_h, int out_w, int kernel_h, int kernel_w, int stride_h,
                           int stride_w, int pad_h, int pad_w, int dilation_h, int dilation_w) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int w = (int)(i % width);
    const int h = (int)((i / width) % height);
    const int c = (int)((i / width / height) % channels);
    const int image = (int)(i / width / height / channels);
    float sum = 0.0f;
    for (int a = 0; a < kernel_h; ++a) {
        const int hs = h + pad_h - a * dilation_h;
        if (hs < 0 || hs % stride_h) continue;
        const int oh = hs / stride_h;
        if (oh >= out_h) continue;
        for (int b = 0; b < kernel_w; ++b) {
            const int ws = w + pad_w - b * dilation_w;
            if (ws < 0 || ws % stride_w) continue;
            const int ow = ws / stride_w;
            if (ow >= out_w) continue;
            const long long row = ((long long)c * kernel_h + a) * kernel_w + b;
            sum += cols[((row * batch + image) * out_h + oh) * out_w + ow];
        }
    }
    dx[i] = sum;
}

// First pass of a per-channel sum over x [outer, channels, inner]: grid (chunks, channels)
__global__ void lnn_channel_sum_partial(const float* x, float* partial, long long outer, int channels,
                                        long long inner, int square) {
    const int c = blockIdx.y;
    const long long count = outer * inner;
    const long long step = (long long)gridDim.x * blockDim.x;
    float sum = 0.0f;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < count; e += step) {
        const float v = x[((e / inner) * channels + c) * inner + e % inner];
        sum += square ? v * v : v;
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) partial[(long long)c * gridDim.x + blockIdx.x] = sum;
}

// Second pass: out[c] = sum (or sqrt of the sum) of the chunks' partial sums; one block per channel
__global__ void lnn_channel_sum_finish(const float* partial, float* out, int chunks, int take_sqrt) {
    float sum = 0.0f;
    for (int k = threadIdx.x; k < chunks; k += blockDim.x) sum += partial[(long long)blockIdx.x * chunks + k];
    sum = block_sum(sum);
    if (threadIdx.x == 0) out[blockIdx.x] = take_sqrt ? sqrtf(sum) : sum;
}

// logits [N, K], labels [N] -> dlogits = (softmax - onehot) * scale, row_loss, row_correct (NaN loss
// for a label outside 0..K-1)
__global__ void lnn_softmax_cross_entropy(const float* logits, const int* labels, float* dlogits,
                                          float* row_loss, float* row_correct, int rows, int classes, float scale) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* z = logits + (long long)r * classes;
    float top = z[0];
    int best = 0;
    for (int k = 1; k < classes; ++k) if (z[k] > top) { top = z[k]; best = k; }
    float total = 0.0f;
    for (int k = 0; k < classes; ++k) total += expf(z[k] - top);
    const int label = labels[r];
    const bool valid = label >= 0 && label < classes;
    row_loss[r] = valid ? logf(total) + top - z[label] : __int_as_float(0x7fc00000);
    row_correct[r] = (valid && best == label) ? 1.0f : 0.0f;
    for (int k = 0; k < classes; ++k) {
        const float p = expf(z[k] - top) / total;
        dlogits[(long long)r * classes + k] = (k == label ? p - 1.0f : p) * scale;
    }
}

__device__ __forceinline__ float clipped(float* g, long long i, const float* stats, float max_norm) {
    float grad = g[i];
    if (max_norm > 0.0f) {
        const float coefficient = max_norm / (stats[2] + 1e-6f);
        if (coefficient < 1.0f) { grad *= coefficient; g[i] = grad; }
    }
    return grad;
}

// scalars: [lr, first step (1/0)]
__global__ void lnn_sgd_update(float* p, float* g, float* buf, const float* scalars, const float* stats,
                               long long size, float momentum, float weight_decay, int nesterov, float max_norm) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= size) return;
    float grad = clipped(g, i, stats, max_norm);
    if (weight_decay != 0.0f) grad = grad + weight_decay * p[i];
    if (momentum != 0.0f) {
        const float b = scalars[1] != 0.0f ? grad : momentum * buf[i] + grad;
        buf[i] = b;
        grad = nesterov ? grad + momentum * b : b;
    }
    p[i] = p[i] - scalars[0] * grad;
}

// scalars: [lr / (1 - beta1^t), 1 - beta2^t, 1 - lr * weight_decay]
__global__ void lnn_adam_update(float* p, float* g, float* m, float* v, const float* scalars, const float* stats,
                                long long size, float beta1, float beta2, float eps, float weight_decay,
                                int decoupled, float max_norm) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= size) return;
    float grad = clipped(g, i, stats, max_norm);
    float param = p[i];
    if (weight_decay != 0.0f) {
        if (decoupled) param *= scalars[2];
        else grad = grad + weight_decay * param;
    }
    const float m_new = beta1 * m[i] + (1.0f - beta1) * grad;
    const float v_new = beta2 * v[i] + (1.0f - beta2) * grad * grad;
    m[i] = m_new;
    v[i] = v_new;
    p[i] = param - scalars[0] * m_new / (sqrtf(v_new / scalars[1]) + eps);
}

}
"""


# --------------------------------------------------------------------------- cuBLAS through ctypes

def _loaded_cublas_path() -> str | None:
    """The libcublas this process has mapped (CuPy's), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                name = path.rsplit("/", 1)[-1]
                if name.startswith("libcublas.so"):
                    return path
    except OSError:
        return None
    return None


class Cublas:
    """cublasSgemm_v2 on a handle of our own, bound to one stream with a pre-allocated workspace."""

    OP_N, OP_T = 0, 1

    def __init__(self, cupy, stream):
        cupy.cuda.device.get_cublas_handle()               # makes CuPy load its libcublas
        path = _loaded_cublas_path()
        candidates = [path] if path else ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]
        self.lib = None
        for candidate in candidates:
            try:
                self.lib = ctypes.CDLL(candidate)
                break
            except OSError:
                continue
        if self.lib is None:
            raise GraphFailure(f"cannot load libcublas (tried {', '.join(candidates)})")
        lib = self.lib
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cublasSetWorkspace_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.cublasDestroy_v2.argtypes = [ctypes.c_void_p]
        lib.cublasSgemm_v2.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                       ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_float),
                                       ctypes.c_void_p, ctypes.c_int]
        lib.cublasSgemmStridedBatched.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong,
            ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.POINTER(ctypes.c_float),
            ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_int]
        self.handle = ctypes.c_void_p()
        self._check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate_v2")
        self.workspace = cupy.empty(CUBLAS_WORKSPACE_BYTES, dtype=np.uint8)
        self._check(lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream.ptr)), "cublasSetStream_v2")
        self._check(lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                              CUBLAS_WORKSPACE_BYTES), "cublasSetWorkspace_v2")
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int, what: str):
        if status != 0:
            raise GraphFailure(f"{what} returned cuBLAS status {status}")

    def matmul(self, out, a, b, transpose_a=False, transpose_b=False):
        """Row-major out [M, N] = op(a) [M, K] @ op(b) [K, N]; a is stored [K, M] when transpose_a."""
        m, n = out.shape
        k = a.shape[0] if transpose_a else a.shape[1]
        if (a.shape[1] if transpose_a else a.shape[0]) != m or (b.shape[1] if transpose_b else b.shape[0]) != k \
                or (b.shape[0] if transpose_b else b.shape[1]) != n:
            raise GraphFailure(f"GEMM shapes do not agree: out {out.shape}, a {a.shape}{'.T' * transpose_a}, "
                               f"b {b.shape}{'.T' * transpose_b}")
        for array in (out, a, b):
            if not array.flags.c_contiguous:
                raise GraphFailure("a GEMM operand is not contiguous")
        # column-major: out.T [N, M] = op(b).T @ op(a).T
        status = self.lib.cublasSgemm_v2(
            self.handle, self.OP_T if transpose_b else self.OP_N, self.OP_T if transpose_a else self.OP_N,
            n, m, k, ctypes.byref(self._one), ctypes.c_void_p(b.data.ptr), b.shape[1],
            ctypes.c_void_p(a.data.ptr), a.shape[1], ctypes.byref(self._zero), ctypes.c_void_p(out.data.ptr), n)
        self._check(status, "cublasSgemm_v2")

    def matmul_batched(self, out, a, b):
        """Row-major out [B, M, N] = a [B, M, K] @ b [B, K, N], all contiguous (Winograd's 16 products)."""
        count, m, n = out.shape
        k = a.shape[2]
        if a.shape != (count, m, k) or b.shape != (count, k, n):
            raise GraphFailure(f"batched GEMM shapes do not agree: out {out.shape}, a {a.shape}, b {b.shape}")
        for array in (out, a, b):
            if not array.flags.c_contiguous:
                raise GraphFailure("a batched GEMM operand is not contiguous")
        status = self.lib.cublasSgemmStridedBatched(
            self.handle, self.OP_N, self.OP_N, n, m, k, ctypes.byref(self._one), ctypes.c_void_p(b.data.ptr), n,
            k * n, ctypes.c_void_p(a.data.ptr), k, m * k, ctypes.byref(self._zero), ctypes.c_void_p(out.data.ptr),
            n, m * n, count)
        self._check(status, "cublasSgemmStridedBatched")

    def close(self):
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = ctypes.c_void_p()


# --------------------------------------------------------------------------- the step


class DeviceStepResult:
    """A StepResult whose numbers stay on the device until first read (one copy for all three)."""

    skipped = False

    def __init__(self, stats, rows: int):
        self._stats, self.rows, self._values = stats, rows, None

    def _read(self):
        if self._values is None:
            loss_sum, correct, norm = (float(v) for v in self._stats.get()[:3])
            self._values = (loss_sum / self.rows, norm, int(round(correct)))
        return self._values

    loss = property(lambda self: self._read()[0])
    grad_norm = property(lambda self: self._read()[1])
    correct = property(lambda self: self._read()[2])
    labelled = property(lambda self: self.rows)       # outlier exposure never runs as a graph


def _refuse_allocation(size):
    raise GraphFailure(f"a CuPy allocation of {size} bytes inside the captured step")


class GraphStep:
    """Runs Trainer steps of exactly plan.batch_size uint8 rows as launches of a captured graph."""

    def __init__(self, trainer):
        import cupy
        import cupyx

        from lnn.runtime.cuda import fused

        self.cupy, self.fused, self.trainer = cupy, fused, trainer
        plan, model = trainer.plan, trainer.model
        self.plan, self.n = plan, plan.batch_size
        self.stream = cupy.cuda.Stream(non_blocking=True)    # ordered with the default stream by events
        self.cublas = Cublas(cupy, self.stream)
        self.module = cupy.RawModule(code=KERNELS)
        n = self.n
        self.x_u8 = cupy.empty((n,) + tuple(model.input_shape), dtype=np.uint8)
        self.labels = cupy.empty(n, dtype=np.int32)
        self.row_loss = cupy.empty(n, dtype=np.float32)
        self.row_correct = cupy.empty(n, dtype=np.float32)
        self.stats = cupy.zeros(4, dtype=np.float32)          # loss sum, correct, gradient norm
        self.scalars = cupy.zeros(SCALARS, dtype=np.float32)
        self.host_scalars = cupyx.empty_pinned((PINNED_SLOTS, SCALARS), dtype=np.float32)
        self.slot_events = [None] * PINNED_SLOTS
        self.slot = 0
        widest = max([1] + [max(node.out_shape[0], 1) for node in model.nodes])
        self.ones = cupy.ones(widest, dtype=np.float32)
        self.zeros = cupy.zeros(widest, dtype=np.float32)
        self.multiplier, self.offset = (a.reshape(-1) for a in trainer._normalizer)
        self.launches = []            # the step, as a list of zero-argument callables (launch order)
        partial_sizes = [1]
        self._build(partial_sizes)
        self.partial = cupy.empty(max(partial_sizes), dtype=np.float32)
        self.graph = None
        self.steps_run = 0

    # ------------------------------------------------------------------ building the launch list

    def _kernel(self, name, total, *args, grid=None):
        function = self.module.get_function(name)
        grid = grid or (ceil_div(int(total), THREADS),)
        self.launches.append(lambda: function(grid, (THREADS,), args))

    def _channel_sum(self, x, out, outer, channels, inner, partial_sizes, square=False, take_sqrt=False):
        """out[c] = sum over x [outer, channels, inner] of channel c (or its L2 norm)."""
        chunks = reduce_chunks(outer * inner)
        partial_sizes.append(chunks * channels)
        first = self.module.get_function("lnn_channel_sum_partial")
        second = self.module.get_function("lnn_channel_sum_finish")
        args = (np.int64(outer), np.int32(channels), np.int64(inner), np.int32(square))

        def launch():
            first((chunks, channels), (THREADS,), (x, self.partial) + args)
            second((channels,), (THREADS,), (self.partial, out, np.int32(chunks), np.int32(take_sqrt)))
        self.launches.append(launch)

    def _build(self, partial_sizes):
        plan, n = self.plan, self.n
        views = plan.views(n)
        calls = views["calls"]
        model = self.trainer.model
        x0 = views["act:-1"]
        channels = model.input_shape[0]
        self._kernel("lnn_normalize_u8", x0.size, self.x_u8, self.multiplier, self.offset, x0,
                     np.int64(x0.size), np.int32(channels), np.int64(x0.size // (n * channels)))
        for i, node in enumerate(model.nodes):
            if not plan.trains_alias[i]:
                self._forward(node, calls[i])
        last = plan.num_layers - 1
        logits, dlogits = views[f"act:{last}"], views[f"grad:{last}"]
        classes = logits.shape[1]
        self._kernel("lnn_softmax_cross_entropy", n, logits, self.labels, dlogits, self.row_loss, self.row_correct,
                     np.int32(n), np.int32(classes), np.float32(1.0 / n))
        self._channel_sum(self.row_loss, self.stats[0:1], 1, 1, n, partial_sizes)
        self._channel_sum(self.row_correct, self.stats[1:2], 1, 1, n, partial_sizes)
        for i in reversed(range(plan.num_layers)):
            if not plan.runs_backward[i]:
                break
            if not plan.trains_alias[i]:
                self._backward(model.nodes[i], calls[i], partial_sizes)
        grads = plan.grads
        self._channel_sum(grads, self.stats[2:3], 1, 1, grads.size, partial_sizes, square=True, take_sqrt=True)
        self._update()

    def _epilogue_args(self, node, c):
        relu = 1 if node.attrs.get("activation") else 0
        bias = c["params"].get("bias")
        return (bias if bias is not None else self.zeros), relu

    def _forward(self, node, c):
        fused, n, attrs = self.fused, self.n, node.attrs
        x, y = c["x"], c["y"]
        layer = self.plan.layers[node.index]
        if node.op == "conv2d" and layer.winograd:
            kernels, weight, bias = layer.winograd_kernels(), c["params"]["weight"], c["params"].get("bias")
            v, m, relu = c["ws"]["winograd_v"], c["ws"]["winograd_m"], bool(attrs.get("activation"))
            self.launches.append(lambda: kernels.forward(x, weight, bias, y, v, m, relu=relu,
                                                         matmul=self.cublas.matmul_batched))
        elif node.op == "conv2d" and layer.implicit:
            kernels, weight, bias = layer.implicit_kernels(), c["params"]["weight"], c["params"].get("bias")
            relu = bool(attrs.get("activation"))
            self.launches.append(lambda: kernels.forward(x, weight, bias, y, relu=relu))
        elif node.op == "linear":
            y2 = y.reshape(n, -1)
            self.launches.append(lambda: self.cublas.matmul(y2, x.reshape(n, -1), c["params"]["weight"],
                                                            transpose_b=True))
            shift, relu = self._epilogue_args(node, c)
            if c["params"].get("bias") is not None or relu:
                self.launches.append(lambda: fused.epilogue_in_place(self.ones, shift, y2.shape[1], 1, relu, 0.0, y2))
        elif node.op == "conv2d":
            cols, gemm = c["ws"]["cols"], c["ws"]["gemm"]
            out_channels = y.shape[1]
            weight = c["params"]["weight"].reshape(out_channels, -1)
            shift, relu = self._epilogue_args(node, c)
            positions = y[0, 0].size
            self.launches.append(lambda: fused.im2col(x, attrs, cols))
            self.launches.append(lambda: self.cublas.matmul(gemm.reshape(out_channels, -1), weight,
                                                            cols.reshape(weight.shape[1], -1)))
            self.launches.append(lambda: fused.epilogue_from_gemm(gemm, self.ones, shift, n, out_channels, positions,
                                                                  relu, 0.0, y))
        elif node.op == "maxpool2d":
            self._kernel("lnn_maxpool_forward", y.size, x, y, c["ws"]["argmax"], np.int64(y.size),
                         *self._pool_geometry(x, y, attrs))
        elif node.op == "global_avg_pool":
            planes = n * x.shape[1]
            self._kernel("lnn_global_avg_pool_forward", planes, x, y, np.int64(planes), np.int32(x[0, 0].size))

    @staticmethod
    def _pool_geometry(x, y, attrs):
        (kh, kw), (sh, sw), (ph, pw) = attrs["kernel_size"], attrs["stride"], attrs["padding"]
        return tuple(np.int32(v) for v in (x.shape[2], x.shape[3], y.shape[2], y.shape[3], kh, kw, sh, sw, ph, pw))

    def _backward(self, node, c, partial_sizes):
        n, attrs = self.n, node.attrs
        x, y, dy, dx = c["x"], c["y"], c["dy"], c["dx"]
        layer = self.plan.layers[node.index]
        if node.attrs.get("activation") and not layer.relu_undone_by_next:
            self._kernel("lnn_relu_backward", dy.size, dy, y, np.int64(dy.size))
        if node.op == "conv2d" and layer.implicit:
            kernels, weight, grads = layer.implicit_kernels(), c["params"]["weight"], c["grads"]
            self.launches.append(lambda: kernels.weight_gradient(dy, x, grads["weight"], grads.get("bias"),
                                                                 accumulate=False))
            if dx is not None and layer.winograd:
                winograd, v, m = layer.winograd_kernels(), c["ws"]["winograd_v_b"], c["ws"]["winograd_m_b"]
                self.launches.append(lambda: winograd.input_gradient(dy, weight, dx, v, m,
                                                                     matmul=self.cublas.matmul_batched))
            elif dx is not None:
                self.launches.append(lambda: kernels.input_gradient(dy, weight, dx))
        elif node.op == "linear":
            dy2, x2 = dy.reshape(n, -1), x.reshape(n, -1)
            weight, grads = c["params"]["weight"], c["grads"]
            self.launches.append(lambda: self.cublas.matmul(grads["weight"], dy2, x2, transpose_a=True))
            if "bias" in grads:
                self._channel_sum(dy2, grads["bias"], n, dy2.shape[1], 1, partial_sizes)
            if dx is not None:
                self.launches.append(lambda: self.cublas.matmul(dx.reshape(n, -1), dy2, weight))
        elif node.op == "conv2d":
            cols, gemm = c["ws"]["cols_b"], c["ws"]["gemm_b"]
            out_channels, positions = dy.shape[1], dy[0, 0].size
            weight = c["params"]["weight"].reshape(out_channels, -1)
            dweight = c["grads"]["weight"].reshape(out_channels, -1)
            gemm2, cols2 = gemm.reshape(out_channels, -1), cols.reshape(weight.shape[1], -1)
            self._kernel("lnn_nchw_to_cnp", dy.size, dy, gemm, np.int64(dy.size), np.int32(n),
                         np.int32(out_channels), np.int64(positions))
            if "bias" in c["grads"]:
                self._channel_sum(dy, c["grads"]["bias"], n, out_channels, positions, partial_sizes)
            self.launches.append(lambda: self.fused.im2col(x, attrs, cols))
            self.launches.append(lambda: self.cublas.matmul(dweight, gemm2, cols2, transpose_b=True))
            if dx is not None:
                self.launches.append(lambda: self.cublas.matmul(cols2, weight, gemm2, transpose_a=True))
                (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (attrs["kernel_size"], attrs["stride"], attrs["padding"],
                                                          attrs["dilation"])
                self._kernel("lnn_col2im", dx.size, cols, dx, np.int64(dx.size),
                             *(np.int32(v) for v in (n, dx.shape[1], dx.shape[2], dx.shape[3], dy.shape[2],
                                                     dy.shape[3], kh, kw, sh, sw, ph, pw, dh, dw)))
        elif node.op == "maxpool2d" and dx is not None:
            (kh, kw), stride, padding = attrs["kernel_size"], tuple(attrs["stride"]), tuple(attrs["padding"])
            tiled = (stride == (kh, kw) and padding == (0, 0) and dx.shape[2] == dy.shape[2] * kh
                     and dx.shape[3] == dy.shape[3] * kw)
            relu = layer.takes_relu_backward
            if tiled:
                self._kernel("lnn_maxpool_backward_tiled", dy.size, dy, c["ws"]["argmax"], y, dx, np.int64(dy.size),
                             *(np.int32(v) for v in (dy.shape[2], dy.shape[3], kh, kw, relu)))
            else:
                if relu:
                    self._kernel("lnn_relu_backward", dy.size, dy, y, np.int64(dy.size))
                self._kernel("lnn_maxpool_backward", dx.size, dy, c["ws"]["argmax"], dx, np.int64(dx.size),
                             *self._pool_geometry(dx, dy, attrs))
        elif node.op == "global_avg_pool" and dx is not None:
            self._kernel("lnn_global_avg_pool_backward", dx.size, dy, x, dx, np.int64(dx.size),
                         np.int32(dx[0, 0].size), np.int32(layer.takes_relu_backward))

    def _update(self):
        trainer, plan = self.trainer, self.plan
        config = trainer.optimizer_config
        state = trainer.optimizer.state
        max_norm = np.float32(trainer.config.grad_clip or 0.0)
        size = np.int64(plan.params.size)
        if config["type"] == "sgd":
            buffer = state.get("momentum_buffer", plan.params)
            self._kernel("lnn_sgd_update", size, plan.params, plan.grads, buffer, self.scalars, self.stats, size,
                         np.float32(config["momentum"]), np.float32(config["weight_decay"]),
                         np.int32(bool(config["nesterov"])), max_norm)
        else:
            beta1, beta2 = config["betas"]
            self._kernel("lnn_adam_update", size, plan.params, plan.grads, state["exp_avg"], state["exp_avg_sq"],
                         self.scalars, self.stats, size, np.float32(beta1), np.float32(beta2),
                         np.float32(config["eps"]), np.float32(config["weight_decay"]),
                         np.int32(config["type"] == "adamw"), max_norm)

    # ------------------------------------------------------------------ running

    def _host_scalars(self, lr: float, step: int) -> np.ndarray:
        """This step's scalars (step counts from 1, as Optimizer.steps after its increment)."""
        config = self.trainer.optimizer_config
        values = np.zeros(SCALARS, np.float64)
        if config["type"] == "sgd":
            values[:2] = lr, 1.0 if step == 1 else 0.0
        else:
            beta1, beta2 = config["betas"]
            values[:3] = lr / (1 - beta1 ** step), 1 - beta2 ** step, 1 - lr * config["weight_decay"]
        return values.astype(np.float32)

    def _load(self, x, y, lr: float, step: int):
        """Inputs and scalars into the fixed device buffers, on the step's stream."""
        cupy = self.cupy
        if isinstance(x, np.ndarray):
            self.x_u8.set(np.ascontiguousarray(x), stream=self.stream)
        else:
            cupy.copyto(self.x_u8, x)
        cupy.copyto(self.labels, cupy.asarray(y), casting="unsafe")
        event = self.slot_events[self.slot]
        if event is not None:
            event.synchronize()                  # this pinned slot's last copy has been read
        self.host_scalars[self.slot] = self._host_scalars(lr, step)
        self.scalars.set(self.host_scalars[self.slot], stream=self.stream)
        self.slot_events[self.slot] = self.stream.record()
        self.slot = (self.slot + 1) % PINNED_SLOTS

    def _run_launches(self):
        for launch in self.launches:
            launch()

    def _snapshot(self):
        trainer = self.trainer
        return [a.copy() for a in (trainer.plan.params, *trainer.optimizer.state.values())]

    def _restore(self, saved):
        for target, value in zip((self.trainer.plan.params, *self.trainer.optimizer.state.values()), saved):
            target[...] = value

    def _capture(self):
        cupy = self.cupy
        mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
        self.stream.begin_capture(mode) if mode is not None else self.stream.begin_capture()
        try:
            with cupy.cuda.using_allocator(_refuse_allocation):
                self._run_launches()
        except Exception as err:
            try:
                self.stream.end_capture()
            except Exception:            # noqa: BLE001 - the capture is already invalid; report the first error
                pass
            raise GraphFailure(f"capture failed: {_one_line(err)}") from None
        try:
            return self.stream.end_capture()
        except Exception as err:
            raise GraphFailure(f"end of capture failed: {_one_line(err)}") from None

    def step(self, x, y, lr: float) -> DeviceStepResult:
        """One optimizer step on exactly plan.batch_size rows; the caller counts the step."""
        optimizer = self.trainer.optimizer
        step_number = optimizer.steps + 1
        default = self.cupy.cuda.Stream.null
        self.stream.wait_event(default.record())            # the batch was made on the default stream
        try:
            result = self._step_on_stream(x, y, lr, step_number)
        finally:
            default.wait_event(self.stream.record())        # later default-stream work sees this step
        optimizer.steps = step_number
        self.steps_run += 1
        return result

    def _step_on_stream(self, x, y, lr: float, step_number: int) -> DeviceStepResult:
        with self.stream:
            if self.graph is None and self.steps_run == 0:
                saved = self._snapshot()
                try:
                    self._load(x, y, lr, step_number)
                    self._run_launches()
                    self.stream.synchronize()
                except Exception as err:
                    self._restore(saved)
                    raise GraphFailure(f"the first (uncaptured) graph step failed: {_one_line(err)}") from None
            else:
                self._load(x, y, lr, step_number)
                if self.graph is None:
                    self.graph = self._capture()
                try:
                    self.graph.launch(self.stream)
                except Exception as err:
                    raise GraphFailure(f"graph launch failed: {_one_line(err)}") from None
            return DeviceStepResult(self.stats.copy(), self.n)

    def close(self):
        self.cublas.close()


def _one_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}"[:300]
