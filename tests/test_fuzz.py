"""The fuzz targets (tests/fuzz.py) in a short fixed run, and the inputs fuzzing has found, kept as cases.

The run is a child process (the fuzzer caps its own address space, which must not cap pytest's) with a
fixed seed and a fixed number of inputs per target, so it is the same run every time."""

import struct
import subprocess
import sys

import pytest

from lnn.formats.errors import LnnError
from lnn.tests import fuzz

EXAMPLES = 150                 # per target: about 10 s in all on the 2-core CI


def test_a_short_fixed_fuzz_run_finds_nothing(tmp_path):
    result = subprocess.run([sys.executable, "-m", "lnn.tests.fuzz", "--examples", str(EXAMPLES), "--seed", "0"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert [line.split(":")[0] for line in result.stdout.splitlines()] == list(fuzz.TARGETS), result.stdout


def test_the_seeds_are_valid_inputs():
    """Each seed passes its target as a valid result (not an LnnError), so mutations start from deep inside."""
    for target, check in fuzz.TARGETS.items():
        for data in fuzz.seeds(target):
            check(data)


def test_a_repaired_header_gets_a_damaged_bin_past_the_checksums():
    data = bytearray(fuzz.seeds("bin")[0])           # REPAIR + a valid .bin
    data[1 + 200] ^= 0x01                            # inside the tensor table
    with pytest.raises(LnnError, match="checksum"):
        fuzz.check_bin(fuzz.AS_IS + bytes(data[1:]))
    with pytest.raises(LnnError) as refused:
        fuzz.check_bin(bytes(data))
    assert "checksum" not in str(refused.value)


def bmp_claiming(height: int) -> bytes:
    """The 24x20 seed BMP with its header's height replaced (the fuzzer's first find: 1048596 rows)."""
    bmp = next(image for image in fuzz.seed_images() if image[:2] == b"BM")
    return bmp[:22] + struct.pack("<i", height) + bmp[26:]


@pytest.mark.parametrize("data", [bmp_claiming(1048596), bmp_claiming(-1048596)], ids=["tall", "tall_top_down"])
def test_found_by_fuzzing_a_bmp_taller_than_the_decoder_allows(data):
    with pytest.raises(LnnError):                   # was a raw cv2.error (CV_IO_MAX_IMAGE_HEIGHT)
        fuzz.check_image(data)
