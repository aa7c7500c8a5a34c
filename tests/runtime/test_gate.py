"""The out-of-distribution gate, calibration and photo checks as a Session applies them (lnn/runtime/gate.py).

Scores are checked against plain restatements of their formulas; the decision against the NumPy
backend's on every other backend (the CUDA case is in test_cuda_backend.py); the photo checks on the
sample leaves (PlantVillage photos: they pass) and on darkened, overexposed, blurred, tiny and
leaf-small copies of them (each caught with its reason; benchmarks/photo_checks.py measures the same on
all the tomato photos).
"""

import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import EXAMPLES, REPO, prepared_photos, runtime_devices
from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes
from lnn.formats.model import parse_model
from lnn.runtime import Session, backend_class
from lnn.runtime.gate import Prediction, energy_score, knn_score, mahalanobis_score, unit_rows
from lnn.runtime.photo_checks import DEFAULTS, check_photo
from lnn.runtime.preprocess import read_image, resize_image

sys.path.insert(0, str(REPO / "benchmarks"))
from photo_checks import box_blur, spoiled_copies  # noqa: E402  (benchmarks/photo_checks.py: the same copies)

SAMPLES = sorted((EXAMPLES / "leaves").glob("*.jpg"))
DESCRIPTION = {"name": "gated", "input_shape": [3, 16, 16], "labels": ["a", "b", "c"], "layers": [
    {"type": "conv2d", "name": "c1", "out_channels": 6, "kernel_size": 3, "padding": 1, "bias": False},
    {"type": "batchnorm", "name": "bn", "activation": "relu"},
    {"type": "maxpool2d", "kernel_size": 2},
    {"type": "conv2d", "name": "c2", "out_channels": 8, "kernel_size": 3, "padding": 1, "activation": "relu"},
    {"type": "global_avg_pool", "name": "pool"},
    {"type": "dropout", "p": 0.2},
    {"type": "linear", "name": "fc", "out_features": 3}]}


def weights_for(model, seed=0):
    rng = np.random.default_rng(seed)
    weights = {key: rng.standard_normal(shape).astype(np.float32) * 0.5 for key, shape in model.param_shapes().items()}
    weights["bn.running_var"] = np.abs(weights["bn.running_var"]) + 0.5
    return weights


def gated_bin(scores=("mahalanobis", "energy", "knn", "msp"), thresholds=None, photo_checks=None, temperature=1.7,
              uncertain_below=0.4):
    model = parse_model(DESCRIPTION)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((8, 8))
    tensors = {"gate.class_means": rng.random((3, 8)).astype(np.float32),
               "gate.precision": (a @ a.T / 8 + np.eye(8)).astype(np.float32),
               "gate.train_features": unit_rows(rng.random((20, 8))).astype(np.float32)}
    needed = {"mahalanobis": ("gate.class_means", "gate.precision"), "knn": ("gate.train_features",)}
    tensors = {key: value for key, value in tensors.items() if any(key in needed.get(s, ()) for s in scores)}
    meta = build_metadata(model)
    meta["gate"] = {"feature": "pool", "scores": list(scores), "rule": "test",
                    "thresholds": thresholds or {score: 0.0 for score in scores}}
    if "knn" in scores:
        meta["gate"]["knn_k"] = 3
    if photo_checks is not None:
        meta["gate"]["photo_checks"] = photo_checks
    meta["calibration"] = {"temperature": temperature, "rule": "test"}
    meta["thresholds"] = {"uncertain_below": uncertain_below}
    return parse_bin_bytes(encode_bin(model, {**weights_for(model), **tensors}, meta), "gated.bin")


def inputs(n=24, seed=5):
    return prepared_photos(parse_model(DESCRIPTION), n, seed)


def thresholds_in_gaps(scores: dict) -> dict:
    """Per score a threshold in the widest gap between the middle half of its values (no photo is near it)."""
    out = {}
    for name, values in scores.items():
        ordered = np.sort(values)
        middle = ordered[len(ordered) // 4: 3 * len(ordered) // 4 + 1]
        gap = np.argmax(np.diff(middle))
        out[name] = float((middle[gap] + middle[gap + 1]) / 2)
    return out


def test_scores_match_their_formulas():
    rng = np.random.default_rng(0)
    logits, features = rng.standard_normal((5, 3)) * 4, rng.standard_normal((5, 8))
    means, a = rng.standard_normal((3, 8)), rng.standard_normal((8, 8))
    precision = a @ a.T
    expected = [min((f - m) @ precision @ (f - m) for m in means) for f in features]
    np.testing.assert_allclose(mahalanobis_score(features, means, precision), expected, rtol=1e-9)
    np.testing.assert_allclose(energy_score(logits), [-np.log(np.exp(row).sum()) for row in logits], rtol=1e-12)
    bank = unit_rows(rng.standard_normal((9, 8)))
    unit = features / np.linalg.norm(features, axis=1, keepdims=True)
    expected = [np.sort(np.linalg.norm(bank - u, axis=1))[2] for u in unit]
    np.testing.assert_allclose(knn_score(features, bank, 3), expected, rtol=1e-9)


def test_kept_features_equal_the_reference_even_where_the_backend_would_fuse():
    model = parse_model(DESCRIPTION)
    weights = weights_for(model)
    x = inputs(4)
    reference = backend_class("numpy")(model, weights, keep=("c1", "bn", "pool", "dropout_5"))
    out, kept = reference.run_with_features(x)
    for device in runtime_devices()[1:]:
        backend = backend_class(device)(model, weights, keep=("c1", "bn", "pool", "dropout_5"))
        got_out, got = backend.run_with_features(x)
        np.testing.assert_allclose(got_out, out, rtol=1e-4, atol=1e-5)
        for name in ("c1", "bn", "pool", "dropout_5"):     # c1 before its batch norm folds, bn before its pool fuses
            np.testing.assert_allclose(got[name], kept[name], rtol=1e-4, atol=1e-5, err_msg=f"{device} {name}")
        np.testing.assert_allclose(backend.run(x), out, rtol=1e-4, atol=1e-5)
    from lnn.runtime.cuda.backend import CudaBackend     # its plan on NumPy arrays (the GPU case: test_cuda_backend)

    got_out, got = CudaBackend(model, weights, array_module=np, keep=("c1", "pool")).run_with_features(x)
    np.testing.assert_allclose(got["c1"], kept["c1"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["pool"], kept["pool"], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(len(runtime_devices()) < 2, reason="the cpu backend (Numba) is not installed")
def test_split_runs_over_threads_keep_features_too():
    model = parse_model(DESCRIPTION)
    weights = weights_for(model)
    x = inputs(8)
    _, expected = backend_class("numpy")(model, weights, keep=("pool",)).run_with_features(x)
    backend = backend_class("cpu")(model, weights, threads=2, keep=("pool",))
    backend._flops_per_row = 1e9                 # force the split path on this small model
    _, got = backend.run_with_features(x)
    np.testing.assert_allclose(got["pool"], expected["pool"], rtol=1e-4, atol=1e-5)


def test_gate_decision_and_scores_are_equal_across_backends():
    x = inputs()
    numpy_scores = Session(gated_bin(), "numpy").judge(x).scores
    gated = gated_bin(thresholds=thresholds_in_gaps(numpy_scores))
    reference = Session(gated, "numpy").judge(x)
    assert {"not_a_leaf", None} <= set(reference.reasons)          # the thresholds split the batch
    for device in runtime_devices()[1:]:
        judged = Session(gated, device).judge(x)
        assert judged.reasons == reference.reasons, device
        for name, values in reference.scores.items():
            np.testing.assert_allclose(judged.scores[name], values, rtol=1e-4, err_msg=f"{device} {name}")
        np.testing.assert_allclose(judged.probabilities, reference.probabilities, rtol=1e-4, atol=1e-6)


def test_temperature_divides_the_logits_and_low_confidence_is_the_last_reason():
    x = inputs()
    never_gated = {"scores": ("mahalanobis",), "thresholds": {"mahalanobis": 1e9}}
    middle = float(np.median(Session(gated_bin(**never_gated), "numpy").predict(x).max(axis=1)))
    session = Session(gated_bin(**never_gated, uncertain_below=middle), "numpy")
    logits = session.run(x)
    expected = np.exp(logits / 1.7) / np.exp(logits / 1.7).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(session.predict(x), expected, rtol=1e-5)
    reasons = session.judge(x).reasons
    assert reasons == ["low_confidence" if p < middle else None for p in expected.max(axis=1)]
    assert "low_confidence" in reasons and None in reasons


def test_an_old_model_without_a_gate_keeps_its_behaviour():
    model = parse_model(DESCRIPTION)
    meta = build_metadata(model)
    meta["thresholds"] = {"uncertain_below": 0.5}
    session = Session(parse_bin_bytes(encode_bin(model, weights_for(model), meta)), "numpy")
    x = inputs()
    logits = session.run(x)
    np.testing.assert_allclose(session.predict(x), np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True),
                               rtol=1e-5)
    judged = session.judge(x)
    assert judged.scores == {} and session.feature is None
    assert judged.reasons == ["low_confidence" if p < 0.5 else None for p in judged.probabilities.max(axis=1)]


def test_prediction_behaves_as_the_old_ranked_list():
    ranked = [("Late blight", 0.9), ("Healthy", 0.1)]
    answer = Prediction(ranked, "not_a_leaf", "This does not look like a tomato leaf.")
    (best, probability), *_ = answer
    assert (best, probability) == ranked[0] and answer[1] == ranked[1] and len(answer) == 2
    assert answer == ranked and answer.uncertain and not Prediction(ranked).uncertain


# --------------------------------------------------------------------------- photo checks

@pytest.mark.parametrize("photo", SAMPLES, ids=lambda path: path.stem)
def test_photo_checks_pass_the_sample_leaves_and_catch_spoiled_copies(photo):
    image = read_image(photo)
    assert check_photo(image).reason is None, check_photo(image).measures
    for reason, what, copy in spoiled_copies(image):
        assert check_photo(copy).reason == reason, (what, check_photo(copy).measures)


def test_photo_check_thresholds_come_from_the_model_and_predict_image_says_why():
    image = read_image(SAMPLES[0])
    blurred = box_blur(image, 2)
    assert check_photo(blurred, {"blur_below": 0.0}).reason is None
    session = Session(gated_bin(scores=("mahalanobis",), thresholds={"mahalanobis": 1e9}, uncertain_below=0.0,
                                photo_checks=dict(DEFAULTS)), "numpy")
    answer = session.predict_image(blurred)
    assert answer.reason == "blurred" and "blurred" in answer.instruction and answer.uncertain
    tiny = session.predict_image(resize_image(image, 64, 64)[:, :, ::-1].copy(), color="rgb")
    assert tiny.reason == "too_small" and "64x64" in tiny.instruction
    assert session.predict_image(image).reason is None


def test_photo_checks_take_grey_and_four_channel_photos():
    image = read_image(SAMPLES[0])
    grey = image.mean(axis=2).astype(np.uint8)
    for photo in (grey, np.repeat(grey[:, :, None], 3, axis=2)):        # one channel, or a colour file of grey
        checked = check_photo(photo)                                     # (14 of the outlier photos are such)
        assert checked.reason == "too_small" and "no colour" in checked.detail and "Move closer" not in checked.detail
    small_leaf = np.full((512, 512, 3), 128, np.uint8)                   # a leaf in 2% of a grey frame
    small_leaf[:72, :72] = resize_image(image, 72, 72)
    assert "Move closer" in check_photo(small_leaf).detail
    assert check_photo(np.concatenate([image, np.full(image.shape[:2] + (1,), 255, np.uint8)], axis=2)).reason is None


def test_sample_photos_exist():
    assert len(SAMPLES) >= 6 and all(Path(p).stat().st_size for p in SAMPLES)


def test_photo_check_defaults_are_the_checks_the_format_knows():
    from lnn.formats.gate import PHOTO_CHECKS

    assert set(DEFAULTS) == set(PHOTO_CHECKS)
    assert all(PHOTO_CHECKS[k][0] <= v <= PHOTO_CHECKS[k][1] for k, v in DEFAULTS.items())


def test_a_session_keeping_another_node_refuses_to_judge_with_the_gate():
    import lnn

    session = Session(gated_bin(scores=("mahalanobis",)), "numpy", features="c2")
    assert session.run_with_features(inputs(2))[1].shape == (2, 8, 8, 8)
    with pytest.raises(lnn.LnnError, match="gate uses 'pool'"):
        session.judge(inputs(2))
