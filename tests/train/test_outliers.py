"""The outlier split: stable by path, disjoint, about 50/20/30, and independent of what else is there."""

from collections import Counter

import pytest

from lnn.formats.errors import LnnInputError
from lnn.train.outliers import outlier_part, split_outliers


def test_parts_are_disjoint_stable_and_near_their_shares(tmp_path):
    for i in range(400):
        (tmp_path / ("a" if i % 2 else "b")).mkdir(exist_ok=True)
        (tmp_path / ("a" if i % 2 else "b") / f"p{i}.jpg").write_bytes(b"x")
    (tmp_path / "a" / ".hidden.jpg").write_bytes(b"x")
    (tmp_path / "a" / "notes.txt").write_text("x")
    parts = split_outliers(tmp_path)
    every = [p for files in parts.values() for p in files]
    assert len(every) == len(set(every)) == 400
    shares = {name: len(files) / 400 for name, files in parts.items()}
    assert abs(shares["fit"] - 0.5) < 0.08 and abs(shares["validation"] - 0.2) < 0.06
    # a photo's part depends on its own path only: removing the others changes nothing
    one = parts["test"][0]
    assert outlier_part(one.relative_to(tmp_path).as_posix()) == "test"
    assert Counter(outlier_part(f"a/p{i}.jpg") for i in range(1, 400, 2)) == Counter(
        outlier_part(p.relative_to(tmp_path).as_posix()) for p in every if p.parent.name == "a")


def test_missing_or_empty_folder_is_one_clear_error(tmp_path):
    with pytest.raises(LnnInputError, match="no such folder"):
        split_outliers(tmp_path / "absent")
    with pytest.raises(LnnInputError, match="no image files"):
        split_outliers(tmp_path)


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs named pipes")
def test_a_pipe_or_broken_link_named_like_a_photo_is_listed_to_be_skipped_and_counted(tmp_path):
    import os

    (tmp_path / "a").mkdir()
    os.mkfifo(tmp_path / "a" / "pipe.jpg")
    (tmp_path / "a" / "broken.jpg").symlink_to(tmp_path / "nowhere")
    (tmp_path / "a" / "folder.jpg").mkdir()
    listed = sorted(p.name for files in split_outliers(tmp_path).values() for p in files)
    assert listed == ["broken.jpg", "pipe.jpg"]
