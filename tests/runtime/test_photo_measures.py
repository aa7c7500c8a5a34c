"""The CPU backend's compiled photo measures (runtime/cpu/photo_measures.py) against the NumPy reference
(runtime/photo_checks.py copy_statistics), on real and made-up photos, and through Session.check_photo."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import REPO

pytest.importorskip("numba")

LEAVES = REPO / "examples" / "leaves"


def made_up_photos() -> list:
    """Photos the checks must tell apart: dark, blown out, flat grey (blurred), a leaf on black, noise, tiny."""
    rng = np.random.default_rng(3)
    leaf_on_black = np.zeros((300, 300, 3), np.uint8)
    leaf_on_black[80:220, 60:240] = (40, 160, 60)
    return [np.full((256, 256, 3), 12, np.uint8), np.full((256, 256, 3), 252, np.uint8),
            np.full((200, 300, 3), 128, np.uint8), leaf_on_black,
            rng.integers(0, 256, (256, 256, 3), dtype=np.uint8), rng.integers(0, 256, (40, 50, 3), dtype=np.uint8),
            rng.integers(0, 256, (300, 200), dtype=np.uint8)]


def photos() -> list:
    import cv2

    return [cv2.imread(str(path)) for path in sorted(LEAVES.glob("*.jpg"))] + made_up_photos()


@pytest.mark.parametrize("check_size", [256, 37])
def test_compiled_measures_match_the_numpy_reference(check_size):
    from lnn.runtime.cpu.photo_measures import copy_statistics
    from lnn.runtime.photo_checks import measure

    for image in photos():
        expected = measure(image, check_size)
        got = measure(image, check_size, copy_statistics)
        assert set(got) == set(expected)
        for name, value in expected.items():
            if name == "laplacian_variance":
                assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6)
            else:
                assert got[name] == value, name


def test_the_whole_number_leaf_test_is_the_float32_one_for_every_level():
    from lnn.runtime.cpu.photo_measures import SATURATION_DIVISOR, VALUE_FLOOR
    from lnn.runtime.photo_checks import LEAF_SATURATION, LEAF_VALUE

    top = np.arange(256)[:, None]
    spread = np.arange(256)[None, :]
    possible = spread <= top
    by_floats = spread.astype(np.float32) >= np.float32(LEAF_SATURATION) * top.astype(np.float32)
    assert ((SATURATION_DIVISOR * spread >= top) == by_floats)[possible].all()
    levels = np.arange(256)
    assert ((levels >= VALUE_FLOOR) == (levels.astype(np.float32) >= np.float32(LEAF_VALUE * 255))).all()


def test_a_cpu_session_checks_photos_as_a_numpy_one():
    import lnn
    from lnn.tools.infer import DEFAULT_MODEL

    cpu, reference = lnn.load(DEFAULT_MODEL, device="cpu", threads=1), lnn.load(DEFAULT_MODEL, device="numpy")
    for image in photos():
        a, b = cpu.check_photo(image), reference.check_photo(image)
        assert (a.reason, a.detail) == (b.reason, b.detail)
        assert a.measures["leaf_fill"] == b.measures["leaf_fill"]
