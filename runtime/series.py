"""Series and table data: the UCR/UEA archive's files and CSV tables, and a model's series/table preprocessing.

Readers (NumPy and the standard library's csv; every problem is one LnnInputError naming the file, the
line and the column or channel):
  - `read_series_file(path)` -> SeriesFile: `.ts` (sktime/UEA: `@` header, `@data`, channels separated by
    `:`, the label last), `.tsv` (UCR 2018: the label, then the values; NaN padding at the end of a shorter
    series) and `.arff` (Weka: numeric attributes and the class last; UEA multivariate: one relational
    attribute whose value is `'c1 values\\nc2 values'`). Univariate and multivariate. Each series is
    [C, T_i] float32: trailing missing values (`?`, NaN: how the archive pads a shorter series) are cut
    off, missing values inside a series are filled by linear interpolation between their neighbours.
    Lengths may differ; `fit_length` brings every series to the model's length, as its preprocessing
    says: resampled ("linear") or padded at the end with its own mean ("pad_mean"; no mask).
  - `read_table(path, target=None)` -> Table: a CSV file with a header row; every cell outside the target
    column must be a finite number (empty cells, text, NaN and infinity and ragged rows are refused with
    their line and column).
Every value must lie within float32's range, in which models compute; given a model's preprocessing
(lnn-infer), also after its standardisation (a value beyond is refused with its line and channel or column).

Preprocessing (a model's metadata.preprocess, formats/model.py `_parse_standardize`, SPEC "Metadata
JSON"): series `{"kind": "series", "length": T, "resample": "linear" | "pad_mean", "mean": [C], "std": [C]}`,
tables `{"kind": "table", "columns": [F], "mean": [F], "std": [F]}`; x = (raw - mean) / std after fitting the length.
`fit_standardize` fits mean and std on training data, `standardize` applies them: the trainer and every
Session call the same function.
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lnn.formats.errors import LnnInputError
from lnn.formats.files import read_regular_file
from lnn.formats.limits import MAX_DATA_FILE_BYTES, MAX_INPUT_ELEMENTS
from lnn.formats.ops import FLOAT32_MAX

SERIES_SUFFIXES = (".ts", ".tsv", ".arff")
TABLE_SUFFIXES = (".csv",)
MISSING = ("?", "nan", "NaN", "NAN", "")
FLOAT32_RANGE = (-FLOAT32_MAX, FLOAT32_MAX)


@dataclass
class SeriesFile:
    path: Path
    series: list               # [C, T_i] float32 each
    labels: list | None        # one class name per series (None: the file has no class column)
    classes: list | None       # the declared class names (.ts @classLabel, .arff nominal), else None

    @property
    def channels(self) -> int:
        return self.series[0].shape[0]


@dataclass
class Table:
    path: Path
    columns: list              # the feature columns' names, in file order
    values: np.ndarray         # [N, F] float64
    labels: list | None        # the target column's cells (None without a target)


# --------------------------------------------------------------------------- reading files

def read_text(path, what: str) -> str:
    """A regular file of at most MAX_DATA_FILE_BYTES, as UTF-8 text (a BOM dropped)."""
    path = Path(path)
    raw = read_regular_file(path, f"a {what}", MAX_DATA_FILE_BYTES, "MAX_DATA_FILE_BYTES")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise LnnInputError(f"{path}: not UTF-8 text, not a {what} (byte {err.start})") from None


def value_range(preprocess: dict | None, index: int) -> tuple:
    """(low, high): the values of channel or column `index` a model can compute with, within float32's range
    before and after its standardisation (x - mean) / std; without one (or for a channel it lacks), float32's range."""
    if not preprocess or index >= len(preprocess["mean"]):
        return FLOAT32_RANGE
    mean, std = preprocess["mean"][index], preprocess["std"][index]
    return max(-FLOAT32_MAX, mean - FLOAT32_MAX * std), min(FLOAT32_MAX, mean + FLOAT32_MAX * std)


PLAIN_NUMBER = re.compile(r"\s*[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?\s*", re.ASCII)   # 5, -0.5, .5, 1e3


def _finite_number(cell: str, where: str, bounds: tuple = FLOAT32_RANGE) -> float:
    """One cell as a finite float within `bounds` (value_range), or an LnnInputError naming `where` and the cell.
    Written as a table writes a number (PLAIN_NUMBER): Python's float() also reads '5_5' and Arabic-Indic or
    full-width digits as 55, a typo or a foreign format taken silently as another value."""
    try:
        value = float(cell)
    except ValueError:
        raise LnnInputError(f"{where}: {cell[:40]!r} is not a number") from None
    if not math.isfinite(value):
        raise LnnInputError(f"{where}: {cell[:40]!r} is not a finite number")
    if not PLAIN_NUMBER.fullmatch(cell):
        raise LnnInputError(f"{where}: {cell[:40]!r} is not a number written with the digits 0-9 (such as 5.5 or "
                            f"-1e3)")
    if abs(value) > FLOAT32_MAX:
        raise LnnInputError(f"{where}: {cell[:40]!r} is beyond float32's range (±{FLOAT32_MAX:.4g}), in which "
                            f"the model computes")
    if not bounds[0] <= value <= bounds[1]:
        raise LnnInputError(f"{where}: {cell[:40]!r} overflows float32 after the model's standardisation "
                            f"(x - mean) / std")
    return value


def _numbers(text: str, sep: str, where: str, bounds: tuple = FLOAT32_RANGE) -> np.ndarray:
    """One channel's values, `sep`-separated -> float64 with NaN for missing values ('?', NaN, empty); text,
    infinity or a value outside `bounds` (value_range) is an error naming the value. NumPy parses the text (no
    Python string per value); the loop below only runs to name a bad value."""
    try:
        fast = np.fromstring(text.replace("?", "nan"), dtype=np.float64, sep=sep)
        if len(fast) == text.count(sep) + 1 and not (fast < bounds[0]).any() and not (fast > bounds[1]).any():
            return fast
    except ValueError:
        pass
    cells = text.split(sep)
    out = np.empty(len(cells))
    for i, cell in enumerate(cells):
        cell = cell.strip()
        if cell in MISSING:
            out[i] = np.nan
            continue
        out[i] = _finite_number(cell, f"{where}, value {i + 1}", bounds)
    return out


def clean_series(channels: list, where: str) -> np.ndarray:
    """Channels of one series (NaN = missing) -> [C, T]: trailing missing values cut (the archive's padding
    of a shorter series), inner ones filled by linear interpolation; channels must then be equally long."""
    cut = []
    for c, values in enumerate(channels):
        present = np.flatnonzero(~np.isnan(values))
        if len(present) == 0:
            raise LnnInputError(f"{where}: channel {c + 1} holds no value")
        values = values[:present[-1] + 1]
        if len(present) < len(values):
            values = np.interp(np.arange(len(values)), present, values[present])
        cut.append(values)
    lengths = {len(values) for values in cut}
    if len(lengths) > 1:
        raise LnnInputError(f"{where}: its channels have different lengths ({', '.join(map(str, (len(v) for v in cut)))})")
    return np.stack(cut).astype(np.float32)       # the model computes in float32; half the memory of float64


def _read_ts(path: Path, text: str, preprocess: dict | None) -> SeriesFile:
    header, classes, has_labels, series, labels = {}, None, True, [], []
    lines = iter(enumerate(text.splitlines(), 1))
    for number, line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not line.startswith("@"):
            raise LnnInputError(f"{path}: line {number}: data before @data (a .ts file starts with @ header lines)")
        key, _, value = line[1:].partition(" ")
        key = key.lower()
        if key == "data":
            break
        header[key] = value.strip()
        if key == "classlabel":
            words = value.split()
            has_labels = bool(words) and words[0].lower() == "true"
            classes = words[1:] if has_labels else None
    else:
        raise LnnInputError(f"{path}: no @data line (not a .ts file of the UCR/UEA archive)")
    if header.get("timestamps", "false").lower() == "true":
        raise LnnInputError(f"{path}: series with time stamps (@timeStamps true) are not read; write the values only")
    for number, line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(":")
        if has_labels:
            if len(parts) < 2:
                raise LnnInputError(f"{path}: line {number}: no class label after the values (@classLabel true)")
            labels.append(parts[-1].strip())
            parts = parts[:-1]
        where = f"{path}: line {number}"
        series.append(clean_series([_numbers(p, ",", f"{where}, channel {c + 1}", value_range(preprocess, c))
                                    for c, p in enumerate(parts)], where))
    return SeriesFile(path, series, labels if has_labels else None, classes)


def _read_tsv(path: Path, text: str, preprocess: dict | None) -> SeriesFile:
    series, labels = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        label, sep, values = line.replace(",", "\t").partition("\t")
        if not sep:
            raise LnnInputError(f"{path}: line {number}: a .tsv line holds the class label, then the values")
        labels.append(_label_text(label))
        where = f"{path}: line {number}"
        series.append(clean_series([_numbers(values, "\t", f"{where}, channel 1", value_range(preprocess, 0))], where))
    return SeriesFile(path, series, labels, None)


def _label_text(cell: str) -> str:
    """A class label as text: '1.0' and '1' are the same class in the archive's numeric labels."""
    cell = cell.strip()
    try:
        value = float(cell)
    except ValueError:
        return cell
    return str(int(value)) if math.isfinite(value) and value == int(value) else cell


def _read_arff(path: Path, text: str, preprocess: dict | None) -> SeriesFile:
    attributes, relational, data_at = [], False, None
    lines = text.splitlines()
    depth = 0
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        lower = stripped.lower()
        if not stripped or stripped.startswith("%"):
            continue
        if lower.startswith("@data"):
            data_at = number
            break
        if lower.startswith("@attribute"):
            if depth == 0:
                attributes.append(stripped)
            if "relational" in lower.split():
                relational, depth = True, depth + 1
        elif lower.startswith("@end"):
            depth -= 1
    if data_at is None or not attributes:
        raise LnnInputError(f"{path}: no @attribute and @data lines (not an .arff file)")
    last = attributes[-1]
    classes = None
    if "{" in last and last.rstrip().endswith("}"):
        classes = [c.strip().strip("'\"") for c in last[last.index("{") + 1:last.rindex("}")].split(",")]
    series, labels = [], []
    for number, line in enumerate(lines[data_at:], data_at + 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("%"):
            continue
        where = f"{path}: line {number}"
        if relational:
            quote = stripped[0]
            end = stripped.rfind(quote)
            if quote not in "'\"" or end <= 0:
                raise LnnInputError(f"{where}: a relational value is quoted: 'c1 values\\nc2 values',label")
            body, rest = stripped[1:end], stripped[end + 1:].lstrip(",")
            channels = body.replace("\\n", "\n").split("\n")
        else:
            cells = stripped.split(",")
            channels, rest = [",".join(cells[:-1])], cells[-1]
        if classes is not None:
            labels.append(rest.strip().strip("'\""))
        series.append(clean_series([_numbers(ch, ",", f"{where}, channel {c + 1}", value_range(preprocess, c))
                                    for c, ch in enumerate(channels)], where))
    return SeriesFile(path, series, labels if classes is not None else None, classes)


READERS = {".ts": _read_ts, ".tsv": _read_tsv, ".arff": _read_arff}


def read_series_file(path, preprocess: dict | None = None) -> SeriesFile:
    """A .ts, .tsv or .arff file of series (see the module doc); an empty or mixed-channel file is refused.
    `preprocess`: the model's (lnn-infer), whose standardisation must keep every value within float32's range."""
    path = Path(path)
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise LnnInputError(f"{path}: not a series file ({', '.join(SERIES_SUFFIXES)})")
    result = reader(path, read_text(path, "series file"), preprocess)
    if not result.series:
        raise LnnInputError(f"{path}: holds no series")
    channels = {s.shape[0] for s in result.series}
    if len(channels) > 1:
        raise LnnInputError(f"{path}: its series have different channel counts ({', '.join(map(str, sorted(channels)))})")
    if result.classes is not None and result.labels is not None:
        unknown = sorted(set(result.labels) - set(result.classes))
        if unknown:
            raise LnnInputError(f"{path}: class {unknown[0]!r} is not among the declared classes "
                                f"({', '.join(result.classes)})")
    return result


def _csv_rows(path: Path, text: str):
    """(line number, cells) of each CSV row; a cell over the csv module's field size limit is an LnnInputError
    naming the line."""
    import csv            # only for a table: not on every start

    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        for row in reader:
            yield reader.line_num, row
    except csv.Error:     # the default dialect's only error: a cell over the limit
        raise LnnInputError(f"{path}: line {reader.line_num}: a cell is longer than the csv module's limit of "
                            f"{csv.field_size_limit():,} characters") from None


COLUMNS_LISTED = 12             # column names an error line lists before saying how many more
NAME_SHOWN = 40                 # characters of each


def listed(names: list) -> str:
    """Column names for an error line: the first COLUMNS_LISTED (each cut at NAME_SHOWN characters), then how many
    more (a header of 2,000,000 columns made a line of 20 MB)."""
    shown = ", ".join(name if len(name) <= NAME_SHOWN else name[:NAME_SHOWN] + "..." for name in names[:COLUMNS_LISTED])
    return shown + (f", ... and {len(names) - COLUMNS_LISTED:,} more" if len(names) > COLUMNS_LISTED else "")


def read_table(path, target: str | None = None, columns: list | None = None, preprocess: dict | None = None) -> Table:
    """A CSV table with a header row (see the module doc). `target`: the class column, kept as text;
    `columns`: read only these feature columns, in this order (lnn-infer: a model's columns; any other column,
    such as the class, is left unread), else every column but the target. `preprocess`: the model's (lnn-infer;
    its mean and std in `columns`' order), whose standardisation must keep every value within float32's range."""
    path = Path(path)
    rows = _csv_rows(path, read_text(path, "CSV table"))
    _, header = next(rows, (1, []))
    if not header or not any(cell.strip() for cell in header):
        raise LnnInputError(f"{path}: the CSV table is empty (it needs a header row naming the columns)")
    names = [cell.strip() for cell in header]
    # Each name's index, so that every check below is one look-up a name: scanning the names before each one
    # took 34 s for a header of 80,000 columns, and a 2,000,000-column file was never answered.
    column_at = {}
    for i, name in enumerate(names):
        if not name:
            raise LnnInputError(f"{path}: line 1, column {i + 1}: the header names no column")
        if column_at.setdefault(name, i) != i:
            raise LnnInputError(f"{path}: line 1: column {name!r} appears twice")
    if target is not None and target not in column_at:
        raise LnnInputError(f"{path}: no column {target!r} (columns: {listed(names)})")
    target_at = column_at[target] if target is not None else None
    if columns is not None:
        missing = [name for name in columns if name not in column_at]
        if missing:
            raise LnnInputError(f"{path}: no column {missing[0]!r}, which the model takes (its columns: "
                                f"{listed(columns)})")
        features = [column_at[name] for name in columns]
    else:
        features = [i for i in range(len(names)) if i != target_at]
    if not features:
        raise LnnInputError(f"{path}: no feature column besides the target {target!r}")
    bounds = [value_range(preprocess, j) for j in range(len(features))]       # per column, not per cell
    values, labels = [], []
    for line, row in rows:
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(names):
            raise LnnInputError(f"{path}: line {line} has {len(row)} cells, the header has {len(names)} columns")
        numbers = []
        for j, i in enumerate(features):
            cell = row[i].strip()
            where = f"{path}: line {line}, column {names[i]!r}"
            if not cell:
                raise LnnInputError(f"{where}: missing value (the cell is empty)")
            numbers.append(_finite_number(cell, where, bounds[j]))
        values.append(numbers)
        if target_at is not None:
            label = row[target_at].strip()
            if not label:
                raise LnnInputError(f"{path}: line {line}, column {target!r}: missing class label")
            labels.append(_label_text(label))
    if not values:
        raise LnnInputError(f"{path}: the CSV table has a header but no rows")
    return Table(path, [names[i] for i in features], np.array(values, np.float64), labels if target else None)


# --------------------------------------------------------------------------- preprocessing

def resample(series: np.ndarray, length: int) -> np.ndarray:
    """[C, T_i] -> [C, length] by linear interpolation over the same time span (unchanged when T_i = length)."""
    series = np.asarray(series, np.float64)
    if series.shape[1] == length:
        return series
    if series.shape[1] == 1:
        return np.repeat(series, length, axis=1)
    positions = np.linspace(0, series.shape[1] - 1, length)
    return np.stack([np.interp(positions, np.arange(series.shape[1]), channel) for channel in series])


def fit_length(series: np.ndarray, length: int, how: str = "linear") -> np.ndarray:
    """[C, T_i] -> [C, length] as formats/model.py SERIES_FITS says: "linear" resamples; "pad_mean" pads a
    shorter series at its end with its own mean per channel, so time keeps its scale (a longer one is resampled)."""
    series = np.asarray(series, np.float64)
    if how == "pad_mean" and series.shape[1] < length:
        fill = np.repeat(series.mean(axis=1, keepdims=True), length - series.shape[1], axis=1)
        return np.concatenate([series, fill], axis=1)
    return resample(series, length)


def stack_series(series: list, length: int, how: str = "linear") -> np.ndarray:
    """Series [C, T_i] -> [N, C, length] float32, each brought to `length` by fit_length; at most
    16 x MAX_INPUT_ELEMENTS values (1 GiB) at once."""
    channels = series[0].shape[0]
    if len(series) * channels * length > MAX_INPUT_ELEMENTS * 16:
        raise LnnInputError(f"{len(series):,} series of {channels} x {length} values are too many to hold at once "
                            f"(16 x MAX_INPUT_ELEMENTS in lnn/formats/limits.py)")
    out = np.empty((len(series), channels, length), np.float32)
    for row, values in enumerate(series):
        out[row] = fit_length(values, length, how)
    return out


def fit_standardize(values: np.ndarray) -> tuple:
    """Training values [N, C, T] (per channel) or [N, F] (per column) -> (mean, std) lists; a constant
    channel gets std 1 (it carries no information, and dividing by 0 would make it infinite)."""
    axes = (0, 2) if values.ndim == 3 else (0,)
    mean = values.mean(axis=axes, dtype=np.float64)
    std = values.std(axis=axes, dtype=np.float64)
    std = np.where(std > 1e-12 * np.maximum(1.0, np.abs(mean)), std, 1.0)
    return [float(v) for v in mean], [float(v) for v in std]


def standardize(values: np.ndarray, preprocess: dict) -> np.ndarray:
    """[N, C, T] or [N, F] raw values (already of the model's length) -> float32 model inputs, (x - mean) / std;
    a value that this takes beyond float32's range is an LnnInputError naming its series or row."""
    shape = (1, -1, 1) if values.ndim == 3 else (1, -1)
    mean = np.asarray(preprocess["mean"], np.float64).reshape(shape)
    std = np.asarray(preprocess["std"], np.float64).reshape(shape)
    out = (values - mean) / std
    beyond = np.argwhere(np.abs(out) > FLOAT32_MAX)
    if len(beyond):
        at = tuple(beyond[0])
        row, column = ("series", "channel") if values.ndim == 3 else ("row", "column")
        raise LnnInputError(f"{row} {at[0] + 1}, {column} {at[1] + 1}: {values[at]:.6g} overflows float32 after the model's standardisation "
                            f"(x - mean) / std")
    return out.astype(np.float32)


def check_raw(values, model, what: str = "the input") -> np.ndarray:
    """An array given to a series or table model: numbers, finite -> float64."""
    try:
        array = np.asarray(values)
    except ValueError:                  # nested lists of different lengths
        raise LnnInputError(f"{what}: rows or series of different lengths in one array; give series of different "
                            f"lengths as a list of arrays, each [C, T] (or [T] for a one-channel model)") from None
    if array.dtype.kind not in "iuf" or array.size == 0:
        raise LnnInputError(f"{what}: must be a non-empty array of numbers, not {array.dtype} of shape {list(array.shape)}")
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise LnnInputError(f"{what}: holds NaN or infinity")
    if (np.abs(array) > FLOAT32_MAX).any():
        raise LnnInputError(f"{what}: {array[np.abs(array) > FLOAT32_MAX][0]:.6g} is beyond float32's range "
                            f"(±{FLOAT32_MAX:.4g}), in which the model computes")
    return array


def is_series_list(values, model) -> bool:
    """Whether `values` is a list of series for a series model, each [C, T_i] or, for a one-channel model, [T_i]
    (lengths may differ): a batch. A list of numbers is one series [T]."""
    if len(model.input_shape) != 2 or not isinstance(values, list) or not values:
        return False
    try:
        ranks = {np.ndim(v) for v in values}
    except ValueError:                  # an item of ragged nested lists: check_raw names it
        return False
    return ranks == {2} or (ranks == {1} and model.input_shape[0] == 1)


def model_inputs(model, values) -> np.ndarray:
    """Raw values for a series model ([T] univariate, [C, T'] or [N, C, T'] with any length T', or a list
    of [C, T_i] or univariate [T_i] series of different lengths) or a table model ([F] or [N, F]) ->
    [N, *input_shape] float32 with the model's preprocessing."""
    rank = len(model.input_shape)
    if is_series_list(values, model):
        return np.concatenate([model_inputs(model, v) for v in values])
    array = check_raw(values, model)
    if rank == 2 and array.ndim == 1 and model.input_shape[0] == 1:
        array = array[None]                      # a univariate series [T] is [1, T]
    if array.ndim == rank:
        array = array[None]
    if array.ndim != rank + 1 or array.shape[1] != model.input_shape[0]:
        kind = "a series [C, T] or a batch [N, C, T]" if rank == 2 else "a row [F] or rows [N, F]"
        raise LnnInputError(f"model {model.name!r} takes {kind} with {'C' if rank == 2 else 'F'} = "
                            f"{model.input_shape[0]}; got shape {list(np.shape(values))}")
    if rank == 2:
        array = stack_series(list(array), model.input_shape[1], (model.preprocess or {}).get("resample", "linear"))
    if model.preprocess is None:
        return array.astype(np.float32)
    return standardize(array, model.preprocess)
