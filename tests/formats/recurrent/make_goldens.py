"""Writes the PyTorch-made fixtures of lnn's recurrent ops (lstm, gru); needs torch (2.13.0 was used):

    python tests/formats/recurrent/make_goldens.py

goldens.npz: for each case of CASES (an lnn layer description), `<case>.x` [N, C, T], `<case>.y` (torch's
answer in lnn's layout: [N, H*D, T] for "sequence", h_n of the top layer [N, H*D] for "last") and
`<case>.<param>` (the module's state dict, float32). torch_lstm.onnx / torch_gru.onnx: a channel-first
module (x [N, C, T] -> rnn over x.permute(2, 0, 1) -> output.permute(1, 2, 0)) exported by torch.onnx
with a dynamic batch, its weights and a sample (`onnx.x`, `onnx.y`) in onnx_samples.npz. The tests read
these files and need no torch.
"""

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CASES = {
    "lstm_seq": {"type": "lstm", "hidden_size": 5, "input_shape": [3, 7]},
    "lstm_bi2_last": {"type": "lstm", "hidden_size": 4, "num_layers": 2, "bidirectional": True, "return": "last",
                      "input_shape": [3, 6]},
    "lstm_nobias_bi_seq": {"type": "lstm", "hidden_size": 3, "bidirectional": True, "bias": False, "input_shape": [2, 5]},
    "gru_seq": {"type": "gru", "hidden_size": 5, "input_shape": [3, 7]},
    "gru_bi2_last": {"type": "gru", "hidden_size": 4, "num_layers": 2, "bidirectional": True, "return": "last",
                     "input_shape": [3, 6]},
    "gru_nobias_2_seq": {"type": "gru", "hidden_size": 3, "num_layers": 2, "bias": False, "input_shape": [2, 5]},
}
ONNX_CASES = {"lstm": {"input_size": 3, "hidden_size": 6, "num_layers": 2, "bidirectional": True},
              "gru": {"input_size": 3, "hidden_size": 5, "num_layers": 2, "bidirectional": True}}


def main():
    import torch

    torch.manual_seed(0)
    arrays = {}
    for case, layer in CASES.items():
        (channels, steps), hidden = layer["input_shape"], layer["hidden_size"]
        module = getattr(torch.nn, layer["type"].upper())(channels, hidden, num_layers=layer.get("num_layers", 1),
                                                          bidirectional=layer.get("bidirectional", False),
                                                          bias=layer.get("bias", True))
        x = torch.randn(2, channels, steps)
        with torch.no_grad():
            output, state = module(x.permute(2, 0, 1))
            h_n = state[0] if layer["type"] == "lstm" else state
            directions = 2 if layer.get("bidirectional") else 1
            y = (torch.cat(list(h_n[-directions:]), dim=1) if layer.get("return") == "last"
                 else output.permute(1, 2, 0))
        arrays[f"{case}.x"], arrays[f"{case}.y"] = x.numpy(), y.numpy()
        arrays[f"{case}.layer"] = np.array(json.dumps(layer))
        for key, value in module.state_dict().items():
            arrays[f"{case}.{key}"] = value.numpy()
    np.savez_compressed(HERE / "goldens.npz", **arrays)

    class ChannelFirst(torch.nn.Module):
        def __init__(self, kind, **options):
            super().__init__()
            self.rnn = getattr(torch.nn, kind.upper())(**options)

        def forward(self, x):
            return self.rnn(x.permute(2, 0, 1))[0].permute(1, 2, 0)

    samples = {}
    for kind, options in ONNX_CASES.items():
        module = ChannelFirst(kind, **options).eval()
        x = torch.randn(3, options["input_size"], 9)
        torch.onnx.export(module, (x,), str(HERE / f"torch_{kind}.onnx"), dynamo=False, opset_version=17,
                          input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": {0: "N"}, "output": {0: "N"}})
        with torch.no_grad():
            samples[f"{kind}.x"], samples[f"{kind}.y"] = x.numpy(), module(x).numpy()
    np.savez_compressed(HERE / "onnx_samples.npz", **samples)


if __name__ == "__main__":
    main()
