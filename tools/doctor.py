"""lnn-doctor: check each backend by computing something on it, and say PASS, FAIL or SKIP.

    lnn-doctor
    lnn-doctor MODEL.bin        # also: does this computer compute what the model was exported with?

  numpy  the reference runtime runs a small CNN; the trainer's NumPy forward and one training
         step agree with it
  numba  the Numba CPU backend (lnn.runtime.cpu) runs the same CNN and matches the reference; says
         how many threads threads="auto" gives (the cores this process may use: runtime/cores.py) and that the CNN
         split over them gives the one-thread answer
  cuda   CuPy sees a GPU (name, compute capability, memory, fast fp16 or not); the trainer's
         CuPy forward matches the reference, and a float16 matrix product matches float32
A backend that is not installed is SKIP; one asked for by name that does not work (LNN_CPU_KERNELS
set to a wrong value, or to aot without the compiled module) is FAIL with the reason.
Exit status 0 when numpy passes (lnn works everywhere it must) and nothing FAILs, 1 otherwise.

With MODEL.bin it then runs the model's test vectors (formats/SPEC.md "Test vector rules": inputs and
the exporting machine's outputs, stored by lnn-export) on this computer's numpy and cpu backends, one
vector at a time, and reports each backend's largest difference from the stored outputs against the
allowed 1e-4 of their scale, then one verdict line: PASS, or FAIL (this computer computes something
else: do not trust its answers). A model without test vectors is FAIL with how to add them. A PASS is
remembered for the field app, which otherwise runs the vectors at its first start with a model.
"""

from __future__ import annotations

import importlib.util
import os
import traceback

import numpy as np

from lnn.formats.vectors import TOLERANCE
from lnn.tools.cli import command_parser, human_bytes, run_command

PROG = "lnn-doctor"
CHECK_MODEL = {
    "name": "doctor", "input_shape": [3, 9, 9], "loss": "cross_entropy",
    "layers": [{"type": "conv2d", "name": "conv", "out_channels": 4, "kernel_size": 3, "padding": 1},
               {"type": "batchnorm", "name": "bn", "activation": "relu"},
               {"type": "maxpool2d", "kernel_size": 2}, {"type": "flatten"},
               {"type": "linear", "name": "fc", "out_features": 5}],
}


def _model_and_weights():
    from lnn.formats.model import parse_model
    from lnn.train.trainer import initial_weights

    model = parse_model(CHECK_MODEL)
    weights = initial_weights(model, 0, np.float32)
    x = np.random.default_rng(0).normal(size=(6, 3, 9, 9)).astype(np.float32)
    return model, weights, x


def _reference(model, weights, x):
    from lnn.runtime.reference import NumpyBackend

    return NumpyBackend(model, weights).run(x)


def _close(a, b, tolerance=1e-4) -> bool:
    return bool(np.allclose(a, b, rtol=tolerance, atol=tolerance))


def check_numpy() -> tuple[str, str]:
    from lnn.train.trainer import Trainer

    model, weights, x = _model_and_weights()
    expected = _reference(model, weights, x)
    trainer = Trainer(model, device="cpu", batch_size=6, log=lambda *a: None)
    trainer.set_weights(weights)
    if not _close(trainer.predict(x), expected):
        return "FAIL", "the trainer's forward differs from the reference runtime"
    result = trainer.step(x, np.arange(6) % 5)
    if not np.isfinite(result.loss) or result.grad_norm <= 0:
        return "FAIL", f"a training step gave loss {result.loss}, gradient norm {result.grad_norm}"
    return "PASS", f"numpy {np.__version__}: reference forward, trainer forward and a training step agree"


def check_numba() -> tuple[str, str]:
    if importlib.util.find_spec("numba") is None:
        return "SKIP", "numba is not installed (pip install numba)"
    chosen = os.environ.get("LNN_CPU_KERNELS")
    try:
        from lnn.runtime.cpu import BACKEND
    except (ImportError, AttributeError) as err:
        if chosen:                               # asked for by name: not working is a fault, not an absence
            return "FAIL", f"LNN_CPU_KERNELS={chosen}: the CPU backend does not load ({err})"
        return "SKIP", f"the Numba backend is not available ({err})"
    from lnn.runtime import cores_in_words, usable_cores

    model, weights, x = _model_and_weights()
    got = BACKEND(model, weights).run(x)
    if not _close(got, _reference(model, weights, x)):
        return "FAIL", "the Numba backend's output differs from the reference"
    cores = usable_cores()
    split = max(cores, 2)
    backend = BACKEND(model, weights, threads=split)
    backend.task_flops = 0                        # split even this small CNN's layers
    got_split = backend.run(x)
    if not _close(got_split, got, 1e-5):
        return "FAIL", f"the Numba backend split over {split} threads differs from one thread"
    import numba

    return "PASS", (f"numba {numba.__version__}: the CPU backend matches the reference, split over {split} threads "
                    f"too; threads auto = {cores} ({cores_in_words()})")


def check_cuda() -> tuple[str, str]:
    from lnn.train.device import _cupy_with_gpu, cuda_info

    cupy, reason = _cupy_with_gpu()
    if cupy is None:
        return "SKIP", reason
    from lnn.train.trainer import Trainer

    info = cuda_info(cupy)
    where = (f"{info['name']}, compute capability {info['compute_capability']}, "
             f"{human_bytes(info['memory_free'])} free of {human_bytes(info['memory_total'])}, "
             f"fast fp16: {'yes' if info['fast_fp16'] else 'no'}")
    model, weights, x = _model_and_weights()
    trainer = Trainer(model, device="cuda", batch_size=6, log=lambda *a: None)
    trainer.set_weights(weights)
    if not _close(trainer.predict(x), _reference(model, weights, x)):
        return "FAIL", f"{where}; the CuPy forward differs from the reference"
    a = cupy.random.standard_normal((256, 256), dtype=cupy.float32)
    full = a @ a
    half = (a.astype(cupy.float16) @ a.astype(cupy.float16)).astype(cupy.float32)
    error = float(cupy.abs(full - half).max() / cupy.abs(full).max())
    if error > 1e-2:
        return "FAIL", f"{where}; a float16 matrix product is off by {error:.2g} relative"
    return "PASS", f"cupy {cupy.__version__}: {where}; forward matches the reference, fp16 product ok"


CHECKS = {"numpy": check_numpy, "numba": check_numba, "cuda": check_cuda}


VECTOR_DEVICES = ("numpy", "cpu")      # this computer's backends; cuda is checked above


def _failure(err: Exception) -> str:
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"{type(err).__name__}: {err} ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"


def report(name: str, status: str, detail: str) -> None:
    print(f"{name:7} {status:4}  {' '.join(str(detail).split())}", flush=True)


def check_vectors(bin_model, device: str) -> tuple[str, str]:
    """One backend: run the model's test vectors (runtime/vectors.py) and remember a PASS."""
    from lnn.runtime import Session, resolve_device
    from lnn.runtime.vectors import check_session, record_verdict, verdict_path

    if device == "cpu" and resolve_device("auto") != "cpu":
        return "SKIP", "the cpu backend is not installed here (pip install numba)"
    session = Session(bin_model, device)
    check = check_session(session)
    if check.passed:
        record_verdict(verdict_path(session), check)
    return ("PASS" if check.passed else "FAIL"), check.detail()


def check_model(path: str, bin_model) -> int:
    vectors = bin_model.metadata.get("test_vectors")
    if vectors is None:
        report("model", "FAIL", f"{path} carries no test vectors, so this computer cannot be checked with it: "
                                f"re-export it (lnn-export {path} -o NEW.bin) to add them")
        return 1
    report("model", "", f"{path}: {vectors['count']} test vectors ({vectors['inputs']}); "
                        f"outputs by {vectors['outputs']}")
    results = {}
    for device in VECTOR_DEVICES:
        try:
            results[device], detail = check_vectors(bin_model, device)
        except Exception as err:                 # noqa: BLE001 - a backend that cannot run the model is a finding
            results[device], detail = "FAIL", _failure(err)
        report(device, results[device], detail)
    if "FAIL" in results.values():
        failed = ", ".join(device for device, status in results.items() if status == "FAIL")
        report("verdict", "FAIL", f"this computer computes something else than the one {path} was exported on "
                                  f"({failed}): do not trust its answers here")
        return 1
    report("verdict", "PASS", f"this computer computes what {path} was exported with "
                              f"(within {TOLERANCE:g} of the outputs' scale)")
    return 0


def body(args) -> int:
    if args.model is not None:
        from lnn.formats.binfile import read_bin

        bin_model = read_bin(args.model)         # a bad file is one error line (SPEC's message), before anything
    results = {}
    for name, check in CHECKS.items():
        try:
            status, detail = check()
        except Exception as err:                 # a broken backend is a finding, reported in one line
            status, detail = "FAIL", _failure(err)
        results[name] = status
        report(name, status, detail)
    healthy = results["numpy"] == "PASS" and "FAIL" not in results.values()
    if args.model is None:
        return 0 if healthy else 1
    verdict = check_model(args.model, bin_model)
    return 0 if healthy and verdict == 0 else 1


def main(argv=None) -> int:
    parser = command_parser(PROG, __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("model", nargs="?", metavar="MODEL.bin",
                        help="also run this model's test vectors on this computer's numpy and cpu backends")
    return run_command(parser, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
