"""The shapes world: the attributes of objects, scenes, and how scenes are sampled.

A scene is a background (a tone and a hue) plus 3 to 8 objects, as a COCO image holds several
objects (7.7 instances of 3.5 categories on average, Lin et al., ECCV 2014, Sec. 5). Each object has
a shape, a colour, a size, a texture and a position; the position words (``left``/``centre``/
``right``, ``top``/``middle``/``bottom``) are derived from the sampled centre, never sampled on their
own, so they always agree with the pixels. Objects sit in distinct cells of a 4 x 4 grid (with
jitter) and overlap little, so that every object stays recognisable at 96 x 96; two objects can share
a position word pair, as two people in a photo can both be "on the left".

Spatial relations are numeric predicates on centres (:func:`relation_holds`); the caption checker
and the caption sampler both use them, so a caption's truth is decided by one definition. The words
for every value are in :mod:`.lexicon`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from icr.data.synthetic.lexicon import BACKGROUND_HUES, SHAPES

COLOURS = {  # name -> base RGB; far apart in hue or brightness so that colour words stay clear
    "red": (214, 39, 40),
    "orange": (245, 130, 20),
    "yellow": (236, 214, 32),
    "green": (44, 160, 44),
    "cyan": (30, 200, 215),
    "blue": (40, 80, 220),
    "purple": (136, 60, 190),
    "pink": (245, 120, 185),
    "brown": (140, 86, 40),
    "grey": (128, 128, 128),
}
SIZES = ("small", "medium", "large")
SIZE_FRACTION = {"small": 0.12, "medium": 0.17, "large": 0.23}  # box side / image side
TEXTURES = ("solid", "striped", "dotted", "outlined", "checkered")
HPOS = ("left", "centre", "right")
VPOS = ("top", "middle", "bottom")
TONES = ("dark", "light")
HUES = BACKGROUND_HUES
ATTRIBUTES = ("shape", "colour", "size", "texture", "hpos", "vpos")
RELATIONS = ("left_of", "right_of", "above", "below", "next_to")
GRID = 4  # objects sit in distinct cells of a GRID x GRID grid
OBJECT_COUNTS = (3, 4, 5, 6, 7, 8)
OBJECT_COUNT_PROBS = (0.12, 0.2, 0.22, 0.2, 0.15, 0.11)  # mean 5.3 objects

MIN_OFFSET = 0.125  # relations left/right/above/below need centres this far apart (fraction of W)
NEXT_TO = 0.3  # next_to: centre distance at most this (fraction of W)
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
    hue: str
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
    return bool(relation_of_offsets(rel, b.cx - a.cx, b.cy - a.cy, size))


def relation_of_offsets(rel: str, dx: np.ndarray | float, dy: np.ndarray | float, size: int
                        ) -> np.ndarray | bool:
    """The definition of the relations on centre offsets ``dx = b.cx - a.cx``, ``dy = b.cy - a.cy``
    (scalars or arrays of any shape): whether ``a rel b``."""
    gap = MIN_OFFSET * size
    if rel == "left_of":
        return dx >= gap
    if rel == "right_of":
        return -dx >= gap
    if rel == "above":
        return dy >= gap
    if rel == "below":
        return -dy >= gap
    if rel == "next_to":
        return np.hypot(dx, dy) <= NEXT_TO * size
    raise ValueError(f"unknown relation {rel!r}; valid: {', '.join(RELATIONS)}")


def _overlap(a: tuple, b: tuple) -> float:
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    smaller = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
    return iw * ih / smaller


def background_rgb(tone: str, hue: str, rng: np.random.Generator) -> tuple[int, int, int]:
    """A dark or light shade of a hue: the hue's colour darkened or mixed with white, jittered."""
    base = np.asarray(COLOURS[hue], dtype=float)
    if tone == "dark":
        rgb = base * rng.uniform(0.18, 0.32)
    else:
        rgb = base * rng.uniform(0.15, 0.3) + 255 * rng.uniform(0.62, 0.78)
    return tuple(int(v) for v in np.clip(np.rint(rgb + rng.uniform(-6, 6, size=3)), 0, 255))


def _sample_background(rng: np.random.Generator) -> Background:
    tone = TONES[int(rng.integers(len(TONES)))]
    hue = HUES[int(rng.integers(len(HUES)))]
    return Background(
        tone=tone, hue=hue, rgb=background_rgb(tone, hue, rng), noise=float(rng.uniform(0, 8)),
        gradient=float(rng.uniform(0, 25)), angle=float(rng.uniform(0, 2 * np.pi)),
    )


def _sample_object(rng: np.random.Generator, cell: int, size: int) -> SceneObject:
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    size_word = SIZES[int(rng.integers(len(SIZES)))]
    texture = TEXTURES[int(rng.integers(len(TEXTURES)))]
    side = SIZE_FRACTION[size_word] * size * float(rng.uniform(0.92, 1.08))
    step = size / GRID
    cx = (cell % GRID + 0.5) * step + float(rng.uniform(-0.3, 0.3)) * step
    cy = (cell // GRID + 0.5) * step + float(rng.uniform(-0.3, 0.3)) * step
    half = side / 2 + 1
    cx, cy = float(np.clip(cx, half, size - half)), float(np.clip(cy, half, size - half))
    rgb = tuple(int(np.clip(c + rng.integers(-14, 15), 0, 255)) for c in COLOURS[colour])
    rotation = 0.0 if shape == "circle" else float(rng.uniform(-12, 12))
    # rounded here, not only in the JSON, so a scene read back from scenes.json is the same scene
    cx, cy, side, rotation = (round(v, 3) for v in (cx, cy, side, rotation))
    hpos, vpos = position_words(cx, cy, size)
    return SceneObject(shape, colour, size_word, texture, cx, cy, side, rotation, rgb, hpos, vpos)


def sample_scene(rng: np.random.Generator, size: int = 96) -> Scene:
    """Sample a background and 3..8 objects in distinct grid cells, overlapping little."""
    n = int(rng.choice(OBJECT_COUNTS, p=OBJECT_COUNT_PROBS))
    cells = rng.permutation(GRID * GRID)[:n]
    objects: list[SceneObject] = []
    for cell in cells:
        for _ in range(20):
            obj = _sample_object(rng, int(cell), size)
            if all(_overlap(obj.box, o.box) <= MAX_OVERLAP for o in objects):
                objects.append(obj)
                break
        # a cell whose object keeps colliding is left empty: the scene has one object fewer
    return Scene(size=size, background=_sample_background(rng), objects=tuple(objects))
