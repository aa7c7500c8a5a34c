"""Per-layer convolution kernels on the GPU, lnn against cuDNN: the 3x3 convolutions (in channels x size ->
out channels) of the bundled tomato model and of the reference leaf_cnn224, at batch 64 and 256; ms per call
of the forward, the weight gradient and the input gradient for
  fp32             lnn's float32 kernels on halo tiles (CUDA cores): lnn_conv3x3_cuda_cores, and the weight
                   gradient's lnn_conv3x3_wgrad_cuda_cores from 16 input channels
  fp32 gather      float32 implicit GEMM, the window gathered per element (what other windows run)
  fp32 winograd    Winograd F(2x2, 3x3) (runtime/cuda/winograd.py: float32 forward and input gradient from 32
                   channels in and out, the weight gradient where winograd.weight_gradient_chosen)
  fp16 cuda cores  lnn's float16 path of cards without mma.m16n8k16 (before sm_80)
  fp16 mma gather  tensor cores, the window gathered per element (what other window sizes run)
  fp16 mma halo    tensor cores from halo tiles (what amp runs for 3x3 windows on sm_80+)
and PyTorch (cuDNN, `cudnn.benchmark`) in float16 channels_last and in float32 with TF32 off: forward alone,
and forward + backward. Random data, CUDA events, 30 calls after a warm-up.
    python benchmarks/gpu_conv_layers.py [--models tomato_leaf leaf_cnn224]
                                          (on the GPU machine; benchmarks/gpu_check.sh runs it)
"""

import argparse
import time

import cupy
import numpy as np

from lnn.runtime.cuda import conv_gemm, winograd
from report import cuda_event_ms

LAYERS = {"tomato_leaf": [(3, 128, 24), (24, 64, 48), (48, 32, 96), (96, 16, 192), (192, 8, 384)],
          "leaf_cnn224": [(3, 224, 32), (32, 112, 64), (64, 56, 128), (128, 28, 256)]}
ATTRS = {"kernel_size": (3, 3), "stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1,
         "bias": False}
VARIANTS = [("fp32", np.float32, {}), ("fp32 gather", np.float32, {"uses_halo": lambda attrs: False}),
            ("fp16 cuda cores", np.float16, {"tensor_cores": lambda: False}),
            ("fp16 mma gather", np.float16, {"uses_halo": lambda attrs: False}), ("fp16 mma halo", np.float16, {})]
REPEATS = 30


def layer_arrays(dtype, batch: int, channels: int, size: int, out_channels: int) -> tuple:
    """Random x, weight and dy of a layer in `dtype` (drawn in float32, seed 0), and y and dx to write."""
    rng = cupy.random.default_rng(0)
    x = rng.standard_normal((batch, channels, size, size), dtype=np.float32).astype(dtype)
    weight = (rng.standard_normal((out_channels, channels, 3, 3), dtype=np.float32) * 0.1).astype(dtype)
    dy = rng.standard_normal((batch, out_channels, size, size), dtype=np.float32).astype(dtype)
    return x, weight, dy, cupy.empty_like(dy), cupy.empty_like(x)


def lnn_layer(dtype, overrides: dict, batch: int, channels: int, size: int, out_channels: int) -> tuple:
    """(forward, weight gradient, input gradient) ms with conv_gemm's choices replaced by `overrides`."""
    saved = {name: getattr(conv_gemm, name) for name in overrides}
    for name, value in overrides.items():
        setattr(conv_gemm, name, value)
    try:
        x, weight, dy, y, dx = layer_arrays(dtype, batch, channels, size, out_channels)
        dweight = cupy.empty_like(weight)
        kernels = conv_gemm.ConvKernels(ATTRS, (channels, size, size), (out_channels, size, size), dtype=dtype)
        return (cuda_event_ms(lambda: kernels.forward(x, weight, None, y), REPEATS),
                cuda_event_ms(lambda: kernels.weight_gradient(dy, x, dweight, None, False), REPEATS),
                cuda_event_ms(lambda: kernels.input_gradient(dy, weight, dx), REPEATS))
    finally:
        for name, value in saved.items():
            setattr(conv_gemm, name, value)


def winograd_layer(batch: int, channels: int, size: int, out_channels: int) -> tuple:
    """(forward, weight gradient, input gradient) ms of the layer on WinogradKernels in float32."""
    x, weight, dy, y, dx = layer_arrays(np.float32, batch, channels, size, out_channels)
    dweight = cupy.empty_like(weight)
    kernels = winograd.WinogradKernels(ATTRS, (channels, size, size), (out_channels, size, size))
    hw = (size, size)
    v, m = (cupy.empty(shape, np.float32) for shape in winograd.workspace_shapes(channels, out_channels, hw, hw, batch))
    v_b, m_b, products = (cupy.empty(shape, np.float32)
                          for shape in winograd.backward_workspace_shapes(channels, out_channels, hw, hw, batch))
    return (cuda_event_ms(lambda: kernels.forward(x, weight, None, y, v, m), REPEATS),
            cuda_event_ms(lambda: kernels.weight_gradient(dy, x, dweight, None, False, v_b, m_b, products), REPEATS),
            cuda_event_ms(lambda: kernels.input_gradient(dy, weight, dx, v_b, m_b), REPEATS))


def torch_layer(batch: int, channels: int, size: int, out_channels: int, half: bool) -> tuple:
    """(forward, forward + backward) ms of torch.nn.Conv2d with cudnn.benchmark: float16 channels_last (half),
    or float32 with TF32 off."""
    import torch

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    dtype, layout = (torch.float16, torch.channels_last) if half else (torch.float32, torch.contiguous_format)
    x = torch.randn(batch, channels, size, size, device="cuda", dtype=dtype).to(memory_format=layout)
    x.requires_grad_()
    conv = torch.nn.Conv2d(channels, out_channels, 3, padding=1, bias=False).cuda().to(dtype).to(memory_format=layout)
    dy = torch.randn(batch, out_channels, size, size, device="cuda", dtype=dtype).to(memory_format=layout)

    def forward():
        with torch.no_grad():
            conv(x)

    def step():
        conv(x).backward(dy)

    def ms(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(REPEATS):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / REPEATS * 1e3
    return ms(forward), ms(step)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(LAYERS), default=list(LAYERS))
    args = parser.parse_args()
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, tensor cores for float16: "
          f"{conv_gemm.tensor_cores()}")
    for model in args.models:
        for batch in (64, 256):
            print(f"\n{model}, batch {batch}: ms forward / weight gradient / input gradient (sum)")
            totals = {}
            for channels, size, out_channels in LAYERS[model]:
                cells = [f"{channels}x{size}->{out_channels}"]
                runs = [(label, lnn_layer(dtype, overrides, batch, channels, size, out_channels))
                        for label, dtype, overrides in VARIANTS]
                runs.append(("fp32 winograd", winograd_layer(batch, channels, size, out_channels)))
                for label, times in runs:
                    totals[label] = totals.get(label, 0.0) + sum(times)
                    cells.append(f"{label} " + "/".join(f"{t:.3f}" for t in times) + f" ({sum(times):.3f})")
                for label, half in (("torch fp16 cl", True), ("torch fp32", False)):
                    try:
                        forward, step = torch_layer(batch, channels, size, out_channels, half)
                    except ImportError:
                        cells.append("torch: not installed")
                        break
                    totals[label] = totals.get(label, 0.0) + step
                    cells.append(f"{label} {forward:.3f} / forward + backward {step:.3f}")
                print("  " + " | ".join(cells))
            print("  sums (ms):", ", ".join(f"{k} {v:.3f}" for k, v in totals.items()))


if __name__ == "__main__":
    main()
