"""Session.prepare_image / predict_image on arrays a caller may pass: the documented rules (uint8 0..255,
other integers within 0..255, float 0..255 or 0..1 with a note, HxW / HxWx1 grey, HxWx4 alpha ignored)
and one LnnInputError line for the rest; a grey photo given to a colour model is converted with a note."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import lnn
from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes
from lnn.formats.model import parse_model
from lnn.runtime import Session

rng = np.random.default_rng(0)
IMAGE = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)


def session(color="rgb") -> Session:
    channels = 1 if color == "gray" else 3
    model = parse_model({"name": "tiny", "input_shape": [channels, 8, 8], "labels": ["a", "b"],
                         "preprocess": {"color": color},
                         "layers": [{"type": "conv2d", "out_channels": 4, "kernel_size": 3, "activation": "relu"},
                                    {"type": "global_avg_pool"}, {"type": "linear", "out_features": 2}]})
    weights = {k: rng.standard_normal(s).astype(np.float32) for k, s in model.param_shapes().items()}
    return Session(parse_bin_bytes(encode_bin(model, weights, build_metadata(model))), "numpy")


@pytest.mark.parametrize("image, message", [
    (IMAGE.astype(bool), "a bool array is not an image"),
    (IMAGE.astype(np.int64) * 300, r"integer image values must be 0..255 \(8-bit\), got 0..76500"),
    (-IMAGE.astype(np.int16), "integer image values must be 0..255"),
    (np.zeros((0, 5, 3), np.uint8), r"the image is empty \(shape \[0, 5, 3\]\)"),
    (np.zeros((4, 0), np.uint8), "the image is empty"),
    (np.zeros(30, np.uint8), r"an image must be HxW, HxWx3 or HxWx4 \(BGRA\), got shape \[30\]"),
    (np.zeros((2, 4, 4, 3), np.uint8), "got shape \\[2, 4, 4, 3\\]"),
    (np.zeros((4, 4, 2), np.uint8), "got shape \\[4, 4, 2\\]"),
    (np.where(IMAGE > 128, np.nan, IMAGE.astype(np.float64)), "the image holds NaN or infinite values"),
    (np.full((4, 4, 3), np.inf, np.float32), "NaN or infinite"),
    (IMAGE.astype(np.float32) * 2, r"float image values must be within 0..1 or 0..255, got 0..510"),
    (IMAGE.astype(np.complex64), "an image must hold numbers"),
    (np.array([["a"] * 3] * 3), "an image must hold numbers"),
])
def test_odd_arrays_are_one_input_error_line(image, message):
    with pytest.raises(lnn.LnnInputError, match=message) as refused:
        session().predict_image(image)
    assert "\n" not in str(refused.value)


def test_integer_float_and_alpha_arrays_give_the_uint8_answer():
    s = session()
    expected = s.prepare_image(IMAGE)
    for same in (IMAGE.astype(np.int64), np.dstack([IMAGE, np.full(IMAGE.shape[:2], 7, np.uint8)])):
        np.testing.assert_array_equal(s.prepare_image(same), expected)
    for same in (IMAGE.astype(np.float64), IMAGE.astype(np.float16)):      # resized as floats, not rounded to uint8
        np.testing.assert_allclose(s.prepare_image(same), expected, atol=0.5 / 255 + 1e-5)


def test_a_float_image_in_0_to_1_is_read_as_such_and_says_so():
    s = session()
    notes = []
    got = s.prepare_image(IMAGE.astype(np.float32) / 255, notes=notes)
    np.testing.assert_allclose(got, s.prepare_image(IMAGE), atol=0.5 / 255 + 1e-5)
    assert notes == ["the float image's values are all within 0..1: read as 0..1 (x 255); pass uint8 0..255 to avoid this guess"]
    with pytest.warns(lnn.LnnWarning, match="read as 0..1"):
        s.predict_image(IMAGE.astype(np.float64) / 255)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.predict_image(IMAGE.astype(np.float32))               # 0..255 floats: no note


def test_a_grey_photo_in_a_colour_model_is_converted_with_a_note():
    import cv2

    grey = IMAGE[:, :, 1]
    encoded = cv2.imencode(".png", grey)[1].tobytes()
    for s in (session("rgb"), session("bgr")):
        expected = s.prepare_image(np.dstack([grey] * 3))
        for image in (grey, grey[:, :, None], encoded):
            notes = []
            np.testing.assert_array_equal(s.prepare_image(image, notes=notes), expected)
            assert len(notes) == 1 and notes[0].startswith("a grey image given to a colour")
        with pytest.warns(lnn.LnnWarning, match="grey"):
            s.predict_image(encoded)
    gray_model = session("gray")
    notes = []
    gray_model.prepare_image(encoded, notes=notes)
    gray_model.prepare_image(IMAGE, notes=notes)
    assert notes == []                                          # what a grey model expects: nothing to say


@pytest.mark.parametrize("library", ["opencv", "pillow"])
def test_resizing_then_reordering_channels_equals_the_other_order(library, monkeypatch):
    """preprocess_image reorders channels after the resize now (a copy of fewer pixels): exactly the same."""
    from lnn.runtime import preprocess

    monkeypatch.setattr(preprocess, "_library", library)
    big = rng.integers(0, 256, (67, 93, 3), dtype=np.uint8)
    for size in ((8, 8), (120, 40)):
        np.testing.assert_array_equal(preprocess.resize_image(big, *size)[:, :, ::-1],
                                      preprocess.resize_image(np.ascontiguousarray(big[:, :, ::-1]), *size))


def test_the_decoders_print_nothing_on_stderr(tmp_path, capfd):
    """A PNG with a damaged colour profile or an over-long text chunk is decoded without libpng's warning lines
    (its pixels as without those chunks; EXIF kept), and OpenCV's TIFF warning on a float TIFF stays quiet:
    lnn reports a problem in one line itself."""
    import zlib

    import cv2
    from hostile_images import png_chunk
    from lnn.runtime.preprocess import decode_image, png_pixel_chunks

    png = cv2.imencode(".png", IMAGE)[1].tobytes()
    before_data = png.index(b"IDAT") - 4
    chunks = {"bad_profile": png_chunk(b"iCCP", b"icc\x00\x00" + zlib.compress(bytes(100))),
              "text_bomb": png_chunk(b"zTXt", b"Comment\x00\x00" + zlib.compress(bytes(10**7), 9)),
              "exif": png_chunk(b"eXIf", b"MM\x00*\x00\x00\x00\x08\x00\x00")}
    for name, chunk in chunks.items():
        (tmp_path / f"{name}.png").write_bytes(png[:before_data] + chunk + png[before_data:])
        assert np.array_equal(decode_image(tmp_path / f"{name}.png"), IMAGE)
    assert chunks["exif"] in png_pixel_chunks((tmp_path / "exif.png").read_bytes())
    cv2.imwrite(str(tmp_path / "float.tif"), IMAGE.astype(np.float32))
    with pytest.raises(lnn.LnnInputError, match="float.tif: not an image OpenCV can decode"):
        decode_image(tmp_path / "float.tif")
    assert capfd.readouterr().err == ""


def test_color_is_bgr_or_rgb_in_either_case_and_anything_else_is_one_line():
    tiny = session()
    rgb = IMAGE[:, :, ::-1]
    expected = tiny.prepare_image(rgb, color="rgb")
    assert np.array_equal(tiny.prepare_image(rgb, color="RGB"), expected)        # was read as BGR
    assert tiny.predict_image(rgb, color="Rgb") == tiny.predict_image(IMAGE)
    for color in ("xyz", "", None, "gray"):
        with pytest.raises(lnn.LnnInputError) as err:
            tiny.predict_image(IMAGE, color=color)
        assert str(err.value) == f"color must be 'bgr' or 'rgb' (the order of the image's channels), not {color!r}"
