"""The shapes world: the vocabulary of attributes, scenes, and how scenes are sampled.

A scene is a background plus 1 to 4 objects. Each object has a shape, a colour, a size, a texture and
a position; the position words (``left``/``centre``/``right``, ``top``/``middle``/``bottom``) are
derived from the sampled centre, never sampled on their own, so they always agree with the pixels.
Objects sit in distinct cells of a 3 x 3 grid (with jitter) and overlap little, so that every object
stays recognisable at 64 x 64 and a full description (with position) picks out exactly one object.

Spatial relations are numeric predicates on centres (:func:`relation_holds`); the caption checker
and the caption sampler both use them, so a caption's truth is decided by one definition.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

SHAPES = ("circle", "square", "triangle", "diamond", "star", "cross")
COLOURS = {  # name -> base RGB; far apart in hue so that colour words stay unambiguous
    "red": (214, 39, 40),
    "green": (44, 160, 44),
    "blue": (40, 80, 220),
    "yellow": (236, 214, 32),
    "purple": (136, 60, 190),
    "orange": (245, 130, 20),
    "cyan": (30, 200, 215),
    "pink": (245, 120, 185),
}
SIZES = ("small", "medium", "large")
SIZE_PIXELS = {"small": 11.0, "medium": 16.0, "large": 22.0}  # box side at 64 px, scaled with size
TEXTURES = ("solid", "striped", "dotted", "outlined")
HPOS = ("left", "centre", "right")
VPOS = ("top", "middle", "bottom")
TONES = ("dark", "light")
ATTRIBUTES = ("shape", "colour", "size", "texture", "hpos", "vpos")
RELATIONS = ("left_of", "right_of", "above", "below", "next_to")

MIN_OFFSET = 0.125  # relations left/right/above/below need centres this far apart (fraction of W)
NEXT_TO = 0.45  # next_to: centre distance at most this (fraction of W)
MAX_OVERLAP = 0.12  # intersection / smaller box area allowed between two objects


@dataclass(frozen=True)
class SceneObject:
    """One object. ``box`` is ``(x0, y0, x1, y1)`` in pixels (float, exclusive right/bottom)."""

    shape: str
    colour: str
    size: str
    texture: str
    cx: float
    cy: float
    side: float
    rotation: float
    rgb: tuple[int, int, int]
    hpos: str
    vpos: str

    @property
    def box(self) -> tuple[float, float, float, float]:
        h = self.side / 2
        return (self.cx - h, self.cy - h, self.cx + h, self.cy + h)

    def attribute(self, name: str) -> str:
        return getattr(self, name)

    def to_json(self) -> dict:
        d = asdict(self)
        d["box"] = [round(v, 3) for v in self.box]
        for k in ("cx", "cy", "side", "rotation"):
            d[k] = round(d[k], 3)
        d["rgb"] = list(self.rgb)
        return d


@dataclass(frozen=True)
class Background:
    tone: str
    rgb: tuple[int, int, int]
    noise: float  # std of the per-pixel Gaussian noise, in 0..255 units
    gradient: float  # strength of a linear brightness ramp, in 0..255 units
    angle: float  # direction of the ramp (radians)

    def to_json(self) -> dict:
        d = asdict(self)
        d["rgb"] = list(self.rgb)
        d["noise"], d["gradient"], d["angle"] = (round(d[k], 3) for k in ("noise", "gradient", "angle"))
        return d


@dataclass(frozen=True)
class Scene:
    """One image's ground truth: its background and objects, in drawing order."""

    size: int
    background: Background
    objects: tuple[SceneObject, ...]

    def to_json(self) -> dict:
        return {
            "size": self.size,
            "background": self.background.to_json(),
            "objects": [o.to_json() for o in self.objects],
        }

    @classmethod
    def from_json(cls, data: dict) -> Scene:
        """Inverse of :meth:`to_json` (up to the rounding of coordinates)."""
        bg = dict(data["background"])
        bg["rgb"] = tuple(bg["rgb"])
        objects = []
        for o in data["objects"]:
            fields = {k: v for k, v in o.items() if k in SceneObject.__dataclass_fields__}
            fields["rgb"] = tuple(fields["rgb"])
            objects.append(SceneObject(**fields))
        return cls(size=int(data["size"]), background=Background(**bg), objects=tuple(objects))


def position_words(cx: float, cy: float, size: int) -> tuple[str, str]:
    """The horizontal and vertical position words of a centre (thirds of the image)."""
    third = size / 3
    h = HPOS[min(int(cx // third), 2)]
    v = VPOS[min(int(cy // third), 2)]
    return h, v


def relation_holds(rel: str, a: SceneObject, b: SceneObject, size: int) -> bool:
    """Whether ``a rel b`` holds, e.g. ``left_of``: a's centre is clearly left of b's."""
    dx, dy, gap = b.cx - a.cx, b.cy - a.cy, MIN_OFFSET * size
    if rel == "left_of":
        return dx >= gap
    if rel == "right_of":
        return -dx >= gap
    if rel == "above":
        return dy >= gap
    if rel == "below":
        return -dy >= gap
    if rel == "next_to":
        return float(np.hypot(dx, dy)) <= NEXT_TO * size
    raise ValueError(f"unknown relation {rel!r}; valid: {', '.join(RELATIONS)}")


def _overlap(a: tuple, b: tuple) -> float:
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    smaller = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
    return iw * ih / smaller


def _sample_background(rng: np.random.Generator) -> Background:
    tone = TONES[int(rng.integers(len(TONES)))]
    base = rng.uniform(15, 70) if tone == "dark" else rng.uniform(185, 240)
    tint = rng.uniform(-12, 12, size=3)
    rgb = tuple(int(np.clip(round(base + t), 0, 255)) for t in tint)
    return Background(
        tone=tone, rgb=rgb, noise=float(rng.uniform(0, 10)),
        gradient=float(rng.uniform(0, 25)), angle=float(rng.uniform(0, 2 * np.pi)),
    )


def _sample_object(rng: np.random.Generator, cell: int, size: int) -> SceneObject:
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    size_word = SIZES[int(rng.integers(len(SIZES)))]
    texture = TEXTURES[int(rng.integers(len(TEXTURES)))]
    scale = size / 64
    side = SIZE_PIXELS[size_word] * scale * float(rng.uniform(0.92, 1.08))
    third = size / 3
    # the centre stays well inside its cell so the position word is not a coin flip at a border
    cx = (cell % 3 + 0.5) * third + float(rng.uniform(-0.28, 0.28)) * third
    cy = (cell // 3 + 0.5) * third + float(rng.uniform(-0.28, 0.28)) * third
    half = side / 2 + 1
    cx, cy = float(np.clip(cx, half, size - half)), float(np.clip(cy, half, size - half))
    rgb = tuple(int(np.clip(c + rng.integers(-14, 15), 0, 255)) for c in COLOURS[colour])
    rotation = float(rng.uniform(-12, 12)) if shape in ("square", "triangle", "star", "cross") else 0.0
    # rounded here, not only in the JSON, so a scene read back from scenes.json is the same scene
    cx, cy, side, rotation = (round(v, 3) for v in (cx, cy, side, rotation))
    hpos, vpos = position_words(cx, cy, size)
    return SceneObject(shape, colour, size_word, texture, cx, cy, side, rotation, rgb, hpos, vpos)


def sample_scene(rng: np.random.Generator, size: int = 64, max_objects: int = 4) -> Scene:
    """Sample a background and 1..max_objects objects in distinct grid cells, overlapping little."""
    n = int(rng.choice(np.arange(1, max_objects + 1), p=_count_probs(max_objects)))
    cells = rng.permutation(9)[:n]
    objects: list[SceneObject] = []
    for cell in cells:
        for _ in range(20):
            obj = _sample_object(rng, int(cell), size)
            if all(_overlap(obj.box, o.box) <= MAX_OVERLAP for o in objects):
                objects.append(obj)
                break
        # a cell whose object keeps colliding is left empty: the scene has one object fewer
    return Scene(size=size, background=_sample_background(rng), objects=tuple(objects))


def _count_probs(max_objects: int) -> np.ndarray:
    p = np.array([0.2, 0.3, 0.3, 0.2][:max_objects], dtype=float)
    return p / p.sum()
