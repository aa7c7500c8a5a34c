"""lnn's command-line front ends, one module per command, each thin over the library.

    lnn-infer    classify image files or folders with a .bin (the bundled tomato-leaf model by default)
    lnn-train    train a JSON description on MNIST or an image folder (CuPy on a GPU, NumPy on the CPU)
    lnn-eval     accuracy, per-class scores, confusion matrix and calibration of a .bin on an image folder;
                 its threshold, and (--fit-gate) its out-of-distribution gate and temperature
    lnn-export   JSON description + weights (.npz), a .bin or a training checkpoint -> .bin (fp32, fp16, int8), ONNX
    lnn-import   ONNX -> .bin, for the ops lnn supports
    lnn-summary  per-layer table of a model: shapes, parameters, FLOPs, activation and training memory
    lnn-doctor   check each backend (NumPy, Numba, CUDA) by computing on it; with MODEL.bin, run its test vectors
    lnn-bench    how fast a .bin runs here per backend: load, first call, warm p50/p90/p99, peak memory, per layer
    lnn-field    the offline desktop app for a station (Tk); --cli runs lnn-infer's code
    lnn-serve    the station's server for phones on its Wi-Fi (uvicorn + Starlette), with dynamic batching

Each is `main(argv=None) -> int`, runnable as `python -m lnn.tools.<command>`; tools/cli.py holds
what they share (parser, the one-line error path, number formatting).
"""
