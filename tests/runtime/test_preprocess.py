"""runtime/preprocess.py without OpenCV (Pillow decodes, NumPy resizes), as the packaged lnn-field runs it,
against the OpenCV path as the independent reference: same pixels up to rounding, same answers."""

import io

import numpy as np
import pytest

from conftest import EXAMPLES
from hostile_images import HEIC_START
import lnn
from lnn.formats.errors import LnnInputError
from lnn.runtime import preprocess
from lnn.tools.infer import DEFAULT_MODEL

cv2 = pytest.importorskip("cv2")
pytest.importorskip("PIL")
LEAVES = sorted((EXAMPLES / "leaves").glob("*.jpg"))


@pytest.fixture
def use(monkeypatch):
    def choose(library):
        monkeypatch.setattr(preprocess, "_library", library)
    return choose


def photo_like(height=457, width=613):
    """A smooth random colour image (blocks blurred by a cubic enlargement), not noise."""
    blocks = np.random.default_rng(0).integers(0, 256, (40, 50, 3)).astype(np.uint8)
    return cv2.resize(blocks, (width, height), interpolation=cv2.INTER_CUBIC)


@pytest.mark.parametrize("size", [(128, 128), (100, 77), (613, 100), (700, 500), (1226, 914), (128, 600), (613, 457)],
                         ids=["shrink", "shrink_uneven", "one_side", "enlarge", "double", "mixed", "same"])
def test_numpy_resize_matches_opencv(use, size):
    image = photo_like()
    for source, tolerance in [(image, 1), (image[:, :, :1], 1), (image.astype(np.float32) / 255, 1e-4)]:
        use("opencv")
        expected = preprocess.resize_image(source, *size).astype(np.float64)
        use("pillow")
        got = preprocess.resize_image(source, *size)
        assert got.shape == expected.shape and got.dtype in (source.dtype, np.float32)
        assert np.abs(got - expected).max() <= tolerance, size


def test_pillow_decodes_jpeg_and_png_like_opencv(use, tmp_path):
    png, png16, gray16 = tmp_path / "leaf.png", tmp_path / "leaf16.png", tmp_path / "gray16.png"
    cv2.imwrite(str(png), photo_like(61, 47))
    cv2.imwrite(str(png16), photo_like(61, 47).astype(np.uint16) * 257 + 100)
    cv2.imwrite(str(gray16), photo_like(61, 47)[:, :, 1].astype(np.uint16) * 257 + 100)
    for path in [*LEAVES, png, png16, gray16]:
        use("opencv")
        expected = preprocess.read_image(path)
        use("pillow")
        assert np.array_equal(preprocess.read_image(path), expected), path.name


def test_pillow_applies_the_exif_orientation_like_opencv(use):
    from PIL import Image

    image = Image.fromarray(photo_like(40, 60)[:, :, ::-1].copy())
    exif = Image.Exif()
    exif[0x0112] = 6                                   # orientation: rotate 90 degrees clockwise to view
    encoded = io.BytesIO()
    image.save(encoded, "JPEG", exif=exif, quality=95)
    use("opencv")
    expected = preprocess.read_image(encoded.getvalue())
    use("pillow")
    got = preprocess.read_image(encoded.getvalue())
    assert got.shape == expected.shape == (60, 40, 3)
    assert np.abs(got.astype(int) - expected).max() <= 1


def test_gray_matches_opencv(use):
    image = photo_like()
    use("pillow")
    assert np.abs(preprocess._bgr_to_gray(image).astype(int) - cv2.cvtColor(image, cv2.COLOR_BGR2GRAY)).max() <= 1


def test_pillow_refuses_a_non_image_in_one_line(use, tmp_path):
    use("pillow")
    text = tmp_path / "notes.jpg"
    text.write_text("not a photo")
    with pytest.raises(LnnInputError, match=r"notes.jpg: not an image lnn can read \(JPEG, PNG"):
        preprocess.read_image(text)


@pytest.mark.parametrize("start, says", [
    (HEIC_START, "a HEIC photo (an iPhone's own format), which lnn cannot read; save or send it as JPEG"),
    (b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1miaf", "an AVIF picture"),
    (b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00isomiso2avc1mp41", "a video, not a photo"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "a JPEG XL picture"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "a JPEG 2000 picture"),
    (b"%PDF-1.7\n", "a PDF document, not a photo"),
    (b"\xef\xbb\xbf<?xml version='1.0'?>\n<svg xmlns='http://www.w3.org/2000/svg'/>", "an SVG drawing"),
    (b"<!DOCTYPE html><html><body>502 Bad Gateway", "a web page (HTML)"),
    (b"\x00\x00\x00\x18ftypcrx \x00\x00\x00\x01crx isom", "not an image lnn can read (JPEG, PNG"),  # a Canon raw
])
def test_a_file_people_send_for_a_photo_that_lnn_cannot_read_is_named_with_what_to_do(start, says):
    with pytest.raises(LnnInputError) as refused:
        preprocess.decode_image(start + bytes(200), "IMG_0042")
    assert str(refused.value).startswith(f"IMG_0042: {says}") and "\n" not in str(refused.value)


def test_the_sample_leaves_get_the_same_answers_without_opencv(use):
    session = lnn.load(DEFAULT_MODEL, device="numpy")
    for leaf in LEAVES:
        use("opencv")
        expected = session.predict_image(leaf)
        use("pillow")
        got = session.predict_image(leaf)
        assert got[0][0] == expected[0][0], leaf.name
        assert abs(got[0][1] - expected[0][1]) <= 0.005, leaf.name            # 0.5 percentage points


@pytest.mark.parametrize("library", ["opencv", "pillow"])
def test_decode_image_takes_an_encoded_uint8_array_and_refuses_what_it_cannot_take(use, library):
    """cv2.imencode's array (1-D or [N, 1] uint8) is encoded bytes; an int, None or a decoded image is one line."""
    use(library)
    image = photo_like(40, 50)
    encoded = cv2.imencode(".png", image)[1].reshape(-1)
    for given in (encoded, encoded[:, None]):
        assert np.array_equal(preprocess.decode_image(given), preprocess.decode_image(encoded.tobytes()))
    session = lnn.load(DEFAULT_MODEL, device="numpy")
    assert session.decode_photo(encoded[:, None]).shape == (40, 50, 3)
    takes = "a photo to decode is a path, encoded bytes, or a uint8 array of them (1-D or [N, 1], as cv2.imencode gives)"
    for given, what in ((3, "int 3"), (None, "NoneType None"),
                        (image, "a uint8 array of shape [40, 50, 3] (a decoded image goes to prepare_image)")):
        with pytest.raises(LnnInputError) as err:
            session.decode_photo(given)
        assert str(err.value) == f"<image>: {takes}; not {what}"
