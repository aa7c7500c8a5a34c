"""tools/cli.py's run_command: every failure a person can meet is one line and an exit status."""

import json

from cli_helpers import run_command as run_command_process
from conftest import EXAMPLES
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


def test_a_photo_named_with_a_newline_keeps_its_answer_on_its_lines(tmp_path):
    """The answer for people names the file on its first line, the newline escaped, as the error lines do."""
    import shutil

    photo = tmp_path / "leaf\nsecond.jpg"
    shutil.copyfile(EXAMPLES / "leaves" / "late_blight.jpg", photo)
    result = run_command_process("infer", photo)
    assert result.returncode == 0, result.stderr
    first, *rest = result.stdout.splitlines()
    assert first.startswith(f"{tmp_path}/leaf\\nsecond.jpg: Late blight (")
    assert all(line.startswith("  ") for line in rest)


def test_a_label_holding_a_newline_is_refused_not_printed_as_a_forged_answer(tmp_path):
    """A .bin whose display name was "Healthy\\nfake.jpg: Late blight (99.0%)" printed that second line as an answer
    of its own under lnn-infer: the reader refuses the model in one line, so no screen shows such a label."""
    from conftest import REPO
    from lnn.formats.binfile import encode_bin, read_bin
    from lnn.tests.formats.test_binfile import refresh_crcs

    bundled = read_bin(REPO / "models" / "tomato_leaf.bin")
    metadata = json.loads(json.dumps(bundled.metadata))
    metadata["labels"][2]["display"] = "Healthy  fake.jpg: Late blight (99.0%)"     # the writer refuses a newline
    data = encode_bin(bundled.model, dict(bundled.tensors), metadata, bundled.stored_dtypes)
    forged = tmp_path / "forged.bin"
    forged.write_bytes(refresh_crcs(data.replace(b"Healthy  fake", b"Healthy\\nfake")))      # JSON's \n: same length
    result = run_command_process("infer", "--model", forged, EXAMPLES / "leaves" / "healthy.jpg")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (f"lnn-infer: error: {forged}: metadata: labels[2]: the display holds a control character "
                             f"(\\n), which would break or rewrite the lines an answer is printed in\n")
