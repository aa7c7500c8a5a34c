# PyInstaller runtime hook: runs in the frozen lnn-field before any app code.
# The app ships the CPU kernels compiled ahead of time and Pillow instead of Numba and OpenCV (see
# lnn-field.spec); lnn would pick both by itself when Numba and OpenCV are absent, and saying so here
# keeps it that way even if a later build let one of them in (Numba's JIT cache does not work in a
# frozen app, and its compile would make the first start slow again). Only when the compiled kernels are
# there, though: a build made without them (a Numba without numba.pycc, packaging/BUILD.md) keeps lnn's own
# choice, the JIT when Numba is bundled, else the NumPy backend.
import importlib.util
import os

if importlib.util.find_spec("lnn_cpu_kernels") is not None:     # lnn.runtime.cpu.aot.MODULE
    os.environ["LNN_CPU_KERNELS"] = "aot"
os.environ["LNN_IMAGE_LIBRARY"] = "pillow"
