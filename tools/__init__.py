"""lnn's command-line front ends, one module per command, each thin over the library.

    lnn-export   JSON description + weights (.npz) or a .bin  ->  .bin (fp32 or fp16 weights)
    lnn-infer    classify image files or folders with a .bin (the bundled tomato-leaf model by default)
    lnn-summary  per-layer table of a model: shapes, parameters, FLOPs, activation and training memory

Each is `main(argv=None) -> int`, runnable as `python -m lnn.tools.<command>`; tools/cli.py holds
what they share (parser, the one-line error path, number formatting).
"""
