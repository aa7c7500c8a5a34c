"""lnn-field's window (Tk): open photos, see each answer, keep a history, save a CSV report.

Threads: Tk runs on the main thread only. One worker thread owns the model Session; the window sends
it requests (load a model, classify photos) on one queue and reads results from another, polled every
POLL_MS with Tk's `after`, so neither a model load, Numba's first compile nor a folder of photos can
freeze the window.

Failures never freeze it either: whatever the worker meets (lnn's own errors, and also a MemoryError from
a model with a huge input or a library's raw exception) becomes a message, the photo gets a "Not checked"
row in the history, and the worker goes on with the next request; a failure while showing a result
becomes a dialog and the polling goes on. The failures of one request (a folder, several photos) are
collected into ONE summary dialog when the request is done.

Device: the app runs on the CPU backend ("cpu"), falling back to NumPy when it cannot load; it answers
about 8x faster than NumPy per photo, which is what a folder of photos on a Raspberry Pi needs. The
packaged app has the kernels compiled ahead of time (runtime/cpu/aot.py), so it starts ready; run from a
Python install with Numba, the first start compiles them once per computer (cached per user; the window
shows "Preparing…" meanwhile, and photos opened then wait their turn). lnn-infer's policy (NumPy for a
few images) suits a process that answers once and exits.

The machine check: a model's first start on a computer runs its test vectors (runtime/vectors.py
check_once: the exporting machine's outputs for a few inputs) on the backend the app will use; a
computer that computes something else is refused with a dialog naming the difference and lnn-doctor,
and its model is not used. A PASS is remembered per model file and computer, so later starts skip it.

The answer's wording (labels, uncertainty, advice) comes from lnn-infer's Answer class, so the window
and the command line always agree.

The Phones menu runs lnn-serve (tools/serve.py's BackgroundServer) on a thread of this process, on every
network, port 8080, with the window's model, and shows the address phones on the station's Wi-Fi open, in
words and as a QR code that a phone's camera opens.
"""

from __future__ import annotations

import csv
import datetime
import queue
import threading
import tkinter as tk
from pathlib import Path
from tkinter import filedialog, messagebox, ttk

import numpy as np

from lnn.formats.binfile import atomic_output
from lnn.formats.errors import LnnError, LnnInputError
from lnn.runtime import resolve_device
from lnn.runtime.preprocess import read_image, resize_image
from lnn.runtime.vectors import check_once
from lnn.tools.infer import DEFAULT_MODEL, IMAGE_SUFFIXES, answers_for, images_in_folder, load_session

TITLE = "lnn field — tomato leaf check"
POLL_MS = 50                  # how often the window reads the worker's results
PHOTO_SIZE = 360              # the shown photo fits in this many pixels square
TOP_K = 3
NOT_CHECKED = "Not checked"
SUMMARY_LINES = 12            # failures listed by name in one summary dialog; the rest are counted
UNCERTAIN_HEADLINES = {"low_confidence": "Uncertain — take a clearer photo of one leaf",
                       "not_a_leaf": "Not a leaf this model knows — no diagnosis"}
RETAKE_HEADLINE = "Retake the photo — no diagnosis"          # the photo checks' reasons
REPORT_COLUMNS = ("time", "photo", "result", "confidence", "uncertain", "second", "third", "advice", "model")
PHONE_SERVER_HOST, PHONE_SERVER_PORT = "0.0.0.0", 8080      # every network of this computer: the station's Wi-Fi


# --------------------------------------------------------------------------- the worker thread

def photo_ppm(image: np.ndarray) -> bytes:
    """A decoded BGR photo shrunk to fit PHOTO_SIZE, as binary PPM bytes, which Tk's PhotoImage reads
    without an image library."""
    scale = PHOTO_SIZE / max(image.shape[:2])
    if scale < 1:
        height, width = (max(1, round(side * scale)) for side in image.shape[:2])
        image = resize_image(image, width, height)
    height, width = image.shape[:2]
    return b"P6 %d %d 255\n" % (width, height) + np.ascontiguousarray(image[:, :, ::-1]).tobytes()


def failure_text(err: BaseException) -> str:
    """One line saying why a photo or a model failed: lnn's own message, or the kind of an unexpected failure."""
    if isinstance(err, LnnError):
        return str(err)
    if isinstance(err, MemoryError):
        return "not enough memory (the photo or the model is too large for this computer)"
    if isinstance(err, OSError):
        return f"{err.filename}: {err.strerror or err}" if err.filename else str(err.strerror or err)
    return f"unexpected error ({type(err).__name__}: {' '.join(str(err).split())})"


class Failure:
    """A photo that could not be checked: its history row says why."""

    def __init__(self, path: Path, message: str):
        self.file = str(path)
        self.message = message

    def reason(self) -> str:
        """The message without the photo's path in front (the row already names the photo)."""
        return self.message[len(self.file) + 2:] if self.message.startswith(f"{self.file}: ") else self.message


class Worker(threading.Thread):
    """Owns the Session. Requests: ("load", path) and ("classify", [paths]); results go to `results`:
    ("preparing", model_path), ("ready", model_path, device, threads), ("model_error", model_path, message),
    ("refused", model_path, message) when this computer fails the model's test vectors,
    ("answer", Answer, ppm_bytes), ("failed", path, message), ("checked", photo_count) at the end of a
    classify request, ("worker_error", message) when a request failed as a whole, ("idle",).
    No exception ends the thread: it answers every request it takes."""

    def __init__(self, results: queue.Queue):
        super().__init__(name="lnn-field-worker", daemon=True)
        self.requests: queue.Queue = queue.Queue()
        self.results = results
        self.session = None
        self.model_path = None

    def run(self):
        while True:
            kind, payload = self.requests.get()
            try:
                {"load": self.load, "classify": self.classify}[kind](payload)
            except Exception as err:           # noqa: BLE001 - the last resort: report it, keep serving
                self.results.put(("worker_error", failure_text(err)))
            if self.requests.empty():
                self.results.put(("idle",))

    def load(self, model_path: Path):
        self.results.put(("preparing", model_path))
        try:
            session = load_session(str(model_path), resolve_device("auto"), None)    # the CPU backend, else NumPy
            # Under Numba's JIT the first run compiles the kernels (or loads them from the per-user cache):
            # the test vectors' run, the first on this computer, or a warm-up (Session.warm_up, as lnn-serve's).
            check = check_once(session)
            if check is None or check.cached:
                session.warm_up(1)
        except Exception as err:               # noqa: BLE001 - e.g. MemoryError from a model with a huge input
            self.results.put(("model_error", model_path, failure_text(err)))
            return
        if check is not None and not check.passed:
            self.results.put(("refused", model_path, check.refusal(model_path)))
            return
        self.session, self.model_path = session, model_path
        self.results.put(("ready", model_path, session.device, session.threads))

    def classify(self, paths: list):
        try:
            for path in paths:
                self.results.put(self.check(path))
        finally:
            self.results.put(("checked", len(paths)))

    def check(self, path: Path) -> tuple:
        """One photo -> an ("answer", ...) or a ("failed", ...) message; never raises."""
        if self.session is None:
            return "failed", path, "no model is loaded; open a model first"
        try:
            notes: list = []
            image = read_image(path, self.session.decode_side(), notes)    # once, for the model and the screen
            top_k = min(TOP_K, len(self.session.labels))
            [answer] = answers_for(self.session, [(path, *self.session.prepare_and_check(image, notes=notes), notes)],
                                   top_k)
            if isinstance(answer, str):                    # the model's output is not a number
                return "failed", path, answer
            return "answer", answer, photo_ppm(image)
        except Exception as err:                   # noqa: BLE001 - one bad photo never stops the others
            return "failed", path, failure_text(err)


# --------------------------------------------------------------------------- the window

class FieldApp:
    """The window. The buttons call open_photos, open_paths (a folder), open_model and save_report with what
    the dialogs return; tests call the same methods directly."""

    def __init__(self, root: tk.Tk, model_path: str | Path | None = None, photos=()):
        self.root = root
        self.results: queue.Queue = queue.Queue()
        self.worker = Worker(self.results)
        self.history: list = []             # (time, Answer or Failure, ppm bytes or None, model name), oldest first
        self.request_failures: list = []    # the Failures of the request being checked, for its one summary
        self.model_name = ""
        self.busy = False
        self.shown_image = None             # keeps the PhotoImage alive while it is on screen
        self.phone_server = None            # lnn-serve's BackgroundServer while the Phones menu has it running
        self.address_dialog = self.address_image = None     # the window with its address, and its QR code
        self._build()
        self.worker.start()
        self.open_model(model_path or DEFAULT_MODEL)
        if photos:                          # from the command line: checked once the model is ready
            self.open_paths(photos)
        self.root.after(POLL_MS, self._poll)

    def _build(self):
        root = self.root
        root.title(TITLE)
        root.minsize(760, 520)
        menubar = tk.Menu(root)
        self.phones_menu = tk.Menu(menubar, tearoff=False)
        self.phones_menu.add_command(label="Start the phone server…", command=self.toggle_phone_server)
        menubar.add_cascade(label="Phones", menu=self.phones_menu)
        root.configure(menu=menubar)
        bar = ttk.Frame(root, padding=6)
        bar.pack(side="top", fill="x")
        ttk.Button(bar, text="Open photo…", command=self._ask_photos).pack(side="left")
        ttk.Button(bar, text="Open folder…", command=self._ask_folder).pack(side="left", padx=4)
        ttk.Button(bar, text="Save report…", command=self._ask_report).pack(side="left")
        ttk.Button(bar, text="Open model…", command=self._ask_model).pack(side="right")

        self.status = tk.StringVar(value="Starting…")
        ttk.Label(root, textvariable=self.status, padding=(8, 2), relief="sunken").pack(side="bottom", fill="x")

        body = ttk.Frame(root, padding=6)
        body.pack(side="top", fill="both", expand=True)
        self.photo = ttk.Label(body, text="No photo yet", anchor="center", width=40)
        self.photo.grid(row=0, column=0, rowspan=2, sticky="n")

        answer = ttk.Frame(body, padding=(12, 0))
        answer.grid(row=0, column=1, sticky="nsew")
        self.headline = tk.StringVar()
        self.details = tk.StringVar()
        self.advice = tk.StringVar()
        ttk.Label(answer, textvariable=self.headline, font=("TkDefaultFont", 16, "bold"), wraplength=360).pack(anchor="w")
        ttk.Label(answer, textvariable=self.details, font="TkFixedFont", justify="left").pack(anchor="w", pady=6)
        ttk.Label(answer, textvariable=self.advice, wraplength=360, justify="left").pack(anchor="w")

        self.table = ttk.Treeview(body, columns=("photo", "result", "confidence"), show="headings", height=8)
        for column, heading, width in (("photo", "Photo", 220), ("result", "Result", 200), ("confidence", "Confidence", 90)):
            self.table.heading(column, text=heading)
            self.table.column(column, width=width, anchor="w")
        self.table.grid(row=1, column=1, sticky="nsew", padx=(12, 0), pady=(8, 0))
        self.table.bind("<<TreeviewSelect>>", self._show_selected)
        body.columnconfigure(1, weight=1)
        body.rowconfigure(1, weight=1)

    # ---- what the buttons do (the dialogs, then the same methods tests call)

    def _ask_photos(self):
        kinds = [("Photos", " ".join(f"*{s} *{s.upper()}" for s in IMAGE_SUFFIXES)), ("All files", "*")]
        paths = filedialog.askopenfilenames(parent=self.root, title="Open leaf photos", filetypes=kinds)
        if paths:
            self.open_photos(paths)

    def _ask_folder(self):
        folder = filedialog.askdirectory(parent=self.root, title="Open a folder of leaf photos", mustexist=True)
        if folder:
            self.open_paths([folder])

    def _ask_model(self):
        path = filedialog.askopenfilename(parent=self.root, title="Open a model",
                                          filetypes=[("lnn models", "*.bin"), ("All files", "*")])
        if path:
            self.open_model(path)

    def _ask_report(self):
        if not self.history:
            messagebox.showinfo(TITLE, "There is nothing to report yet: open a photo first.", parent=self.root)
            return
        default = f"leaf-report-{datetime.date.today().isoformat()}.csv"
        path = filedialog.asksaveasfilename(parent=self.root, title="Save report", initialfile=default,
                                            defaultextension=".csv", filetypes=[("CSV", "*.csv")])
        if path:
            try:
                self.save_report(path)
            except (OSError, LnnInputError) as err:       # LnnInputError: a pipe or device chosen as the report
                messagebox.showerror(TITLE, f"The report could not be saved:\n{getattr(err, 'strerror', None) or err}",
                                     parent=self.root)

    def open_photos(self, paths):
        paths = [Path(p) for p in paths]
        self._set_busy(f"Checking {len(paths)} photo{'s' if len(paths) > 1 else ''}…")
        self.worker.requests.put(("classify", paths))

    def open_paths(self, paths):
        """Photos and folders (a folder gives its photos, sorted by name); a folder without photos, or one
        that cannot be read, is named in one warning."""
        photos, unusable = [], []
        for path in map(Path, paths):
            if not path.is_dir():
                photos.append(path)                 # a missing or bad file gets its row from the worker
                continue
            try:
                found = images_in_folder(path)
            except OSError as err:
                unusable.append(f"{path}: cannot be read ({err.strerror or err})")
                continue
            photos.extend(found)
            if not found:
                unusable.append(f"{path}: holds no photos ({', '.join(IMAGE_SUFFIXES)})")
        if unusable:
            messagebox.showwarning(TITLE, "\n".join(unusable), parent=self.root)
        if photos:
            self.open_photos(photos)

    def open_model(self, path):
        self._set_busy("Preparing…")
        self.worker.requests.put(("load", Path(path)))

    def save_report(self, path) -> None:
        """Write the session's history as CSV: one row per photo, best answer first."""
        with atomic_output(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(REPORT_COLUMNS)
            for when, answer, _, model in self.history:
                if isinstance(answer, Failure):
                    writer.writerow([when, answer.file, NOT_CHECKED.lower(), "", "", "", "", answer.reason(), model])
                    continue
                result = answer.as_dict()
                others = [f"{item['display']} {item['probability']:.1%}" for item in result["top_k"][1:3]]
                others += [""] * (2 - len(others))
                writer.writerow([when, answer.file, "uncertain" if answer.uncertain else result["display"],
                                 f"{answer.confidence:.4f}", int(answer.uncertain), *others,
                                 result.get("advice", answer.instruction or ""), model])
        self.status.set(f"Report saved: {path}")

    def toggle_phone_server(self, host: str = PHONE_SERVER_HOST, port: int = PHONE_SERVER_PORT) -> str:
        """The Phones menu: start lnn-serve in the background with the model in use, or stop it. The dialog
        says which address phones open; returns its text."""
        from lnn.tools.serve import ALL_NETWORKS, BackgroundServer, lan_address, phones_can_open

        if self.phone_server is not None:
            self.phone_server.stop()
            self.phone_server = None
            self.close_phone_address()
            self.phones_menu.entryconfigure(0, label="Start the phone server…")
            text = "The phone server is stopped; phones get no more answers from this computer."
            messagebox.showinfo(TITLE, text, parent=self.root)
            return text
        try:
            self.phone_server = BackgroundServer(self.worker.model_path or DEFAULT_MODEL, host, port)
        except LnnError as err:                 # no serve extra, the port in use, a bad model: one line
            text = f"The phone server could not start:\n{err}"
            messagebox.showerror(TITLE, text, parent=self.root)
            return text
        url = self.phone_server.url
        self.phones_menu.entryconfigure(0, label=f"Stop the phone server ({url})")
        reach = (f"The server listens on every network of this computer ({host}), so any phone on the same Wi-Fi "
                 f"reaches it" if host in ALL_NETWORKS else f"The server listens on {host} only")
        text = (f"Phones on this station's Wi-Fi can now open\n\n    {url}\n\nin their browser, take a photo of "
                f"a leaf and get the answer. {reach}; no internet is needed. Stop it from the Phones menu.")
        if host in ALL_NETWORKS and lan_address() == "127.0.0.1":
            text += ("\n\nThis computer is on no network now: connect it to the station's Wi-Fi, then stop and "
                     "start the phone server again to see its address there.")
        scannable = phones_can_open(url)
        if scannable:
            text += "\n\nOr point a phone's camera at this code, which opens the same address:"
        self.show_phone_address(text, url if scannable else None)
        return text

    def show_phone_address(self, text: str, url: str | None) -> None:
        """The phone server's address in a window of its own beside the main one (which goes on answering), with
        the QR code of `url` when given; replaces the one shown before."""
        from lnn.tools.serve_app import address_qr

        self.close_phone_address()
        dialog = self.address_dialog = tk.Toplevel(self.root)
        dialog.title(TITLE)
        dialog.transient(self.root)
        dialog.protocol("WM_DELETE_WINDOW", self.close_phone_address)
        frame = ttk.Frame(dialog, padding=16)
        frame.pack(fill="both", expand=True)
        ttk.Label(frame, text=text, wraplength=440, justify="left").pack(anchor="w")
        if url is not None:
            self.address_image = tk.PhotoImage(data=address_qr(url, "ppm"), format="ppm")
            ttk.Label(frame, image=self.address_image).pack(pady=12)
        ttk.Button(frame, text="OK", command=self.close_phone_address).pack(pady=(12, 0))

    def close_phone_address(self) -> None:
        if self.address_dialog is not None:
            self.address_dialog.destroy()
        self.address_dialog = self.address_image = None

    # ---- results from the worker

    def _set_busy(self, message: str):
        self.busy = True
        self.status.set(message)
        self.root.configure(cursor="watch")

    def _poll(self):
        try:
            while True:
                message = self.results.get_nowait()
                try:
                    self._handle(message)
                except Exception as err:       # noqa: BLE001 - e.g. a photo Tk cannot show: say so, keep polling
                    messagebox.showerror(TITLE, f"Something went wrong showing a result:\n{failure_text(err)}",
                                         parent=self.root)
        except queue.Empty:
            pass
        finally:
            self.root.after(POLL_MS, self._poll)

    def _handle(self, message: tuple):
        kind = message[0]
        if kind == "preparing":
            self.status.set(f"Preparing {message[1].name}… (the first start on a computer takes a little while)")
        elif kind == "ready":
            self.model_name = message[1].name
            threads = f", {message[3]} thread{'s' if message[3] > 1 else ''}" if message[3] else ""
            self.status.set(f"Ready: model {self.model_name} ({'Numba' if message[2] == 'cpu' else 'NumPy'}{threads})")
        elif kind == "model_error":
            path, text = message[1], message[2]
            still = f"\n\nStill using {self.model_name}." if self.model_name else ""
            messagebox.showerror(TITLE, f"This file is not a model the app can use:\n{path}\n\n{text}{still}",
                                 parent=self.root)
        elif kind == "refused":
            still = f"\n\nStill using {self.model_name}." if self.model_name else ""
            self.status.set(f"Refused: {message[1].name} computes something else on this computer")
            messagebox.showerror(TITLE, f"This computer cannot use this model:\n\n{message[2]}{still}", parent=self.root)
        elif kind == "answer":
            when = datetime.datetime.now().isoformat(timespec="seconds")
            self.history.append((when, message[1], message[2], self.model_name))
            self._add_row(len(self.history) - 1)
        elif kind == "failed":
            when = datetime.datetime.now().isoformat(timespec="seconds")
            failure = Failure(message[1], message[2])
            self.history.append((when, failure, None, self.model_name))
            self.request_failures.append(failure)
            self._add_row(len(self.history) - 1)
        elif kind == "checked":
            failures, self.request_failures = self.request_failures, []
            if failures:
                self._show_failures(failures, message[1])
        elif kind == "worker_error":
            messagebox.showerror(TITLE, f"The request could not be finished:\n{message[1]}", parent=self.root)
        elif kind == "idle":
            self.busy = False
            self.root.configure(cursor="")
            if self.model_name and not self.status.get().startswith("Report saved"):
                failed = sum(isinstance(entry[1], Failure) for entry in self.history)
                not_checked = f", {failed} not checked" if failed else ""
                self.status.set(f"Ready: model {self.model_name} — "
                                f"{len(self.history) - failed} photo(s) checked{not_checked}")

    def _show_failures(self, failures: list, photo_count: int):
        """ONE dialog for the failures of one request, however many photos it held."""
        if photo_count == 1:
            text = f"This photo could not be checked:\n{failures[0].message}"
        else:
            lines = [f"{Path(f.file).name}: {f.reason()}" for f in failures[:SUMMARY_LINES]]
            if len(failures) > SUMMARY_LINES:
                lines.append(f"… and {len(failures) - SUMMARY_LINES} more (see the history)")
            text = f"{len(failures)} of {photo_count} photos could not be checked:\n\n" + "\n".join(lines)
        messagebox.showerror(TITLE, text, parent=self.root)

    def _add_row(self, index: int):
        answer = self.history[index][1]
        if isinstance(answer, Failure):
            values = (Path(answer.file).name, NOT_CHECKED, "")
        else:
            result = "Uncertain" if answer.uncertain else answer.best["display"]
            values = (Path(answer.file).name, result, f"{answer.confidence:.1%}")
        self.table.insert("", "end", iid=str(index), values=values)
        self.select(index)

    def select(self, index: int):
        """Select a history row, which puts its photo and answer on screen."""
        self.table.selection_set(str(index))
        self.table.see(str(index))
        self.show(index)

    def _show_selected(self, _event=None):
        selected = self.table.selection()
        if selected:
            self.show(int(selected[0]))

    def show(self, index: int):
        """Put one history entry on screen: the photo, the answer in words, the top 3 and the advice."""
        _, answer, ppm, _ = self.history[index]
        if isinstance(answer, Failure):
            self.shown_image = None
            self.photo.configure(image="", text="No photo to show")
            self.headline.set(f"{NOT_CHECKED} — {Path(answer.file).name}")
            self.details.set("")
            self.advice.set(answer.reason())
            return
        self.shown_image = tk.PhotoImage(data=ppm, format="ppm")
        self.photo.configure(image=self.shown_image, text="")
        if answer.uncertain:
            self.headline.set(UNCERTAIN_HEADLINES.get(answer.reason, RETAKE_HEADLINE))
            advice = answer.explanation
        else:
            self.headline.set(f"{answer.best['display']} — {answer.confidence:.1%} sure")
            advice = f"Advice: {answer.best['advice']}" if "advice" in answer.best else ""
        self.advice.set("\n".join(([advice] if advice else []) + [f"Note: {note}" for note in answer.notes]))
        refused = answer.uncertain and answer.reason != "low_confidence"     # a score beside a disease reads as one
        self.details.set("" if refused else "\n".join(f"{rank}. {label['display']:<28} {p:6.1%}"
                                                      for rank, (label, p) in enumerate(answer.ranked, 1)))

    def shown_text(self) -> str:
        """What the answer panel says, as one string (for tests and screen readers)."""
        return "\n".join((self.headline.get(), self.details.get(), self.advice.get()))


def run_app(model_path: str | None = None, photos=()) -> int:
    try:
        root = tk.Tk()
    except tk.TclError as err:                   # no display (e.g. over ssh): say so in one line
        raise LnnInputError(f"cannot open a window ({err}); use --cli IMAGE... without a display") from None
    app = FieldApp(root, model_path, photos)
    root.mainloop()
    if app.phone_server is not None:
        stop_for_good(app.phone_server)
    return 0


def stop_for_good(phone_server) -> None:
    """The window is closed: stop the phone server. One stopped during its model's warm-up leaves the process
    at once: the interpreter's exit would join the inference thread inside its compile (unseen, 20-30 s after
    the window closed, then an error line), and leaving loses only the kernels being compiled
    (serve.leave_during_the_warm_up)."""
    from lnn.tools.serve import leave_at_once

    compiling = phone_server.warming_up
    phone_server.stop()
    if compiling:
        leave_at_once(0)
