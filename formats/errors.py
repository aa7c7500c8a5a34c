"""The errors lnn raises for bad input. Each carries a one-line message that names the problem; `one_line` and
`escaped` keep a message, or a file name inside one, on one line when it is printed."""

# What would break an error line or act on the terminal (C0 and C1 controls, Unicode's line and paragraph
# separators), written as Python writes them in a string: a newline as \n, an escape as \x1b.
CONTROL_ESCAPES = {code: repr(chr(code))[1:-1] for code in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)}


def escaped(text) -> str:
    """`text` with its control characters escaped (CONTROL_ESCAPES), so that a file name holding a newline is
    shown as it is and cannot split the line it is printed in."""
    return str(text).translate(CONTROL_ESCAPES)


def control_character(text: str) -> str | None:
    """The first control character in `text` (CONTROL_ESCAPES) as `escaped` writes it ("\\n", "\\x1b"), or None.
    Text a model shows people (its labels, advice, the gate's subject) must hold none: it is printed inside
    the lines of an answer, on a terminal, the field app's screen and the server's page, where a newline
    forges a line of its own and an escape recolours or rewrites the screen."""
    return next((CONTROL_ESCAPES[ord(char)] for char in text if ord(char) in CONTROL_ESCAPES), None)


def one_line(text) -> str:
    """A message as one line: stripped, its control characters escaped."""
    return escaped(str(text).strip())


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
