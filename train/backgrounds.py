"""Procedural backgrounds for leaves cut out of their lab photo (no photo is ever used).

    picture = background("soil", np.random.default_rng(7), 128, 128)      # uint8 [H, W, 3], RGB

Every background is drawn from a Generator with OpenCV's drawing, resizing and blurring calls (which
release the GIL, so augmentation threads run them in parallel), in about a millisecond at 128 x 128.
Families:
  training (TRAINING_KINDS, what train/augment.py's "background" draws from):
    soil      brown earth: multi-octave value noise for clods, dark and light specks, a few pebbles
    foliage   out-of-focus leaves: many green ellipses of varied shade over dark green, then blurred
    texture   regular patterns: gratings, checkerboards, wood-like rings, in two random colours, noisy
    clutter   a gradient with random rectangles, circles, lines, polygons and blurred colour blobs
  held out (HELD_OUT_KINDS, only benchmarks/shifted_accuracy.py uses them, so that benchmark measures
  generalisation to backgrounds of a kind training never saw, not memory of the training ones):
    grass     thin blades in greens and straw over dark earth
    bokeh     dark scene with large blurred discs of light
    concrete  grey fractal stone with cracks and stains
"""

from __future__ import annotations

import colorsys
import math

import numpy as np

TRAINING_KINDS = ("soil", "foliage", "texture", "clutter")
HELD_OUT_KINDS = ("grass", "bokeh", "concrete")


def _opencv():
    import cv2

    return cv2


def hsv_colour(hue: float, saturation: float, value: float) -> tuple:
    """RGB 0..255 floats of a hue in degrees and saturation, value in 0..1."""
    red, green, blue = colorsys.hsv_to_rgb((hue % 360) / 360, min(max(saturation, 0), 1), min(max(value, 0), 1))
    return (red * 255, green * 255, blue * 255)


def value_noise(rng: np.random.Generator, height: int, width: int, octaves: int = 4, base: int = 4,
                persistence: float = 0.55) -> np.ndarray:
    """float32 [H, W] fractal noise, mean 0, roughly unit spread: random grids of base*2^k cells,
    each resized (bicubic) to the full size and summed with weights persistence^k."""
    cv2 = _opencv()
    total = np.zeros((height, width), np.float32)
    weight, weights = 1.0, 0.0
    for octave in range(octaves):
        cells = base * 2 ** octave
        grid = rng.standard_normal((cells, cells)).astype(np.float32)
        total += weight * cv2.resize(grid, (width, height), interpolation=cv2.INTER_CUBIC)
        weights += weight
        weight *= persistence
    return total / weights


def _tinted(field: np.ndarray, colour: tuple, spread: float) -> np.ndarray:
    """float32 [H, W, 3]: colour * (1 + spread * field), per channel."""
    shade = 1 + spread * field[..., None]
    return shade * np.asarray(colour, np.float32)


def _finish(picture: np.ndarray) -> np.ndarray:
    return np.clip(picture, 0, 255).astype(np.uint8)


# --------------------------------------------------------------------------- training families

def soil(rng, height, width):
    cv2 = _opencv()
    colour = hsv_colour(rng.uniform(18, 42), rng.uniform(0.35, 0.75), rng.uniform(0.18, 0.5))
    picture = _tinted(value_noise(rng, height, width, octaves=5, base=int(rng.integers(3, 8))), colour, 0.45)
    specks = rng.random((height, width)) < rng.uniform(0.01, 0.06)
    picture[specks] *= rng.uniform(0.3, 1.7)
    for _ in range(int(rng.integers(0, 8))):
        centre = (int(rng.integers(0, width)), int(rng.integers(0, height)))
        axes = (int(rng.integers(2, max(3, width // 14))), int(rng.integers(2, max(3, height // 14))))
        grey = rng.uniform(60, 200)
        cv2.ellipse(picture, centre, axes, rng.uniform(0, 180), 0, 360,
                    (grey * rng.uniform(0.9, 1.1), grey, grey * rng.uniform(0.85, 1.0)), -1, cv2.LINE_AA)
    return _finish(cv2.GaussianBlur(picture, (0, 0), rng.uniform(0.4, 1.2)))


def foliage(rng, height, width):
    cv2 = _opencv()
    base = hsv_colour(rng.uniform(70, 150), rng.uniform(0.4, 0.9), rng.uniform(0.08, 0.3))
    picture = _tinted(value_noise(rng, height, width, octaves=3), base, 0.5)
    for _ in range(int(rng.integers(15, 50))):
        centre = (int(rng.integers(-width // 8, width + width // 8)), int(rng.integers(-height // 8, height + height // 8)))
        length = rng.uniform(0.06, 0.3) * width
        axes = (int(length), int(length * rng.uniform(0.25, 0.6)))
        colour = hsv_colour(rng.uniform(55, 150), rng.uniform(0.3, 0.95), rng.uniform(0.2, 0.85))
        cv2.ellipse(picture, centre, axes, rng.uniform(0, 180), 0, 360, colour, -1, cv2.LINE_AA)
    return _finish(cv2.GaussianBlur(picture, (0, 0), rng.uniform(0.5, 4.0)))


def texture(rng, height, width):
    cv2 = _opencv()
    first = np.asarray(hsv_colour(rng.uniform(0, 360), rng.uniform(0, 0.8), rng.uniform(0.15, 0.95)), np.float32)
    second = np.asarray(hsv_colour(rng.uniform(0, 360), rng.uniform(0, 0.8), rng.uniform(0.15, 0.95)), np.float32)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = rng.uniform(0, math.pi)
    period = rng.uniform(4, 30)
    along = (xs * math.cos(angle) + ys * math.sin(angle)) / period
    pattern = int(rng.integers(0, 3))
    if pattern == 0:                                                     # grating
        mix = 0.5 + 0.5 * np.sin(2 * math.pi * along)
    elif pattern == 1:                                                   # checkerboard
        across = (-xs * math.sin(angle) + ys * math.cos(angle)) / period
        mix = ((np.floor(along) + np.floor(across)) % 2).astype(np.float32)
    else:                                                                # wood-like rings, warped by noise
        cx, cy = rng.uniform(-width, 2 * width), rng.uniform(-height, 2 * height)
        radius = np.sqrt((xs - cx) ** 2 + (ys - cy) ** 2) / period
        mix = 0.5 + 0.5 * np.sin(2 * math.pi * (radius + 0.8 * value_noise(rng, height, width, octaves=2)))
    picture = first + mix[..., None] * (second - first)
    picture *= 1 + 0.12 * value_noise(rng, height, width, octaves=4, base=8)[..., None]
    picture += rng.normal(0, rng.uniform(1, 8), picture.shape).astype(np.float32)
    return _finish(cv2.GaussianBlur(picture, (0, 0), rng.uniform(0.3, 1.5)))


def clutter(rng, height, width):
    cv2 = _opencv()
    start = np.asarray(hsv_colour(rng.uniform(0, 360), rng.uniform(0, 0.7), rng.uniform(0.1, 1)), np.float32)
    end = np.asarray(hsv_colour(rng.uniform(0, 360), rng.uniform(0, 0.7), rng.uniform(0.1, 1)), np.float32)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = rng.uniform(0, 2 * math.pi)
    ramp = (xs / width * math.cos(angle) + ys / height * math.sin(angle) + 1) / 2
    picture = start + np.clip(ramp, 0, 1)[..., None] * (end - start)
    small = (max(1, height // 8), max(1, width // 8))           # blurred blobs, drawn at 1/8 size
    blobs = np.zeros(small + (3,), np.float32)
    for _ in range(int(rng.integers(2, 7))):
        centre = (int(rng.integers(0, small[1])), int(rng.integers(0, small[0])))
        cv2.circle(blobs, centre, int(rng.integers(max(1, small[1] // 10), max(2, small[1] // 3))),
                   hsv_colour(rng.uniform(0, 360), rng.uniform(0.2, 1), rng.uniform(0.3, 1)), -1)
    blobs = cv2.resize(cv2.GaussianBlur(blobs, (0, 0), 1.2), (width, height), interpolation=cv2.INTER_CUBIC)
    picture = 0.6 * picture + 0.4 * blobs
    for _ in range(int(rng.integers(4, 16))):
        colour = hsv_colour(rng.uniform(0, 360), rng.uniform(0, 1), rng.uniform(0.05, 1))
        shape = int(rng.integers(0, 4))
        x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
        size = int(rng.integers(3, max(4, width // 3)))
        if shape == 0:
            cv2.rectangle(picture, (x, y), (x + size, y + int(size * rng.uniform(0.3, 2))), colour, -1)
        elif shape == 1:
            cv2.circle(picture, (x, y), size // 2, colour, -1, cv2.LINE_AA)
        elif shape == 2:
            cv2.line(picture, (x, y), (int(rng.integers(0, width)), int(rng.integers(0, height))), colour,
                     int(rng.integers(1, 5)), cv2.LINE_AA)
        else:
            points = np.stack([x + rng.integers(-size, size + 1, 5), y + rng.integers(-size, size + 1, 5)], 1)
            cv2.fillPoly(picture, [points.astype(np.int32)], colour, cv2.LINE_AA)
    return _finish(cv2.GaussianBlur(picture, (0, 0), rng.uniform(0.3, 2.0)))


# --------------------------------------------------------------------------- held-out families

def grass(rng, height, width):
    cv2 = _opencv()
    base = hsv_colour(rng.uniform(20, 50), rng.uniform(0.3, 0.7), rng.uniform(0.1, 0.3))
    picture = _tinted(value_noise(rng, height, width, octaves=3), base, 0.4)
    lean = rng.uniform(-0.6, 0.6)
    for _ in range(int(rng.integers(120, 300))):
        x, y = rng.uniform(-0.1, 1.1) * width, rng.uniform(0, 1.2) * height
        length = rng.uniform(0.1, 0.45) * height
        tip = (int(x + (lean + rng.normal(0, 0.25)) * length), int(y - length))
        colour = hsv_colour(rng.uniform(40, 120), rng.uniform(0.3, 0.9), rng.uniform(0.25, 0.9))
        cv2.line(picture, (int(x), int(y)), tip, colour, int(rng.integers(1, 3)), cv2.LINE_AA)
    return _finish(cv2.GaussianBlur(picture, (0, 0), rng.uniform(0.3, 1.5)))


def bokeh(rng, height, width):
    cv2 = _opencv()
    picture = _tinted(value_noise(rng, height, width, octaves=2),
                      hsv_colour(rng.uniform(0, 360), rng.uniform(0, 0.6), rng.uniform(0.03, 0.25)), 0.5)
    lights = np.zeros_like(picture)
    for _ in range(int(rng.integers(8, 30))):
        centre = (int(rng.integers(0, width)), int(rng.integers(0, height)))
        colour = hsv_colour(rng.uniform(0, 360), rng.uniform(0, 0.8), rng.uniform(0.4, 1))
        cv2.circle(lights, centre, int(rng.integers(width // 20, width // 6)), colour, -1, cv2.LINE_AA)
    picture += 0.8 * cv2.GaussianBlur(lights, (0, 0), rng.uniform(1.5, 5))
    return _finish(picture)


def concrete(rng, height, width):
    cv2 = _opencv()
    grey = rng.uniform(70, 200)
    colour = (grey * rng.uniform(0.95, 1.08), grey, grey * rng.uniform(0.88, 1.02))
    picture = _tinted(value_noise(rng, height, width, octaves=6, base=6, persistence=0.7), colour, 0.25)
    picture += rng.normal(0, 6, picture.shape).astype(np.float32)
    for _ in range(int(rng.integers(1, 5))):
        points = [(int(rng.integers(0, width)), int(rng.integers(0, height)))]
        for _ in range(int(rng.integers(3, 9))):
            points.append((points[-1][0] + int(rng.integers(-width // 6, width // 6 + 1)),
                           points[-1][1] + int(rng.integers(-height // 6, height // 6 + 1))))
        cv2.polylines(picture, [np.asarray(points, np.int32)], False, (grey * 0.35,) * 3, 1, cv2.LINE_AA)
    stains = np.clip(value_noise(rng, height, width, octaves=2, base=3), 0, None)
    picture *= 1 - 0.25 * stains[..., None]
    return _finish(picture)


GENERATORS = {"soil": soil, "foliage": foliage, "texture": texture, "clutter": clutter,
              "grass": grass, "bokeh": bokeh, "concrete": concrete}


def background(kind: str, rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, 3] RGB picture of the family `kind` (one of GENERATORS)."""
    return GENERATORS[kind](rng, height, width)
