"""The synthetic video world: deterministic, its text matches its event log, it renders and encodes what it says."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import av
import numpy as np
import pytest

from decoders.train import world as W
from decoders.train.world import (
    COLOURS,
    SHAPES,
    Event,
    WorldObject,
    WorldSpec,
    caption,
    caption_events,
    make_video,
    make_world,
    questions,
    render_frame,
    render_frames,
    vocabulary,
    world_from_json,
    world_to_json,
    write_world_video,
)

NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve".split()
DURATIONS = (5.0, 30.0, 240.0, 3600.0)


def _frames_digest(world: WorldSpec) -> str:
    h = hashlib.sha256()
    for frame in render_frames(world):
        h.update(frame.tobytes())
    return h.hexdigest()


def _worlds(n_seeds: int = 12) -> list[WorldSpec]:
    return [make_world(seed, d, fps=fps) for seed in range(n_seeds) for d in DURATIONS for fps in (1.0, 2.0)]


def test_same_seed_gives_identical_world_frames_captions_and_questions() -> None:
    a = make_world(11, 40.0)
    W._background.cache_clear()  # the second rendering rebuilds the background from the seed
    digest_a = _frames_digest(a)
    W._background.cache_clear()
    b = make_world(11, 40.0)
    assert a == b
    assert _frames_digest(b) == digest_a
    assert caption(a, np.random.default_rng(3)) == caption(b, np.random.default_rng(3))
    assert questions(a, np.random.default_rng(4)) == questions(b, np.random.default_rng(4))

    c = make_world(12, 40.0)
    assert c != a
    assert _frames_digest(c) != digest_a
    # a different text rng gives different text (over a few draws)
    assert len({caption(a, np.random.default_rng(s)) for s in range(5)}) > 1


def test_default_worlds_spread_events_one_at_a_time_each_visible_for_several_frames() -> None:
    counts: dict[float, list[int]] = {d: [] for d in DURATIONS}
    for w in _worlds():
        counts[w.duration_s].append(len(w.events))
        assert 1 <= len(w.events) <= 8
        gap = max(1.0, 2.0 / w.fps)
        for e in w.events:
            frames = [k for k in range(W.frame_count(w)) if e.visible_at(k / w.fps)]
            assert len(frames) >= 4, (w.seed, w.duration_s, e)
            # the whole object stays inside the frame from enter to leave
            for t in (e.enter_s, e.leave_s):
                cx, cy = e.center_at(t)
                r = e.obj.size / 2
                assert r <= cx <= w.width - r and r <= cy <= w.height - r
            # one dominant direction
            vx, vy = e.velocity_xy
            assert max(abs(vx), abs(vy)) >= 4 * min(abs(vx), abs(vy))
        for prev, nxt in zip(w.events, w.events[1:]):
            assert prev.leave_s + gap - 1e-6 <= nxt.enter_s  # never two at once, and a gap between
        last = w.events[-1]
        assert last.leave_s == w.duration_s or last.leave_s <= w.end_time
        if w.duration_s >= 240:  # spread over the whole duration, not bunched at the start
            assert last.enter_s > w.duration_s / 2
    assert np.mean(counts[3600.0]) > np.mean(counts[30.0]) > np.mean(counts[5.0]) - 1e-9


def test_make_world_rejects_events_that_do_not_fit() -> None:
    with pytest.raises(ValueError):
        make_world(0, 10.0, n_events=10)
    assert len(make_world(0, 10.0, n_events=2).events) == 2
    assert len(make_world(0, 600.0, n_events=12).events) == 12


def _expected(w: WorldSpec, qa: W.QA) -> tuple[str, tuple[int, ...]]:
    """The answer and the events it is read from, recomputed from the event list and the question's words."""
    colours = [e.obj.colour for e in w.events]
    shapes = [e.obj.shape for e in w.events]
    every = range(len(w.events))
    words = qa.question.split()
    qc = [x for x in words if x in COLOURS]
    qs = [x for x in words if x in SHAPES]
    plural = {s + ("es" if s.endswith("s") else "s"): s for s in SHAPES}
    qp = [plural[x] for x in words if x in plural]
    if qa.qtype == "count":
        return NUMBERS[len(w.events)], tuple(every)
    if qa.qtype == "count_colour":
        return NUMBERS[colours.count(qc[0])], tuple(i for i in every if colours[i] == qc[0])
    if qa.qtype == "count_shape":
        return NUMBERS[shapes.count(qp[0])], tuple(i for i in every if shapes[i] == qp[0])
    if qa.qtype == "first":
        return f"{colours[0]} {shapes[0]}", (0,)
    if qa.qtype == "last":
        return f"{colours[-1]} {shapes[-1]}", (len(w.events) - 1,)
    if qa.qtype == "end":
        t_last = (math.ceil(w.duration_s * w.fps - 1e-6) - 1) / w.fps
        on = [i for i in every if w.events[i].enter_s <= t_last < w.events[i].leave_s]
        assert len(on) <= 1
        return (f"{colours[on[0]]} {shapes[on[0]]}" if on else "nothing"), tuple(on)
    if qa.qtype == "colour_of_shape":
        assert shapes.count(qs[0]) == 1  # only asked when unambiguous
        return colours[shapes.index(qs[0])], (shapes.index(qs[0]),)
    if qa.qtype == "shape_of_colour":
        assert colours.count(qc[0]) == 1
        return shapes[colours.index(qc[0])], (colours.index(qc[0]),)
    pairs = list(zip(colours, shapes))
    ref = (qc[0], qs[0])
    assert pairs.count(ref) == 1
    i = pairs.index(ref)
    if qa.qtype == "shape_after":
        return shapes[i + 1], (i + 1,)
    if qa.qtype == "colour_after":
        return colours[i + 1], (i + 1,)
    if qa.qtype == "direction":
        vx, vy = w.events[i].velocity_xy
        return ("right" if vx > 0 else "left") if abs(vx) > abs(vy) else ("down" if vy > 0 else "up"), (i,)
    raise AssertionError(f"unexpected qtype {qa.qtype}")


def test_answers_match_the_event_log() -> None:
    seen: set[str] = set()
    for i, w in enumerate(_worlds(8)):
        for r in range(3):
            qas = questions(w, np.random.default_rng(1000 * i + r))
            assert {"count", "count_colour", "count_shape", "first", "last", "end"} <= {q.qtype for q in qas}
            for qa in qas:
                seen.add(qa.qtype)
                assert (qa.answer, qa.refs) == _expected(w, qa), (w.seed, qa)
    assert seen == set(W.QTYPES)


def test_traced_answers_list_every_object_in_order_and_end_with_the_answer() -> None:
    n_traced = 0
    for i, w in enumerate([*_worlds(8), make_world(9, 20.0, n_events=0)]):
        listed = W.object_list(w)
        if not w.events:
            assert listed == "nothing"
        else:  # "<colour> <shape> <direction>" per event, in entry order
            items = [item.split() for item in listed.split(" , ")]
            assert [tuple(x[:2]) for x in items] == W.event_pairs(w)
            assert [x[2] for x in items] == [e.direction for e in w.events]
        for qa in questions(w, np.random.default_rng(i)):
            text = W.answer_text(w, qa)
            assert W.final_answer(text) == qa.answer
            assert W.final_answer(f"  {text}  ") == qa.answer  # scored after whitespace normalisation
            if qa.qtype in W.TRACED_QTYPES:
                assert text == f"{listed} . {qa.answer}"
                n_traced += 1
            else:
                assert text == qa.answer
    assert n_traced > 20
    assert set(W.QTYPES) > W.TRACED_QTYPES
    # a reply that is not the trained form is scored whole (so a wrong format is wrong)
    assert W.final_answer("red circle left .") == "red circle left ."
    assert W.final_answer("red circle left . blue . green") == "green"


def test_caption_events_inverts_every_caption_variant() -> None:
    for w in _worlds(10):
        truth = [(e.obj.colour, e.obj.shape) for e in w.events]
        assert caption_events(caption(w)) == truth
        for r in range(10):
            assert caption_events(caption(w, np.random.default_rng(r))) == truth
    # the randomised captions are a real distribution, and every template fragment shows up
    w = make_world(5, 600.0, n_events=6)
    texts = {caption(w, np.random.default_rng(r)) for r in range(300)}
    assert len(texts) == 300
    joined = " | ".join(texts)
    fragments = [
        *W._VERB_INTROS,
        *W._NOUN_INTROS,
        *W._VERB_MOTIONS,
        *W._NOUN_MOTIONS,
        *W._THEN_PREFIXES,
        *(f for f in W._FIRST_PREFIXES if f),
    ]
    for frag in fragments:
        core = max((piece.strip() for piece in re.split(r"\{\w\}", frag)), key=len)
        assert core in joined, frag


def test_caption_and_questions_handle_empty_and_overlapping_worlds() -> None:
    empty = WorldSpec(0, 10.0, 2.0, 64, 64, ())
    assert caption_events(caption(empty)) == []
    for r in range(10):
        assert caption_events(caption(empty, np.random.default_rng(r))) == []
    qas = {q.qtype: q.answer for q in questions(empty, np.random.default_rng(0))}
    assert qas["count"] == "zero" and qas["end"] == "nothing"
    assert render_frame(empty, 1.0).shape == (64, 64, 3)

    red = Event(WorldObject("circle", "red", 20), 1.0, 10.0, (20.0, 20.0), (0.0, 1.0))
    blue = Event(WorldObject("cross", "blue", 20), 2.0, 10.0, (44.0, 20.0), (0.0, 1.0))
    both = WorldSpec(0, 10.0, 2.0, 64, 64, (red, blue))
    assert caption_events(caption(both)) == [("red", "circle"), ("blue", "cross")]
    assert "two objects are still there at the end" in caption(both)
    assert "end" not in {q.qtype for q in questions(both, np.random.default_rng(0))}
    frame = render_frame(both, 3.0)
    for e in (red, blue):
        x, y = e.center_at(3.0)
        assert np.abs(frame[int(y), int(x)].astype(int) - COLOURS[e.obj.colour]).max() <= 2


def _background_like(pixel: np.ndarray) -> bool:
    return int(pixel.max()) < 90


def test_render_draws_objects_in_their_colour_only_while_on_screen() -> None:
    for seed in range(6):
        w = make_world(seed, 120.0, fps=2.0)
        for e in w.events:
            t = (e.enter_s + e.leave_s) / 2
            frame = render_frame(w, t)
            assert frame.shape == (w.height, w.width, 3) and frame.dtype == np.uint8
            cx, cy = e.center_at(t)
            assert np.abs(frame[int(cy), int(cx)].astype(int) - COLOURS[e.obj.colour]).max() <= 2
            # far from the object: background (dim)
            fx = 2 if cx > w.width / 2 else w.width - 3
            fy = 2 if cy > w.height / 2 else w.height - 3
            assert _background_like(frame[fy, fx])
            # absent just before it enters and once it has left (unless it stays until the end)
            x0, y0 = e.center_at(e.enter_s)
            assert _background_like(render_frame(w, e.enter_s - 0.5)[int(y0), int(x0)])
            if e.leave_s < w.duration_s:
                x1, y1 = e.center_at(e.leave_s)
                assert _background_like(render_frame(w, e.leave_s)[int(y1), int(x1)])
        # render_frames yields exactly the frames render_frame gives at k / fps
        frames = list(render_frames(w, fps=0.5))
        assert len(frames) == 60
        for k in (0, 17, 59):
            np.testing.assert_array_equal(frames[k], render_frame(w, k / 0.5))


def test_background_is_dim_low_contrast_and_slowly_varying() -> None:
    w = make_world(3, 600.0, n_events=1)
    quiet = [t for t in np.arange(0.0, 600.0, 37.0) if not w.on_screen(float(t))]
    frames = np.stack([render_frame(w, float(t)).astype(np.float32) for t in quiet])
    assert frames.max() < 90 and frames.mean() < 60
    assert frames.std(axis=(1, 2)).max() < 12  # low contrast within a frame
    a, b = render_frame(w, 100.0).astype(int), render_frame(w, 100.5).astype(int)
    assert 0 < np.abs(a - b).mean() < 4  # mild noise, not static, not flickering


@pytest.mark.parametrize("codec,suffix", [("h264", ".mp4"), ("mpeg4", ".mp4"), ("vp9", ".webm")])
def test_write_world_video_is_decodable_with_its_event_log_beside_it(
    tmp_path: Path, codec: str, suffix: str
) -> None:
    w = make_world(21, 20.0, fps=2.0)
    path = write_world_video(w, tmp_path / f"clip{suffix}", codec=codec)
    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == W.frame_count(w) == 40
    assert frames[0].shape == (224, 224, 3)
    log = json.loads(path.with_suffix(".json").read_text())
    assert world_from_json(log) == w
    assert world_from_json(json.loads(json.dumps(world_to_json(w)))) == w
    e = w.events[0]
    k = math.ceil(e.enter_s * w.fps) + 2
    cx, cy = e.center_at(k / w.fps)
    assert np.abs(frames[k][int(cy), int(cx)].astype(int) - COLOURS[e.obj.colour]).max() <= 16


def test_make_video_entry_point_writes_the_requested_geometry(tmp_path: Path) -> None:
    path = make_video(tmp_path / "sub" / "v.mp4", duration_s=6.0, fps=5.0, width=320, height=240, seed=3)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = list(container.decode(stream))
    assert len(frames) == 30
    assert (frames[0].width, frames[0].height) == (320, 240)
    assert world_from_json(json.loads(path.with_suffix(".json").read_text())) == make_world(
        3, 6.0, 5.0, 320, 240
    )


def test_scan_traces_count_step_by_step_and_stop_lookups_at_the_object_read() -> None:
    n_counts = n_lookups = 0
    for i, w in enumerate([*_worlds(8), make_world(9, 20.0, n_events=0)]):
        full = [item.split() for item in W.object_list(w).split(" , ")] if w.events else []
        for qa in questions(w, np.random.default_rng(i)):
            text = W.answer_text(w, qa, "scan")
            assert W.final_answer(text) == qa.answer
            if qa.qtype not in W.TRACED_QTYPES:
                assert text == qa.answer
                with pytest.raises(ValueError, match="not a traced"):
                    W.scan_list(w, qa)
                continue
            trace, _, answer = text.rpartition(" . ")
            if not w.events:
                assert trace == "nothing"
                continue
            items = [item.split() for item in trace.split(" , ")]
            if qa.qtype in ("count_colour", "count_shape"):  # every object, each with the running count
                n_counts += 1
                assert [x[:3] for x in items] == full
                attr = 0 if qa.qtype == "count_colour" else 1
                target = re.match(r"how many (\w+)", qa.question)[1]  # type: ignore[index]
                target = target if attr == 0 else next(s for s, p in W.SHAPE_PLURALS.items() if p == target)
                running = 0
                for x in items:
                    running += x[attr] == target
                    assert x[3] == W.NUMBER_WORDS[running]
                assert items[-1][3] == answer
            else:  # a prefix of the full list ending at the object the answer is read from
                n_lookups += 1
                assert items == full[: len(items)] and len(items) == qa.refs[0] + 1
                last = items[-1]
                if qa.qtype == "direction":
                    assert last[2] == answer and " ".join(last[:2]) in qa.question
                elif qa.qtype in ("colour_of_shape", "colour_after"):
                    assert last[0] == answer
                else:
                    assert last[1] == answer
                if qa.qtype in ("shape_after", "colour_after"):  # the item before it is the one named
                    assert len(items) >= 2 and " ".join(items[-2][:2]) in qa.question
                elif qa.qtype != "direction":
                    named = last[1] if qa.qtype == "colour_of_shape" else last[0]
                    assert named in qa.question.split()
                    assert all(x[1 if qa.qtype == "colour_of_shape" else 0] != named for x in items[:-1])
    assert n_counts > 10 and n_lookups > 20
    with pytest.raises(ValueError, match="trace style"):
        W.answer_text(_worlds(1)[0], questions(_worlds(1)[0], np.random.default_rng(0))[0], "tree")


def test_cued_answers_repeat_the_cue_and_final_answer_recovers_the_answer() -> None:
    rng = np.random.default_rng(3)
    seen = set()
    for world in _worlds(6):
        for q in W.questions(world, rng):
            text = W.cued_answer(q)
            assert W.final_answer(text) == q.answer
            if q.cue:
                seen.add(q.qtype)
                assert text.split(" . ")[0] == q.cue and q.cue.split()[-1] in (*W.COLOURS, *W.SHAPES)
            else:
                assert text == q.answer
    assert seen == set(W.TRACED_QTYPES)


def test_cued_traces_are_scans_with_the_questions_cue_before_every_item() -> None:
    n = 0
    for i, w in enumerate([*_worlds(8), make_world(9, 20.0, n_events=0)]):
        for qa in questions(w, np.random.default_rng(i)):
            if qa.qtype not in W.TRACED_QTYPES:
                assert qa.cue == ""
                assert W.answer_text(w, qa, "cued") == qa.answer
                continue
            # the cue is what the question names: a colour, a shape (a plural in count_shape) or both
            words = qa.cue.split()
            assert len(words) == (2 if qa.qtype in ("shape_after", "colour_after", "direction") else 1)
            asked = qa.question.split()
            for word in words:
                assert word in asked or W.SHAPE_PLURALS.get(word) in asked
            text = W.answer_text(w, qa, "cued")
            assert W.final_answer(text) == qa.answer
            trace, _, _ = text.rpartition(" . ")
            if not w.events:
                assert trace == "nothing"
                continue
            scan = W.scan_list(w, qa).split(" , ")
            assert trace.split(" , ") == [f"{qa.cue} {item}" for item in scan]
            n += 1
    assert n > 30
    with pytest.raises(ValueError, match="cue"):
        W.cued_scan(_worlds(1)[0], W.QA("what colour is the square ?", "red", "colour_of_shape", (0,)))


def test_vocabulary_covers_every_generated_token() -> None:
    vocab = set(vocabulary())
    assert len(vocab) == len(vocabulary())
    n_texts = 0
    for i, w in enumerate(_worlds(10)):
        rng = np.random.default_rng(i)
        texts = [caption(w), *(caption(w, rng) for _ in range(5))]
        for qa in questions(w, rng):
            texts += [qa.question, qa.answer, W.answer_text(w, qa), W.answer_text(w, qa, "scan")]
            assert 1 <= len(qa.answer.split()) <= 2
        for text in texts:
            assert text == " ".join(text.split()) == text.lower()
            assert set(text.split()) <= vocab, set(text.split()) - vocab
            n_texts += 1
    assert n_texts > 1000


def test_one_hour_world_renders_every_frame() -> None:
    assert sum(1 for _ in render_frames(make_world(0, 3600.0, fps=1.0))) == 3600


def _cbcr(rgb: tuple[int, int, int]) -> np.ndarray:
    r, g, b = rgb
    y = 0.299 * r + 0.587 * g + 0.114 * b
    return np.array([(b - y) * 0.564, (r - y) * 0.713])


def test_colours_and_shapes_are_far_apart() -> None:
    names = list(COLOURS)
    for i, a in enumerate(names):
        assert max(COLOURS[a]) >= 200  # much brighter than the background (< 90)
        for b in names[i + 1 :]:
            assert np.linalg.norm(np.subtract(COLOURS[a], COLOURS[b])) >= 140, (a, b)
            assert np.linalg.norm(_cbcr(COLOURS[a]) - _cbcr(COLOURS[b])) >= 80, (a, b)  # survives 4:2:0
    for size in (16, 28, 48, 64):
        for i, a in enumerate(SHAPES):
            for b in SHAPES[i + 1 :]:
                differ = np.abs(W._shape_alpha(a, size) - W._shape_alpha(b, size)).mean()
                assert differ >= 0.15, (a, b, size)
