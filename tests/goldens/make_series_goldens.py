"""Writes the PyTorch-made golden fixtures of the sequence ops (tests/goldens/series/): run it with torch installed
(`pip install torch==2.13.0` in a venv; lnn itself never needs torch) from the repository root:

    .venv/bin/python tests/goldens/make_series_goldens.py

For each case: `<case>.npz` holds the lnn description (JSON), the input [N, C, T], the PyTorch module's
parameters under lnn's keys (`<layer name>.<param>`, as the state_dict of an nn.Sequential names them)
and PyTorch's output; `<case>.onnx` is the same module exported by torch.onnx (TorchScript exporter, opset 17,
eval mode), which lnn-import must read back. tests/formats/test_series_goldens.py checks them. The
fixtures are small (a few KB each) and committed, so the tests need no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

OUT = Path(__file__).parent / "series"
OPSET = 17


def conv1d(name, out_channels, kernel_size, **attrs):
    return {"type": "conv1d", "name": name, "out_channels": out_channels, "kernel_size": kernel_size, **attrs}


# case -> (input [C, T], lnn layers, the PyTorch module built the same way)
CASES = {
    "conv1d_same_even_bn_relu": (
        (3, 19),
        [conv1d("0", 8, 8, padding="same", bias=False), {"type": "batchnorm", "name": "1"}, {"type": "relu"},
         conv1d("3", 6, 5, padding="same", dilation=2, groups=2, activation="tanh")],
        lambda: nn.Sequential(nn.Conv1d(3, 8, 8, padding="same", bias=False), nn.BatchNorm1d(8), nn.ReLU(),
                              nn.Conv1d(8, 6, 5, padding="same", dilation=2, groups=2), nn.Tanh())),
    "conv1d_stride_padding_depthwise": (
        (4, 23),
        [conv1d("0", 4, 3, stride=2, padding=1, groups=4), conv1d("1", 5, 1), conv1d("2", 3, 4, dilation=3)],
        lambda: nn.Sequential(nn.Conv1d(4, 4, 3, stride=2, padding=1, groups=4), nn.Conv1d(4, 5, 1),
                              nn.Conv1d(5, 3, 4, dilation=3))),
    "pools_max_avg_global_avg": (
        (3, 29),
        [conv1d("0", 6, 5, padding=2, activation="relu"),
         {"type": "maxpool1d", "kernel_size": 3, "stride": 2, "padding": 1},
         {"type": "avgpool1d", "kernel_size": 3, "stride": 1, "padding": 1, "count_include_pad": False},
         {"type": "avgpool1d", "kernel_size": 2, "padding": 1}, {"type": "global_avg_pool"}],
        lambda: nn.Sequential(nn.Conv1d(3, 6, 5, padding=2), nn.ReLU(), nn.MaxPool1d(3, 2, 1),
                              nn.AvgPool1d(3, 1, 1, count_include_pad=False), nn.AvgPool1d(2, padding=1),
                              nn.AdaptiveAvgPool1d(1), nn.Flatten())),
    "global_max_pool": (
        (2, 15),
        [conv1d("0", 4, 3, activation="tanh"), {"type": "maxpool1d", "kernel_size": 2},
         {"type": "global_max_pool"}],
        lambda: nn.Sequential(nn.Conv1d(2, 4, 3), nn.Tanh(), nn.MaxPool1d(2), nn.AdaptiveMaxPool1d(1), nn.Flatten())),
}


def randomize(module: nn.Module, rng: np.random.Generator) -> None:
    """Batch norms get statistics and affine values away from their defaults (so folding is tested)."""
    for layer in module.modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            c = layer.num_features
            layer.running_mean.copy_(torch.tensor(rng.normal(0, 0.5, c)))
            layer.running_var.copy_(torch.tensor(rng.uniform(0.5, 2.0, c)))
            layer.weight.data.copy_(torch.tensor(rng.normal(1, 0.2, c)))
            layer.bias.data.copy_(torch.tensor(rng.normal(0, 0.3, c)))


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for index, (case, (shape, layers, build)) in enumerate(CASES.items()):
        torch.manual_seed(index)
        rng = np.random.default_rng(index)
        module = build().eval()
        randomize(module, rng)
        x = rng.standard_normal((3, *shape)).astype(np.float32)
        with torch.no_grad():
            expected = module(torch.from_numpy(x)).numpy()
        params = {key: value.numpy().astype(np.float32) for key, value in module.state_dict().items()
                  if not key.endswith("num_batches_tracked")}
        description = {"name": case, "input_shape": list(shape), "layers": layers, "loss": "mse"}
        np.savez_compressed(OUT / f"{case}.npz", description=np.array(json.dumps(description)), input=x,
                            expected=expected, **{f"param:{key}": value for key, value in params.items()})
        torch.onnx.export(module, (torch.from_numpy(x),), str(OUT / f"{case}.onnx"), dynamo=False, opset_version=OPSET,
                          input_names=["input"], output_names=["output"], dynamic_axes={"input": {0: "N"}})
        print(case, expected.shape)


if __name__ == "__main__":
    main()
