"""The augmentation's description block, leaf masks, procedural backgrounds, each newer transform, and
outlier exposure (the mixed dataset, the trainer's loss, lnn-train --outliers on tiny real folders)."""

import json
import math

import cv2
import numpy as np
import pytest

from conftest import DATA
from lnn.formats.errors import LnnError, LnnInputError, ModelSpecError
from lnn.train.augment import RECOMMENDED, AugmentedDataset, Augmenter, augmenter_from_block, parse_augment
from lnn.train.backgrounds import GENERATORS, HELD_OUT_KINDS, TRAINING_KINDS, background
from lnn.train.config import TrainingConfig
from lnn.train.data import ArrayDataset
from lnn.train.exposure import OutlierMix, outlier_images
from lnn.train.outliers import split_outliers
from lnn.train.segment import leaf_mask, sheet_colour

from test_images import small_leaf_description, tiny_tomato


def still(**changes) -> Augmenter:
    """An augmenter that changes nothing unless told."""
    settings = dict(crop_area=(1.0, 1.0), crop_ratio=(1.0, 1.0), rotation=0.0, flips=False, brightness=0.0,
                    contrast=0.0, saturation=0.0, blur_p=0.0, workers=2)
    settings.update(changes)
    return Augmenter(**settings)


def leaf_photo(size=64, seed=0):
    """A green ellipse (the leaf) with a darker grey shadow on a noisy purple-grey sheet, [3, H, W] RGB, and
    the ellipse's own mask."""
    rng = np.random.default_rng(seed)
    hwc = np.clip(rng.normal((150, 140, 155), 4, (size, size, 3)), 0, 255).astype(np.uint8)
    centre, axes = (size // 2, size // 2), (size // 4, size // 3)
    cv2.ellipse(hwc, (centre[0] + 5, centre[1] + 4), axes, 20, 0, 360, (80, 75, 85), -1)       # shadow
    truth = np.zeros((size, size), np.uint8)
    cv2.ellipse(truth, centre, axes, 20, 0, 360, 255, -1)
    hwc[truth > 0] = np.clip(rng.normal((60, 140, 50), 10, (int((truth > 0).sum()), 3)), 0, 255)
    return np.ascontiguousarray(hwc.transpose(2, 0, 1)), truth


# --------------------------------------------------------------------------- the description's block

def test_block_defaults_switches_and_recommended_values():
    classic = augmenter_from_block(None, "rgb")
    assert classic == Augmenter(color="rgb") and not classic.uses_masks
    assert augmenter_from_block(True, "rgb") == Augmenter(color="rgb")
    assert augmenter_from_block(False, "rgb") is None
    everything = augmenter_from_block({name: True for name in RECOMMENDED}, "rgb")
    assert everything.background_p == 0.7 and everything.background_kinds == TRAINING_KINDS
    assert everything.jpeg_quality == (30, 90) and everything.hue == 8.0 and everything.uses_masks
    partial = augmenter_from_block({"noise": {"p": 0.9}, "lighting": {"hue": 20}, "blur": False, "rotation": 10},
                                   "rgb")
    assert partial.noise_p == 0.9 and partial.noise_sigma == (2.0, 10.0)         # others: the recommended
    assert partial.hue == 20 and partial.brightness == 0.3
    assert partial.blur_p == 0 and partial.rotation == 10.0 and partial.scale_p == 0
    image = np.random.default_rng(0).integers(0, 256, (2, 3, 16, 16), dtype=np.uint8)
    off = augmenter_from_block({"crop": False, "flips": False, "rotation": False, "lighting": False, "blur": False},
                               "rgb")
    assert np.array_equal(off(image, np.random.default_rng(1)), image)


@pytest.mark.parametrize("block, message", [
    ("yes", "training.augment must be true, false or an object"),
    ({"colour": True}, "training.augment: unknown field 'colour'"),
    ({"noise": {"p": 1.5}}, "training.augment.noise.p must be a probability from 0 to 1, not 1.5"),
    ({"noise": {"sigma": [5, 2]}}, "training.augment.noise.sigma must be [low, high]"),
    ({"jpeg_quality": {"range": [30.5, 90]}}, "training.augment.jpeg_quality.range must be [low, high] with 1"),
    ({"background": {"kinds": ["grass"]}}, "training.augment.background.kinds must be a non-empty list of soil"),
    ({"background": {"mode": 1}}, "training.augment.background: unknown field 'mode'"),
    ({"rotation": 400}, "training.augment.rotation must be degrees from 0 to 180"),
    ({"flips": 1}, "training.augment.flips must be true or false, not 1"),
    ({"scale": 0.5}, "training.augment.scale must be true, false or an object with p, range"),
])
def test_block_errors_name_the_field(block, message):
    with pytest.raises(ModelSpecError) as caught:
        TrainingConfig.parse({"augment": block})
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_gray_models_cannot_replace_backgrounds():
    with pytest.raises(ModelSpecError, match="background needs colour images"):
        augmenter_from_block({"background": True}, "gray")
    assert parse_augment({"scale": True})["scale_p"] == 0.5


def test_outliers_block():
    assert TrainingConfig.parse(None).outliers == {"ratio": 0.25, "weight": 0.5}
    assert TrainingConfig.parse({"outliers": {"weight": 1}}).outliers == {"ratio": 0.25, "weight": 1.0}
    with pytest.raises(ModelSpecError, match="training.outliers.ratio must be a positive number up to 4, not 0"):
        TrainingConfig.parse({"outliers": {"ratio": 0}})
    with pytest.raises(ModelSpecError, match="unknown field 'folder'"):
        TrainingConfig.parse({"outliers": {"folder": "x"}})


# --------------------------------------------------------------------------- masks and backgrounds

def test_leaf_mask_finds_the_leaf_and_not_its_shadow():
    image, truth = leaf_photo()
    mask = leaf_mask(image) > 127
    inside = truth > 0
    iou = (mask & inside).sum() / (mask | inside).sum()
    assert iou > 0.9
    assert not mask[:4].any() and not mask[-4:].any()
    bgr = np.ascontiguousarray(image[::-1])
    assert np.array_equal(leaf_mask(bgr, "bgr"), leaf_mask(image, "rgb"))
    plain = np.full((3, 32, 32), 128, np.uint8)
    assert not leaf_mask(plain).any()                      # no leaf: an empty mask, not the noise
    assert np.allclose(sheet_colour(image.transpose(1, 2, 0)), (150, 140, 155), atol=3)


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_backgrounds_are_deterministic_varied_pictures(kind):
    first = background(kind, np.random.default_rng(3), 48, 40)
    assert first.shape == (48, 40, 3) and first.dtype == np.uint8
    assert np.array_equal(first, background(kind, np.random.default_rng(3), 48, 40))
    assert not np.array_equal(first, background(kind, np.random.default_rng(4), 48, 40))
    assert first.std() > 3                                  # not a flat colour
    assert set(TRAINING_KINDS).isdisjoint(HELD_OUT_KINDS) and set(TRAINING_KINDS) | set(HELD_OUT_KINDS) == set(GENERATORS)


# --------------------------------------------------------------------------- the transforms

def settings_of(augmenter, count, height, width, **values):
    settings = augmenter.draw(np.random.default_rng(0), count, height, width)
    for key, value in values.items():
        settings[key] = np.asarray([value] * count)
    return settings


def run_one(augmenter, image, mask=None, **values):
    settings = settings_of(augmenter, 1, *image.shape[1:], **values)
    out = np.empty_like(image)
    augmenter.augment_one(image, settings, 0, out, mask)
    return out


def test_background_replacement_composites_through_the_mask():
    image, truth = leaf_photo()
    augmenter = still(background_p=1.0, shadow_p=0.0, background_kinds=("soil",))
    full = np.full(truth.shape, 255, np.uint8)
    assert np.array_equal(run_one(augmenter, image, full, background=0), image)       # all leaf: unchanged
    speck = np.zeros_like(truth)
    speck[30:32, 30:32] = 255
    settings = settings_of(augmenter, 1, 64, 64, background=0)
    want = background("soil", np.random.default_rng(int(settings["seed"][0])), 64, 64).transpose(2, 0, 1)
    out = np.empty_like(image)
    augmenter.augment_one(image, settings, 0, out, speck)
    assert np.array_equal(out[:, speck == 0], want[:, speck == 0])                   # outside the leaf: background
    assert np.array_equal(run_one(augmenter, image, np.zeros_like(truth), background=0), image)   # no leaf found
    mask = leaf_mask(image)
    mixed = run_one(augmenter, image, mask, background=0)
    assert np.array_equal(mixed[:, mask == 255], image[:, mask == 255])
    assert not np.array_equal(mixed[:, mask == 0], image[:, mask == 0])
    assert np.array_equal(run_one(augmenter, image, None, background=0), image)       # no mask: kept


def test_a_shrunk_leaf_sits_on_its_own_sheet():
    image, _ = leaf_photo()
    mask = leaf_mask(image)
    out = run_one(still(shadow_p=0.0), image, mask, scale=0.5)
    sheet = np.rint(sheet_colour(image.transpose(1, 2, 0)))
    assert np.array_equal(out[:, :8, :8].reshape(3, -1).T, np.tile(sheet, (64, 1)))     # corners: plain sheet
    small = cv2.resize(image.transpose(1, 2, 0), (32, 32), interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1)
    centre = out[:, 16:48, 16:48].astype(int)
    assert np.abs(centre[:, 12:20, 12:20] - small[:, 12:20, 12:20]).mean() < 12          # the leaf, half size


def test_gamma_gradient_noise_jpeg_and_erasing():
    image = np.random.default_rng(1).integers(40, 216, (3, 32, 32), dtype=np.uint8)
    augmenter = still()
    gamma = run_one(augmenter, image, gamma=0.5)
    want = np.clip(np.rint(255 * (image / 255) ** 0.5), 0, 255)
    assert np.abs(gamma.astype(int) - want).max() <= 1
    flat = np.full((3, 32, 32), 100, np.uint8)
    ramp = run_one(augmenter, flat, gradient=0.5, gradient_angle=0.0).astype(int)
    assert ramp[:, :, -1].mean() == pytest.approx(150, abs=2) and ramp[:, :, 0].mean() == pytest.approx(50, abs=2)
    noisy = run_one(augmenter, flat, noise=8.0).astype(int)
    assert 6 < (noisy - 100).std() < 10
    smooth = cv2.GaussianBlur(image.transpose(1, 2, 0), (0, 0), 3).transpose(2, 0, 1).copy()
    jpeg = run_one(augmenter, smooth, jpeg=20)
    assert not np.array_equal(jpeg, smooth) and np.abs(jpeg.astype(int) - smooth).mean() < 6
    ok, encoded = cv2.imencode(".jpg", np.ascontiguousarray(smooth.transpose(1, 2, 0)[:, :, ::-1]),
                               [cv2.IMWRITE_JPEG_QUALITY, 20])
    assert np.array_equal(jpeg.transpose(1, 2, 0), cv2.imdecode(encoded, cv2.IMREAD_COLOR)[:, :, ::-1])
    erased = run_one(augmenter, flat, erase=True, erase_box=[4, 6, 10, 5])
    changed = np.any(erased != flat, axis=0)
    assert changed[6:11, 4:14].mean() > 0.9 and not changed[:6].any() and not changed[:, 15:].any()


def test_hue_turns_colours_and_keeps_grey():
    grey = np.full((3, 8, 8), 120, np.uint8)
    assert np.abs(run_one(still(), grey, hue=40.0).astype(int) - 120).max() <= 1
    red = np.zeros((3, 8, 8), np.uint8)
    red[0] = 200
    turned = run_one(still(), red, hue=120.0).astype(int)
    assert turned[1].mean() > turned[0].mean() and turned[1].mean() > turned[2].mean()    # red -> green


def test_everything_on_is_reproducible_and_thread_independent():
    image, _ = leaf_photo()
    images = np.stack([image] * 12)
    masks = np.stack([leaf_mask(image)] * 12)
    block = {name: True for name in RECOMMENDED}
    one = augmenter_from_block(block, "rgb", workers=1)(images, np.random.default_rng(9), masks)
    two = augmenter_from_block(block, "rgb", workers=3)(images, np.random.default_rng(9), masks)
    assert np.array_equal(one, two)
    assert len({row.tobytes() for row in one}) == 12
    source = ArrayDataset(images, np.arange(12) % 2)
    dataset = AugmentedDataset(source, np.arange(12), augmenter_from_block(block, "rgb", workers=2), masks=masks)
    assert np.array_equal(dataset.batch(np.array([3, 1]))[0], dataset.batch(np.array([3, 1]))[0])
    assert np.array_equal(dataset.limit(5).batch(np.array([3]))[0], dataset.batch(np.array([3]))[0])


# --------------------------------------------------------------------------- outlier exposure

def test_outlier_mix_appends_outlier_rows_at_the_ratio():
    inliers = ArrayDataset(np.zeros((8, 1, 2, 2), np.uint8), np.arange(8) % 3)
    outliers = ArrayDataset(np.arange(3, dtype=np.uint8)[:, None, None, None].repeat(4, 1).reshape(3, 1, 2, 2) + 1,
                            np.full(3, -1))
    mix = OutlierMix(inliers, outliers, ratio=0.5)
    assert len(mix) == 12 and mix.outlier_rows == 4 and not mix.in_memory
    assert mix.labels.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, -1, -1, -1, -1]
    images, labels = mix.batch(np.array([9, 2, 11, 8]))
    assert labels.tolist() == [-1, 2, -1, -1]
    assert images[:, 0, 0, 0].tolist() == [2, 0, 1, 1]          # outlier rows j -> photo j % 3
    assert len(mix.limit(4)) == 6


def test_trainer_with_outliers_pulls_them_to_the_uniform_posterior():
    from lnn.train.trainer import Trainer

    rng = np.random.default_rng(0)
    description = {"input_shape": [2], "layers": [{"type": "linear", "out_features": 32, "activation": "relu"},
                                                  {"type": "linear", "out_features": 3}], "loss": "cross_entropy",
                   "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9},
                   "training": {"batch_size": 40, "outliers": {"weight": 1.0}}}
    centres = np.array([[4.0, 0.0], [-4.0, 0.0], [0.0, 4.0]])
    labels = rng.integers(0, 3, 300)
    x = centres[labels] + rng.normal(0, 0.5, (300, 2))
    far = rng.normal(0, 0.3, (100, 2)) + np.array([0.0, -6.0])          # outliers: away from every class
    data = ArrayDataset(np.concatenate([x, far]).astype(np.float32), np.concatenate([labels, np.full(100, -1)]))
    data.has_outliers = True
    with pytest.raises(LnnError, match="create the Trainer with outliers=True"):
        Trainer(description, device="cpu", log=lambda m: None).fit(data, epochs=1, progress=False)
    trainer = Trainer(description, device="cpu", outliers=True, log=lambda m: None)
    history = trainer.fit(data, epochs=30, progress=False)
    assert history[-1]["train_accuracy"] > 0.95                       # counted over the labelled rows only
    probabilities = trainer.predict(far.astype(np.float32))
    probabilities = np.exp(probabilities) / np.exp(probabilities).sum(axis=1, keepdims=True)
    assert probabilities.max(axis=1).mean() < 0.5                      # near 1/3, not confident
    plain = Trainer(description, device="cpu", log=lambda m: None)
    plain.fit(ArrayDataset(x.astype(np.float32), labels), epochs=30, progress=False)
    logits = plain.predict(far.astype(np.float32))
    assert (np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)).max(axis=1).mean() > 0.8


def test_a_step_with_outliers_is_the_hendrycks_objective():
    from lnn.train.trainer import Trainer

    description = {"input_shape": [3], "layers": [{"type": "linear", "out_features": 4}], "loss": "cross_entropy",
                   "optimizer": {"type": "sgd", "lr": 0.1}, "training": {"batch_size": 8}}
    trainer = Trainer(description, device="cpu", outliers=True, log=lambda m: None)
    x = np.random.default_rng(2).normal(size=(7, 3)).astype(np.float32)
    y = np.array([0, -1, 2, 3, -1, -1, 1])
    logits = x.astype(np.float64) @ trainer.weights()["linear_0.weight"].T.astype(np.float64) \
        + trainer.weights()["linear_0.bias"]
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    inlier = y >= 0
    want = -log_p[inlier, y[inlier]].mean() + 0.5 * (-log_p[~inlier].mean(axis=1)).mean()
    result = trainer.step(x, y)
    assert result.loss == pytest.approx(want, rel=1e-5) and result.labelled == 4 and result.rows == 7


def test_cuda_graph_refuses_outlier_exposure():
    from lnn.train.trainer import Trainer

    description = {"input_shape": [3], "layers": [{"type": "linear", "out_features": 4}], "loss": "cross_entropy"}
    with pytest.raises(LnnError, match="outlier exposure needs the cross_entropy loss"):
        Trainer(dict(description, loss="mse"), device="cpu", outliers=True)
    assert Trainer(description, device="cpu", outliers=True).graph_mode is False


def tiny_outliers(tmp_path, per_folder=8):
    source = DATA / "outliers"
    if not source.is_dir():
        pytest.skip(f"{source} is not here")
    folder = tmp_path / "outliers"
    for sub in ("everyday", "textures_and_ground"):
        (folder / sub).mkdir(parents=True)
        for photo in sorted((source / sub).iterdir())[:per_folder]:
            (folder / sub / photo.name).symlink_to(photo)
    return folder


def test_outlier_images_are_the_fit_part_only(tmp_path):
    folder = tiny_outliers(tmp_path)
    data = outlier_images(folder, (3, 24, 24), "rgb", cache_root=tmp_path / "cache", log=lambda m: None,
                          progress=False)
    fit = split_outliers(folder)["fit"]
    assert 0 < len(data) == len(fit) < 16
    assert set(np.asarray(data.labels).tolist()) == {-1}
    from lnn.train.images import decode_for_model

    assert np.array_equal(data.images[0], decode_for_model(fit[0], (24, 24), "rgb"))


def test_lnn_train_with_outliers_and_every_augmentation(tmp_path, monkeypatch, capsys):
    from lnn.tools.train import main

    classes = ("healthy", "late_blight")
    folder = tiny_tomato(tmp_path, classes, per_class=10)
    outliers = tiny_outliers(tmp_path)
    monkeypatch.setenv("LNN_CACHE_DIR", str(tmp_path / "cache"))
    path = small_leaf_description(tmp_path, classes, size=32)
    description = json.loads(path.read_text())
    description["training"]["augment"] = {name: True for name in RECOMMENDED}
    description["training"]["outliers"] = {"ratio": 0.5}
    path.write_text(json.dumps(description))
    code = main([str(path), "--data", f"folder:{folder}", "--outliers", str(outliers), "--epochs", "1",
                 "--batch", "8", "--out", str(tmp_path / "run"), "--device", "cpu", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "with background replacement" in out and "outlier exposure with" in out and "8 outlier rows" in out
    entry = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(entry["train_loss"]) and 0 <= entry["val_accuracy"] <= 1
    assert (tmp_path / "run" / "model.bin").exists()
    code = main([str(path), "--data", f"mnist:{tmp_path}", "--outliers", str(outliers), "--out",
                 str(tmp_path / "run2"), "--quiet"])
    assert code == 1 and "--outliers needs --data folder:DIR" in capsys.readouterr().err


def test_lnn_train_outliers_folder_errors_are_one_line(tmp_path, monkeypatch, capsys):
    from lnn.tools.train import main

    folder = tiny_tomato(tmp_path, ("healthy", "late_blight"), per_class=3)
    monkeypatch.setenv("LNN_CACHE_DIR", str(tmp_path / "cache"))
    path = small_leaf_description(tmp_path, ("healthy", "late_blight"), size=24)
    code = main([str(path), "--data", f"folder:{folder}", "--outliers", str(tmp_path / "nowhere"),
                 "--out", str(tmp_path / "run"), "--quiet", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 1 and "no such folder of outlier photos" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(LnnInputError):
        split_outliers(tmp_path / "nowhere")


@pytest.mark.slow
def test_worker_processes_make_the_same_images_as_threads():
    image, _ = leaf_photo()
    images = np.stack([image] * 6)
    masks = np.stack([leaf_mask(image)] * 6)
    block = {name: True for name in RECOMMENDED}
    threads = augmenter_from_block(block, "rgb", workers=2)(images, np.random.default_rng(4), masks)
    augmenter = augmenter_from_block(block, "rgb", workers=2, processes=True)
    try:
        assert np.array_equal(augmenter(images, np.random.default_rng(4), masks), threads)
        assert np.array_equal(augmenter(images, np.random.default_rng(4), None),
                              augmenter_from_block(block, "rgb", workers=1)(images, np.random.default_rng(4)))
    finally:
        augmenter.close()


def test_shifted_copy_is_deterministic_and_uses_held_out_backgrounds(monkeypatch):
    """benchmarks/shifted_accuracy.py's copies: fixed by the seed, each shift its own change."""
    import sys

    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import shifted_accuracy

    image, _ = leaf_photo()
    images, masks = np.stack([image] * 3), np.stack([leaf_mask(image)] * 3)
    assert shifted_accuracy.still_augmenter("rgb").background_kinds == HELD_OUT_KINDS
    copies = {shift: shifted_accuracy.shifted_copy(images, masks, shift, "rgb", seed=5)
              for shift in shifted_accuracy.SHIFTS}
    for shift, copy in copies.items():
        assert np.array_equal(copy, shifted_accuracy.shifted_copy(images, masks, shift, "rgb", seed=5))
        assert not np.array_equal(copy, images), shift
    assert copies["darker"].mean() < 0.65 * images.mean()
    leaf = masks[0] == 255
    assert np.array_equal(copies["background"][:, :, leaf], images[:, :, leaf])        # the leaf itself kept
    assert not np.array_equal(copies["background"], shifted_accuracy.shifted_copy(images, masks, "background",
                                                                                  "rgb", seed=6))
    del sys.modules["shifted_accuracy"]


def test_augment_processes_follow_the_core_count_or_the_environment(tmp_path, monkeypatch):
    from lnn.train import images

    folder = tiny_tomato(tmp_path, ("healthy", "late_blight"), per_class=3)
    description = json.loads(small_leaf_description(tmp_path, ("healthy", "late_blight"), size=24).read_text())
    monkeypatch.setenv("LNN_CACHE_DIR", str(tmp_path / "cache"))

    def processes():
        train, _, _ = images.folder_datasets(folder, description, log=lambda m: None, progress=False)
        return train.augmenter.processes

    monkeypatch.setattr(images.os, "cpu_count", lambda: 16)
    assert processes() is True
    monkeypatch.setenv("LNN_AUGMENT_PROCESSES", "0")
    assert processes() is False
    monkeypatch.setattr(images.os, "cpu_count", lambda: 2)
    monkeypatch.setenv("LNN_AUGMENT_PROCESSES", "1")
    assert processes() is True
    monkeypatch.delenv("LNN_AUGMENT_PROCESSES")
    assert processes() is False
