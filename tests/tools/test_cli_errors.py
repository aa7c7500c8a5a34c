"""tools/cli.py's run_command: every failure a person can meet is one line and an exit status."""

import json

from cli_helpers import run_command as run_command_process
from lnn.formats.errors import LnnInputError
from lnn.tools.cli import command_parser, run_command


def test_running_out_of_memory_anywhere_is_one_line(capsys):
    def body(args):
        raise MemoryError("Unable to allocate 578. GiB for an array with shape (100000000, 1568)")

    assert run_command(command_parser("lnn-x", "test"), body, []) == 1
    captured = capsys.readouterr()
    assert captured.err == ("lnn-x: error: out of memory (Unable to allocate 578. GiB for an array with shape "
                            "(100000000, 1568)): give it less at once (a smaller --batch, fewer or smaller inputs)\n")


def test_control_characters_in_an_error_are_escaped_so_it_stays_one_line(capsys):
    def body(args):
        raise LnnInputError("/photos/new\nline\x1b[31m.jpg\u2028: not an image")

    assert run_command(command_parser("lnn-x", "test"), body, []) == 1
    assert capsys.readouterr().err == "lnn-x: error: /photos/new\\nline\\x1b[31m.jpg\\u2028: not an image\n"


def test_a_file_name_holding_a_newline_is_one_error_line_and_record(tmp_path):
    bad = tmp_path / "new\nline.jpg"
    bad.write_bytes(b"not a photo")
    result = run_command_process("infer", "--json", bad)
    assert result.returncode == 1
    assert result.stderr == (f"lnn-infer: error: {tmp_path}/new\\nline.jpg: not an image lnn can read "
                             f"(JPEG, PNG, BMP, TIFF, WebP, GIF, PNM)\n")
    assert json.loads(result.stdout) == {"file": str(bad), "error": "not an image lnn can read (JPEG, PNG, BMP, TIFF, "
                                                                    "WebP, GIF, PNM)"}
