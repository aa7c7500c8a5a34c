"""lnn: train small neural networks on an ordinary GPU, run them offline on edge devices.

    import lnn
    session = lnn.load("models/tomato_leaf.bin")          # device="auto" | "cpu" | "numpy"
    session.predict_image("leaf.jpg")                      # [("Late blight", 0.97), ...]

Importing lnn (or lnn.runtime) never imports CuPy, Numba or the training side.
"""

from lnn.formats.errors import LnnError, LnnFormatError, LnnInputError, LnnWarning, ModelSpecError
from lnn.runtime import load
from lnn.version import __version__

__all__ = ["load", "LnnError", "LnnFormatError", "LnnInputError", "LnnWarning", "ModelSpecError", "__version__"]
