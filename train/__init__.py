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

from lnn.train.checkpoint import export_checkpoint, load_checkpoint
from lnn.train.config import TrainingConfig
from lnn.train.data import ArrayDataset, MemmapDataset, load_mnist
from lnn.train.plan import Plan, plan_memory
from lnn.train.trainer import StepResult, Trainer

__all__ = ["Trainer", "StepResult", "Plan", "plan_memory", "TrainingConfig", "ArrayDataset", "MemmapDataset",
           "load_mnist", "load_checkpoint", "export_checkpoint"]
