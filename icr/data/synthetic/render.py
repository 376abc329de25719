"""Render a :class:`~icr.data.synthetic.world.Scene` to an RGB array.

Objects are drawn as coverage masks at 4x the output resolution with Pillow and box-filtered down,
which anti-aliases edges; textures (stripes, dots, checks, outline) are computed on the same grid;
an outline is the filled shape minus its erosion, so every shape has one of even width. The
background is a tinted flat colour with a linear ramp and Gaussian pixel noise. Every random choice
comes from the generator passed in, so a scene and a seed give the same pixels on every run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw
from scipy import ndimage

from icr.data.synthetic.world import Background, Scene, SceneObject

SUPERSAMPLE = 4


@dataclass(frozen=True)
class Rendering:
    """Pixels and the tight box of each object's visible outline, ``(x0, y0, x1, y1)`` float px."""

    pixels: np.ndarray  # (H, W, 3) uint8
    boxes: tuple[tuple[float, float, float, float], ...]


def _regular(sides: int, radius: float = 1.0, start: float = -np.pi / 2) -> np.ndarray:
    angle = start + np.arange(sides) * 2 * np.pi / sides
    return radius * np.stack([np.cos(angle), np.sin(angle)], axis=1)


def _unit_polygon(shape: str) -> np.ndarray:
    """Vertices in [-1, 1]^2 (y down) of a shape whose bounding square has side 2."""
    if shape == "square":
        return np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], dtype=float) * 0.86
    if shape == "rectangle":
        return np.array([[-1, -0.55], [1, -0.55], [1, 0.55], [-1, 0.55]], dtype=float)
    if shape == "oval":
        t = np.linspace(0, 2 * np.pi, 48, endpoint=False)
        return np.stack([np.cos(t), 0.58 * np.sin(t)], axis=1)
    if shape == "triangle":
        return np.array([[0, -1], [1, 0.8], [-1, 0.8]], dtype=float)
    if shape == "diamond":
        return np.array([[0, -1], [0.7, 0], [0, 1], [-0.7, 0]], dtype=float)
    if shape == "pentagon":
        return _regular(5) + [0, 0.1]
    if shape == "hexagon":
        return _regular(6, start=0.0)
    if shape == "star":
        k = np.arange(10)
        radius = np.where(k % 2 == 0, 1.0, 0.45)
        angle = -np.pi / 2 + k * np.pi / 5
        return np.stack([radius * np.cos(angle), radius * np.sin(angle) + 0.1], axis=1)
    if shape == "cross":
        a, b = 0.32, 0.95
        return np.array([
            [-a, -b], [a, -b], [a, -a], [b, -a], [b, a], [a, a],
            [a, b], [-a, b], [-a, a], [-b, a], [-b, -a], [-a, -a],
        ])
    if shape == "heart":
        t = np.linspace(0, 2 * np.pi, 48, endpoint=False)
        x = 16 * np.sin(t) ** 3
        y = -(13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t))
        return np.stack([x / 17, (y + 2.5) / 17], axis=1)
    if shape == "crescent":  # the outer circle's arc, then the inner (offset) circle's arc back
        outer = np.linspace(np.pi * 0.32, np.pi * 1.68, 30)
        inner = np.linspace(np.pi * 1.45, np.pi * 0.55, 24)
        return np.concatenate([
            np.stack([np.cos(outer), np.sin(outer)], axis=1),
            np.stack([0.45 + 0.82 * np.cos(inner), 0.82 * np.sin(inner)], axis=1)])
    if shape == "arrow":
        return np.array([[1, 0], [0.15, -0.8], [0.15, -0.32], [-1, -0.32], [-1, 0.32],
                         [0.15, 0.32], [0.15, 0.8]], dtype=float)
    raise ValueError(f"no polygon for shape {shape!r}")


def _window(obj: SceneObject, canvas: int) -> tuple[int, int, int, int]:
    """Supersampled pixel window ``(x0, y0, x1, y1)`` that contains the object."""
    s = SUPERSAMPLE
    r = obj.side / 2 * 1.5 + 1  # rotated corners stay inside
    size = canvas // s  # whole output pixels, so the window can be box-filtered on its own
    x0, y0 = max(int(obj.cx - r), 0), max(int(obj.cy - r), 0)
    x1, y1 = min(int(obj.cx + r) + 2, size), min(int(obj.cy + r) + 2, size)
    return x0 * s, y0 * s, x1 * s, y1 * s


def _draw_mask(obj: SceneObject, window: tuple[int, int, int, int], outline: bool) -> np.ndarray:
    """Coverage of the object (or of its outline) inside ``window`` of the supersampled canvas."""
    x0, y0, x1, y1 = window
    img = Image.new("L", (x1 - x0, y1 - y0), 0)
    draw = ImageDraw.Draw(img)
    s = SUPERSAMPLE
    half = obj.side / 2 * s
    cx, cy = obj.cx * s - x0, obj.cy * s - y0
    if obj.shape == "circle":
        draw.ellipse([cx - half, cy - half, cx + half, cy + half], fill=255)
    else:
        theta = np.deg2rad(obj.rotation)
        rot = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
        pts = _unit_polygon(obj.shape) @ rot.T * half + [cx, cy]
        draw.polygon([(float(x), float(y)) for x, y in pts], fill=255)
    mask = np.asarray(img)
    if outline:  # the shape minus its erosion: a band of even width along the border
        width = max(int(round(obj.side * s * 0.14)), 2 * s)
        mask = mask - ndimage.minimum_filter(mask, size=2 * width + 1, mode="constant")
    return mask.astype(np.float32) / 255.0


def _texture(obj: SceneObject, window: tuple[int, int, int, int], tone: str, scale: float) -> np.ndarray:
    """The colour of each supersampled pixel of ``window`` inside the object, (h, w, 3) float32."""
    x0, y0, x1, y1 = window
    base = np.asarray(obj.rgb, dtype=np.float32)
    # the second colour of stripes and dots contrasts with the background, so the silhouette holds
    second = base * 0.35 if tone == "light" else base * 0.4 + 255 * 0.6
    out = np.empty((y1 - y0, x1 - x0, 3), dtype=np.float32)
    out[:] = base
    if obj.texture in ("striped", "dotted", "checkered"):
        s = SUPERSAMPLE
        yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float32) / s  # output-pixel coordinates
        period = 4.0 * scale  # pixels of the output image: 2-px stripes at 96 x 96
        if obj.texture == "striped":
            on = np.mod(xx + yy, period * 1.2) < period * 0.6
        elif obj.texture == "checkered":
            on = (np.floor((xx - obj.cx) / (period * 0.6)) + np.floor((yy - obj.cy) / (period * 0.6))) % 2 == 0
        else:
            dx = np.mod(xx - obj.cx, period) - period / 2
            dy = np.mod(yy - obj.cy, period) - period / 2
            on = dx * dx + dy * dy <= (1.1 * scale) ** 2
        out[on] = second
    return out


def _background(bg: Background, size: int, rng: np.random.Generator) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size - 0.5
    ramp = (xx * np.cos(bg.angle) + yy * np.sin(bg.angle)) * bg.gradient
    noise = rng.normal(0.0, bg.noise, size=(size, size, 1)).astype(np.float32)
    return np.asarray(bg.rgb, dtype=np.float32) + ramp[..., None] + noise


def _downsample(a: np.ndarray, s: int) -> np.ndarray:
    h, w = a.shape[0] // s, a.shape[1] // s
    return a.reshape(h, s, w, s, *a.shape[2:]).sum(axis=3).sum(axis=1) / (s * s)


def _tight_box(mask: np.ndarray, window: tuple[int, int, int, int]) -> tuple[float, float, float, float]:
    ys, xs = np.nonzero(mask > 0.5)
    s = SUPERSAMPLE
    x0, y0 = window[0] + int(xs.min()), window[1] + int(ys.min())
    x1, y1 = window[0] + int(xs.max()) + 1, window[1] + int(ys.max()) + 1
    return (x0 / s, y0 / s, x1 / s, y1 / s)


def render_scene(scene: Scene, rng: np.random.Generator) -> Rendering:
    """Draw ``scene``; ``rng`` only supplies pixel noise."""
    size, s = scene.size, SUPERSAMPLE
    canvas = size * s
    image = _background(scene.background, size, rng)  # (H, W, 3)
    boxes = []
    for obj in scene.objects:
        window = _window(obj, canvas)
        x0, y0, x1, y1 = window
        fill = _draw_mask(obj, window, outline=False)
        mask = _draw_mask(obj, window, outline=True) if obj.texture == "outlined" else fill
        mask = mask[..., None]  # (h, w, 1)
        texture = _texture(obj, window, scene.background.tone, size / 96)
        # compose on the supersampled window only, then box-filter it back into the image
        under = image[y0 // s:y1 // s, x0 // s:x1 // s]
        under = np.repeat(np.repeat(under, s, axis=0), s, axis=1)  # (h, w, 3)
        image[y0 // s:y1 // s, x0 // s:x1 // s] = _downsample(under * (1 - mask) + texture * mask, s)
        boxes.append(_tight_box(fill, window))
    noise = rng.normal(0.0, 2.0, size=(size, size, 3)).astype(np.float32)
    pixels = image + noise
    return Rendering(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), tuple(boxes))
