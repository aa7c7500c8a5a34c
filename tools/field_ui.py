"""lnn-field's window (Tk): open photos, see each answer, keep a history, save a CSV report.

Threads: Tk runs on the main thread only. One worker thread owns the model Session; the window sends
it requests (load a model, classify photos) on one queue and reads results from another, polled every
POLL_MS with Tk's `after`, so neither a model load, Numba's first compile nor a folder of photos can
freeze the window.

Device: the app runs on the CPU backend ("cpu"), falling back to NumPy when it cannot load; it answers
about 8x faster than NumPy per photo, which is what a folder of photos on a Raspberry Pi needs. The
packaged app has the kernels compiled ahead of time (runtime/cpu/aot.py), so it starts ready; run from a
Python install with Numba, the first start compiles them once per computer (cached per user; the window
shows "Preparing…" meanwhile, and photos opened then wait their turn). lnn-infer's policy (NumPy for a
few images) suits a process that answers once and exits.

The answer's wording (labels, uncertainty, advice) comes from lnn-infer's Answer class, so the window
and the command line always agree.

The Phones menu runs lnn-serve (tools/serve.py's BackgroundServer) on a thread of this process, on every
network, port 8080, with the window's model, and shows the address phones on the station's Wi-Fi open.
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

from lnn.formats.errors import LnnError, LnnInputError
from lnn.runtime import resolve_device
from lnn.runtime.preprocess import read_image, resize_image
from lnn.tools.infer import CLEARER_PHOTO, DEFAULT_MODEL, IMAGE_SUFFIXES, Answer, images_in_folder, load_session

TITLE = "lnn field — tomato leaf check"
POLL_MS = 50                  # how often the window reads the worker's results
PHOTO_SIZE = 360              # the shown photo fits in this many pixels square
TOP_K = 3
UNCERTAIN_HEADLINE = "Uncertain — take a clearer photo of one leaf"
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


class Worker(threading.Thread):
    """Owns the Session. Requests: ("load", path) and ("classify", [paths]); results go to `results`:
    ("preparing", model_path), ("ready", model_path, device), ("model_error", model_path, message),
    ("answer", Answer, ppm_bytes), ("failed", path, message), ("idle",)."""

    def __init__(self, results: queue.Queue):
        super().__init__(name="lnn-field-worker", daemon=True)
        self.requests: queue.Queue = queue.Queue()
        self.results = results
        self.session = None
        self.model_path = None

    def run(self):
        while True:
            kind, payload = self.requests.get()
            if kind == "load":
                self.load(payload)
            elif kind == "classify":
                self.classify(payload)
            if self.requests.empty():
                self.results.put(("idle",))

    def load(self, model_path: Path):
        self.results.put(("preparing", model_path))
        try:
            session = load_session(str(model_path), resolve_device("auto"), None)    # the CPU backend, else NumPy
            # Under Numba's JIT the first run compiles the kernels (or loads them from the per-user cache).
            session.predict(np.random.default_rng(0).standard_normal((1, *session.input_shape), np.float32))
        except (LnnError, OSError) as err:
            self.results.put(("model_error", model_path, str(err)))
            return
        self.session, self.model_path = session, model_path
        self.results.put(("ready", model_path, session.device))

    def classify(self, paths: list):
        if self.session is None:
            for path in paths:
                self.results.put(("failed", path, "no model is loaded; open a model first"))
            return
        threshold = (self.session.metadata.get("thresholds") or {}).get("uncertain_below")
        top_k = min(TOP_K, len(self.session.labels))
        for path in paths:
            try:
                image = read_image(path)                   # decoded once, for the model and the screen
                probabilities = self.session.predict(self.session.prepare_image(image)[None])[0]
                ppm = photo_ppm(image)
            except (LnnError, OSError) as err:
                self.results.put(("failed", path, str(err)))
                continue
            self.results.put(("answer", Answer(path, probabilities, self.session.labels, top_k, threshold), ppm))


# --------------------------------------------------------------------------- the window

class FieldApp:
    """The window. The buttons call open_photos, open_folder, open_model and save_report with what the
    dialogs return; tests call the same methods directly."""

    def __init__(self, root: tk.Tk, model_path: str | Path | None = None):
        self.root = root
        self.results: queue.Queue = queue.Queue()
        self.worker = Worker(self.results)
        self.history: list = []             # (time, Answer, ppm bytes, model name), oldest first
        self.model_name = ""
        self.busy = False
        self.shown_image = None             # keeps the PhotoImage alive while it is on screen
        self.phone_server = None            # lnn-serve's BackgroundServer while the Phones menu has it running
        self._build()
        self.worker.start()
        self.open_model(model_path or DEFAULT_MODEL)
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
            self.open_folder(folder)

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
            except OSError as err:
                messagebox.showerror(TITLE, f"The report could not be saved:\n{err.strerror or err}", parent=self.root)

    def open_photos(self, paths):
        paths = [Path(p) for p in paths]
        self._set_busy(f"Checking {len(paths)} photo{'s' if len(paths) > 1 else ''}…")
        self.worker.requests.put(("classify", paths))

    def open_folder(self, folder):
        photos = images_in_folder(Path(folder))
        if not photos:
            messagebox.showwarning(TITLE, f"The folder holds no photos ({', '.join(IMAGE_SUFFIXES)}):\n{folder}",
                                   parent=self.root)
            return
        self.open_photos(photos)

    def open_model(self, path):
        self._set_busy("Preparing…")
        self.worker.requests.put(("load", Path(path)))

    def save_report(self, path) -> None:
        """Write the session's history as CSV: one row per photo, best answer first."""
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(REPORT_COLUMNS)
            for when, answer, _, model in self.history:
                result = answer.as_dict()
                others = [f"{item['display']} {item['probability']:.1%}" for item in result["top_k"][1:3]]
                others += [""] * (2 - len(others))
                writer.writerow([when, answer.file, "uncertain" if answer.uncertain else result["display"],
                                 f"{answer.confidence:.4f}", int(answer.uncertain), *others,
                                 result.get("advice", CLEARER_PHOTO if answer.uncertain else ""), model])
        self.status.set(f"Report saved: {path}")

    def toggle_phone_server(self, host: str = PHONE_SERVER_HOST, port: int = PHONE_SERVER_PORT) -> str:
        """The Phones menu: start lnn-serve in the background with the model in use, or stop it. The dialog
        says which address phones open; returns its text."""
        from lnn.tools.serve import ALL_NETWORKS, BackgroundServer, lan_address

        if self.phone_server is not None:
            self.phone_server.stop()
            self.phone_server = None
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
        messagebox.showinfo(TITLE, text, parent=self.root)
        return text

    # ---- results from the worker

    def _set_busy(self, message: str):
        self.busy = True
        self.status.set(message)
        self.root.configure(cursor="watch")

    def _poll(self):
        try:
            while True:
                self._handle(self.results.get_nowait())
        except queue.Empty:
            pass
        self.root.after(POLL_MS, self._poll)

    def _handle(self, message: tuple):
        kind = message[0]
        if kind == "preparing":
            self.status.set(f"Preparing {message[1].name}… (the first start on a computer takes a little while)")
        elif kind == "ready":
            self.model_name = message[1].name
            self.status.set(f"Ready: model {self.model_name} ({'Numba' if message[2] == 'cpu' else 'NumPy'})")
        elif kind == "model_error":
            path, text = message[1], message[2]
            still = f"\n\nStill using {self.model_name}." if self.model_name else ""
            messagebox.showerror(TITLE, f"This file is not a model the app can use:\n{path}\n\n{text}{still}",
                                 parent=self.root)
        elif kind == "answer":
            when = datetime.datetime.now().isoformat(timespec="seconds")
            self.history.append((when, message[1], message[2], self.model_name))
            self._add_row(len(self.history) - 1)
        elif kind == "failed":
            messagebox.showerror(TITLE, f"This photo could not be checked:\n{message[2]}", parent=self.root)
        elif kind == "idle":
            self.busy = False
            self.root.configure(cursor="")
            if self.model_name and not self.status.get().startswith("Report saved"):
                self.status.set(f"Ready: model {self.model_name} — {len(self.history)} photo(s) checked")

    def _add_row(self, index: int):
        answer = self.history[index][1]
        result = "Uncertain" if answer.uncertain else answer.best["display"]
        self.table.insert("", "end", iid=str(index), values=(Path(answer.file).name, result, f"{answer.confidence:.1%}"))
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
        self.shown_image = tk.PhotoImage(data=ppm, format="ppm")
        self.photo.configure(image=self.shown_image, text="")
        if answer.uncertain:
            self.headline.set(UNCERTAIN_HEADLINE)
            self.advice.set(f"Best guess {answer.best['display']} at {answer.confidence:.0%}, under the model's "
                            f"{answer.uncertain_below:.0%} threshold. {CLEARER_PHOTO}")
        else:
            self.headline.set(f"{answer.best['display']} — {answer.confidence:.1%} sure")
            self.advice.set(f"Advice: {answer.best['advice']}" if "advice" in answer.best else "")
        self.details.set("\n".join(f"{rank}. {label['display']:<28} {p:6.1%}"
                                   for rank, (label, p) in enumerate(answer.ranked, 1)))

    def shown_text(self) -> str:
        """What the answer panel says, as one string (for tests and screen readers)."""
        return "\n".join((self.headline.get(), self.details.get(), self.advice.get()))


def run_app(model_path: str | None = None) -> int:
    try:
        root = tk.Tk()
    except tk.TclError as err:                   # no display (e.g. over ssh): say so in one line
        raise LnnInputError(f"cannot open a window ({err}); use --cli IMAGE... without a display") from None
    FieldApp(root, model_path)
    root.mainloop()
    return 0
