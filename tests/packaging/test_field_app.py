"""lnn-field's window under a virtual display (Xvfb), driven through the app's own methods (the ones its
buttons call): open sample photos, wait for the answers the worker thread sends, save the report and
check it, refuse a bad model while keeping the old one, and keep a screenshot for a person to look at.

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


def child(scenario: str, tmp_path: Path) -> int:
    import tkinter as tk

    from lnn.tools.field_ui import FieldApp

    try:
        root = tk.Tk()
    except tk.TclError as err:
        print(f"Tk cannot open the virtual display: {err}")
        return 3
    root.geometry("1000x640+0+0")
    app = FieldApp(root)
    pump_until(root, lambda: app.model_name and not app.busy)
    assert app.status.get().startswith("Ready"), app.status.get()
    {"photos": scenario_photos, "bad_model": scenario_bad_model}[scenario](app, root, tmp_path)
    root.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(child(sys.argv[1], Path(sys.argv[2])))
