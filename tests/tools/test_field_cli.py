"""lnn-field's command line: photos given to the window mode reach the window, and --cli (lnn-infer's code)
speaks as lnn-field in every error line."""

import json
import shutil

import pytest

from cli_helpers import assert_one_line_error, run_command
from conftest import EXAMPLES
from lnn.tools import field

LEAF = EXAMPLES / "leaves" / "healthy.jpg"


def test_photos_on_the_command_line_open_the_window_with_them(monkeypatch, tmp_path):
    field_ui = pytest.importorskip("lnn.tools.field_ui")        # needs tkinter, not a display
    opened = []
    monkeypatch.setattr(field_ui, "run_app", lambda model, photos: opened.append((model, photos)) or 0)
    assert field.main(["--model", "m.bin", str(LEAF), str(tmp_path)]) == 0
    assert opened == [("m.bin", [str(LEAF), str(tmp_path)])]
    assert field.main([]) == 0 and opened[-1] == (None, [])


def test_cli_errors_say_lnn_field(tmp_path):
    missing = run_command("field", "--cli", tmp_path / "missing.jpg")
    assert missing.returncode == 1
    assert_one_line_error(missing.stderr, "lnn-field", "missing.jpg")

    usage = run_command("field", "--cli", "--top-k", "0", LEAF)
    assert usage.returncode == 1
    assert_one_line_error(usage.stderr, "lnn-field", "--top-k")

    no_inputs = run_command("field", "--cli")
    assert no_inputs.returncode == 2
    assert_one_line_error(no_inputs.stderr, "lnn-field", "required")


def test_cli_answers_the_good_photo_and_names_the_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    shutil.copy(LEAF, tmp_path / "leaf.jpg")
    result = run_command("field", "--cli", "--json", tmp_path / "leaf.jpg", tmp_path / "empty")
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "lnn-field", "empty", "no image files")
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [answer["display"] for answer in answers if "display" in answer] == ["Healthy"]
