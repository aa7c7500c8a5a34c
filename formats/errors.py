"""The errors lnn raises for bad input. Each carries a one-line message that names the problem."""


class LnnError(Exception):
    """Base of every error lnn reports to a person as one line (the commands print str(err))."""


class LnnFormatError(LnnError):
    """A `.bin` model file is damaged, truncated, of an unknown version or otherwise unusable."""


class ModelSpecError(LnnError):
    """A JSON model description is wrong: the message names the layer, the field and what was expected."""


class LnnInputError(LnnError):
    """Input data is unusable: a missing file, a non-image, a wrongly shaped batch."""


class LnnWarning(UserWarning):
    """Something a person should know about an answer that is still given (e.g. a grey photo given to a
    colour model); lnn-infer prints these with the answer."""
