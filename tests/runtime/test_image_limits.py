"""Image decoding limits (formats/limits.py), both decoders: pixel bombs refused from the header before
any decoding, big baseline JPEGs decoded reduced, only regular files read and at most so many bytes,
JPEGs with bytes after their end marker decoded, truncated files refused. Every hostile file is made
here, small (a 33000 x 33000 PNG is a header and a few bytes of data)."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import threading
import warnings
import zlib

import numpy as np
import pytest

from conftest import REPO
from hostile_images import png_chunk, png_claiming, with_jpeg_size
from lnn.formats import limits
from lnn.formats.errors import LnnInputError
from lnn.runtime import preprocess
from lnn.tools.infer import DEFAULT_MODEL

cv2 = pytest.importorskip("cv2")
pytest.importorskip("PIL")
LIBRARIES = ["opencv", "pillow"]


@pytest.fixture(params=LIBRARIES)
def library(request, monkeypatch):
    monkeypatch.setattr(preprocess, "_library", request.param)
    return request.param


def photo(height=90, width=120) -> np.ndarray:
    blocks = np.random.default_rng(0).integers(0, 256, (6, 8, 3)).astype(np.uint8)
    return cv2.resize(blocks, (width, height), interpolation=cv2.INTER_CUBIC)


def jpeg(image=None, **options) -> bytes:
    params = [cv2.IMWRITE_JPEG_QUALITY, 92] + [p for key, value in options.items()
                                                for p in (getattr(cv2, f"IMWRITE_JPEG_{key.upper()}"), value)]
    return cv2.imencode(".jpg", photo() if image is None else image, params)[1].tobytes()


def no_decoding(*args):
    raise AssertionError("the decoder was called")


def gif(screen: tuple, image: tuple, before_image: bytes = b"") -> bytes:
    """A GIF's start: its logical screen (width, height) without a colour table, `before_image` (extensions), then
    its first image's descriptor (left, top, width, height) and a few bytes of data."""
    return (b"GIF89a" + struct.pack("<HHBBB", *screen, 0, 0, 0) + before_image + b"," + struct.pack("<4HB", *image, 0)
            + bytes(64))


GIF_EXTENSIONS = b"!\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00" + b"!\xfe\x03,,,\x02;;\x00"   # a loop count, a comment


def tiff(size_entries: list, rows: bytes = b"", before_ifd: bytes = b"") -> bytes:
    """A little-endian TIFF of one uncompressed strip of 8-bit grey `rows`, its first IFD holding `size_entries`
    ((tag, type, count, value): its width and height as the test writes them) and the tags a decoder needs;
    `before_ifd` lies at offset 8, where an entry's value may point."""
    strip_tags = [(258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1), (273, 4, 1, None), (277, 3, 1, 1),
                  (278, 4, 1, 1 << 16), (279, 4, 1, len(rows))]
    entries = size_entries + strip_tags
    ifd_at = 8 + len(before_ifd)
    rows_at = ifd_at + 2 + 12 * len(entries) + 4
    ifd = b"".join(struct.pack("<HHI", tag, kind, count) + struct.pack("<H2x" if kind == 3 else "<I",
                                                                       rows_at if value is None else value)
                   for tag, kind, count, value in entries)
    return b"II*\x00" + struct.pack("<I", ifd_at) + before_ifd + struct.pack("<H", len(entries)) + ifd + bytes(4) + rows


BOMBS = {
    "png_33000": (png_claiming(33000, 33000), "33000x33000 = 1,089,000,000 pixels"),
    "png_30000": (png_claiming(30000, 30000), "30000x30000 = 900,000,000 pixels"),
    "jpeg_65000": (with_jpeg_size(jpeg(), 65000, 65000), "65000x65000 = 4,225,000,000 pixels"),
    "bmp": (b"BM" + bytes(12) + struct.pack("<Iii", 40, 40000, -40000) + bytes(64), "40000x40000"),
    "gif": (gif((65535, 65535), (0, 0, 16, 16)), "65535x65535"),
    "gif_image_over_its_screen": (gif((16, 16), (30000, 30000, 20000, 20000), GIF_EXTENSIONS), "50000x50000"),
    "webp": (b"RIFF" + bytes(4) + b"WEBPVP8X" + bytes(8) + (16383).to_bytes(3, "little") * 2 + bytes(32),
             "16384x16384 = 268,435,456 pixels"),
    "tiff": (b"II*\x00" + struct.pack("<IH", 8, 2) + struct.pack("<HHII", 256, 4, 1, 100000)
             + struct.pack("<HHII", 257, 4, 1, 100000) + bytes(16), "100000x100000"),
    "tiff_repeated_size_tags": (tiff([(256, 4, 1, 100000), (256, 4, 1, 10), (257, 4, 1, 100000), (257, 3, 1, 10)]),
                                "100000x100000"),            # libtiff and Pillow read the first of a repeated tag
    "tiff_8_byte_width": (tiff([(256, 16, 1, 8), (257, 4, 1, 100000)], before_ifd=struct.pack("<Q", 100000)),
                          "100000x100000"),                  # a LONG8 value, at the offset its entry holds
    "pnm": (b"P5\n# made here\n40000 40000\n255\n" + bytes(64), "40000x40000"),
    "pnm_comment_ended_by_cr": (b"P4\n#\r40000 40000\n#x\n1 1\n" + bytes(64), "40000x40000"),   # as OpenCV ends it
}


@pytest.mark.parametrize("case", sorted(BOMBS))
def test_a_pixel_bomb_is_refused_from_its_header_before_decoding(library, monkeypatch, case):
    data, size = BOMBS[case]
    monkeypatch.setattr(preprocess, "_decode", no_decoding)
    with pytest.raises(LnnInputError) as refused:
        preprocess.read_image(data)
    assert str(refused.value) == f"<bytes>: the image is {size.split(' =')[0]} = " \
        f"{int(size.split('x')[0]) * int(size.split('x')[1].split(' ')[0]):,} pixels, " \
        f"over lnn's limit of {limits.MAX_IMAGE_PIXELS:,} pixels"


TIFF_SIZE_TAGS = {
    "repeated, the larger first": [(256, 4, 1, 40), (256, 4, 1, 10), (257, 4, 1, 30), (257, 4, 1, 10)],
    "repeated, the smaller first": [(256, 3, 1, 10), (256, 3, 1, 40), (257, 3, 1, 10), (257, 3, 1, 30)],
    "an 8-byte width": [(256, 16, 1, 8), (257, 3, 1, 30)],
    "signed types": [(256, 9, 1, 40), (257, 8, 1, 30)],
}


@pytest.mark.parametrize("case", sorted(TIFF_SIZE_TAGS))
def test_a_tiff_header_is_never_read_smaller_than_a_decoder_reads_it(library, case):
    """Where a TIFF's size tags are odd, lnn's header reading is at least each decoder's: a repeated tag counts at
    its largest, each value is read as its type says."""
    data = tiff(TIFF_SIZE_TAGS[case], bytes(range(40)) * 30, before_ifd=struct.pack("<Q", 40))
    header = preprocess.read_header(data)
    decoded = preprocess._decode(data, header, [])
    assert decoded is not None and header.width >= decoded.shape[1] and header.height >= decoded.shape[0]
    assert (header.width, header.height) == (40, 30)


def test_a_tiff_size_tag_with_two_values_is_not_read_as_libtiff_refuses_it():
    data = tiff([(256, 4, 2, 8), (257, 3, 1, 30)], bytes(1200), before_ifd=struct.pack("<II", 40, 40))
    assert cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_ANYCOLOR) is None
    assert preprocess.read_header(data) is None


def test_a_pnm_header_is_read_as_both_decoders_read_it_or_refused(library, monkeypatch):
    """A comment ends at a CR as at an LF (both decoders end it so); a comment right after a number, which OpenCV
    ends there and Pillow reads on after, is refused; a size cut by the end of the bytes read for the header is
    not read short."""
    assert preprocess.read_image(b"P5\n#\r30 20\n255\n" + bytes(600)).shape == (20, 30, 3)
    monkeypatch.setattr(preprocess, "_decode", no_decoding)
    with pytest.raises(LnnInputError, match="^<bytes>: the PNM header's size can be read two ways"):
        preprocess.read_image(b"P4\n8#\n900 8#\n900\n" + bytes(64))         # 8x900 to OpenCV, 8900x8900 to Pillow
    cut = b"P4" + b" " * (preprocess.PNM_HEADER_BYTES - 10) + b"40000 40000\n" + bytes(64)    # 40000 40|000
    with pytest.raises(LnnInputError, match="^<bytes>: not an image lnn can read"):
        preprocess.read_image(cut)


def test_a_gif_is_as_large_as_its_first_image_where_that_overflows_its_screen(library):
    """Pillow decodes a GIF at its screen's size grown to hold the first image (OpenCV refuses such a file)."""
    from PIL import Image

    encoded = io.BytesIO()
    Image.new("P", (60, 40), 0).save(encoded, "GIF")
    data = bytearray(encoded.getvalue())
    data[6:10] = struct.pack("<HH", 16, 16)                          # the screen patched smaller than its image
    header = preprocess.read_header(bytes(data))
    assert (header.width, header.height) == (60, 40)
    decoded = preprocess._decode(bytes(data), header, [])
    assert decoded is None if library == "opencv" else decoded.shape[:2] == (40, 60)


def test_a_gif_without_an_image_is_truncated_and_one_over_the_block_limit_refused(library, monkeypatch):
    monkeypatch.setattr(preprocess, "_decode", no_decoding)
    with pytest.raises(LnnInputError, match="^<bytes>: the image is truncated"):
        preprocess.read_image(gif((16, 16), (0, 0, 16, 16), GIF_EXTENSIONS)[:13 + len(GIF_EXTENSIONS)])
    many_sub_blocks = b"!\xfe" + b"\x01x" * limits.MAX_GIF_BLOCKS + b"\x00"
    with pytest.raises(LnnInputError, match=f"^<bytes>: the GIF has more than {limits.MAX_GIF_BLOCKS:,} blocks "):
        preprocess.read_image(gif((16, 16), (0, 0, 16, 16), many_sub_blocks))


def test_a_big_png_that_cannot_be_decoded_reduced_is_refused_over_the_decoding_limit(library, monkeypatch):
    monkeypatch.setattr(preprocess, "_decode", no_decoding)
    with pytest.raises(LnnInputError, match=r"8000x8000 = 64,000,000 pixels; a PNG cannot be decoded at a reduced "
                                            r"size, and lnn's limit for decoding at full size is 50,000,000 pixels"):
        preprocess.read_image(png_claiming(8000, 8000))


def test_a_big_baseline_jpeg_is_decoded_reduced_and_a_progressive_one_refused(library, monkeypatch):
    monkeypatch.setattr(limits, "MAX_DECODED_PIXELS", 4000)        # a 120 x 90 photo stands for a 200 MP one
    image = preprocess.read_image(jpeg())
    assert image.shape == (45, 60, 3)                               # 1/2: the least reduction under the limit
    full = cv2.imdecode(np.frombuffer(jpeg(), np.uint8), cv2.IMREAD_COLOR)
    expected = cv2.resize(full, (60, 45), interpolation=cv2.INTER_AREA)
    assert np.abs(image.astype(int) - expected).mean() < 3          # the same picture, at half the size
    monkeypatch.setattr(limits, "MAX_DECODED_PIXELS", 200)
    assert preprocess.read_image(jpeg()).shape == (12, 15, 3)       # 1/8
    with pytest.raises(LnnInputError, match="a progressive JPEG cannot be decoded at a reduced size"):
        preprocess.read_image(jpeg(progressive=1))


def test_a_baseline_jpeg_larger_than_needed_is_decoded_reduced_to_no_less_than_its_keep_side(library):
    data = jpeg(photo(90, 120))
    assert preprocess.decode_image(data).shape == (90, 120, 3)                   # nothing asked: full size
    assert preprocess.decode_image(data, keep_side=40).shape == (45, 60, 3)      # 1/4 would leave 23 rows
    assert preprocess.decode_image(data, keep_side=11).shape == (12, 15, 3)      # 1/8
    assert preprocess.decode_image(data, keep_side=46).shape == (90, 120, 3)     # 1/2 would leave 45 rows
    progressive = jpeg(photo(90, 120), progressive=1)
    assert preprocess.decode_image(progressive, keep_side=11).shape == (90, 120, 3)
    png = cv2.imencode(".png", photo(90, 120))[1].tobytes()
    assert preprocess.decode_image(png, keep_side=11).shape == (90, 120, 3)


def test_a_session_decodes_a_big_phone_photo_reduced_with_the_same_answer():
    """The bundled model needs 256 pixels a side (its photo checks' copy; its input is 128): a 1600 x 1200 JPEG is
    decoded at 1/4 (400 x 300), and its answer is the full-size decoding's (by hand, 150 PlantVillage photos
    enlarged to phone sizes: the same top class in all, the largest change of any probability 0.057, median 0)."""
    from lnn.runtime import load

    session = load(DEFAULT_MODEL, device="numpy")
    assert session.decode_side() == 256
    leaf = cv2.imread(str(REPO / "examples" / "leaves" / "late_blight.jpg"))
    big = cv2.resize(leaf, (1600, 1200), interpolation=cv2.INTER_CUBIC)
    data = cv2.imencode(".jpg", big, [cv2.IMWRITE_JPEG_QUALITY, 92])[1].tobytes()
    x, check = session.prepare_and_check(data)
    assert (check.measures["width"], check.measures["height"]) == (400, 300)
    full_x, full_check = session.prepare_and_check(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR))
    assert (full_check.measures["width"], check.reason) == (1600, full_check.reason)
    assert np.abs(x - full_x).mean() < 0.02                                       # normalized units (1/255 / std ~ 0.017)
    reduced, full = session.predict_image(data), session.predict_image(big)
    assert reduced[0][0] == full[0][0] and abs(reduced[0][1] - full[0][1]) < 0.01


def test_both_decoders_reduce_a_big_jpeg_alike(monkeypatch):
    monkeypatch.setattr(limits, "MAX_DECODED_PIXELS", 4000)
    decoded = {}
    for name in LIBRARIES:
        monkeypatch.setattr(preprocess, "_library", name)
        decoded[name] = preprocess.read_image(jpeg()).astype(int)
    assert np.abs(decoded["opencv"] - decoded["pillow"]).max() <= 2


def test_pillow_gives_no_decompression_bomb_warning_for_a_100_megapixel_photo(monkeypatch):
    from PIL import Image

    monkeypatch.setattr(preprocess, "_library", "pillow")
    monkeypatch.setattr(preprocess, "_decode_jpeg", lambda data, header, notes: None)   # as for a JPEG TurboJPEG
    data = with_jpeg_size(jpeg(), 12000, 9000)     # refuses outright: the image library decodes it. 108 MP: Pillow's
    with warnings.catch_warnings():                # default warns above 89 MP
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            preprocess.read_image(data)                             # its data is a small photo's: decoded or refused
        except LnnInputError as err:
            assert "not an image Pillow can decode" in str(err)


def test_bytes_after_the_end_marker_are_decoded_and_a_truncated_file_is_refused(library, tmp_path):
    from lnn.train.images import decode_for_model

    whole = jpeg()
    expected = preprocess.read_image(whole)
    for trailer in (b"SEFHsamsung trailer" * 20, jpeg(photo(30, 40)), b"\x00" * 100):    # phones append these
        path = tmp_path / "phone.jpg"
        path.write_bytes(whole + trailer)
        assert np.array_equal(preprocess.read_image(path), expected)
        assert decode_for_model(path, (32, 32), "rgb").shape == (3, 32, 32)          # training decodes it too
    with_thumbnail = whole[:2] + b"\xff\xe1" + struct.pack(">H", 2 + 64) \
        + jpeg(photo(8, 8))[:60] + b"\xff\xd9\x00\x00" + whole[2:]                    # an APP1 holding an end marker
    for cut in (whole[:len(whole) // 2], whole[:200], with_thumbnail[:len(with_thumbnail) // 2]):
        with pytest.raises(LnnInputError, match="<bytes>: the image is truncated"):
            preprocess.read_image(cut)
    png = cv2.imencode(".png", photo())[1].tobytes()
    assert np.array_equal(preprocess.read_image(png + b"trailing bytes"), preprocess.read_image(png))
    with pytest.raises(LnnInputError, match="truncated"):
        preprocess.read_image(png[:-20])


def test_a_jpeg_over_the_scan_or_segment_limits_is_refused(library):
    scan = b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00" + b"\x12\x34"
    many_scans = jpeg()[:-2] + scan * (limits.MAX_JPEG_SCANS + 1) + b"\xff\xd9"
    with pytest.raises(LnnInputError, match=f"more than {limits.MAX_JPEG_SCANS} scans"):
        preprocess.read_image(many_scans)
    many_segments = b"\xff\xd8" + b"\xff\xfe\x00\x02" * (limits.MAX_JPEG_SEGMENTS + 1) + jpeg()[2:]
    with pytest.raises(LnnInputError, match=f"more than {limits.MAX_JPEG_SEGMENTS} segments"):
        preprocess.read_image(many_segments)


def test_a_png_over_the_chunk_limit_is_refused(library, monkeypatch):
    """Each chunk a PNG's pixel chunks keep is held until they are joined: 8 M empty IDAT chunks took 2.5 GB."""
    monkeypatch.setattr(limits, "MAX_PNG_CHUNKS", 20)
    encoded = cv2.imencode(".png", photo(16, 16))[1].tobytes()
    idat_end = encoded.index(b"IEND") - 4
    with_empty_idats = encoded[:idat_end] + png_chunk(b"IDAT", b"") * (20 - 3) + encoded[idat_end:]   # 20 in all
    assert preprocess.read_image(with_empty_idats).shape == (16, 16, 3)
    with pytest.raises(LnnInputError, match="^<bytes>: the PNG has more than 20 chunks \\(lnn's limit\\)$"):
        preprocess.read_image(with_empty_idats[:idat_end] + png_chunk(b"IDAT", b"") + with_empty_idats[idat_end:])


def test_a_png_whose_image_data_inflates_far_beyond_its_image_is_refused_before_opencv(library):
    """libpng inflated a PNG's image data whole, past the rows its image needs: a 100x100 PNG carrying 500 MB of
    zeros (486 KB) took OpenCV 1 s, and one at the upload limit would take minutes. Refused before OpenCV decodes it;
    Pillow stops where the image is whole. An interlaced PNG's data, whose rows are counted pass by pass, decodes."""
    def grey_png(width, height, interlaced, image_data):
        header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, interlaced)
        return (preprocess.PNG_SIGNATURE + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(image_data))
                + png_chunk(b"IEND", b""))

    interlaced = grey_png(37, 29, 1, bytes(preprocess.png_image_bytes(grey_png(37, 29, 1, b""))))
    assert preprocess.read_image(interlaced).shape == (29, 37, 3)
    bomb = grey_png(100, 100, 0, bytes(100 * 101 + 50_000_000))
    if library == "opencv":
        with pytest.raises(LnnInputError, match="inflates to more than 85,736 bytes, where its image needs 10,100 "
                                                "\\(a decompression bomb\\)$"):
            preprocess.read_image(bomb)
    else:
        assert preprocess.read_image(bomb).shape == (100, 100, 3)


def finishes(function, seconds=10.0):
    """function() run on a daemon thread: (finished in time, its exception or None)."""
    outcome = {}

    def run():
        try:
            function()
        except Exception as err:           # noqa: BLE001 - returned to the test
            outcome["error"] = err
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), outcome.get("error")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_only_regular_files_are_read(library, tmp_path):
    pipe = tmp_path / "leaf.jpg"
    os.mkfifo(pipe)
    done, error = finishes(lambda: preprocess.read_image(pipe))
    assert done, "reading a named pipe hung"
    assert isinstance(error, LnnInputError) and str(error) == f"{pipe}: is a named pipe, not an image file"
    if os.path.exists("/dev/zero"):
        with pytest.raises(LnnInputError, match="^/dev/zero: is a character device, not an image file$"):
            preprocess.read_image("/dev/zero")
    with pytest.raises(LnnInputError, match="is a folder"):
        preprocess.read_image(tmp_path)


def test_at_most_so_many_bytes_are_read(library, monkeypatch, tmp_path):
    monkeypatch.setattr(limits, "MAX_IMAGE_FILE_BYTES", 1000)
    big = tmp_path / "big.png"
    big.write_bytes(cv2.imencode(".png", photo())[1].tobytes())
    with pytest.raises(LnnInputError, match=rf"big.png: the file is {big.stat().st_size:,} bytes, "
                                            rf"over lnn's limit of 1,000 bytes for an image"):
        preprocess.read_image(big)


@pytest.mark.slow
@pytest.mark.parametrize("image_library", LIBRARIES)
def test_a_200_megapixel_phone_jpeg_is_answered_within_1_gb(tmp_path, image_library):
    """lnn-infer on a 16320 x 12240 baseline JPEG (made in a child process): answered, peak memory < 1 GiB."""
    path = tmp_path / "phone.jpg"
    make = ("import cv2, numpy as np; y, x = np.ogrid[:12240, :16320]; image = np.empty((12240, 16320, 3), np.uint8); "
            "image[..., 0] = (x % 256).astype(np.uint8); image[..., 1] = (y % 256).astype(np.uint8); "
            "image[..., 2] = ((x + y) // 64 % 256).astype(np.uint8); "
            f"cv2.imwrite({str(path)!r}, image, [cv2.IMWRITE_JPEG_QUALITY, 80])")
    subprocess.run([sys.executable, "-c", make], check=True)
    measure = ("import sys; from lnn.tools.bench import peak_rss_bytes; from lnn.tools.infer import main; "
               "status = main(sys.argv[1:]); print(peak_rss_bytes() // 1024); sys.exit(status)")
    result = subprocess.run([sys.executable, "-c", measure, "--json", "--model", str(DEFAULT_MODEL), str(path)],
                            capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={**os.environ, "LNN_IMAGE_LIBRARY": image_library})
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""                                   # no warning lines (Pillow's bomb warning)
    answer, peak_kib = result.stdout.splitlines()
    assert '"label"' in answer
    assert int(peak_kib) < 1024 * 1024, f"peak {int(peak_kib) / 1024:.0f} MiB"
