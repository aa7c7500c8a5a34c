"""lnn-field's Phones menu: it starts lnn-serve in the background with the window's model, the dialog
gives the address phones open (and its QR code, read back with OpenCV's QR reader), a photo sent there gets
its answer, and the same menu stops it.

Runs the window on the virtual display of test_field_app.py (a child process per scenario, skipping
without Xvfb or Tk). The test listens on loopback only (the menu's default is every network, 0.0.0.0)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_field_app import ANSWER_TIMEOUT_S, LEAVES, display, pump_until  # noqa: F401 (display: fixture)

HERE = Path(__file__).resolve()


def test_phones_menu_starts_and_stops_the_server(display):
    pytest.importorskip("uvicorn")
    result = subprocess.run([sys.executable, str(HERE)], env={**os.environ, "DISPLAY": display},
                            capture_output=True, text=True, timeout=2 * ANSWER_TIMEOUT_S)
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout + result.stderr


def test_closing_the_window_while_the_phone_server_warms_up_ends_the_process_at_once(display, tmp_path):
    """A cold kernel cache, so that the server's warm-up compiles for a while: the window closed during it, the
    process ends within seconds (it waited 20-30 s for the compile at the interpreter's exit, then printed
    "the model failed its warm-up"), and the next start finds a cache it can use."""
    pytest.importorskip("uvicorn")
    import time

    cold = {**os.environ, "DISPLAY": display, "LNN_CACHE_DIR": str(tmp_path), "NUMBA_CACHE_DIR": str(tmp_path)}
    child = subprocess.Popen([sys.executable, str(HERE), "close-while-warming"], env=cold, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        said = child.stdout.readline()                    # "closed" when the window closes
        closed_at = time.monotonic()
        returncode = child.wait(timeout=2 * ANSWER_TIMEOUT_S)
        ended_at = time.monotonic()
    finally:
        child.kill()
    said += child.stdout.read()
    errors = child.stderr.read()
    if returncode == 3:
        pytest.skip(said.strip())
    assert returncode == 0 and said.startswith("closed"), said + errors
    assert ended_at - closed_at < 5.0, f"the process ended {ended_at - closed_at:.1f} s after its window closed"
    assert "warm-up" not in errors, errors
    again = subprocess.run([sys.executable, str(HERE)], env=cold, capture_output=True, text=True,
                           timeout=2 * ANSWER_TIMEOUT_S)
    assert again.returncode == 0, again.stdout + again.stderr


def test_the_address_for_phones_is_the_lan_address_on_every_network():
    from lnn.tools.serve import lan_address, phone_url

    assert phone_url("0.0.0.0", 8080) == f"http://{lan_address()}:8080/"
    assert phone_url("127.0.0.1", 9000) == "http://127.0.0.1:9000/"
    assert lan_address().count(".") == 3


def test_only_addresses_other_devices_reach_get_a_qr_code():
    from lnn.tools.serve import phones_can_open

    assert phones_can_open("http://192.168.1.23:8080/") and phones_can_open("http://[fe80::1]:8080/")
    assert phones_can_open("http://station.local:8080/")
    for loopback in ("http://127.0.0.1:8080/", "http://127.0.1.1:8080/", "http://[::1]:8080/",
                     "http://localhost:8080/"):
        assert not phones_can_open(loopback), loopback


def read_qr_code(image) -> str:
    """The text of the QR code a Tk PhotoImage shows (conftest.qr_code_text's reading, in the child process,
    which has no conftest)."""
    import tempfile

    import cv2

    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "shown.ppm")
        image.write(path, format="ppm")
        return cv2.QRCodeDetector().detectAndDecode(cv2.imread(path))[0]


def child() -> int:
    import time
    import tkinter as tk

    import httpx

    from lnn.tools import field_ui

    try:
        root = tk.Tk()
    except tk.TclError as err:
        print(f"Tk cannot open the virtual display: {err}")
        return 3
    dialogs = []
    field_ui.messagebox.showinfo = lambda title, text, **_: dialogs.append(text)
    app = field_ui.FieldApp(root)
    pump_until(root, lambda: app.model_name and not app.busy)

    text = app.toggle_phone_server("127.0.0.1", 0)
    url = app.phone_server.url
    assert url.startswith("http://127.0.0.1:") and url in text and url in app.phones_menu.entrycget(0, "label"), text
    assert app.address_dialog.winfo_exists() and app.address_image is None, "a loopback address got a QR code"
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while httpx.get(url + "readyz").status_code != 200:
        assert time.monotonic() < deadline, "the phone server never became ready"
        time.sleep(0.1)
    answer = httpx.post(url + "v1/classify", content=(LEAVES / "late_blight.jpg").read_bytes(), timeout=60).json()
    assert answer["display"] == "Late blight", answer

    station = "http://192.168.1.23:8080/"               # the address dialog of a server on the station's Wi-Fi
    app.show_phone_address(f"Phones open {station}", station)
    assert read_qr_code(app.address_image) == station

    assert "stopped" in app.toggle_phone_server()
    assert app.address_dialog is None, "the address stayed on screen after Stop"
    assert app.phone_server is None and app.phones_menu.entrycget(0, "label").startswith("Start")
    try:
        httpx.get(url + "healthz", timeout=5)
        raise AssertionError("the phone server still answers after Stop")
    except httpx.ConnectError:
        pass
    assert len(dialogs) == 1
    root.destroy()
    return 0


def close_while_warming() -> int:
    """lnn-field's own run_app, its window closed while the phone server it started still warms up; says
    "closed" on stdout when it closes the window."""
    import tkinter as tk

    from lnn.tools import field_ui

    try:
        tk.Tk().destroy()
    except tk.TclError as err:
        print(f"Tk cannot open the virtual display: {err}")
        return 3
    field_ui.messagebox.showinfo = lambda *args, **kwargs: None

    class ClosedWhileWarming(field_ui.FieldApp):
        def __init__(self, root, *args):
            super().__init__(root, *args)
            self.toggle_phone_server("127.0.0.1", 0)
            root.after(200, self.close_once_warming)

        def close_once_warming(self):
            print("closed" if self.phone_server.warming_up else "the warm-up ended before the window closed", flush=True)
            self.root.destroy()

    field_ui.FieldApp = ClosedWhileWarming
    return field_ui.run_app()


if __name__ == "__main__":
    sys.exit(close_while_warming() if sys.argv[1:] == ["close-while-warming"] else child())
