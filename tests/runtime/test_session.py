"""lnn.load / Session: input checks, probabilities, image prediction, unavailable backends."""

import numpy as np
import pytest

import lnn
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


def test_run_checks_the_batch_shape():
    session = tiny_session()
    with pytest.raises(lnn.LnnInputError, match=r"expected a batch of shape \[N, 3, 8, 8\], got \[3, 8, 8\]"):
        session.run(np.zeros((3, 8, 8), np.float32))
    with pytest.raises(lnn.LnnInputError, match="empty"):
        session.run(np.zeros((0, 3, 8, 8), np.float32))
    for odd in (np.full((1, 3, 8, 8), "x"), np.zeros((1, 3, 8, 8), complex), np.zeros((1, 3, 8, 8), bool)):
        with pytest.raises(lnn.LnnInputError, match=f"^a batch must hold numbers .*, not {odd.dtype}$"):
            session.run(odd)


def test_predict_is_softmax_of_logits_unless_the_model_ends_in_softmax():
    plain, ending_in_softmax = tiny_session(), tiny_session("softmax")
    x = rng.standard_normal((5, 3, 8, 8)).astype(np.float32)
    logits = plain.run(x)
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(plain.predict(x), expected, rtol=1e-5)
    np.testing.assert_allclose(ending_in_softmax.predict(x).sum(axis=1), 1, rtol=1e-5)
    assert not plain.outputs_probabilities and ending_in_softmax.outputs_probabilities


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
    with pytest.raises(lnn.LnnInputError, match=r"^the numpy backend takes no option 'thread'; its options: threads$"):
        Session(source, "numpy", thread=2)
