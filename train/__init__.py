"""lnn.train: compile a model description into a static training plan and train it (NumPy or CuPy).

    from lnn.train import Trainer, load_mnist
    train, test = load_mnist("data/mnist")
    trainer = Trainer("mnist_mlp.json", device="auto", seed=0, batch_size=64)
    trainer.fit(train, test, epochs=5, out_dir="runs/mlp")      # -> runs/mlp/model.bin

Modules: kernels (forward/backward of every op), layers (per-op buffers), plan (flat parameter
buffers, liveness-pooled activations, memory report), optim, config (the "training" block),
data (MNIST, datasets, prefetching), trainer, run (the run folder), checkpoint, device.
Importing lnn.runtime never imports this package.
"""

import importlib

# Each name and its module, imported when first asked for: lnn.train.data (lnn-train's split defaults, which its
# --help prints) loads without the trainer.
_EXPORTS = {"Trainer": "trainer", "StepResult": "trainer", "Plan": "plan", "plan_memory": "plan",
            "TrainingConfig": "config", "ArrayDataset": "data", "MemmapDataset": "data", "load_mnist": "data",
            "load_checkpoint": "checkpoint", "export_checkpoint": "checkpoint"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lnn.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lnn.train.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
