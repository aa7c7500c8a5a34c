"""lnn.load / Session: input checks, probabilities, image prediction, unavailable backends."""

import numpy as np
import pytest

import lnn
from conftest import EXAMPLES, prepared_photos
from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes
from lnn.formats.model import parse_model
from lnn.runtime import Session, backend_class

rng = np.random.default_rng(0)


def tiny_session(last_activation=None, device="numpy") -> Session:
    model = parse_model({"name": "tiny", "input_shape": [3, 8, 8], "labels": ["cat", "dog", "late_blight"],
                         "layers": [{"type": "conv2d", "name": "c", "out_channels": 4, "kernel_size": 3, "activation": "relu"},
                                    {"type": "global_avg_pool"},
                                    {"type": "linear", "name": "fc", "out_features": 3, "activation": last_activation}]})
    weights = {k: rng.standard_normal(s).astype(np.float32) for k, s in model.param_shapes().items()}
    return Session(parse_bin_bytes(encode_bin(model, weights, build_metadata(model))), device)


def measured_on_the_backend(session: Session, monkeypatch, on_device: bool = True) -> Session:
    """The session on the cuda backend's plans run by NumPy; on_device: its checks take each input's lowest and
    highest value from the backend's uploaded input (run_measured) once the batch has run, as on a GPU for a large
    batch (else as the backend chooses: from the host's batch before it runs, below DEVICE_EXTREMES_FROM_BYTES)."""
    from lnn.runtime.cuda import backend
    from lnn.runtime.cuda.backend import CudaBackend

    if on_device:
        monkeypatch.setattr(backend, "DEVICE_EXTREMES_FROM_BYTES", 0)
    keep = (session.feature,) if session.feature else ()
    session.backend = CudaBackend(session.model, session.bin.weights_fp32(), keep=keep, array_module=np)
    assert hasattr(session.backend, "run_measured")
    return session


def test_run_checks_the_batch_shape():
    session = tiny_session()
    with pytest.raises(lnn.LnnInputError, match=r"expected a batch of shape \[N, 3, 8, 8\], got \[3, 8, 8\]"):
        session.run(np.zeros((3, 8, 8), np.float32))
    with pytest.raises(lnn.LnnInputError, match="empty"):
        session.run(np.zeros((0, 3, 8, 8), np.float32))
    for odd in (np.full((1, 3, 8, 8), "x"), np.zeros((1, 3, 8, 8), complex), np.zeros((1, 3, 8, 8), bool)):
        with pytest.raises(lnn.LnnInputError, match=f"^a batch must hold numbers .*, not {odd.dtype}$"):
            session.run(odd)


@pytest.mark.parametrize("measured", [False, True])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # NaN through the NumPy plan
def test_run_refuses_nan_infinity_and_ragged_rows_naming_the_input(measured, monkeypatch):
    """The backends differ on NaN (the cpu kernels' ReLU makes it 0), so neither sees one: one line naming it."""
    session = measured_on_the_backend(tiny_session(), monkeypatch) if measured else tiny_session()
    x = rng.standard_normal((3, 3, 8, 8)).astype(np.float32)
    for bad, value in ((1, np.nan), (2, np.inf), (0, 1e39)):       # 1e39: beyond float32 once converted
        y = x.astype(np.float64)
        y[bad, 1, 2, 3] = value
        with pytest.raises(lnn.LnnInputError, match=f"^input {bad} of the batch holds NaN or infinity"):
            session.run(y)
        with pytest.raises(lnn.LnnInputError, match=f"^input {bad} of the batch holds NaN or infinity"):
            session.judge(y)
    with pytest.raises(lnn.LnnInputError, match="rows here differ in length"):
        session.run([[1.0, 2.0], [3.0]])


@pytest.mark.parametrize("measured", [False, True])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # NaN through the NumPy plan
def test_predict_and_judge_refuse_nan_and_infinity_as_run_does_before_the_prepared_range(measured, monkeypatch):
    """predict and judge of an image model find NaN and infinity in each input's lowest and highest value per
    channel (what the prepared-range check takes; NaN propagates through min and max, an infinity is a bound):
    each is the line run gives, naming the first such input, even when another input is out of range; a model
    that takes no images checks every value."""
    session = measured_on_the_backend(tiny_session(), monkeypatch) if measured else tiny_session()
    assert session.prepared_range is not None
    x = prepared_photos(session.model, 4)
    finite_line = r"^input {} of the batch holds NaN or infinity \(or a value beyond float32's range\)$"
    for bad, value in ((1, np.nan), (2, np.inf), (3, -np.inf), (0, 1e39), (1, -1e39)):   # 1e39: inf as float32
        for where in ((0, 0, 0), (2, 7, 7)):
            y = x.astype(np.float64)
            y[bad][where] = value
            for call in (session.run, session.predict, session.judge):
                with pytest.raises(lnn.LnnInputError, match=finite_line.format(bad)):
                    call(y)
            other = 0 if bad else 3
            y[other] = x[other] * 1000                             # another input out of range (before or after)
            for call in (session.predict, session.judge):
                with pytest.raises(lnn.LnnInputError, match=finite_line.format(bad)):
                    call(y)
    y = x.copy()
    y[2] = x[2] * 1000
    y[3, 1] = np.nan                                                  # a whole channel NaN
    y[3, 0] = np.inf
    for call in (session.predict, session.judge):
        with pytest.raises(lnn.LnnInputError, match=finite_line.format(3)):
            call(y)
        with pytest.raises(lnn.LnnInputError, match=r"^input 2 is not a photo prepared for this model: its channel "):
            call(y[:3])
    rows = Session(parse_bin_bytes(encode_bin(*table_model(), build_metadata(table_model()[0]))), "numpy")
    rows = measured_on_the_backend(rows, monkeypatch) if measured else rows
    assert rows.prepared_range is None
    z = rng.standard_normal((3, 4)) * 1000
    for value in (np.nan, np.inf, -np.inf):
        z[1, 2] = value
        for call in (rows.run, rows.predict, rows.judge):
            with pytest.raises(lnn.LnnInputError, match=finite_line.format(1)):
                call(z)


def table_model():
    model = parse_model({"name": "rows", "input_shape": [4], "labels": ["a", "b"],
                         "layers": [{"type": "linear", "name": "fc", "out_features": 2}]})
    return model, {k: rng.standard_normal(s).astype(np.float32) for k, s in model.param_shapes().items()}


@pytest.mark.parametrize("device", ["numpy", "cpu"])
def test_a_large_batch_runs_in_chunks_with_the_answers_of_one_call(device):
    """A batch over RUN_CHUNK is computed a chunk at a time (bounded memory: the cpu backend keeps plans of the
    chunk sizes only), with each input's answer as it is alone."""
    from lnn.runtime import RUN_CHUNK

    if device == "cpu":
        pytest.importorskip("numba")
    session = tiny_session(device=device)
    count = 2 * RUN_CHUNK[device] + 5
    x = rng.standard_normal((count, 3, 8, 8)).astype(np.float32)
    alone = np.concatenate([session.run(x[i:i + 1]) for i in range(count)])
    np.testing.assert_allclose(session.run(x), alone, rtol=1e-5, atol=1e-6)
    if device == "cpu":
        assert {key[0] for key in session.backend._plans.keys()} == {1, 5, RUN_CHUNK[device]}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # NaN through the NumPy plan
@pytest.mark.parametrize("on_device", [True, False])
def test_checks_measured_on_the_backend_take_the_whole_batch_over_its_chunks(monkeypatch, on_device):
    """On a backend that measures its own input (cuda's run_measured), a batch over RUN_CHUNK is checked whole once
    every chunk has run: the same outputs and features as the host's checks give, and the same line for the same
    input, NaN named before an input out of range in an earlier chunk, each by its index in the whole batch."""
    from lnn.runtime import RUN_CHUNK

    host = tiny_session()
    measured = measured_on_the_backend(Session(host.bin, "numpy"), monkeypatch, on_device)          # the same weights
    count = 2 * RUN_CHUNK["numpy"] + 5
    x = prepared_photos(host.model, count)
    for call in ("run", "predict"):
        np.testing.assert_allclose(getattr(measured, call)(x), getattr(host, call)(x), rtol=1e-5, atol=1e-6)
    y = x.copy()
    y[3] = x[3] * 1000                               # out of range, first chunk
    y[count - 2, 2, 1, 1] = np.nan                   # NaN, last chunk
    for session in (host, measured):
        for call in (session.predict, session.judge, session.run):
            with pytest.raises(lnn.LnnInputError, match=f"^input {count - 2} of the batch holds NaN or infinity"):
                call(y)
        y2 = y.copy()
        y2[count - 2] = x[count - 2]
        with pytest.raises(lnn.LnnInputError, match=r"^input 3 is not a photo prepared for this model"):
            session.judge(y2)
        y2[3] = x[3]
        y2[RUN_CHUNK["numpy"] + 1] = x[0] * 1000    # out of range, second chunk
        with pytest.raises(lnn.LnnInputError, match=f"^input {RUN_CHUNK['numpy'] + 1} is not a photo prepared"):
            session.predict(y2)


def test_judge_flags_what_it_cannot_answer_and_checks_its_photo_reasons():
    session = tiny_session()
    logits = np.array([[1.0, 2.0, 3.0], [np.inf, 0.0, 0.0], [np.nan, 1.0, 1.0]])
    judgement = session.judge_rules.judge(logits)
    assert judgement.reasons == [None, "low_confidence", "low_confidence"]
    x = prepared_photos(session.model, 2)
    with pytest.raises(lnn.LnnInputError, match="^photo_reasons has 1 reasons for 2 photos$"):
        session.judge(x, ["blurred"])
    with pytest.raises(lnn.LnnInputError, match="^warm_up takes a batch size of at least 1, not 0$"):
        session.warm_up(0)


def test_predict_is_softmax_of_logits_unless_the_model_ends_in_softmax():
    plain, ending_in_softmax = tiny_session(), tiny_session("softmax")
    x = prepared_photos(plain.model, 5)
    logits = plain.run(x)
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(plain.predict(x), expected, rtol=1e-5)
    np.testing.assert_allclose(ending_in_softmax.predict(x).sum(axis=1), 1, rtol=1e-5)
    assert not plain.outputs_probabilities and ending_in_softmax.outputs_probabilities


@pytest.mark.parametrize("measured", [False, True])
def test_judge_and_predict_of_an_image_model_take_only_inputs_its_preprocessing_makes(measured, monkeypatch):
    """Raw pixels, or another normalisation, got a confident answer; run takes any numbers. The bundled model's
    preprocessing (scale 1/255, ImageNet's mean and std) makes -2.118..2.249 of channel 0."""
    session = lnn.load(EXAMPLES.parent / "models" / "tomato_leaf.bin", device="numpy")
    session = measured_on_the_backend(session, monkeypatch) if measured else session
    photo = session.prepare_image(EXAMPLES / "leaves" / "late_blight.jpg")[None]
    assert session.judge(photo).reasons == [None]
    raw = photo * np.float32(0.229 * 255) + np.float32(0.485 * 255)        # 0..255 again, channel 0 at least
    message = (r"^input 1 is not a photo prepared for this model: its channel 0 runs from [\d.-]+ to [\d.]+, while "
               r"the model's preprocessing makes -2\.118 to 2\.249; give photos to predict_image, or prepare_image them$")
    for call in (session.judge, session.predict):
        with pytest.raises(lnn.LnnInputError, match=message):
            call(np.concatenate([photo, raw]))
    edge = photo * np.float32(1.04)                                          # within the 5% margin: still taken
    session.judge(edge)
    assert session.run(raw).shape == (1, 10)


def test_run_returns_a_copy_the_backend_cannot_overwrite():
    session = tiny_session()
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    first = session.run(x)
    kept = first.copy()
    session.run(-x)
    np.testing.assert_array_equal(first, kept)


def test_predict_image_ranks_display_names_best_first():
    session = tiny_session()
    image = rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)
    ranked = session.predict_image(image)
    assert [label for label, _ in ranked] == [session.labels[i]["display"] for i in np.argsort(-session.predict(session.prepare_image(image)[None])[0])]
    assert {label for label, _ in ranked} == {"Cat", "Dog", "Late blight"}
    assert abs(sum(p for _, p in ranked) - 1) < 1e-5
    assert len(session.predict_image(image, top_k=2)) == 2


def test_predict_image_rgb_arrays_match_their_bgr_twin():
    session = tiny_session()
    bgr = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
    assert session.predict_image(bgr) == session.predict_image(bgr[:, :, ::-1].copy(), color="rgb")


def test_unknown_and_unavailable_devices_are_clear():
    with pytest.raises(lnn.LnnInputError, match=r"^device must be one of auto, numpy, cpu, cuda; not 'gpu'$"):
        tiny_session(device="gpu")

    try:
        backend_class("cuda")
    except lnn.LnnError as err:
        assert "cuda backend" in str(err)
    else:
        pytest.skip("a CUDA backend is usable here")


def test_threads_is_accepted_everywhere_and_checked_once():
    source = tiny_session().bin
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(Session(source, "numpy", threads=4).run(x), Session(source, "numpy").run(x))
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(lnn.LnnInputError, match=f"^threads must be a positive whole number or 'auto', not {bad!r}$"):
            Session(source, "numpy", threads=bad)
    for huge in (1025, 10**20):
        with pytest.raises(lnn.LnnInputError, match=f"^threads must be at most 1024 .*, not {huge}$"):
            Session(source, "numpy", threads=huge)
    with pytest.raises(lnn.LnnInputError, match=r"^the numpy backend takes no option 'thread'; its options: threads$"):
        Session(source, "numpy", thread=2)
