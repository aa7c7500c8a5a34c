"""Image folders: leaf grouping and the split, the decoded cache, class balancing, augmentation,
and lnn-train on a tiny subset of the tomato photos through `--data folder:DIR`."""

import json
import math
import os
import time

import cv2
import numpy as np
import pytest

from conftest import DATA, EXAMPLES, need
from hostile_images import with_data_left_over
from lnn.formats.errors import LnnInputError
from lnn.train import images as images_module
from lnn.train.augment import AugmentedDataset, Augmenter
from lnn.train.data import ArrayDataset, Prefetcher
from lnn.train.images import ImageFolder, balanced_rows, class_labels, leaf_group, scan_folder, split_by_leaf

TOMATO = DATA / "tomato"
UUID = "0a1b2c3d-0000-4000-8000-000000000000___"


# --------------------------------------------------------------------------- leaves and the split

def test_leaf_group_follows_the_plantvillage_leaf_number():
    assert leaf_group(f"healthy/{UUID}GH_HL_Leaf_259.1.jpg") == leaf_group(f"healthy/{UUID}GH_HL_Leaf_259.jpg")
    assert leaf_group(f"{UUID}GHLB_PS_Leaf_24_Day_13.jpg") == leaf_group(f"{UUID}GHLB_PS_Leaf_24_Day_16.jpg")
    assert leaf_group(f"{UUID}GHLB_PS_leaf_24_day_13.jpg") == leaf_group(f"{UUID}GHLB_PS_Leaf_24_Day_13.jpg")
    assert leaf_group(f"{UUID}GH_HL_Leaf_259.1JPG.jpg") == leaf_group(f"{UUID}GH_HL_Leaf_259.jpg")
    assert leaf_group(f"{UUID}GH_HL_Leaf_259.jpg") != leaf_group(f"{UUID}GH_HL_Leaf_25.jpg")
    # names without a leaf number are each their own group
    assert leaf_group(f"{UUID}RS_HL_0105.jpg") != leaf_group(f"{UUID}RS_HL_0106.jpg")
    assert leaf_group("x/photo.jpg") == leaf_group("x/photo.jpg")


def synthetic_names():
    """3 classes: 40 single photos, one with 10 photos of 4 leaves (3 + 3 + 2 + 2), one of 25."""
    files, labels = [], []
    for i in range(40):
        files.append(f"a/{i:04d}___RS_{i}.jpg")
        labels.append(0)
    for leaf, count in ((7, 3), (8, 3), (9, 2), (10, 2)):
        for k in range(count):
            files.append(f"b/{leaf:02d}{k}___GHLB_Leaf_{leaf}{'.' + str(k) if k else ''}.jpg")
            labels.append(1)
    for i in range(30):
        files.append(f"b/x{i:03d}___RS_Late.B_{i}.jpg")
        labels.append(1)
    for i in range(25):
        files.append(f"c/{i:04d}___PSU_CG_{i}.jpg")
        labels.append(2)
    return files, np.array(labels)


def test_split_is_stratified_grouped_and_deterministic():
    files, labels = synthetic_names()
    train, val = split_by_leaf(files, labels, 0.2, seed=3)
    assert sorted(np.concatenate([train, val])) == list(range(len(files)))
    assert np.bincount(labels[val]).tolist() == [8, 8, 5]                      # round(0.2 * n) per class
    groups = [(labels[i], leaf_group(files[i])) for i in range(len(files))]
    assert not {groups[i] for i in train} & {groups[i] for i in val}           # no leaf on both sides
    again = split_by_leaf(files, labels, 0.2, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip((train, val), again))
    other = split_by_leaf(files, labels, 0.2, seed=4)[1]
    assert not np.array_equal(val, other)
    with pytest.raises(LnnInputError, match="between 0 and 1"):
        split_by_leaf(files, labels, 1.0)


def test_real_tomato_split_keeps_every_leaf_on_one_side():
    classes, files, labels, _ = scan_folder(need(TOMATO))
    labels = np.array(labels)
    train, val = split_by_leaf(files, labels)
    assert len(classes) == 10 and len(files) == 3839
    for label in range(10):
        assert np.sum(labels[val] == label) == round(0.2 * np.sum(labels == label))
    train_groups = {(labels[i], leaf_group(files[i])) for i in train}
    val_groups = {(labels[i], leaf_group(files[i])) for i in val}
    assert not train_groups & val_groups
    # the folder really has multi-photo leaves, so the grouping is exercised
    late = [leaf_group(files[i]) for i in np.flatnonzero(labels == classes.index("late_blight"))]
    assert max(late.count(g) for g in set(late)) > 5


def test_balanced_rows_give_every_class_the_largest_count():
    labels = np.array([0] * 10 + [1] * 3 + [2] * 7)
    rows = np.arange(len(labels))[::-1].copy()
    out = balanced_rows(rows, labels, seed=1)
    assert np.bincount(labels[out]).tolist() == [10, 10, 10]
    assert set(out) == set(rows)                                # every row at least once
    counts = np.bincount(out, minlength=len(labels))
    assert sorted(counts[10:13]) == [3, 3, 4]                   # repeats spread over the rows, not one row x8
    assert np.array_equal(out, balanced_rows(rows, labels, seed=1))


# --------------------------------------------------------------------------- the cache

def make_folder(root, sizes=((40, 30), (64, 64), (20, 50))):
    """class_a: red-ish photos, class_b: green-ish, of different sizes; a broken JPEG and a text file too."""
    rng = np.random.default_rng(0)
    for name, channel in (("class_a", 2), ("class_b", 1)):
        (root / name).mkdir(parents=True)
        for i, (h, w) in enumerate(sizes):
            image = rng.integers(0, 60, (h, w, 3), dtype=np.uint8)
            image[:, :, channel] = rng.integers(150, 255, (h, w), dtype=np.uint8)
            cv2.imwrite(str(root / name / f"p{i}.png"), image)
    cv2.imwrite(str(root / "class_a" / "good.jpg"), np.full((30, 30, 3), 90, np.uint8))
    data = (root / "class_a" / "good.jpg").read_bytes()
    (root / "class_b" / "broken.jpg").write_bytes(data[: len(data) // 2])
    (root / "class_b" / "notes.txt").write_text("not an image")
    (root / "empty_class").mkdir()
    return root


def test_cache_holds_the_pixels_lnn_infer_sees_and_skips_bad_files(tmp_path):
    folder = make_folder(tmp_path / "photos")
    messages = []
    data = ImageFolder.load(folder, (3, 16, 24), "rgb", cache_root=tmp_path / "cache", log=messages.append,
                            progress=False)
    assert data.classes == ["class_a", "class_b"]
    assert data.files == ["class_a/good.jpg", "class_a/p0.png", "class_a/p1.png", "class_a/p2.png",
                          "class_b/p0.png", "class_b/p1.png", "class_b/p2.png"]
    assert data.labels.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert [f for f, _ in data.skipped] == ["class_b/broken.jpg"]
    assert any("broken.jpg" in m and "truncated" in m for m in messages)
    assert any("1 of 8 image files could not be decoded" in m for m in messages)
    assert data.data.images.shape == (7, 3, 16, 24) and data.data.images.dtype == np.uint8
    for row, name in enumerate(data.files):      # independent reference: OpenCV directly
        bgr = cv2.imread(str(folder / name))
        shrink = bgr.shape[0] > 16 or bgr.shape[1] > 24
        want = cv2.resize(bgr, (24, 16), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
        assert np.array_equal(data.data.images[row], want[:, :, ::-1].transpose(2, 0, 1)), name
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [data.cache_dir.name,    # no temporary left
                                                                      images_module.LATEST_CACHES]


def test_the_cache_keeps_phone_jpegs_with_a_trailer_and_skips_a_pixel_bomb(tmp_path):
    from hostile_images import png_claiming

    folder = make_folder(tmp_path / "photos")
    good = (folder / "class_a" / "good.jpg").read_bytes()
    (folder / "class_a" / "phone.jpg").write_bytes(good + b"\x00\x00trailer a phone appended" * 8)
    (folder / "class_b" / "bomb.png").write_bytes(png_claiming(33000, 33000))
    messages = []
    data = ImageFolder.load(folder, (3, 16, 24), "rgb", cache_root=tmp_path / "cache", log=messages.append,
                            progress=False)
    assert "class_a/phone.jpg" in data.files
    assert np.array_equal(data.data.images[data.files.index("class_a/phone.jpg")],
                          data.data.images[data.files.index("class_a/good.jpg")])
    assert sorted(f for f, _ in data.skipped) == ["class_b/bomb.png", "class_b/broken.jpg"]
    assert any("bomb.png" in m and "over lnn's limit of 250,000,000 pixels" in m for m in messages)


def test_photos_decoded_with_a_note_are_kept_and_counted_in_one_line_each_time_the_folder_opens(tmp_path):
    """A JPEG whose data ran on after its image (a drone's padding, or damage) is trained on, as lnn-infer answers
    it; the folder's log says how many, once, naming the first, from the cache too."""
    folder = make_folder(tmp_path / "photos")
    for name in ("drone1.jpg", "drone2.jpg"):
        (folder / "class_b" / name).write_bytes(with_data_left_over((folder / "class_a" / "good.jpg").read_bytes()))
    for _ in range(2):                                      # decoded, then from the cache
        messages = []
        data = ImageFolder.load(folder, (3, 16, 24), "rgb", cache_root=tmp_path / "cache", log=messages.append,
                                progress=False)
        assert {"class_b/drone1.jpg", "class_b/drone2.jpg"} <= set(data.files)
        [line] = [m for m in messages if "with a note" in m]
        assert "2 of 10 image files were decoded with a note (first: class_b/drone1.jpg: the JPEG's data ran on" in line
    assert np.array_equal(data.data.images[data.files.index("class_b/drone1.jpg")],
                          data.data.images[data.files.index("class_a/good.jpg")])


def test_second_open_does_not_decode_and_a_changed_file_rebuilds(tmp_path, monkeypatch):
    folder = make_folder(tmp_path / "photos")
    first = ImageFolder.load(folder, (3, 16, 16), "rgb", cache_root=tmp_path / "cache", log=lambda m: None,
                             progress=False)

    def no_decoding(*args):
        raise AssertionError("decoded although the cache was there")

    monkeypatch.setattr(images_module, "decode_for_model", no_decoding)
    started = time.perf_counter()
    second = ImageFolder.load(folder, (3, 16, 16), "rgb", cache_root=tmp_path / "cache", log=lambda m: None)
    assert time.perf_counter() - started < 1.0
    assert second.cache_dir == first.cache_dir
    assert np.array_equal(second.data.images, first.data.images)
    monkeypatch.undo()
    stamp = (folder / "class_a" / "p0.png").stat()
    os.utime(folder / "class_a" / "p0.png", ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))
    third = ImageFolder.load(folder, (3, 16, 16), "rgb", cache_root=tmp_path / "cache", log=lambda m: None,
                             progress=False)
    assert third.cache_dir != first.cache_dir
    other_size = ImageFolder.load(folder, (1, 8, 8), "gray", cache_root=tmp_path / "cache", log=lambda m: None,
                                  progress=False)
    assert other_size.data.images.shape == (7, 1, 8, 8)
    # another photo of the same size copied over it with the old mtime kept (cp -p): its ctime is new
    photo = folder / "class_a" / "p0.png"
    stamp, other = photo.stat(), (folder / "class_a" / "p1.png").read_bytes()
    time.sleep(0.01)
    photo.write_bytes(other[:stamp.st_size].ljust(stamp.st_size, b"\0"))
    os.utime(photo, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert photo.stat().st_size == stamp.st_size and photo.stat().st_mtime_ns == stamp.st_mtime_ns
    fourth = ImageFolder.load(folder, (3, 16, 16), "rgb", cache_root=tmp_path / "cache", log=lambda m: None,
                              progress=False)
    assert fourth.cache_dir != third.cache_dir


def test_a_folder_keeps_one_cache_per_size_the_one_from_before_its_photos_changed_is_removed(tmp_path):
    folder, root = make_folder(tmp_path / "photos"), tmp_path / "cache"
    messages = []

    def load(shape=(3, 16, 16), color="rgb"):
        return ImageFolder.load(folder, shape, color, cache_root=root, log=messages.append, progress=False)

    first = load()
    pixels = np.array(first.data.images)
    other_size = load((1, 8, 8), "gray")
    assert load().cache_dir == first.cache_dir and first.cache_dir.is_dir()
    assert not any("removed" in m for m in messages), messages
    stamp = (folder / "class_a" / "p0.png").stat()
    os.utime(folder / "class_a" / "p0.png", ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))
    messages.clear()
    changed = load()
    assert changed.cache_dir != first.cache_dir and changed.cache_dir.is_dir()
    assert not first.cache_dir.exists()
    assert [m for m in messages if "removed" in m] == [f"{folder}: removed its cache from before its photos changed "
                                                       f"({first.cache_dir})"]
    assert np.array_equal(first.data.images, pixels)          # a run that had it open still reads it
    assert other_size.cache_dir.is_dir()                       # another size's: replaced only when it is opened
    changed_other_size = load((1, 8, 8), "gray")
    assert changed_other_size.cache_dir != other_size.cache_dir and not other_size.cache_dir.exists()
    assert load().cache_dir == changed.cache_dir and changed.cache_dir.is_dir()
    caches = sorted(p.name for p in root.iterdir() if images_module.CACHE_KEY.fullmatch(p.name))
    assert caches == sorted([changed.cache_dir.name, changed_other_size.cache_dir.name])
    assert not [p for p in root.iterdir() if p.name.startswith(".")]     # nothing half-removed left behind


def test_bad_folders_are_one_clear_error(tmp_path):
    with pytest.raises(LnnInputError, match="no such folder"):
        scan_folder(tmp_path / "missing")
    (tmp_path / "flat").mkdir()
    cv2.imwrite(str(tmp_path / "flat" / "a.png"), np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(LnnInputError, match="no class sub-folders"):
        scan_folder(tmp_path / "flat")
    (tmp_path / "bad" / "only").mkdir(parents=True)
    (tmp_path / "bad" / "only" / "x.jpg").write_bytes(b"not a jpeg at all")
    with pytest.raises(LnnInputError, match="none of its 1 image files"):
        ImageFolder.load(tmp_path / "bad", (3, 8, 8), "rgb", cache_root=tmp_path / "cache", log=lambda m: None,
                         progress=False)
    assert not any((tmp_path / "cache").iterdir())


def test_labels_must_match_the_class_folders(tmp_path):
    folder, classes = tmp_path / "p", ["class_a", "class_b"]
    assert class_labels(folder, classes) == ["class_a", "class_b"]
    given = [{"name": "class_a", "display": "A"}, "class_b"]
    assert class_labels(folder, classes, given) == given
    with pytest.raises(LnnInputError, match="missing from the labels: class_b"):
        class_labels(folder, classes, ["class_a", "class_c"])
    with pytest.raises(LnnInputError, match="sorted folder order"):
        class_labels(folder, classes, ["class_b", "class_a"])


@pytest.mark.parametrize("names, problem", [
    (["class_a", "class_b", "class_c"], r"labels: 3 given, but the last layer outputs 2 values"),
    (["class_a", "class\nb"], r"labels\[0\]: the name holds a control character \(\\n\)"),
    ([os.fsdecode(b"class_\xe4"), "class_b"], r"labels\[1\]: the name is not UTF-8 text \(a lone UTF-16 surrogate "
                                              r"\\udce4 in a string: a name written in another encoding\)"),
])
def test_class_folders_that_cannot_be_labels_are_refused_before_any_photo_is_decoded(tmp_path, monkeypatch, names,
                                                                                      problem):
    for name in names:          # a class folder named in Latin-1 trained a whole run, then could not be written
        (tmp_path / "photos" / name).mkdir(parents=True)
        (tmp_path / "photos" / name / "a.png").write_bytes(cv2.imencode(".png", np.zeros((4, 4, 3), np.uint8))[1])
    monkeypatch.setattr(ImageFolder, "load", lambda *args, **kwargs: pytest.fail("decoded the photos first"))
    description = {"name": "m", "input_shape": [3, 8, 8],
                   "preprocess": {"color": "rgb", "scale": 1 / 255, "mean": [0] * 3, "std": [1] * 3},
                   "layers": [{"type": "global_avg_pool"}, {"type": "linear", "out_features": 2}]}
    with pytest.raises(LnnInputError, match=f"photos: the model's labels for its class sub-folders: {problem}"):
        images_module.folder_datasets(tmp_path / "photos", description, log=lambda m: None, progress=False)


# --------------------------------------------------------------------------- augmentation

def still(**changes) -> Augmenter:
    """An augmenter that changes nothing unless told."""
    settings = dict(crop_area=(1.0, 1.0), crop_ratio=(1.0, 1.0), rotation=0.0, flips=False, brightness=0.0,
                    contrast=0.0, saturation=0.0, blur_p=0.0, workers=2)
    settings.update(changes)
    return Augmenter(**settings)


def random_images(count=6, channels=3, height=20, width=28, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (count, channels, height, width), dtype=np.uint8)


def fixed_settings(augmenter, count, height, width, **values):
    settings = augmenter.draw(np.random.default_rng(0), count, height, width)
    for key, value in values.items():
        settings[key] = np.full(count, value)
    return settings


def test_neutral_augmentation_is_the_identity():
    images = random_images()
    assert np.array_equal(still()(images, np.random.default_rng(0)), images)
    gray = random_images(channels=1)
    assert np.array_equal(still(color="gray")(gray, np.random.default_rng(0)), gray)


def test_flips_and_quarter_turn_match_numpy():
    augmenter = still()
    images = random_images(count=1, height=24, width=24)
    out = np.empty_like(images[0])
    for flips, want in (((True, False), images[0][:, :, ::-1]), ((False, True), images[0][:, ::-1, :])):
        settings = fixed_settings(augmenter, 1, 24, 24, flip_x=flips[0], flip_y=flips[1])
        augmenter.augment_one(images[0], settings, 0, out)
        assert np.array_equal(out, want)
    settings = fixed_settings(augmenter, 1, 24, 24, angle=math.pi / 2)
    augmenter.augment_one(images[0], settings, 0, out)
    assert np.array_equal(out, np.rot90(images[0], k=1, axes=(1, 2)))     # counter-clockwise on screen


def test_colour_jitter_matches_its_formula():
    augmenter = still()
    image = random_images(count=1, height=8, width=8)[0]
    x = image.transpose(1, 2, 0).astype(np.float64)
    grey_weights = np.array([0.299, 0.587, 0.114])
    out = np.empty_like(image)
    b, c, s = 1.1, 0.8, 0.5
    augmenter.augment_one(image, fixed_settings(augmenter, 1, 8, 8, brightness=b, contrast=c, saturation=s), 0, out)
    y = x * b
    y = (y - (y @ grey_weights).mean()) * c + (y @ grey_weights).mean()
    grey = (y @ grey_weights)[:, :, None]
    y = (y - grey) * s + grey
    want = np.clip(np.rint(y), 0, 255).transpose(2, 0, 1)
    assert np.abs(out.astype(int) - want).max() <= 1
    augmenter.augment_one(image, fixed_settings(augmenter, 1, 8, 8, saturation=0.0), 0, out)
    assert np.abs(out[0].astype(int) - out[1]).max() <= 1 and np.abs(out[1].astype(int) - out[2]).max() <= 1


def test_augmentation_is_reproducible_and_varies_with_the_seed():
    images = random_images(count=16)
    augmenter = Augmenter(workers=2)
    a = augmenter(images, np.random.default_rng(5))
    assert a.dtype == np.uint8 and a.shape == images.shape
    assert np.array_equal(a, Augmenter(workers=1)(images, np.random.default_rng(5)))     # threads do not matter
    assert not np.array_equal(a, augmenter(images, np.random.default_rng(6)))
    assert not np.array_equal(a, images)


def test_augmented_dataset_through_the_prefetcher():
    source = ArrayDataset(random_images(count=10), np.arange(10) % 3)
    rows = np.array([0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 9])
    dataset = AugmentedDataset(source, rows, Augmenter(workers=2), seed=1)
    assert len(dataset) == 12 and dataset.sample_shape == (3, 20, 28) and not dataset.in_memory
    order = np.random.default_rng(0).permutation(12)
    batches = [order[:5], order[5:]]
    with Prefetcher(batches, dataset.batch) as prefetcher:
        got = list(prefetcher)
    for (images, labels), indices in zip(got, batches):
        assert np.array_equal(labels, source.labels[rows[indices]])
        assert np.array_equal(images, dataset.batch(indices)[0])       # same indices, same augmentation
    assert len(dataset.limit(4)) == 4


def test_prefetcher_with_several_loaders_keeps_the_order_and_the_data():
    """Batches loaded at once (augmentation in worker processes) come out in order, equal to one loader's."""
    source = ArrayDataset(random_images(count=24), np.arange(24) % 3)
    dataset = AugmentedDataset(source, np.arange(24), Augmenter(workers=2, processes=True), seed=3)
    assert dataset.loads_at_once >= 2
    batches = np.array_split(np.random.default_rng(1).permutation(24), 6)
    try:
        with Prefetcher(batches, dataset.batch, loaders=dataset.loads_at_once) as prefetcher:
            several = list(prefetcher)
        with Prefetcher(batches, dataset.batch) as prefetcher:
            one = list(prefetcher)
    finally:
        dataset.augmenter.close()
    assert len(several) == 6
    for (images, labels), (images_one, labels_one), indices in zip(several, one, batches):
        assert np.array_equal(labels, source.labels[indices]) and np.array_equal(labels, labels_one)
        assert np.array_equal(images, images_one)


# --------------------------------------------------------------------------- training from a folder

def tiny_tomato(tmp_path, classes=("healthy", "late_blight", "mosaic_virus"), per_class=14):
    folder = tmp_path / "tomato"
    for name in classes:
        (folder / name).mkdir(parents=True)
        for photo in sorted((need(TOMATO) / name).iterdir())[:per_class]:
            (folder / name / photo.name).symlink_to(photo)
    return folder


def small_leaf_description(tmp_path, classes, size=40):
    description = json.loads((EXAMPLES / "tomato_leaf.json").read_text())
    description["input_shape"] = [3, size, size]
    description["layers"][-1]["out_features"] = len(classes)
    description["labels"] = [label for label in description["labels"] if label["name"] in classes]
    path = tmp_path / "leaf.json"
    path.write_text(json.dumps(description))
    return path


def test_tomato_description_is_a_small_image_model():
    from lnn.formats.model import load_model

    model = load_model(EXAMPLES / "tomato_leaf.json")
    assert model.input_shape == (3, 128, 128)
    assert model.num_params < 1_000_000
    assert [label["name"] for label in model.labels] == sorted(label["name"] for label in model.labels)
    assert all(label.get("advice") for label in model.labels)


def test_lnn_train_on_a_tiny_tomato_folder(tmp_path, monkeypatch, capsys):
    from lnn.formats.binfile import read_bin
    from lnn.tools.train import main

    classes = ("healthy", "late_blight", "mosaic_virus")
    folder = tiny_tomato(tmp_path, classes)
    monkeypatch.setenv("LNN_CACHE_DIR", str(tmp_path / "cache"))
    description = small_leaf_description(tmp_path, classes)
    code = main([str(description), "--data", f"folder:{folder}", "--epochs", "1", "--batch", "16",
                 "--out", str(tmp_path / "run"), "--device", "cpu", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "33 training rows" in out and "9 validation images" in out
    entry = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(entry["train_loss"]) and "val_accuracy" in entry
    bundle = read_bin(tmp_path / "run" / "model.bin")
    assert [label["display"] for label in bundle.metadata["labels"]] == \
        ["Healthy", "Late blight", "Tomato mosaic virus"]
    assert bundle.metadata["preprocess"]["resize"] == [40, 40]


def test_lnn_train_refuses_labels_that_do_not_match_the_folders(tmp_path, monkeypatch, capsys):
    from lnn.tools.train import main

    folder = tiny_tomato(tmp_path, ("healthy", "late_blight"), per_class=3)
    monkeypatch.setenv("LNN_CACHE_DIR", str(tmp_path / "cache"))
    description = small_leaf_description(tmp_path, ("healthy", "mosaic_virus"))
    code = main([str(description), "--data", f"folder:{folder}", "--out", str(tmp_path / "run"), "--quiet"])
    assert code == 1
    assert "missing from the labels: late_blight" in capsys.readouterr().err


def test_bundled_sample_leaves_are_on_the_validation_side():
    import csv
    import hashlib

    manifest = {row["sha256"]: row["path"] for row in csv.DictReader(open(need(TOMATO / "manifest.csv")))}
    classes, files, labels, _ = scan_folder(TOMATO)
    validation = {files[i] for i in split_by_leaf(files, labels)[1]}
    samples = sorted((EXAMPLES / "leaves").glob("*.jpg"))
    assert len(samples) >= 6
    for sample in samples:
        source = manifest[hashlib.sha256(sample.read_bytes()).hexdigest()]      # unchanged bytes
        assert source.split("/")[0] == sample.stem
        assert source in validation, sample.name


def unwritable_cache_roots(tmp_path) -> list:
    """Cache folders that cannot be written: one beneath a plain file (even root cannot create it) and,
    when the tests do not run as root (who may write anywhere), a read-only folder."""
    (tmp_path / "a_file").write_text("")
    roots = [tmp_path / "a_file" / "cache"]
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        (tmp_path / "read_only").mkdir()
        (tmp_path / "read_only").chmod(0o555)
        roots.append(tmp_path / "read_only" / "cache")
    return roots


def test_an_unwritable_cache_falls_back_to_a_temporary_folder_with_one_warning(tmp_path):
    folder = make_folder(tmp_path / "photos")
    reference = ImageFolder.load(folder, (3, 16, 16), "rgb", cache_root=tmp_path / "cache", log=lambda m: None,
                                 progress=False)
    for root in unwritable_cache_roots(tmp_path):
        messages = []
        data = ImageFolder.load(folder, (3, 16, 16), "rgb", cache_root=root, log=messages.append, progress=False)
        warnings = [m for m in messages if m.startswith("warning:")]
        assert len(warnings) == 1 and "cannot write the image cache" in warnings[0] and "LNN_CACHE_DIR" in warnings[0]
        assert warnings[0].endswith(f"; decoding into the temporary folder {data.cache_dir.parent} for this run only "
                                    f"(set LNN_CACHE_DIR to a writable folder to decode once)")
        assert np.array_equal(data.data.images, reference.data.images) and data.files == reference.files
        assert not data.cache_dir.is_relative_to(root)


def test_a_split_that_leaves_one_side_empty_names_the_problem(tmp_path):
    folder = make_folder(tmp_path / "photos", sizes=((20, 20),))          # class_a: 2 photos, class_b: 1
    data = ImageFolder.load(folder, (3, 8, 8), "rgb", cache_root=tmp_path / "cache", log=lambda m: None,
                            progress=False)
    with pytest.raises(LnnInputError, match="no photo falls on the validation side .* a larger --val-fraction"):
        data.datasets(0.2)
    with pytest.raises(LnnInputError, match="no photo falls on the training side .* a smaller --val-fraction"):
        data.datasets(0.9)


def test_the_cache_files_have_their_disk_space_reserved_before_they_are_written(tmp_path):
    from lnn.train.data import reserved_memmap

    if not hasattr(os, "posix_fallocate"):
        pytest.skip("no posix_fallocate on this system")
    array = reserved_memmap(tmp_path / "x.npy", np.uint8, (64, 3, 32, 32))
    status = os.stat(tmp_path / "x.npy")
    assert status.st_blocks * 512 >= status.st_size >= array.nbytes      # not sparse: no SIGBUS on a full disk
    del array


def test_a_cache_disk_that_fills_up_falls_back_to_a_temporary_folder_then_is_one_line(tmp_path, monkeypatch):
    import errno

    from lnn.train import data as data_module

    if not hasattr(os, "posix_fallocate"):
        pytest.skip("no posix_fallocate on this system")
    folder = make_folder(tmp_path / "photos")
    reference = ImageFolder.load(folder, (3, 16, 16), "rgb", cache_root=tmp_path / "reference", log=lambda m: None,
                                 progress=False)
    real = os.posix_fallocate
    full = [str(tmp_path / "cache")]

    def filling(descriptor, offset, length):
        if any(os.readlink(f"/proc/self/fd/{descriptor}").startswith(root) for root in full):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(descriptor, offset, length)

    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    monkeypatch.setattr(data_module.os, "posix_fallocate", filling)
    messages = []
    data = ImageFolder.load(folder, (3, 16, 16), "rgb", cache_root=tmp_path / "cache", log=messages.append,
                            progress=False)
    warnings = [m for m in messages if m.startswith("warning:")]
    assert len(warnings) == 1 and "No space left on device" in warnings[0] and "temporary folder" in warnings[0]
    assert warnings[0].startswith("warning: cannot write the image cache: No space left on device (") and \
        warnings[0].endswith(f"); decoding into the temporary folder {data.cache_dir.parent} for this run only "
                             f"(free some space or set LNN_CACHE_DIR to a writable folder to decode once)")
    assert np.array_equal(data.data.images, reference.data.images) and data.files == reference.files
    assert not data.cache_dir.is_relative_to(tmp_path / "cache")
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []     # nothing half-written left
    full.append(os.path.realpath(data.cache_dir.parent.parent))                  # the temporary folders fill up too
    with pytest.raises(LnnInputError, match="cannot write the decoded photos .*No space left on device"):
        ImageFolder.load(folder, (3, 8, 8), "rgb", cache_root=tmp_path / "cache", log=lambda m: None, progress=False)


def odd_entries(folder) -> list:
    """A named pipe, a link to /dev/zero, a broken link, a looping pair and a name with a newline, all *.jpg."""
    folder.mkdir(parents=True, exist_ok=True)
    os.mkfifo(folder / "pipe.jpg")
    (folder / "zero.jpg").symlink_to("/dev/zero")
    (folder / "dangling.jpg").symlink_to(folder / "nowhere.jpg")
    (folder / "loop_a.jpg").symlink_to(folder / "loop_b.jpg")
    (folder / "loop_b.jpg").symlink_to(folder / "loop_a.jpg")
    (folder / "new\nline.jpg").write_text("not a photo")
    return ["dangling.jpg", "loop_a.jpg", "loop_b.jpg", "new\nline.jpg", "pipe.jpg", "zero.jpg"]


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"), reason="needs named pipes")
def test_pipes_devices_and_broken_links_named_like_photos_are_skipped_and_counted_not_ignored(tmp_path):
    folder = make_folder(tmp_path / "photos")
    odd = odd_entries(folder / "class_b")
    messages = []
    data = ImageFolder.load(folder, (3, 8, 8), "rgb", cache_root=tmp_path / "cache", log=messages.append,
                            progress=False)
    assert len(data.files) == 7                                                  # the good photos all kept
    assert sorted(f for f, _ in data.skipped) == sorted(["class_b/broken.jpg"] + [f"class_b/{n}" for n in odd])
    reasons = dict(data.skipped)
    assert "named pipe" in reasons["class_b/pipe.jpg"] and "character device" in reasons["class_b/zero.jpg"]
    assert "no such file" in reasons["class_b/dangling.jpg"] and "symbolic links" in reasons["class_b/loop_a.jpg"]
    assert any("7 of 14 image files could not be decoded" in m for m in messages)
    assert all("\n" not in m for m in messages) and any("new\\nline.jpg" in m for m in messages)


@pytest.mark.parametrize("damage", ["index", "index_list", "short_images", "empty_masks", "no_labels"])
def test_a_damaged_cache_is_decoded_again_with_one_warning(tmp_path, damage):
    folder = make_folder(tmp_path / "photos")
    first = ImageFolder.load(folder, (3, 8, 8), "rgb", cache_root=tmp_path / "cache", log=lambda m: None,
                             progress=False)
    reference, cache = np.array(first.data.images), first.cache_dir
    del first
    if damage == "index":
        (cache / "index.json").write_text('{"fil')
    elif damage == "index_list":
        (cache / "index.json").write_text("[]")
    elif damage == "short_images":
        os.truncate(cache / "images.images.npy", 200)
    elif damage == "empty_masks":
        os.truncate(cache / "images.masks.npy", 0)
    else:
        (cache / "images.labels.npy").unlink()
    messages = []
    again = ImageFolder.load(folder, (3, 8, 8), "rgb", cache_root=tmp_path / "cache", log=messages.append,
                             progress=False)
    warnings = [m for m in messages if m.startswith("warning:")]
    assert len(warnings) == 1 and "the image cache is damaged" in warnings[0], messages
    assert again.cache_dir == cache and np.array_equal(again.data.images, reference)
    assert again.masks is not None and again.masks.shape == (7, 8, 8)
    messages.clear()
    ImageFolder.load(folder, (3, 8, 8), "rgb", cache_root=tmp_path / "cache", log=messages.append, progress=False)
    assert not any(m.startswith("warning:") or "decoding" in m for m in messages)


def test_a_file_for_dir_an_empty_class_folder_and_a_single_class_are_named(tmp_path):
    from lnn.train.images import folder_datasets

    (tmp_path / "a_file").write_text("")
    with pytest.raises(LnnInputError, match="a_file: not a folder"):
        scan_folder(tmp_path / "a_file")
    folder = make_folder(tmp_path / "photos")                        # its empty_class/ holds nothing
    messages = []
    ImageFolder.load(folder, (3, 8, 8), "rgb", cache_root=tmp_path / "cache", log=messages.append, progress=False)
    assert any("1 sub-folder without image files left out" in m and m.endswith(": empty_class") for m in messages)
    (tmp_path / "one" / "only").mkdir(parents=True)
    cv2.imwrite(str(tmp_path / "one" / "only" / "a.png"), np.zeros((4, 4, 3), np.uint8))
    description = {"name": "m", "input_shape": [3, 8, 8],
                   "preprocess": {"color": "rgb", "scale": 1 / 255, "mean": [0] * 3, "std": [1] * 3},
                   "layers": [{"type": "global_avg_pool"}, {"type": "linear", "out_features": 2}]}
    with pytest.raises(LnnInputError, match=r"photos of one class only \(only\)"):
        folder_datasets(tmp_path / "one", description, log=lambda m: None, progress=False)


def test_a_class_whose_every_photo_is_bad_is_refused_before_training(tmp_path, monkeypatch):
    """It trained a model with an output no photo had taught (its accuracy counted the other classes only)."""
    folder = make_folder(tmp_path / "photos")
    (folder / "unreadable").mkdir()
    (folder / "unreadable" / "a.jpg").write_text("not a photo")
    monkeypatch.setenv("LNN_CACHE_DIR", str(tmp_path / "cache"))
    description = {"name": "m", "input_shape": [3, 8, 8],
                   "preprocess": {"color": "rgb", "scale": 1 / 255, "mean": [0] * 3, "std": [1] * 3},
                   "layers": [{"type": "global_avg_pool"}, {"type": "linear", "out_features": 3}]}
    with pytest.raises(LnnInputError, match="photos: no photo of class unreadable could be decoded: replace its"):
        images_module.folder_datasets(folder, description, augment=False, log=lambda m: None, progress=False)


def test_one_walk_of_the_folder_serves_the_classes_the_empty_sub_folders_and_the_load(tmp_path, monkeypatch):
    folder = make_folder(tmp_path / "photos")
    scan = scan_folder(folder)
    assert scan.classes == ["class_a", "class_b"] and scan.empty == ["empty_class"]
    walks = []
    real = images_module.scan_folder
    monkeypatch.setattr(images_module, "scan_folder", lambda where: walks.append(where) or real(where))
    monkeypatch.setenv("LNN_CACHE_DIR", str(tmp_path / "cache"))
    description = {"name": "m", "input_shape": [3, 8, 8],
                   "preprocess": {"color": "rgb", "scale": 1 / 255, "mean": [0] * 3, "std": [1] * 3},
                   "layers": [{"type": "global_avg_pool"}, {"type": "linear", "out_features": 2}]}
    messages = []
    images_module.folder_datasets(folder, description, augment=False, val_fraction=0.3, log=messages.append,
                                  progress=False)
    assert walks == [folder]
    assert any("1 sub-folder without image files left out" in m and m.endswith(": empty_class") for m in messages)
