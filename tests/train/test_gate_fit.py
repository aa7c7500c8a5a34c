"""Fitting the gate and the calibration (train/gate_fit.py) against what the rules say they do."""

import numpy as np
import pytest

from lnn.runtime.gate import softmax
from lnn.train.gate_fit import (Candidate, class_statistics, common_thresholds, expected_calibration_error, fit_gate,
                                fit_temperature, flags, low_confidence_threshold, nll, threshold_at)

rng = np.random.default_rng(0)


def test_temperature_recovers_the_one_that_made_the_labels():
    logits = rng.standard_normal((20000, 5)) * 3
    truth = 2.5
    probabilities = softmax(logits, truth)
    labels = np.array([rng.choice(5, p=p) for p in probabilities])
    fitted = fit_temperature(logits, labels)
    assert abs(fitted - truth) < 0.1
    assert nll(logits, labels, fitted) <= min(nll(logits, labels, t) for t in (fitted * 0.9, fitted * 1.1))


def test_ece_by_hand():
    probabilities = np.array([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.3, 0.7]])
    labels = np.array([0, 1, 0, 1])
    # bins: 0.9 (2 photos, accuracy 0.5), 0.6 (1 photo, right), 0.7 (1 photo, right)
    expected = 0.5 * abs(0.5 - 0.9) + 0.25 * abs(1 - 0.6) + 0.25 * abs(1 - 0.7)
    assert expected_calibration_error(probabilities, labels) == pytest.approx(expected)


def test_thresholds_keep_what_they_promise():
    scores = rng.standard_normal(1000)
    t = threshold_at(scores, 0.97)
    assert np.mean(scores > t) <= 0.03 and np.mean(scores > t) >= 0.029
    two = {"a": rng.standard_normal(1000), "b": rng.standard_normal(1000)}
    low = rng.random(1000) < 0.01
    thresholds = common_thresholds(two, 0.97, low)
    kept = 1 - (flags(two, thresholds) | low).mean()
    assert 0.97 <= kept <= 0.972
    probabilities = softmax(rng.standard_normal((500, 4)) * 2)
    u = low_confidence_threshold(probabilities, 0.01)
    assert np.mean(probabilities.max(axis=1) < u) <= 0.01


def test_class_statistics_are_the_shared_covariance_inverse():
    features = rng.standard_normal((600, 4)) @ rng.standard_normal((4, 4))
    labels = rng.integers(0, 3, 600)
    means, precision = class_statistics(features, labels, 3, shrinkage=0.0)
    centred = features - np.stack([features[labels == k].mean(0) for k in range(3)])[labels]
    np.testing.assert_allclose(precision, np.linalg.inv(np.cov(centred.T, bias=True)), rtol=1e-4)


def test_fit_gate_prefers_the_score_that_separates_and_works_without_logits():
    classes, size = 3, 6
    centres = rng.standard_normal((classes, size)) * 4
    train_labels = rng.integers(0, classes, 900)
    train = centres[train_labels] + rng.standard_normal((900, size))
    val_labels = rng.integers(0, classes, 300)
    val = centres[val_labels] + rng.standard_normal((300, size))
    outliers = rng.standard_normal((100, size)) * 4 + 12          # far from every class, in feature space
    weight = centres / 4                                            # logits that know the classes, not outliers
    fitted = fit_gate((train, train_labels), (val @ weight.T, val, val_labels), (outliers @ weight.T, outliers),
                      classes, with_knn=False)
    assert "mahalanobis" in fitted.candidate.scores and fitted.report["outlier_validation_caught"] > 0.9
    assert fitted.report["validation_kept"] >= 0.97
    as_probabilities = fit_gate((train, train_labels), (softmax(val @ weight.T), val, val_labels),
                                (softmax(outliers @ weight.T), outliers), classes, logits_available=False)
    assert as_probabilities.temperature == 1.0 and "energy" not in as_probabilities.candidate.scores
    probabilities = softmax(val @ weight.T)
    scores = Candidate(("msp",)).compute(probabilities, None, 1.0, outputs_probabilities=True)
    np.testing.assert_allclose(scores["msp"], 1 - probabilities.max(axis=1))   # of p itself, not of softmax(p)


@pytest.mark.parametrize("feature", [None, "pool"])
def test_extract_of_no_batches_is_no_rows_of_the_shapes_batches_give(feature):
    from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes
    from lnn.formats.model import parse_model
    from lnn.runtime import Session
    from lnn.train.gate_fit import extract

    model = parse_model({"name": "tiny", "input_shape": [3, 8, 8], "labels": ["a", "b", "c"],
                         "layers": [{"type": "conv2d", "out_channels": 4, "kernel_size": 3, "activation": "relu"},
                                    {"type": "global_avg_pool", "name": "pool"},
                                    {"type": "linear", "out_features": 3}]})
    weights = {k: rng.standard_normal(s).astype(np.float32) for k, s in model.param_shapes().items()}
    session = Session(parse_bin_bytes(encode_bin(model, weights, build_metadata(model))), "numpy", features=feature)
    some = extract(session, iter([rng.standard_normal((2, 3, 8, 8)).astype(np.float32)]), 2, "some", progress=False)
    none = extract(session, iter([]), 0, "none", progress=False)
    assert none[0].shape == (0,) + some[0].shape[1:] and none[0].dtype == some[0].dtype
    if feature is None:
        assert some[1] is None and none[1] is None
    else:
        assert none[1].shape == (0,) + some[1].shape[1:] == (0, 4) and none[1].dtype == some[1].dtype
