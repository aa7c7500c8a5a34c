"""lnn-field's window under a virtual display (Xvfb), driven through the app's own methods (the ones its
buttons call): open sample photos, wait for the answers the worker thread sends, save the report and
check it, refuse a bad model while keeping the old one, and keep a screenshot for a person to look at.
Failures injected into the worker (a MemoryError, a library's raw exception, a request that fails as a
whole, a photo Tk cannot show, a model that runs out of memory) each give one dialog and leave the window
answering the next photo; a folder with bad files gives ONE summary; photos given on the command line
are checked at start.

Tk runs in a child process (this file run as a script), so each scenario gets a fresh Tk and its X
connection is gone before the Xvfb it used is stopped. Skips when Xvfb or Tk is missing.
The screenshot is written to the test's tmp folder (its path is printed); set LNN_SCREENSHOT to a path
relative to the repository to copy it there too (docs/images/field_app.png was made this way:
LNN_SCREENSHOT=docs/images/field_app.png pytest tests/packaging/test_field_app.py)."""

import csv
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
LEAVES = HERE.parents[2] / "examples" / "leaves"
ANSWER_TIMEOUT_S = 180          # a cold Numba compile on a slow CI core, with room to spare
READY_ANSWER_S = 60             # an answer once the model is ready (a frozen worker never gives one)
COMMAND_LINE = {"command_line": ["{leaves}/healthy.jpg", "{tmp}/folder"]}     # lnn-field's arguments per scenario


@pytest.fixture(scope="module")
def display():
    """A fresh Xvfb on a free display number (Xvfb picks it and writes it to -displayfd)."""
    if shutil.which("Xvfb") is None:
        pytest.skip("Xvfb is not installed (apt-get install xvfb)")
    pytest.importorskip("tkinter")
    read_end, write_end = os.pipe()
    server = subprocess.Popen(["Xvfb", "-displayfd", str(write_end), "-screen", "0", "1000x640x24", "-nolisten", "tcp"],
                              pass_fds=(write_end,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        number = pipe.readline().strip()
    if not number:
        server.kill()
        pytest.skip("Xvfb did not start")
    yield f":{number}"
    server.terminate()
    server.wait(timeout=10)


def drive(display, scenario, tmp_path):
    """Run one scenario below in a child process on the virtual display; return its stdout."""
    env = {**os.environ, "DISPLAY": display}
    result = subprocess.run([sys.executable, str(HERE), scenario, str(tmp_path)], env=env, capture_output=True,
                            text=True, timeout=2 * ANSWER_TIMEOUT_S + 60)
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_open_photos_answer_report_and_screenshot(display, tmp_path):
    from hostile_images import with_data_left_over

    (tmp_path / "drone.jpg").write_bytes(with_data_left_over((LEAVES / "late_blight.jpg").read_bytes()))   # for the child
    out = drive(display, "photos", tmp_path)
    rows = list(csv.DictReader((tmp_path / "report.csv").open(encoding="utf-8")))
    assert [row["result"] for row in rows] == ["Late blight", "Healthy"]
    assert [os.path.basename(row["photo"]) for row in rows] == ["late_blight.jpg", "healthy.jpg"]
    assert all(float(row["confidence"]) > 0.5 and row["uncertain"] == "0" and row["advice"] for row in rows)
    assert rows[1]["second"] and rows[0]["model"] == "tomato_leaf.bin"
    if "screenshot:" in out:
        picture = tmp_path / "field_app.png"
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        print(out.strip())
        if os.environ.get("LNN_SCREENSHOT"):
            shutil.copy(picture, HERE.parents[2] / os.environ["LNN_SCREENSHOT"])


def test_a_bad_model_is_refused_and_the_old_one_kept(display, tmp_path):
    drive(display, "bad_model", tmp_path)


def test_worker_failures_give_a_dialog_and_the_next_photo_is_answered(display, tmp_path):
    drive(display, "worker_failures", tmp_path)


def test_a_mixed_folder_gives_one_summary_and_every_good_photo_an_answer(display, tmp_path):
    drive(display, "mixed_folder", tmp_path)
    rows = list(csv.DictReader((tmp_path / "report.csv").open(encoding="utf-8")))
    assert [os.path.basename(row["photo"]) for row in rows] == ["cut.jpg", "empty.jpg", "healthy.jpg",
                                                                "late_blight.jpg", "notes.png"]
    assert [row["result"] for row in rows] == ["not checked", "not checked", "Healthy", "Late blight", "not checked"]
    assert "truncated" in rows[0]["advice"] and "empty" in rows[1]["advice"] and rows[4]["advice"]


def test_photos_on_the_command_line_are_checked_at_start(display, tmp_path):
    drive(display, "command_line", tmp_path)


# --------------------------------------------------------------------------- the child process

def pump_until(root, condition, timeout_s=ANSWER_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the app gave no result in time"
        root.update()
        time.sleep(0.02)


def write_two_colour_png(path):
    import numpy as np

    from lnn.runtime.preprocess import image_library

    image = np.zeros((300, 300, 3), np.uint8)
    image[:, :150], image[:, 150:] = (220, 160, 40), (30, 60, 200)      # RGB
    if image_library() == "opencv":
        import cv2

        cv2.imwrite(str(path), image[:, :, ::-1])
    else:
        from PIL import Image

        Image.fromarray(image).save(path)


def scenario_photos(app, root, tmp_path):
    from lnn.tools.field_ui import RETAKE_HEADLINE, UNCERTAIN_HEADLINES

    app.open_photos([LEAVES / "late_blight.jpg", LEAVES / "healthy.jpg"])
    assert app.busy                         # the window returns at once; the worker answers later
    pump_until(root, lambda: len(app.history) == 2 and not app.busy)
    shown = app.shown_text()                # the last photo is on screen
    assert shown.startswith("Healthy") and "Advice:" in shown, shown
    app.select(0)
    shown = app.shown_text()
    assert shown.startswith("Late blight"), shown
    assert not any(headline in shown for headline in (RETAKE_HEADLINE, *UNCERTAIN_HEADLINES.values())), shown
    assert shown.count("%") >= 4, shown     # headline + top 3
    assert app.shown_image.width() > 0
    app.save_report(tmp_path / "report.csv")
    root.update()
    not_a_leaf = tmp_path / "two_colours.png"               # a photo of nothing leaf-like: the gate answers
    write_two_colour_png(not_a_leaf)
    app.open_photos([not_a_leaf])
    pump_until(root, lambda: len(app.history) == 3 and not app.busy)
    shown = app.shown_text()
    assert shown.startswith(UNCERTAIN_HEADLINES["not_a_leaf"]), shown
    assert "does not look like a tomato leaf" in shown and "Advice:" not in shown, shown
    assert "%" not in shown, shown                          # no disease score beside the refusal
    app.open_photos([tmp_path / "drone.jpg"])             # data no block uses before its end marker: a note
    pump_until(root, lambda: len(app.history) == 4 and not app.busy)
    shown = app.shown_text()
    assert shown.startswith("Late blight") and "\nNote: " in shown and "ran on after its image ended" in shown, shown
    if shutil.which("import"):              # ImageMagick: the whole virtual screen, which is the window
        subprocess.run(["import", "-window", "root", str(tmp_path / "field_app.png")], check=True, timeout=60)
        print(f"screenshot: {tmp_path / 'field_app.png'}")


def scenario_bad_model(app, root, tmp_path):
    from lnn.tools import field_ui

    shown_errors = []
    field_ui.messagebox.showerror = lambda title, text, **_: shown_errors.append(text)
    bad = tmp_path / "broken.bin"
    bad.write_bytes(b"not a model at all")
    app.open_model(bad)
    pump_until(root, lambda: shown_errors and not app.busy)
    assert "broken.bin" in shown_errors[0] and "Still using tomato_leaf.bin" in shown_errors[0], shown_errors
    app.open_photos([LEAVES / "leaf_mold.jpg"])
    pump_until(root, lambda: app.history and not app.busy)
    assert app.shown_text().startswith("Leaf mold"), app.shown_text()


def capture_errors(field_ui) -> list:
    """The texts of the error dialogs the app shows from now on (instead of showing them)."""
    shown = []
    field_ui.messagebox.showerror = lambda title, text, **_: shown.append(text)
    return shown


def check_one(app, root, photo: Path, shown_errors: list, expected_error: str | None):
    """Open one photo; with expected_error, exactly one dialog naming it and a "Not checked" row; else an answer."""
    from lnn.tools.field_ui import NOT_CHECKED, Failure

    errors_before, rows_before = len(shown_errors), len(app.history)
    app.open_photos([photo])
    pump_until(root, lambda: len(app.history) > rows_before and not app.busy, READY_ANSWER_S)
    new_errors = shown_errors[errors_before:]
    entry = app.history[-1][1]
    if expected_error is None:
        assert not new_errors and not isinstance(entry, Failure), (new_errors, entry)
        assert not app.shown_text().startswith(NOT_CHECKED), app.shown_text()
    else:
        assert len(new_errors) == 1 and expected_error in new_errors[0], new_errors
        assert isinstance(entry, Failure) and app.shown_text().startswith(NOT_CHECKED), app.shown_text()
        assert app.table.item(str(len(app.history) - 1))["values"][1] == NOT_CHECKED


def scenario_worker_failures(app, root, tmp_path):
    from lnn.tools import field_ui

    shown_errors = capture_errors(field_ui)
    leaf = LEAVES / "healthy.jpg"
    real_read_image = field_ui.read_image

    def faulty_read_image(path, *args):        # what a model with a huge input or a pixel bomb used to cause
        if path.name == "huge.jpg":
            raise MemoryError()
        if path.name == "bomb.png":
            raise RuntimeError("OpenCV(4.10.0) error: (-215:Assertion failed) pixels <= CV_IO_MAX_IMAGE_PIXELS")
        return real_read_image(path, *args)

    field_ui.read_image = faulty_read_image
    for name, expected in (("huge.jpg", "not enough memory"), ("bomb.png", "unexpected error (RuntimeError")):
        shutil.copy(leaf, tmp_path / name)
        check_one(app, root, tmp_path / name, shown_errors, expected)
        check_one(app, root, leaf, shown_errors, None)

    def failing_request(paths):                # a failure outside any one photo: the request as a whole
        raise RuntimeError("the request broke")

    app.worker.classify = failing_request
    app.open_photos([leaf])
    pump_until(root, lambda: shown_errors and "the request broke" in shown_errors[-1] and not app.busy, READY_ANSWER_S)
    del app.worker.classify
    check_one(app, root, leaf, shown_errors, None)

    real_photo_ppm = field_ui.photo_ppm        # a photo Tk cannot show: the polling goes on
    field_ui.photo_ppm = lambda image: b"not a picture"
    errors_before = len(shown_errors)
    app.open_photos([leaf])
    pump_until(root, lambda: len(shown_errors) > errors_before and not app.busy, READY_ANSWER_S)
    assert "showing a result" in shown_errors[-1], shown_errors
    field_ui.photo_ppm = real_photo_ppm
    check_one(app, root, leaf, shown_errors, None)
    assert app.shown_image.width() > 0

    real_load_session = field_ui.load_session  # a model whose input is too large for the memory
    field_ui.load_session = lambda *args: (_ for _ in ()).throw(MemoryError())
    errors_before = len(shown_errors)
    app.open_model(tmp_path / "huge_input.bin")
    pump_until(root, lambda: len(shown_errors) > errors_before and not app.busy, READY_ANSWER_S)
    assert "not enough memory" in shown_errors[-1] and "Still using tomato_leaf.bin" in shown_errors[-1], shown_errors
    field_ui.load_session = real_load_session
    check_one(app, root, leaf, shown_errors, None)
    assert app.shown_text().startswith("Healthy"), app.shown_text()


def mixed_folder(tmp_path: Path) -> Path:
    """Two good leaves and three bad files (truncated, empty, not an image), plus a sub-folder that is left alone."""
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    for name in ("healthy.jpg", "late_blight.jpg"):
        shutil.copy(LEAVES / name, folder / name)
    data = (LEAVES / "leaf_mold.jpg").read_bytes()
    (folder / "cut.jpg").write_bytes(data[:len(data) // 2])
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "notes.png").write_text("a shopping list, not a photo\n")
    shutil.copy(LEAVES / "leaf_mold.jpg", folder / "sub" / "deeper.jpg")
    return folder


def scenario_mixed_folder(app, root, tmp_path):
    from lnn.tools import field_ui

    shown_errors = capture_errors(field_ui)
    app.open_paths([mixed_folder(tmp_path)])
    pump_until(root, lambda: len(app.history) == 5 and not app.busy, READY_ANSWER_S)
    assert len(shown_errors) == 1, shown_errors            # ONE summary, not one dialog per bad file
    summary = shown_errors[0]
    assert summary.startswith("3 of 5 photos could not be checked"), summary
    lines = summary.splitlines()[2:]
    assert [line.split(": ")[0] for line in lines] == ["cut.jpg", "empty.jpg", "notes.png"], summary
    assert "truncated" in lines[0] and "empty" in lines[1] and "image" in lines[2], summary
    assert str(tmp_path) not in summary, summary            # each line names the photo once, by its name
    assert "2 photo(s) checked, 3 not checked" in app.status.get(), app.status.get()
    app.save_report(tmp_path / "report.csv")


def scenario_command_line(app, root, tmp_path):
    pump_until(root, lambda: len(app.history) == 6 and not app.busy, READY_ANSWER_S)
    answered = [Path(answer.file).name for _, answer, ppm, _ in app.history if ppm is not None]
    assert answered == ["healthy.jpg", "healthy.jpg", "late_blight.jpg"], answered


def child(scenario: str, tmp_path: Path) -> int:
    import tkinter as tk

    from lnn.tools.field import build_parser
    from lnn.tools.field_ui import FieldApp

    try:
        root = tk.Tk()
    except tk.TclError as err:
        print(f"Tk cannot open the virtual display: {err}")
        return 3
    root.geometry("1000x640+0+0")
    if scenario == "command_line":
        mixed_folder(tmp_path)
    argv = [arg.format(leaves=LEAVES, tmp=tmp_path) for arg in COMMAND_LINE.get(scenario, [])]
    args = build_parser().parse_args(argv)
    if scenario == "command_line":
        from lnn.tools import field_ui

        capture_errors(field_ui)
    app = FieldApp(root, args.model, args.photos)
    pump_until(root, lambda: app.model_name and not app.busy)
    assert app.status.get().startswith("Ready"), app.status.get()
    {"photos": scenario_photos, "bad_model": scenario_bad_model, "worker_failures": scenario_worker_failures,
     "mixed_folder": scenario_mixed_folder, "command_line": scenario_command_line}[scenario](app, root, tmp_path)
    root.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(child(sys.argv[1], Path(sys.argv[2])))
