"""A synthetic video world with known ground truth: coloured shapes enter, move and leave a dim background.

Contract
--------
* ``make_world(seed, duration_s, ...)`` is a pure function of its arguments: every random choice is drawn
  from ``numpy.random.default_rng(seed)`` (the background texture from ``default_rng([seed, _BG_STREAM])``).
* A ``WorldSpec`` holds its events sorted by enter time. Worlds made by ``make_world`` show at most one object
  at a time, with at least ``gap = max(1 s, 2 frames)`` of empty background between objects; every event is
  visible for ``visible_s`` seconds (default ``(max(3, 5 / fps), max(6, 10 / fps))``, i.e. at least 5 frames at
  the world's fps), and events are spread over the whole duration (one per equal time slot). The last object
  either leaves at least ``gap / 2`` before the end or stays on screen until the end (``leave_s ==
  duration_s``). A clip shorter than ``visible_s[0] + gap`` gets one object, on screen throughout. Hand-built
  worlds may overlap; rendering, captions and questions handle that.
* Time: frame ``k`` of a world rendered at ``fps`` shows time ``t = k / fps``; ``frame_count`` frames in all.
  An event is on screen at ``t`` iff ``enter_s <= t < leave_s``; its centre is ``start_xy + velocity_xy *
  (t - enter_s)`` (pixels, x right, y down) and the whole object stays inside the frame. Its direction word
  is the dominant axis of its velocity (the cross-axis drift is at most a fifth of the main one).
* ``render_frame`` returns ``[H, W, 3]`` uint8 RGB, deterministic per ``(seed, t)``: a dim, low-contrast,
  slowly varying texture plus mild noise chosen by the world frame index ``floor(t * world.fps)``, with the
  on-screen objects drawn on top in their ``COLOURS`` value (anti-aliased edges).
* ``write_world_video`` streams frames into a real video (PyAV; h264 in mp4 by default) and writes
  ``world_to_json(world)`` beside it at ``path.with_suffix(".json")``; ``world_from_json`` inverts it exactly.
* Text (captions, questions, answers) is lowercase words separated by single spaces, with ``.``, ``,`` and
  ``?`` as separate tokens, so ``" ".join(text.split()) == text``; every token is in ``vocabulary()``.
* ``caption(world)`` (fixed template) and ``caption(world, rng)`` (templates drawn by ``rng``) name each object
  exactly once, as the adjacent pair ``<colour> <shape>``, in enter order; ``caption_events`` recovers that
  ordered list of ``(colour, shape)`` from any of them (and scores free model output the same way).
* ``questions(world, rng)`` returns one ``QA`` per applicable type in ``QTYPES`` order; answers are one or two
  words (a number word, a colour, a shape, a direction, ``"<colour> <shape>"`` or ``"nothing"``) computed
  from the event log; a question is only asked when its answer is unambiguous. ``QA.refs`` names the events
  the answer is read from (training uses them to supervise attention; drawing them consumes no randomness).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

__all__ = [
    "COLOURS",
    "COUNTING_QTYPES",
    "DIRECTIONS",
    "NUMBER_WORDS",
    "QA",
    "QTYPES",
    "SHAPES",
    "SHAPE_PLURALS",
    "TRACED_QTYPES",
    "TRACE_STYLES",
    "Event",
    "WorldObject",
    "WorldSpec",
    "altered_world",
    "answer_text",
    "caption",
    "caption_events",
    "cued_answer",
    "cued_scan",
    "event_pairs",
    "final_answer",
    "frame_count",
    "item_text",
    "make_video",
    "make_world",
    "object_list",
    "questions",
    "render_frame",
    "render_frames",
    "scan_list",
    "vocabulary",
    "world_from_json",
    "world_to_json",
    "write_world_video",
]

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
SHAPE_PLURALS: dict[str, str] = {
    "circle": "circles",
    "square": "squares",
    "triangle": "triangles",
    "cross": "crosses",
}
# Saturated and far apart in RGB and in YCbCr (so they survive 4:2:0 chroma subsampling); all much brighter
# than the background (luma <= ~70).
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (235, 35, 35),
    "green": (40, 205, 60),
    "blue": (45, 95, 255),
    "yellow": (245, 225, 35),
    "purple": (185, 50, 235),
}
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
NUMBER_WORDS: tuple[str, ...] = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
)
MAX_EVENTS = len(NUMBER_WORDS) - 1
QTYPES: tuple[str, ...] = (
    "count",
    "count_colour",
    "count_shape",
    "colour_of_shape",
    "shape_of_colour",
    "first",
    "last",
    "shape_after",
    "colour_after",
    "direction",
    "end",
)
# question types whose answer is a lookup among the video's objects by some attribute, or a count of those
# with one attribute: trained (``answer_text``) to first list every object in order, then answer, so the
# lookup reads text the model has just written instead of searching the visual tokens by attribute
TRACED_QTYPES: frozenset[str] = frozenset(
    {
        "count_colour",
        "count_shape",
        "colour_of_shape",
        "shape_of_colour",
        "shape_after",
        "colour_after",
        "direction",
    }
)

_BG_STREAM = 0xB6  # second word of the background generator's seed
_REFERENCE_SIDE = 224  # object sizes are specified at this frame side and scaled with min(width, height)
_DEFAULT_SIZE_RANGE = (44, 64)
_NOISE_AMP = 2  # per-pixel noise in [-2, 2] grey levels (i.i.d. per frame: costs bitrate, so kept mild)
_N_LEVELS = 12  # quantised blend levels of the slowly varying background
_TEXTURE_AMP = 9.0


# ---------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class WorldObject:
    shape: str
    colour: str
    size: int  # side of the bounding box in pixels

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; expected one of {SHAPES}")
        if self.colour not in COLOURS:
            raise ValueError(f"unknown colour {self.colour!r}; expected one of {tuple(COLOURS)}")
        if self.size < 2:
            raise ValueError(f"object size must be >= 2 px, got {self.size}")

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"


@dataclass(frozen=True)
class Event:
    """One object's life on screen: visible for ``enter_s <= t < leave_s``, moving linearly."""

    obj: WorldObject
    enter_s: float
    leave_s: float
    start_xy: tuple[float, float]  # centre at enter_s, pixels
    velocity_xy: tuple[float, float]  # pixels per second

    def visible_at(self, t: float) -> bool:
        return self.enter_s <= t < self.leave_s

    def center_at(self, t: float) -> tuple[float, float]:
        dt = t - self.enter_s
        return (self.start_xy[0] + self.velocity_xy[0] * dt, self.start_xy[1] + self.velocity_xy[1] * dt)

    @property
    def direction(self) -> str:
        vx, vy = self.velocity_xy
        if abs(vx) >= abs(vy):
            return "right" if vx > 0 else "left"
        return "down" if vy > 0 else "up"


@dataclass(frozen=True)
class WorldSpec:
    seed: int
    duration_s: float
    fps: float
    width: int
    height: int
    events: tuple[Event, ...]  # sorted by enter_s

    def on_screen(self, t: float) -> list[Event]:
        return [e for e in self.events if e.visible_at(t)]

    @property
    def end_time(self) -> float:
        """Time of the last frame at the world's fps."""
        return (frame_count(self) - 1) / self.fps


@dataclass(frozen=True)
class QA:
    question: str
    answer: str
    qtype: str
    # indices into ``world.events`` of the objects the answer is read from (all counted ones for counts;
    # the answer object for ``*_after``); empty when none is (a count of zero, "nothing" at the end)
    refs: tuple[int, ...] = ()
    # the words the question compares objects with: a colour or a shape (filtered counts, ``colour_of_shape``,
    # ``shape_of_colour``) or ``<colour> <shape>`` (``*_after``, ``direction``); empty for the other types
    cue: str = ""


def frame_count(world: WorldSpec, fps: float | None = None) -> int:
    """Number of frames of ``world`` at ``fps`` (default ``world.fps``): times ``k / fps < duration_s``."""
    f = world.fps if fps is None else fps
    return max(1, math.ceil(world.duration_s * f - 1e-6))


def event_pairs(world: WorldSpec) -> list[tuple[str, str]]:
    """The ordered ``(colour, shape)`` list of the world's events (what ``caption_events`` must recover)."""
    return [(e.obj.colour, e.obj.shape) for e in world.events]


# ---------------------------------------------------------------------------------------------- world


def _default_event_range(duration_s: float) -> tuple[int, int]:
    if duration_s < 30:
        return 1, 3
    if duration_s < 300:
        return 2, 4
    if duration_s < 1800:
        return 3, 6
    return 4, 8


def _default_visible_s(fps: float) -> tuple[float, float]:
    return max(3.0, 5.0 / fps), max(6.0, 10.0 / fps)


def _motion(
    rng: np.random.Generator, width: int, height: int, size: int, seconds: float
) -> tuple[tuple[float, float], tuple[float, float]]:
    """A start centre and a velocity that keep the object inside the frame with one dominant direction."""
    direction = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
    margin = size / 2 + 1
    span_x, span_y = width - 2 * margin, height - 2 * margin
    horizontal = direction in ("left", "right")
    main_span, cross_span = (span_x, span_y) if horizontal else (span_y, span_x)
    a = rng.uniform(0.0, 0.35) * main_span
    b = rng.uniform(0.65, 1.0) * main_span
    main0, main1 = (a, b) if direction in ("right", "down") else (b, a)
    cross0 = rng.uniform(0.0, cross_span)
    cross1 = float(np.clip(cross0 + rng.uniform(-0.2, 0.2) * abs(b - a), 0.0, cross_span))
    if horizontal:
        (x0, x1), (y0, y1) = (main0, main1), (cross0, cross1)
    else:
        (x0, x1), (y0, y1) = (cross0, cross1), (main0, main1)
    start = (round(margin + x0, 2), round(margin + y0, 2))
    end = (margin + x1, margin + y1)
    velocity = (round((end[0] - start[0]) / seconds, 4), round((end[1] - start[1]) / seconds, 4))
    return start, velocity


def make_world(
    seed: int,
    duration_s: float,
    fps: float = 2.0,
    width: int = 224,
    height: int = 224,
    n_events: int | None = None,
    object_size: int | None = None,
    visible_s: tuple[float, float] | None = None,
) -> WorldSpec:
    """A world of ``n_events`` objects (default: 1-3 for short clips growing to 4-8 for an hour or more)."""
    if not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    duration_s, fps = float(duration_s), float(fps)
    if duration_s <= 0 or fps <= 0:
        raise ValueError("duration_s and fps must be positive")
    if width < 16 or height < 16:
        raise ValueError("frames must be at least 16x16")
    lo_vis, hi_vis = visible_s if visible_s is not None else _default_visible_s(fps)
    if not 0 < lo_vis <= hi_vis:
        raise ValueError(f"bad visible_s {visible_s}")
    gap = max(1.0, 2.0 / fps)
    capacity = int(duration_s // (lo_vis + gap))

    rng = np.random.default_rng(int(seed))
    if n_events is None:
        lo, hi = _default_event_range(duration_s)
        n = max(1, min(int(rng.integers(lo, hi + 1)), capacity))
    else:
        n = int(n_events)
        if not 0 <= n <= MAX_EVENTS:
            raise ValueError(f"n_events must be in [0, {MAX_EVENTS}], got {n}")
        if n > max(1, capacity):
            raise ValueError(
                f"{n} events of >= {lo_vis:g} s (plus {gap:g} s gaps) do not fit in {duration_s:g} s"
            )
    stays_to_end = bool(rng.random() < 0.5)
    side = min(width, height)
    max_size = side - 4
    if object_size is not None and not 2 <= object_size <= max_size:
        raise ValueError(f"object_size must be in [2, {max_size}] for {width}x{height}, got {object_size}")

    slot = duration_s / n if n else duration_s
    events: list[Event] = []
    for i in range(n):
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        colour = tuple(COLOURS)[int(rng.integers(len(COLOURS)))]
        if object_size is None:
            base = int(rng.integers(_DEFAULT_SIZE_RANGE[0], _DEFAULT_SIZE_RANGE[1] + 1))
            size = int(min(max_size, max(6, round(base * side / _REFERENCE_SIDE))))
        else:
            size = int(object_size)
        s0 = i * slot
        if slot >= lo_vis + gap:
            # max(): `slot - gap` can round to just below lo_vis when slot == lo_vis + gap
            vis = float(rng.uniform(lo_vis, max(lo_vis, min(hi_vis, slot - gap))))
            if i == n - 1 and stays_to_end:
                enter, leave = duration_s - vis, duration_s
            else:  # the last object leaves a full gap before the end, the others half a gap before their slot's
                end_margin = gap if i == n - 1 else gap / 2
                hi_enter = max(s0 + gap / 2, s0 + slot - end_margin - vis)
                enter = float(rng.uniform(s0 + gap / 2, hi_enter))
                leave = enter + vis
        else:  # a clip too short for an event and its gaps: one object, on screen throughout
            enter, leave = 0.0, duration_s
        start, velocity = _motion(rng, width, height, size, max(leave - enter, 1e-3))
        events.append(Event(WorldObject(shape, colour, size), enter, leave, start, velocity))
    return WorldSpec(int(seed), duration_s, fps, int(width), int(height), tuple(events))


# ---------------------------------------------------------------------------------------------- rendering


def _smooth_field(rng: np.random.Generator, h: int, w: int, cells: int, channels: int) -> np.ndarray:
    """Bilinearly upsampled ``(cells+1)^2`` Gaussian grid: a smooth random field of shape [h, w, channels]."""
    grid = rng.standard_normal((cells + 1, cells + 1, channels)).astype(np.float32)
    ys = np.linspace(0.0, cells, h, dtype=np.float32)
    xs = np.linspace(0.0, cells, w, dtype=np.float32)
    y0 = np.minimum(ys.astype(np.int64), cells - 1)
    x0 = np.minimum(xs.astype(np.int64), cells - 1)
    fy = (ys - y0)[:, None, None]
    fx = (xs - x0)[None, :, None]
    rows = grid[y0] * (1 - fy) + grid[y0 + 1] * fy  # [h, cells+1, c]
    return rows[:, x0] * (1 - fx) + rows[:, x0 + 1] * fx


@dataclass(frozen=True, eq=False)
class _Background:
    levels: np.ndarray  # [_N_LEVELS, H, W, 3] uint8, already lowered by _NOISE_AMP
    noise: np.ndarray  # [K, H, W, 3] uint8 in [0, 2 * _NOISE_AMP]
    period_s: float
    phase: float

    def base(self, t: float) -> np.ndarray:
        w = 0.5 - 0.5 * math.cos(2 * math.pi * t / self.period_s + self.phase)
        return self.levels[round(w * (len(self.levels) - 1))]


@functools.lru_cache(maxsize=8)
def _background(seed: int, width: int, height: int) -> _Background:
    rng = np.random.default_rng([seed, _BG_STREAM])
    base = rng.uniform(36.0, 50.0)
    tint = rng.uniform(-5.0, 5.0, size=3).astype(np.float32)

    def texture() -> np.ndarray:
        lum = 0.7 * _smooth_field(rng, height, width, 3, 1) + 0.5 * _smooth_field(rng, height, width, 9, 1)
        chroma = 0.3 * _smooth_field(rng, height, width, 5, 3)
        return np.clip(lum + chroma, -2.5, 2.5)

    tex_a, tex_b = texture(), texture()
    levels = np.empty((_N_LEVELS, height, width, 3), np.uint8)
    for j in range(_N_LEVELS):
        a = j / (_N_LEVELS - 1)
        img = base + tint + _TEXTURE_AMP * ((1 - a) * tex_a + a * tex_b) - _NOISE_AMP
        levels[j] = np.clip(np.rint(img), 0, 255 - 2 * _NOISE_AMP)
    n_tiles = int(np.clip((32 << 20) // (height * width * 3), 4, 16))
    noise = rng.integers(0, 2 * _NOISE_AMP + 1, size=(n_tiles, height, width, 3), dtype=np.uint8)
    return _Background(levels, noise, float(rng.uniform(60.0, 180.0)), float(rng.uniform(0, 2 * math.pi)))


def _noise_index(seed: int, k: int, n: int) -> int:
    x = (k * 2654435761 + seed * 2246822519 + 374761393) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 2246822519) & 0xFFFFFFFF
    return (x >> 13) % n


@functools.lru_cache(maxsize=512)
def _shape_alpha(shape: str, size: int) -> np.ndarray:
    """Coverage of ``shape`` in a ``size x size`` box, 4x supersampled: float32 [size, size, 1] in [0, 1]."""
    ss = 4
    c = (np.arange(size * ss, dtype=np.float32) + 0.5) / (size * ss) * 2 - 1  # [-1, 1]
    y, x = np.meshgrid(c, c, indexing="ij")
    if shape == "circle":
        inside = x * x + y * y <= 0.9**2
    elif shape == "square":
        inside = (np.abs(x) <= 0.9) & (np.abs(y) <= 0.9)  # corners well outside the circle
    elif shape == "triangle":  # apex up, base at the bottom
        inside = (y <= 0.85) & (y >= -0.95) & (np.abs(x) <= 0.98 * (y + 0.95) / 1.8)
    elif shape == "cross":
        arm = 0.32
        inside = ((np.abs(x) <= arm) & (np.abs(y) <= 0.95)) | ((np.abs(y) <= arm) & (np.abs(x) <= 0.95))
    else:
        raise ValueError(f"unknown shape {shape!r}")
    alpha = inside.reshape(size, ss, size, ss).mean(axis=(1, 3), dtype=np.float32)
    return alpha[:, :, None]


def _draw(frame: np.ndarray, event: Event, t: float) -> None:
    size = event.obj.size
    cx, cy = event.center_at(t)
    x0, y0 = round(cx - size / 2), round(cy - size / 2)
    h, w = frame.shape[:2]
    xa, ya, xb, yb = max(x0, 0), max(y0, 0), min(x0 + size, w), min(y0 + size, h)
    if xa >= xb or ya >= yb:
        return
    alpha = _shape_alpha(event.obj.shape, size)[ya - y0 : yb - y0, xa - x0 : xb - x0]
    region = frame[ya:yb, xa:xb].astype(np.float32)
    colour = np.asarray(COLOURS[event.obj.colour], np.float32)
    region += (colour - region) * alpha
    frame[ya:yb, xa:xb] = np.rint(region).astype(np.uint8)


def _render(world: WorldSpec, bg: _Background, t: float) -> np.ndarray:
    k = math.floor(t * world.fps + 1e-6)
    frame = np.add(bg.base(t), bg.noise[_noise_index(world.seed, k, len(bg.noise))])
    for event in world.events:
        if event.visible_at(t):
            _draw(frame, event, t)
    return frame


def render_frame(world: WorldSpec, t: float) -> np.ndarray:
    """The frame at time ``t``: [height, width, 3] uint8 RGB."""
    return _render(world, _background(world.seed, world.width, world.height), t)


def render_frames(world: WorldSpec, fps: float | None = None) -> Iterator[np.ndarray]:
    """Frames at ``fps`` (default ``world.fps``), times ``k / fps`` for ``k < frame_count(world, fps)``."""
    f = world.fps if fps is None else float(fps)
    bg = _background(world.seed, world.width, world.height)
    for k in range(frame_count(world, f)):
        yield _render(world, bg, k / f)


# ---------------------------------------------------------------------------------------------- files

_CODECS: dict[str, tuple[str, dict[str, str]]] = {
    "h264": ("libx264", {"crf": "23", "preset": "veryfast"}),
    "mpeg4": ("mpeg4", {}),
    "vp9": ("libvpx-vp9", {"crf": "30", "b": "0", "deadline": "realtime", "cpu-used": "8"}),
}


def world_to_json(world: WorldSpec) -> dict:
    return {
        "format": "vidspec-world/1",
        "seed": world.seed,
        "duration_s": world.duration_s,
        "fps": world.fps,
        "width": world.width,
        "height": world.height,
        "events": [
            {
                "shape": e.obj.shape,
                "colour": e.obj.colour,
                "size": e.obj.size,
                "enter_s": e.enter_s,
                "leave_s": e.leave_s,
                "start_xy": list(e.start_xy),
                "velocity_xy": list(e.velocity_xy),
                "direction": e.direction,  # derived, for readers; ignored by world_from_json
            }
            for e in world.events
        ],
    }


def world_from_json(d: dict) -> WorldSpec:
    events = tuple(
        Event(
            WorldObject(str(e["shape"]), str(e["colour"]), int(e["size"])),
            float(e["enter_s"]),
            float(e["leave_s"]),
            (float(e["start_xy"][0]), float(e["start_xy"][1])),
            (float(e["velocity_xy"][0]), float(e["velocity_xy"][1])),
        )
        for e in d["events"]
    )
    return WorldSpec(
        int(d["seed"]), float(d["duration_s"]), float(d["fps"]), int(d["width"]), int(d["height"]), events
    )


def write_world_video(world: WorldSpec, path: str | os.PathLike, codec: str = "h264") -> Path:
    """Encode the world's frames (streamed, bounded memory) to ``path`` and its log to ``path.with_suffix('.json')``."""
    if codec not in _CODECS:
        raise ValueError(f"codec must be one of {tuple(_CODECS)}, got {codec!r}")
    if world.width % 2 or world.height % 2:
        raise ValueError(f"yuv420p needs even frame sides, got {world.width}x{world.height}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    name, options = _CODECS[codec]
    rate = Fraction(world.fps).limit_denominator(100_000)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(name, rate=rate, options=dict(options))
        stream.width, stream.height, stream.pix_fmt = world.width, world.height, "yuv420p"
        if codec == "mpeg4":
            stream.bit_rate = max(400_000, int(world.width * world.height * world.fps * 2))
        for k, arr in enumerate(render_frames(world)):
            frame = av.VideoFrame.from_ndarray(arr, format="rgb24")
            frame.pts = k
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    path.with_suffix(".json").write_text(json.dumps(world_to_json(world), indent=1) + "\n")
    return path


def make_video(
    path: str | os.PathLike,
    duration_s: float,
    fps: float,
    width: int,
    height: int,
    seed: int,
    codec: str = "h264",
) -> Path:
    """``vidspec make-video``: a world video (moving coloured shapes) plus its JSON event log."""
    return write_world_video(make_world(seed, duration_s, fps, width, height), path, codec)


# ---------------------------------------------------------------------------------------------- text
# Templates: "{c}" colour, "{s}" shape, "{p}" plural shape, "{d}" direction phrase, "{n}" number word.

_DIRECTION_PHRASES: dict[str, tuple[str, ...]] = {
    "left": ("left", "to the left"),
    "right": ("right", "to the right"),
    "up": ("up", "upward"),
    "down": ("down", "downward"),
}
_FIRST_PREFIXES = ("", "first", "at first")
_THEN_PREFIXES = ("then", "next", "after that ,", "later", "and then")
_VERB_INTROS = ("a {c} {s} enters", "a {c} {s} appears", "a {c} {s} comes in", "a {c} {s} shows up")
_NOUN_INTROS = ("we see a {c} {s}", "there is a {c} {s}")
_VERB_MOTIONS = ("and moves {d}", "and goes {d}", ", moving {d}", ". it moves {d}", ". it goes {d}")
_NOUN_MOTIONS = ("that moves {d}", "moving {d}", ". it moves {d}", ". it slides {d}")
_END_EMPTY = (
    "then the screen is empty",
    "after that the screen stays empty",
    "then nothing else happens",
    "",
)
_END_STAYS = ("it stays until the end", "it is still there at the end", "it remains until the end")
_END_OTHER_ONE = "one object is still there at the end"
_END_OTHER_MANY = "{n} objects are still there at the end"
_NO_EVENTS = ("nothing happens", "the screen stays empty", "no objects appear")

_QUESTIONS: dict[str, tuple[str, ...]] = {
    "count": ("how many objects appear ?", "how many objects are there ?", "how many shapes appear ?"),
    "count_colour": ("how many {c} objects appear ?", "how many {c} shapes are there ?"),
    "count_shape": ("how many {p} appear ?", "how many {p} are there ?"),
    "colour_of_shape": ("what colour is the {s} ?", "which colour does the {s} have ?"),
    "shape_of_colour": ("what shape is the {c} object ?", "which shape is {c} ?"),
    "first": ("what is the first object ?", "which object appears first ?"),
    "last": ("what is the last object ?", "which object appears last ?"),
    "shape_after": ("what shape appears after the {c} {s} ?", "which shape comes after the {c} {s} ?"),
    "colour_after": (
        "what colour is the object after the {c} {s} ?",
        "which colour comes after the {c} {s} ?",
    ),
    "direction": ("which way does the {c} {s} move ?", "where does the {c} {s} move ?"),
    "end": ("what is on screen at the end ?", "what is there at the end ?"),
}
_NOTHING = "nothing"


def _norm(text: str) -> str:
    return " ".join(text.split())


def _pick(rng: np.random.Generator | None, options: Sequence[str]) -> str:
    return options[0] if rng is None else options[int(rng.integers(len(options)))]


def _end_events(world: WorldSpec) -> list[Event]:
    return world.on_screen(world.end_time)


def caption(world: WorldSpec, rng: np.random.Generator | None = None) -> str:
    """The events in order; ``rng=None`` gives the canonical wording, otherwise templates drawn by ``rng``."""
    if not world.events:
        return _norm(_pick(rng, _NO_EVENTS) + " .")
    sentences: list[str] = []
    for i, e in enumerate(world.events):
        prefix = _pick(rng, _FIRST_PREFIXES if i == 0 else _THEN_PREFIXES)
        if rng is None or rng.random() < 0.75:
            intro, motion = _pick(rng, _VERB_INTROS), _pick(rng, _VERB_MOTIONS)
        else:
            intro, motion = _pick(rng, _NOUN_INTROS), _pick(rng, _NOUN_MOTIONS)
        d = _pick(rng, _DIRECTION_PHRASES[e.direction])
        sentences.append(f"{prefix} {intro} {motion} .".format(c=e.obj.colour, s=e.obj.shape, d=d))
    end = _end_events(world)
    if not end:
        ending = _pick(rng, _END_EMPTY)
    elif len(end) == 1 and end[0] is world.events[-1]:
        ending = _pick(rng, _END_STAYS)
    elif len(end) == 1:
        ending = _END_OTHER_ONE
    else:
        ending = _END_OTHER_MANY.format(n=NUMBER_WORDS[min(len(end), MAX_EVENTS)])
    if ending:
        sentences.append(ending + " .")
    return _norm(" ".join(sentences))


_TOKEN_RE = re.compile(r"[a-z]+|[.,?!]")

# the first two words of the motion phrases that make a sentence of their own ("a red cross enters . it moves
# up ."): such a sentence is still about the event before it
_MOTION_SENTENCES = frozenset(
    tuple(m[2:].split()[:2]) for m in (*_VERB_MOTIONS, *_NOUN_MOTIONS) if m.startswith(". ")
)


def caption_sentence_events(text: str) -> list[int | None]:
    """For each sentence of a caption written by ``caption`` (each closed by ``.``), the index of the event it
    is about: a sentence naming an object is about the next event, a motion sentence (``it moves up``) about
    the same event as the sentence before it; None for the others (the closing sentence: what is on screen
    at the end). Words after the last ``.`` make no sentence."""
    out: list[int | None] = []
    event = -1
    words: list[str] = []
    for w in text.split():
        if w != ".":
            words.append(w)
            continue
        if caption_events(" ".join(words)):
            event += 1
            out.append(event)
        elif event >= 0 and tuple(words[:2]) in _MOTION_SENTENCES:
            out.append(event)
        else:
            out.append(None)
        words = []
    return out


def caption_events(text: str) -> list[tuple[str, str]]:
    """The ordered ``(colour, shape)`` pairs named in ``text`` (adjacent ``<colour> <shape>`` tokens)."""
    tokens = _TOKEN_RE.findall(text.lower())
    return [(a, b) for a, b in itertools.pairwise(tokens) if a in COLOURS and b in SHAPES]


def questions(world: WorldSpec, rng: np.random.Generator) -> list[QA]:
    """One question per applicable type (``QTYPES`` order), targets and phrasing drawn by ``rng``."""
    events = world.events
    names = [e.obj.name for e in events]
    colours = [e.obj.colour for e in events]
    shapes = [e.obj.shape for e in events]
    unique_pair = [i for i, nm in enumerate(names) if names.count(nm) == 1]
    out: list[QA] = []

    def ask(qtype: str, answer: str, refs: Sequence[int] = (), **fields: str) -> None:
        cue = " ".join(fields[k] for k in ("c", "s") if k in fields)
        out.append(QA(_pick(rng, _QUESTIONS[qtype]).format(**fields), answer, qtype, tuple(refs), cue))

    if len(events) <= MAX_EVENTS:  # counts have number words
        ask("count", NUMBER_WORDS[len(events)], range(len(events)))
        present_c = sorted(set(colours), key=tuple(COLOURS).index)
        c = _pick(rng, present_c if present_c and rng.random() < 0.75 else tuple(COLOURS))
        ask("count_colour", NUMBER_WORDS[colours.count(c)], [i for i, x in enumerate(colours) if x == c], c=c)
        present_s = sorted(set(shapes), key=SHAPES.index)
        s = _pick(rng, present_s if present_s and rng.random() < 0.75 else SHAPES)
        ask(
            "count_shape",
            NUMBER_WORDS[shapes.count(s)],
            [i for i, x in enumerate(shapes) if x == s],
            p=SHAPE_PLURALS[s],
            s=s,
        )
    single_s = [s for s in SHAPES if shapes.count(s) == 1]
    if single_s:
        s = _pick(rng, single_s)
        ask("colour_of_shape", colours[shapes.index(s)], [shapes.index(s)], s=s)
    single_c = [c for c in COLOURS if colours.count(c) == 1]
    if single_c:
        c = _pick(rng, single_c)
        ask("shape_of_colour", shapes[colours.index(c)], [colours.index(c)], c=c)
    if events:
        ask("first", names[0], [0])
        ask("last", names[-1], [len(events) - 1])
    refs = [i for i in unique_pair if i < len(events) - 1]
    if refs:
        i = refs[int(rng.integers(len(refs)))]
        ask("shape_after", shapes[i + 1], [i + 1], c=colours[i], s=shapes[i])
        i = refs[int(rng.integers(len(refs)))]
        ask("colour_after", colours[i + 1], [i + 1], c=colours[i], s=shapes[i])
    if unique_pair:
        i = unique_pair[int(rng.integers(len(unique_pair)))]
        ask("direction", events[i].direction, [i], c=colours[i], s=shapes[i])
    end = _end_events(world)
    if len(end) <= 1:
        ask("end", end[0].obj.name if end else _NOTHING, [events.index(e) for e in end])
    return out


def object_list(world: WorldSpec) -> str:
    """Every object in entry order as ``<colour> <shape> <direction>``, comma-separated (``nothing``: none)."""
    if not world.events:
        return _NOTHING
    return " , ".join(item_text(e) for e in world.events)


def altered_world(world: WorldSpec, rng: np.random.Generator, n: int = 1) -> WorldSpec:
    """``world`` with ``n`` objects (at most all) changed in one attribute each, drawn by ``rng``: its colour or
    its shape (to another value), or its direction (reversed). The video stays the original's: training
    answers from an altered world's object list cannot be read from the video, only from the list."""
    events = list(world.events)
    for k in rng.choice(len(events), size=min(n, len(events)), replace=False) if events else ():
        e = events[int(k)]
        what = int(rng.integers(3))
        if what == 2:
            events[int(k)] = dataclasses.replace(e, velocity_xy=(-e.velocity_xy[0], -e.velocity_xy[1]))
            continue
        field, values = ("colour", tuple(COLOURS)) if what == 0 else ("shape", SHAPES)
        others = [v for v in values if v != getattr(e.obj, field)]
        obj = dataclasses.replace(e.obj, **{field: others[int(rng.integers(len(others)))]})
        events[int(k)] = dataclasses.replace(e, obj=obj)
    return dataclasses.replace(world, events=tuple(events))


def item_text(e: Event) -> str:
    """One object of a trace: ``<colour> <shape> <direction>``."""
    return f"{e.obj.colour} {e.obj.shape} {e.direction}"


TRACE_STYLES: tuple[str, ...] = ("list", "scan", "cued")
# the filtered counts: their scan writes the running count after each item
COUNTING_QTYPES = frozenset({"count_colour", "count_shape"})


def scan_list(world: WorldSpec, qa: QA) -> str:
    """``object_list`` worked through step by step towards ``qa`` (a ``TRACED_QTYPES`` question): for a filtered
    count every item is followed by the running count of the objects counted so far (``purple cross up one ,
    green square down one``), so the answer is the last item's count; for a lookup the list stops at the object
    the answer is read from (``qa.refs``: the matched object, or the one after it for ``*_after``), so the
    answer is an attribute of the last item. Each step is a comparison of the item just written with the
    question, never a search of the whole list."""
    return _scan(world, qa, "")


def cued_scan(world: WorldSpec, qa: QA) -> str:
    """``scan_list`` with the question's cue (``qa.cue``) written before every item (``what colour is the
    square ?`` -> ``square purple cross up , square green square down``): the comparison that decides each
    step (go on or stop; count it or not) is between words a fixed distance apart in the model's own text,
    instead of between the item and a word of the question far back."""
    if qa.qtype in TRACED_QTYPES and not qa.cue:
        raise ValueError(f"a cued trace needs the question's cue ({qa.qtype!r} question without one)")
    return _scan(world, qa, qa.cue)


def _scan(world: WorldSpec, qa: QA, cue: str) -> str:
    if qa.qtype not in TRACED_QTYPES:
        raise ValueError(f"{qa.qtype!r} is not a traced question type")
    if not world.events:
        return _NOTHING
    lead = f"{cue} " if cue else ""
    if qa.qtype in COUNTING_QTYPES:
        counted = set(qa.refs)
        running = itertools.accumulate(int(i in counted) for i in range(len(world.events)))
        return " , ".join(
            f"{lead}{item_text(e)} {NUMBER_WORDS[min(n, MAX_EVENTS)]}"
            for e, n in zip(world.events, running, strict=True)
        )
    if len(qa.refs) != 1:
        raise ValueError(f"a lookup refers to one object, not {qa.refs}")
    return " , ".join(f"{lead}{item_text(e)}" for e in world.events[: qa.refs[0] + 1])


def answer_text(world: WorldSpec, qa: QA, style: str = "list") -> str:
    """What the model is trained to say to ``qa``: for ``TRACED_QTYPES``, a trace then `` . `` then the answer
    (``style``: ``"list"``, every object, ``object_list``; ``"scan"``, ``scan_list``; ``"cued"``,
    ``cued_scan``); otherwise the answer alone. ``final_answer`` recovers ``qa.answer`` from each."""
    if style not in TRACE_STYLES:
        raise ValueError(f"trace style must be one of {TRACE_STYLES}, not {style!r}")
    if qa.qtype not in TRACED_QTYPES:
        return qa.answer
    if style == "list":
        trace = object_list(world)
    elif style == "scan":
        trace = scan_list(world, qa)
    else:
        trace = cued_scan(world, qa)
    return f"{trace} . {qa.answer}"


def cued_answer(qa: QA) -> str:
    """A two-turn question's reply that first repeats the question's cue (``qa.cue``: the colour and/or shape it
    asks about), then `` . ``, then the answer (``what colour is the square ?`` -> ``square . red``): the word
    the lookup in the object list matches is the token right before the answer, so reading it takes no hop
    back to the question. Without a cue, the answer alone. ``final_answer`` recovers ``qa.answer``."""
    return f"{qa.cue} . {qa.answer}" if qa.cue else qa.answer


def final_answer(text: str) -> str:
    """The answer in a model's reply: what follows the last `` . `` (the whole reply when there is none)."""
    text = _norm(text)
    _, sep, tail = text.rpartition(" . ")
    return tail if sep else text


@functools.cache
def _vocabulary() -> tuple[str, ...]:
    texts: list[str] = [*SHAPES, *SHAPE_PLURALS.values(), *COLOURS, *NUMBER_WORDS, _NOTHING, "."]
    texts += [p for ps in _DIRECTION_PHRASES.values() for p in ps]
    for group in (
        _FIRST_PREFIXES,
        _THEN_PREFIXES,
        _VERB_INTROS,
        _NOUN_INTROS,
        _VERB_MOTIONS,
        _NOUN_MOTIONS,
        _END_EMPTY,
        _END_STAYS,
        (_END_OTHER_ONE, _END_OTHER_MANY),
        _NO_EVENTS,
        *_QUESTIONS.values(),
    ):
        texts += group
    words = {w for t in texts for w in t.split() if not w.startswith("{")}
    return tuple(sorted(words))


def vocabulary() -> list[str]:
    """Every token any caption, question or answer can contain (sorted)."""
    return list(_vocabulary())
