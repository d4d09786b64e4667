"""Image folders of drawn glyphs for ``bench models``: five classes a small CNN learns, but not at once.

Each image is 32x32 RGB: one glyph (a filled circle, a square, a triangle, a cross or a ring) of random colour,
size, place and (for the square, the triangle and the cross) rotation, over a noisy background crossed by a few
lines of clutter, with pixel noise on top. A filled circle and a small rotated square, or a thick ring and a disc,
look alike at this size, which keeps models from all reaching 100 % within the first versions.

A fleet's devices get different mixes of the classes (non-IID): each has two classes it holds twice as many of,
and the last device lacks one class altogether; the held-out folder on the parameter server's host has every
class evenly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

GLYPHS = ("circle", "square", "triangle", "cross", "ring")
SIZE = 32
"""Height and width of an image, pixels."""
CLUTTER_LINES = 3
"""Most lines of clutter drawn across an image's background."""
PIXEL_NOISE = 18.0
"""Standard deviation of the noise added to every pixel (0-255 scale)."""


def device_mixes(devices: Sequence[str], per_class: int) -> dict[str, dict[str, int]]:
    """Images per class on each device: two classes ``per_class`` each, the others half of it; the last device
    (of two or more) lacks one class."""
    mixes: dict[str, dict[str, int]] = {}
    count = len(GLYPHS)
    for i, device in enumerate(devices):
        major = {GLYPHS[(2 * i) % count], GLYPHS[(2 * i + 1) % count]}
        mix = {name: per_class if name in major else max(1, per_class // 2) for name in GLYPHS}
        if i == len(devices) - 1 and len(devices) > 1:
            del mix[GLYPHS[(2 * i + 2) % count]]
        mixes[device] = mix
    return mixes


def draw_glyphs(root: Path, counts: Mapping[str, int], *, seed: int) -> None:
    """``counts[name]`` PNG images of glyph ``name`` under ``root/<name>/``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for name, count in counts.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.fromarray(glyph(name, rng)).save(folder / f"{name}-{i}.png")


def glyph(name: str, rng: np.random.Generator) -> np.ndarray:
    """One image of glyph ``name``: uint8 (SIZE, SIZE, 3)."""
    from PIL import Image, ImageDraw

    base = rng.integers(0, 90, 3)
    background = np.clip(base + rng.normal(0.0, 25.0, (SIZE, SIZE, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(background)
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(0, CLUTTER_LINES + 1))):
        ends = [int(v) for v in rng.integers(0, SIZE, 4)]
        draw.line(ends, fill=_colour(rng, 60, 170), width=1)
    r = float(rng.uniform(5.0, 11.0))
    cx, cy = (float(v) for v in rng.uniform(r + 1, SIZE - r - 1, 2))
    angle = float(rng.uniform(0.0, 2 * math.pi))
    fill = _colour(rng, 110, 256)
    if name == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif name == "ring":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), outline=fill, width=int(rng.integers(2, 4)))
    elif name == "square":
        draw.polygon(_polygon(cx, cy, r, 4, angle), fill=fill)
    elif name == "triangle":
        draw.polygon(_polygon(cx, cy, r * 1.15, 3, angle), fill=fill)
    elif name == "cross":
        width = max(2.0, r / 2.5)
        for turn in (0.0, math.pi / 2):
            draw.polygon(_bar(cx, cy, r, width, angle + turn), fill=fill)
    else:
        raise ValueError(f"unknown glyph {name!r}; known: {', '.join(GLYPHS)}")
    pixels = np.asarray(image, dtype=np.float32) + rng.normal(0.0, PIXEL_NOISE, (SIZE, SIZE, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8)


def _colour(rng: np.random.Generator, low: int, high: int) -> tuple[int, int, int]:
    r, g, b = (int(v) for v in rng.integers(low, high, 3))
    return r, g, b


def _polygon(cx: float, cy: float, r: float, sides: int, angle: float) -> list[tuple[float, float]]:
    """A regular polygon of ``sides`` corners on a circle of radius ``r``, turned by ``angle``."""
    return [(cx + r * math.cos(angle + 2 * math.pi * k / sides), cy + r * math.sin(angle + 2 * math.pi * k / sides))
            for k in range(sides)]


def _bar(cx: float, cy: float, half_length: float, width: float, angle: float) -> list[tuple[float, float]]:
    """A bar ``2 * half_length`` long and ``width`` wide through (cx, cy), along ``angle``."""
    dx, dy = math.cos(angle), math.sin(angle)
    nx, ny = -dy * width / 2, dx * width / 2
    return [(cx + dx * half_length + nx, cy + dy * half_length + ny), (cx + dx * half_length - nx,
            cy + dy * half_length - ny), (cx - dx * half_length - nx, cy - dy * half_length - ny),
            (cx - dx * half_length + nx, cy - dy * half_length + ny)]
