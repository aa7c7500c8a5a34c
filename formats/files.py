"""Files a person hands to lnn (a model, a description, an image, a series, weights, an ONNX file), checked
one way before anything reads them: the path exists and is a regular file, not a folder, a named pipe, a
device or a socket (a pipe or /dev/zero would be read for ever), and a whole-file read stops at a size limit
of formats/limits.py. Each refusal is one line naming the file:

    PATH: no such file
    PATH: is a folder, not a model file
    PATH: is a named pipe, not an image file
    PATH: the file is 300,000,000 bytes, over lnn's limit of 268,435,456 bytes for an image file (MAX_IMAGE_FILE_BYTES in lnn/formats/limits.py)
    PATH: cannot read the file (Permission denied)

`what` is the file's kind with its article ("a model file", "an image file"); `error` the caller's
exception class (LnnInputError, LnnFormatError, ModelSpecError).
"""

from __future__ import annotations

import os
import stat

from lnn.formats.errors import LnnInputError

SPECIAL_KINDS = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
                 (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _refuse_unless_regular(status: os.stat_result, name: str, what: str, error) -> None:
    if stat.S_ISDIR(status.st_mode):
        raise error(f"{name}: is a folder, not {what}")
    if not stat.S_ISREG(status.st_mode):
        kind = next((kind for test, kind in SPECIAL_KINDS if test(status.st_mode)), "a special file")
        raise error(f"{name}: is {kind}, not {what}")


def _over_limit(name: str, size: int | None, limit: int, limit_name: str, what: str) -> str:
    figure = f"{size:,} bytes, over" if size is not None else "over"
    return f"{name}: the file is {figure} lnn's limit of {limit:,} bytes for {what} ({limit_name} in lnn/formats/limits.py)"


def regular_file(path, what: str, error=LnnInputError) -> os.stat_result:
    """The os.stat of `path`, which must be a regular file: for readers that hand the path on (mmap,
    np.load, onnx.load) rather than read it whole."""
    name = str(path)
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise error(f"{name}: no such file") from None
    except OSError as err:
        raise error(f"{name}: cannot read the file ({err.strerror or err})") from None
    _refuse_unless_regular(status, name, what, error)
    return status


def read_regular_file(path, what: str, limit: int, limit_name: str, error=LnnInputError) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (`limit_name`: its name in limits.py). The file
    is opened without blocking (a named pipe opens at once, then is refused) and checked with fstat, and
    the read asks for the file's own size (read(n) reserves n bytes up front) plus one byte, to see it grow."""
    name = str(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        descriptor = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{name}: no such file") from None
    except IsADirectoryError:
        raise error(f"{name}: is a folder, not {what}") from None
    except OSError as err:
        raise error(f"{name}: cannot read the file ({err.strerror or err})") from None
    try:
        status = os.fstat(descriptor)
        _refuse_unless_regular(status, name, what, error)
        if status.st_size > limit:
            raise error(_over_limit(name, status.st_size, limit, limit_name, what))
    except BaseException:
        os.close(descriptor)
        raise
    with os.fdopen(descriptor, "rb") as file:
        try:
            data = file.read(status.st_size + 1)
        except OSError as err:
            raise error(f"{name}: cannot read the file ({err.strerror or err})") from None
    if len(data) > limit:                                            # it grew while being read
        raise error(_over_limit(name, None, limit, limit_name, what))
    return data
