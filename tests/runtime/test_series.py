"""Series and table readers (runtime/series.py), the series/table preprocessing and its .bin round trip."""

import warnings

import numpy as np
import pytest

import lnn
from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes, write_bin
from lnn.formats.errors import LnnFormatError, LnnInputError, ModelSpecError
from lnn.formats.model import parse_model
from lnn.runtime.series import (fit_length, fit_standardize, model_inputs, read_series_file, read_table, resample,
                                standardize)
from lnn.tests.formats.test_binfile import refresh_crcs

TS_MULTI = """# two channels, unequal lengths
@problemName Toy
@timeStamps false
@missing true
@univariate false
@dimensions 2
@equalLength false
@classLabel true up down
@data
1,2,3,4:10,20,30,40:up
4,?,2:40,30,20:down
"""

ARFF_MULTI = """@relation Toy
@attribute relationalAtt relational
  @attribute t1 numeric
  @attribute t2 numeric
  @attribute t3 numeric
@end relationalAtt
@attribute classAttribute {up,down}
@data
'1,2,3\\n10,20,30',up
"3,2,1\\n30,20,10",down
"""

ARFF_UNI = """@relation Toy
@attribute t1 numeric
@attribute t2 numeric
@attribute t3 numeric
@attribute target {a,b}
@data
1,2,3,a
3,2,1,b
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_ts_multivariate_unequal_lengths_and_missing_values(tmp_path):
    data = read_series_file(write(tmp_path, "Toy_TRAIN.ts", TS_MULTI))
    assert data.classes == ["up", "down"] and data.labels == ["up", "down"]
    np.testing.assert_array_equal(data.series[0], [[1, 2, 3, 4], [10, 20, 30, 40]])
    np.testing.assert_array_equal(data.series[1], [[4, 3, 2], [40, 30, 20]])     # '?' interpolated


def test_tsv_trailing_nan_is_padding_and_labels_are_text(tmp_path):
    data = read_series_file(write(tmp_path, "Toy_TRAIN.tsv", "1\t0.5\t1.5\t2.5\n2.0\t3\t4\tNaN\n"))
    assert data.labels == ["1", "2"]
    assert [s.shape for s in data.series] == [(1, 3), (1, 2)]


def test_arff_univariate_and_multivariate_agree_with_ts(tmp_path):
    uni = read_series_file(write(tmp_path, "Toy_TRAIN.arff", ARFF_UNI))
    assert uni.classes == ["a", "b"] and uni.labels == ["a", "b"]
    np.testing.assert_array_equal(uni.series[1], [[3, 2, 1]])
    multi = read_series_file(write(tmp_path, "Multi_TRAIN.arff", ARFF_MULTI))
    assert multi.labels == ["up", "down"]
    np.testing.assert_array_equal(multi.series[1], [[3, 2, 1], [30, 20, 10]])


@pytest.mark.parametrize("name, text, fragments", [
    ("a.ts", "@classLabel true a b\n@data\n1,2,x:a\n", ["line 3", "channel 1", "value 3", "'x'"]),
    ("a.ts", "@classLabel true a b\n@data\n1,2,3:c\n", ["class 'c'", "a, b"]),
    ("a.ts", "@classLabel true a\n@data\n1,2,3:1,2:a\n", ["line 3", "different lengths"]),
    ("a.ts", "1,2,3:a\n", ["line 1", "@data"]),
    ("a.ts", "@classLabel true a\n@data\n1,inf,3:a\n", ["value 2", "not a finite number"]),
    ("a.ts", "@classLabel true a\n@data\n1,2:1,-1e39:a\n", ["line 3, channel 2, value 2: '-1e39' is beyond float32's range"]),
    ("a.tsv", "1\t2\t1e308\n", ["line 1, channel 1, value 2: '1e308' is beyond float32's range"]),
    ("a.tsv", "1\t?\t?\n", ["line 1", "channel 1 holds no value"]),
    ("a.arff", "@relation x\n@data\n1,2\n", ["not an .arff"]),
    ("a.txt", "1,2\n", ["not a series file"]),
])
def test_series_file_errors_name_the_line_and_channel(tmp_path, name, text, fragments):
    with pytest.raises(LnnInputError) as err:
        read_series_file(write(tmp_path, name, text))
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_table_reads_numbers_and_keeps_the_target_as_text(tmp_path):
    table = read_table(write(tmp_path, "t.csv", "a,b,label\n1,2.5,x\n-3,4e2,7\n"), "label")
    assert table.columns == ["a", "b"] and table.labels == ["x", "7"]
    np.testing.assert_array_equal(table.values, [[1, 2.5], [-3, 400]])
    only = read_table(write(tmp_path, "u.csv", "label,b,a\nx,2,1\n"), columns=["a", "b"])
    np.testing.assert_array_equal(only.values, [[1, 2]])                   # in the order asked, label unread


@pytest.mark.parametrize("text, fragments", [
    ("a,b,y\n1,,x\n", ["line 2", "column 'b'", "missing value"]),
    ("a,b,y\n1,2,x\n1,abc,x\n", ["line 3", "column 'b'", "'abc' is not a number"]),
    ("a,b,y\n1,2,x\n1,2\n", ["line 3", "2 cells", "3 columns"]),
    ("a,b,y\n1,nan,x\n", ["line 2", "column 'b'", "not a finite number"]),
    ("a,b,y\ninf,1,x\n", ["line 2", "column 'a'", "not a finite number"]),
    ("a,b,y\n1,-1e300,x\n", ["line 2, column 'b': '-1e300' is beyond float32's range"]),
    ("a,b,y\n1,5_5,x\n", ["line 2, column 'b': '5_5' is not a number written with the digits 0-9"]),
    ("a,b,y\n\u0665\u0665,1,x\n", ["line 2, column 'a'", "not a number written with the digits 0-9"]),
    ("a,b,y\n1,2,\n", ["line 2", "column 'y'", "missing class label"]),
    ("a,a,y\n1,2,x\n", ["column 'a' appears twice"]),
    ("a,b,z\n1,2,x\n", ["no column 'y'"]),
    ("", ["empty"]),
])
def test_table_errors_name_the_line_and_column(tmp_path, text, fragments):
    with pytest.raises(LnnInputError) as err:
        read_table(write(tmp_path, "t.csv", text), "y")
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_a_cell_over_the_csv_limit_is_one_line_naming_the_line(tmp_path):
    path = write(tmp_path, "t.csv", "a,b\n1,2\n3," + "9" * 200_000 + "\n")
    with pytest.raises(LnnInputError) as err:
        read_table(path)
    assert str(err.value) == f"{path}: line 3: a cell is longer than the csv module's limit of 131,072 characters"


def test_a_table_of_many_columns_is_read_in_time_linear_in_its_columns(tmp_path):
    """Each header name was looked for among those before it (and each model column among all of them): 80,000
    columns took 34 s, 2,000,000 were never answered. 50,000 are read, or their repeated name refused, at once."""
    import time

    names = [f"c{i}" for i in range(50_000)]
    wide = write(tmp_path, "wide.csv", ",".join(names) + "\n" + ",".join(map(str, range(len(names)))) + "\n")
    repeated = write(tmp_path, "repeated.csv", ",".join(names + ["c0"]) + "\n")
    start = time.perf_counter()
    table = read_table(wide, columns=names[::-1])                    # a model's columns, in its own order
    with pytest.raises(LnnInputError, match="line 1: column 'c0' appears twice"):
        read_table(repeated)
    assert time.perf_counter() - start < 2
    np.testing.assert_array_equal(table.values, [np.arange(len(names))[::-1]])
    with pytest.raises(LnnInputError) as err:                        # the columns listed: a few, not 50,000
        read_table(wide, target="class")
    assert str(err.value).endswith("(columns: c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, ... and 49,988 more)")


def test_values_beyond_float32_after_the_models_standardisation_are_one_line_without_warnings(tmp_path):
    """A value finite in float64 but beyond float32, before or after the model's (x - mean) / std, is refused
    with its line and channel or column by the readers, and by its place in an array given to a Session."""
    series_pre = {"mean": [0.0, 1.0], "std": [1.0, 0.5]}
    ts = write(tmp_path, "a.ts", "@classLabel true a\n@data\n1,2:3e38,4:a\n")
    table = write(tmp_path, "t.csv", "a,b\n1,2\n3,3e38\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_series_file(ts).series[0][1, 0] == np.float32(3e38)            # without the model: in range
        with pytest.raises(LnnInputError) as err:
            read_series_file(ts, series_pre)
        assert str(err.value) == (f"{ts}: line 3, channel 2, value 1: '3e38' overflows float32 after the model's "
                                  f"standardisation (x - mean) / std")
        with pytest.raises(LnnInputError) as err:
            read_table(table, columns=["a", "b"], preprocess={"columns": ["a", "b"], **series_pre})
        assert str(err.value) == (f"{table}: line 3, column 'b': '3e38' overflows float32 after the model's "
                                  f"standardisation (x - mean) / std")
        model = parse_model(series_description())
        with pytest.raises(LnnInputError) as err:
            model_inputs(model, np.full((2, 8), 1e300))
        assert str(err.value) == "the input: 1e+300 is beyond float32's range (±3.403e+38), in which the model computes"
        with pytest.raises(LnnInputError) as err:
            model_inputs(model, np.stack([np.zeros(8), np.full(8, -3e38)]))
        assert str(err.value) == ("series 1, channel 2: -3e+38 overflows float32 after the model's standardisation "
                                  "(x - mean) / std")


def test_resample_keeps_the_time_span():
    x = np.array([[0.0, 1.0, 2.0]])
    np.testing.assert_allclose(resample(x, 5), [[0, 0.5, 1, 1.5, 2]])
    assert resample(x, 3) is not None and np.array_equal(resample(x, 3), x)


def test_pad_mean_keeps_time_and_pads_with_the_series_mean():
    x = np.array([[0.0, 1.0, 5.0], [5.0, 4.0, 3.0]])
    np.testing.assert_array_equal(fit_length(x, 5, "pad_mean"), [[0, 1, 5, 2, 2], [5, 4, 3, 4, 4]])
    np.testing.assert_array_equal(fit_length(x, 3, "pad_mean"), x)
    np.testing.assert_allclose(fit_length(x, 2, "pad_mean"), resample(x, 2))                 # longer: resampled
    np.testing.assert_allclose(fit_length(x, 5, "linear"), resample(x, 5))


def test_standardize_per_channel_and_a_constant_channel():
    rng = np.random.default_rng(0)
    x = rng.normal([[3.0], [-1.0]], [[2.0], [0.5]], size=(50, 2, 30))
    x[:, 1] = 7.0                                                           # constant channel
    mean, std = fit_standardize(x)
    np.testing.assert_allclose(mean, [x[:, 0].mean(), 7.0])
    assert std[1] == 1.0 and std[0] == pytest.approx(x[:, 0].std())
    z = standardize(x, {"mean": mean, "std": std})
    assert z.dtype == np.float32 and abs(z[:, 0].mean()) < 1e-5 and abs(z[:, 0].std() - 1) < 1e-4


def series_description(length=8, channels=2, classes=3):
    return {"name": "tiny_series", "input_shape": [channels, length],
            "layers": [{"type": "flatten"}, {"type": "linear", "out_features": classes}],
            "labels": [{"name": f"c{i}", "display": f"c{i}"} for i in range(classes)],
            "preprocess": {"kind": "series", "length": length, "resample": "linear",
                           "mean": [1.5, -2.0][:channels], "std": [2.0, 0.5][:channels]}}


def test_a_one_channel_model_takes_a_list_of_plain_series_of_any_lengths(tmp_path):
    """[T_i] items of a list are one-channel series (a batch, as [1, T_i] items are); a list of numbers is one
    series; ragged nested lists are one LnnInputError line, not NumPy's ValueError."""
    model = parse_model(series_description(channels=1))
    rng = np.random.default_rng(2)
    weights = {"linear_1.weight": rng.normal(size=(3, 8)).astype(np.float32),
               "linear_1.bias": rng.normal(size=3).astype(np.float32)}
    write_bin(tmp_path / "m.bin", model, weights)
    session = lnn.load(tmp_path / "m.bin", device="numpy")
    long, short = rng.normal(size=12), rng.normal(size=5)
    one_by_one = [session.predict_series(v) for v in (long, short, long)]
    for batch in ([long, short, long], [long[None], short[None], long[None]], [list(long), list(short), list(long)]):
        answers = session.predict_series(batch)
        assert len(answers) == 3
        for answer, alone in zip(answers, one_by_one):
            assert [label for label, _ in answer] == [label for label, _ in alone]
            np.testing.assert_allclose([p for _, p in answer], [p for _, p in alone], rtol=1e-5)
    np.testing.assert_array_equal(session.prepare_series([long, long]), session.prepare_series(np.stack([long, long])[:, None]))
    assert session.predict_series(list(long)) == one_by_one[0]                      # a list of numbers: one series
    with pytest.raises(LnnInputError, match="different lengths in one array"):
        session.prepare_series([[list(long), list(short)]])
    two_channels = lnn.load(_two_channel_bin(tmp_path), device="numpy")
    with pytest.raises(LnnInputError, match=r"each \[C, T\]"):          # not one-channel series: no list of [T_i]
        two_channels.prepare_series([long, short])


def _two_channel_bin(tmp_path):
    rng = np.random.default_rng(3)
    write_bin(tmp_path / "two.bin", parse_model(series_description()),
              {"linear_1.weight": rng.normal(size=(3, 16)).astype(np.float32),
               "linear_1.bias": rng.normal(size=3).astype(np.float32)})
    return tmp_path / "two.bin"


def test_series_preprocessing_round_trips_through_the_bin_and_is_applied(tmp_path):
    model = parse_model(series_description())
    rng = np.random.default_rng(1)
    weights = {"linear_1.weight": rng.normal(size=(3, 16)).astype(np.float32),
               "linear_1.bias": rng.normal(size=3).astype(np.float32)}
    write_bin(tmp_path / "m.bin", model, weights)
    session = lnn.load(tmp_path / "m.bin", device="numpy")
    assert session.metadata["preprocess"] == model.preprocess
    raw = rng.normal(size=(2, 12))                                          # another length: resampled to 8
    expected_x = ((resample(raw, 8) - np.array([[1.5], [-2.0]])) / np.array([[2.0], [0.5]])).astype(np.float32)
    np.testing.assert_allclose(session.prepare_series(raw)[0], expected_x, rtol=1e-6)
    logits = expected_x.reshape(-1) @ weights["linear_1.weight"].T + weights["linear_1.bias"]
    prediction = session.predict_series(raw)
    assert prediction[0][0] == f"c{int(np.argmax(logits))}"
    assert len(session.predict_series([raw, raw[:, :5]])) == 2              # a list of unequal lengths
    padded = parse_model(series_description() | {"preprocess": {**series_description()["preprocess"],
                                                                 "resample": "pad_mean"}})
    write_bin(tmp_path / "padded.bin", padded, weights)
    short = raw[:, :5]                                                      # shorter: padded with its mean
    expected_x = ((fit_length(short, 8, "pad_mean") - np.array([[1.5], [-2.0]])) / np.array([[2.0], [0.5]]))
    np.testing.assert_allclose(lnn.load(tmp_path / "padded.bin", device="numpy").prepare_series(short)[0],
                               expected_x.astype(np.float32), rtol=1e-6)


def test_table_preprocessing_round_trip_and_column_names():
    desc = {"name": "tiny_table", "input_shape": [2], "layers": [{"type": "linear", "out_features": 2}],
            "preprocess": {"kind": "table", "columns": ["a", "b"], "mean": [1, 2], "std": [1, 4]}}
    model = parse_model(desc)
    weights = {"linear_0.weight": np.eye(2, dtype=np.float32), "linear_0.bias": np.zeros(2, np.float32)}
    data = encode_bin(model, weights, build_metadata(model))
    back = parse_bin_bytes(data, "m.bin")
    assert back.metadata["preprocess"] == model.preprocess == {**desc["preprocess"], "mean": [1.0, 2.0],
                                                                "std": [1.0, 4.0]}
    np.testing.assert_allclose(model_inputs(back.model, [3.0, 10.0]), [[2.0, 2.0]])


def test_a_series_model_without_preprocessing_stays_valid():
    desc = series_description()
    del desc["preprocess"]
    model = parse_model(desc)
    assert model.preprocess is None
    weights = {"linear_1.weight": np.ones((3, 16), np.float32), "linear_1.bias": np.zeros(3, np.float32)}
    data = encode_bin(model, weights, build_metadata(model))
    assert parse_bin_bytes(data, "old.bin").metadata["preprocess"] is None


@pytest.mark.parametrize("change, fragment", [
    ({"length": 9}, "length must be the input length 8"),
    ({"resample": "nearest"}, "resample must be"),
    ({"std": [1.0, 0.0]}, "std values must be positive"),
    ({"mean": [1.0]}, "mean must be a list of 2 numbers that float32 holds"),
    ({"kind": "table"}, "a series model's preprocessing is"),
    ({"color": "rgb"}, "a series model's preprocessing is"),
])
def test_bad_series_preprocessing_is_one_line(change, fragment):
    desc = series_description()
    desc["preprocess"] = {**desc["preprocess"], **change}
    with pytest.raises(ModelSpecError, match=fragment):
        parse_model(desc)


def test_a_bin_with_damaged_series_preprocessing_is_refused():
    model = parse_model(series_description())
    weights = {"linear_1.weight": np.ones((3, 16), np.float32), "linear_1.bias": np.zeros(3, np.float32)}
    data = encode_bin(model, weights, build_metadata(model))
    damaged = refresh_crcs(data.replace(b'"std":[2.0,0.5]', b'"std":[2.0,0.0]'))     # same length
    with pytest.raises(LnnFormatError, match="metadata: preprocess: std values must be positive"):
        parse_bin_bytes(damaged, "bad.bin")


def test_session_refuses_bad_raw_values():
    model = parse_model(series_description())
    with pytest.raises(LnnInputError, match="NaN or infinity"):
        model_inputs(model, np.array([[1.0, np.nan], [1.0, 2.0]]))
    with pytest.raises(LnnInputError, match="C = 2"):
        model_inputs(model, np.zeros((3, 8)))
    with pytest.raises(LnnInputError, match="array of numbers"):
        model_inputs(model, np.array([["a", "b"], ["c", "d"]]))
