"""The PyTorch peer of the GPU benchmarks: an lnn model description as the same torch network.

PyTorch is only the peer in benchmarks; lnn never depends on it.
"""

from __future__ import annotations

import numpy as np


def torch_sequential(model, weights=None, device="cuda"):
    """The lnn model as a torch.nn.Sequential on `device`, holding `weights` when given (else PyTorch's
    own initialization). Train or eval mode is the caller's to set."""
    import torch
    from torch import nn

    activations = {"relu": nn.ReLU, "relu6": nn.ReLU6, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}

    def activation(spec):
        if spec is None:
            return []
        if spec["type"] == "leaky_relu":
            return [nn.LeakyReLU(spec["negative_slope"])]
        if spec["type"] == "softmax":
            return [nn.Softmax(dim=1)]
        return [activations[spec["type"]]()]

    layers = []
    for node in model.nodes:
        a = node.attrs
        if node.op == "conv2d":
            layer = nn.Conv2d(a["in_channels"], a["out_channels"], a["kernel_size"], a["stride"], a["padding"],
                              a["dilation"], a["groups"], a["bias"])
        elif node.op == "linear":
            layer = nn.Linear(a["in_features"], a["out_features"], a["bias"])
        elif node.op == "batchnorm":
            layer = (nn.BatchNorm2d if len(node.in_shape) == 3 else nn.BatchNorm1d)(a["num_features"], a["eps"])
        elif node.op == "maxpool2d":
            layer = nn.MaxPool2d(a["kernel_size"], a["stride"], a["padding"])
        elif node.op == "avgpool2d":
            layer = nn.AvgPool2d(a["kernel_size"], a["stride"], a["padding"], count_include_pad=a["count_include_pad"])
        elif node.op == "global_avg_pool":
            layer = nn.AdaptiveAvgPool2d(1)
        elif node.op == "flatten":
            layer = nn.Flatten()
        elif node.op == "dropout":
            layer = nn.Dropout(a["p"])
        else:
            layers += activation(a)
            continue
        if weights is not None:
            with torch.no_grad():
                for name in node.param_shapes:
                    getattr(layer, name).copy_(torch.from_numpy(np.asarray(weights[node.param_key(name)])))
        layers.append(layer)
        if node.op == "global_avg_pool" and not a["keepdims"]:
            layers.append(nn.Flatten())
        layers += activation(a.get("activation"))
    return nn.Sequential(*layers).to(device)
