"""`vidspec bench` and `vidspec make-video` end to end on a tiny checkpoint (correctness of the output, not speed)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import av
import numpy as np
import pytest

from decoders.train.world import make_world, render_frames
from decoders.video import VideoError
from pipeline.bench import BenchConfig, read_ahead
from pipeline.cli import main

CONTRACT_FIELDS = {
    "method", "visual_tokens", "prompt_tokens", "new_tokens", "tokens", "text", "prefill_s", "decode_s",
    "decode_tokens_per_s", "mean_accepted_length", "acceptance_rate", "identical_to_vanilla",
    "speedup_vs_vanilla", "speedup_vs_hf",
}  # fmt: skip


def _video(tmp_path: Path, duration: int, seed: int) -> Path:
    """A tiny world video (56x56 at 2 fps: `duration` * 2 frames), written by `vidspec make-video`."""
    out = tmp_path / f"v{seed}.mp4"
    args = ["--duration", str(duration), "--fps", "2", "--size", "56x56", "--seed", str(seed)]
    assert main(["make-video", "--out", str(out), *args]) == 0
    return out


def test_make_video_is_deterministic_and_decodable(tmp_path: Path) -> None:
    a, b = tmp_path / "a.mp4", tmp_path / "b.mp4"
    for p in (a, b):
        assert (
            main(
                [
                    "make-video",
                    "--out",
                    str(p),
                    "--duration",
                    "3",
                    "--fps",
                    "4",
                    "--size",
                    "112x84",
                    "--seed",
                    "5",
                ]
            )
            == 0
        )
    with av.open(str(a)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    with av.open(str(b)) as c:
        frames_b = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) == 12 and frames[0].shape == (84, 112, 3)
    # the world is deterministic to the pixel (its frames before encoding) ...
    world = make_world(5, 3, 4, 112, 84)
    assert all(
        (x == y).all() for x, y in zip(render_frames(world), render_frames(make_world(5, 3, 4, 112, 84)))
    )
    # ... and so are the files up to the encoder: once in a full `make test` run the two encodes differed (not
    # reproduced in 120 encodes since; libx264 runs threaded), so decoded frames must agree to within rounding
    # of a few pixels, far below what a moved or recoloured object would change
    for x, y in zip(frames, frames_b):
        diff = np.abs(x.astype(np.int16) - y.astype(np.int16))
        assert diff.mean() < 0.5 and (diff > 24).mean() < 0.01


def test_bench_writes_the_contract_json_and_a_plot(tiny_checkpoints: dict, tmp_path: Path) -> None:
    video = _video(tmp_path, 8, 1)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main([
        "bench", "--model", str(tiny_checkpoints["qwen2_vl"]), "--video", str(video), "--max-frames", "4,16",
        "--method", "hf", "--method", "hf-prompt-lookup", "--method", "vanilla", "--max-new-tokens", "8",
        "--repeats", "1", "--json", str(out), "--plot", str(png),
    ])  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["warmup"] == 0 and doc["dtype"] == "float32"  # the defaults on the CPU
    rows = doc["results"]
    assert len(rows) == 6
    for r in rows:
        assert set(r) >= CONTRACT_FIELDS
        assert r["new_tokens"] == len(r["tokens"]) and r["mean_accepted_length"] is None
    lengths = sorted({r["visual_tokens"] for r in rows})
    assert len(lengths) == 2 and lengths[1] == 4 * lengths[0]  # 4 and 16 frames
    vanilla = [r for r in rows if r["method"] == "vanilla"]
    assert all(r["identical_to_vanilla"] and r["speedup_vs_vanilla"] == 1.0 for r in vanilla)
    short_hf = next(r for r in rows if r["method"] == "hf" and r["visual_tokens"] == lengths[0])
    assert short_hf["identical_to_vanilla"]  # generate is consistent on a short video
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_unknown_methods_and_missing_files(
    tiny_checkpoints: dict, tmp_path: Path, capsys
) -> None:
    assert (
        main(["bench", "--model", str(tiny_checkpoints["qwen2_vl"]), "--video", "x.mp4", "--method", "magic"])
        == 2
    )
    assert "unknown method" in capsys.readouterr().err
    rc = main(
        ["bench", "--model", str(tiny_checkpoints["qwen2_vl"]), "--video", str(tmp_path / "missing.mp4")]
    )
    assert rc == 2
    assert "missing.mp4" in capsys.readouterr().err


def test_bench_sums_several_questions_per_method(tiny_checkpoints: dict, tmp_path: Path) -> None:
    video = _video(tmp_path, 6, 2)
    out = tmp_path / "r.json"
    rc = main([
        "bench", "--model", str(tiny_checkpoints["qwen2_vl"]), "--video", str(video), "--max-frames", "8",
        "--method", "vanilla", "--method", "std", "--max-new-tokens", "6", "--ignore-eos", "--repeats", "1",
        "--question", "describe the video .", "--question", "what colour is the circle ?", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["question"] == ["describe the video .", "what colour is the circle ?"]
    for r in doc["results"]:
        assert r["new_tokens"] == 12 == len(r["tokens"])  # 6 per question
        assert r["identical_to_vanilla"]
        assert r["decode_tokens_per_s"] == pytest.approx(10 / r["decode_s"])  # 5 decoded per question
    std = next(r for r in doc["results"] if r["method"] == "std")
    assert std["mean_accepted_length"] is not None and std["mean_accepted_length"] >= 1.0


def test_bench_takes_a_dtype_and_untimed_warmup_answers(
    tiny_checkpoints: dict, tmp_path: Path, capsys
) -> None:
    """--dtype loads weights and cache in that dtype (recorded in the JSON); --warmup answers untimed before
    the first length and is not counted among the repeats."""
    video = _video(tmp_path, 6, 3)
    out = tmp_path / "r.json"
    rc = main([
        "bench", "--model", str(tiny_checkpoints["qwen2_vl"]), "--video", str(video), "--max-frames", "8",
        "--method", "vanilla", "--method", "std", "--max-new-tokens", "6", "--ignore-eos", "--repeats", "1",
        "--dtype", "bfloat16", "--warmup", "2", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["dtype"] == "bfloat16" and doc["warmup"] == 2
    assert all(r["repeats"] == 1 and len(r["repeats_decode_s"]) == 1 for r in doc["results"])
    assert "warm-up: 2 untimed answer(s) per method and video" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--warmup"):
        BenchConfig(model=tmp_path, video=video, warmup=-1)
    with pytest.raises(ValueError, match="unknown dtype"):
        BenchConfig(model=tmp_path, video=video, dtype="float8")


def test_bench_repeats_short_decodes_until_min_decode_time(tiny_checkpoints: dict, tmp_path: Path) -> None:
    video = _video(tmp_path, 4, 3)
    out = tmp_path / "r.json"
    rc = main([
        "bench", "--model", str(tiny_checkpoints["qwen2_vl"]), "--video", str(video), "--max-frames", "8",
        "--method", "vanilla", "--method", "std", "--max-new-tokens", "4", "--ignore-eos", "--repeats", "1",
        "--min-decode-s", "1000", "--max-repeats", "3", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["repeats"] == 1 and doc["min_decode_s"] == 1000 and doc["max_repeats"] == 3
    # an unreachable decode time: every method of ours runs the cap, interleaved, and the medians cover them
    for r in doc["results"]:
        assert r["repeats"] == 3 == len(r["repeats_decode_s"])
        assert r["decode_s"] == pytest.approx(sorted(r["repeats_decode_s"])[1])
    # accepted length over every cycle of the three repeats: inside the range of the repeats' own values
    std = next(r for r in doc["results"] if r["method"] == "std")
    each = std["mean_accepted_length_per_repeat"]
    assert len(each) == 3 and min(each) <= std["mean_accepted_length"] <= max(each)
    assert next(r for r in doc["results"] if r["method"] == "vanilla")["mean_accepted_length"] is None


def _rows(table: dict[int, tuple[float, float]]) -> list[dict]:
    return [
        {"method": m, "visual_tokens": n, "decode_tokens_per_s": v}
        for n, (std, sparrow) in table.items()
        for m, v in (("std", std), ("sparrow", sparrow))
    ]


def test_router_calibration_minimises_the_worst_loss() -> None:
    from pipeline.bench import calibrate_router

    # a clean crossover between 4k and 16k: the geometric mean of the two lengths
    t, evidence = calibrate_router(_rows({1024: (400, 800), 4096: (300, 400), 16384: (200, 150)}))
    assert t == 8192 and set(evidence) == {"1024", "4096", "16384"}
    # StD wins by 2% at 16k but loses by 11% at 25k: Sparrow everywhere costs less than switching at 16k
    t, _ = calibrate_router(_rows({1536: (400, 700), 16384: (144.6, 140.9), 25600: (90.3, 101.3)}))
    assert t > 25600
    # StD everywhere
    t, _ = calibrate_router(_rows({512: (900, 800), 4096: (500, 300)}))
    assert t == 0
    with pytest.raises(ValueError):
        calibrate_router([{"method": "std", "visual_tokens": 512, "decode_tokens_per_s": 1.0}])


def test_each_repeat_rotates_the_running_order() -> None:
    from pipeline.bench import _rotated

    ms = ["vanilla", "std", "sparrow"]
    assert [_rotated(ms, r) for r in range(4)] == [
        ["vanilla", "std", "sparrow"],
        ["std", "sparrow", "vanilla"],
        ["sparrow", "vanilla", "std"],
        ["vanilla", "std", "sparrow"],
    ]
    assert _rotated([], 3) == []


def test_repeats_continue_until_each_of_our_methods_has_its_decode_time() -> None:
    from pipeline.bench import BenchConfig, Run, _methods_for_repeat

    cfg = BenchConfig(
        model=Path("m"), video=Path("v"), methods=("hf", "vanilla", "sparrow"), repeats=2,
        min_decode_s=1.0, max_repeats=5,
    )  # fmt: skip
    runs: dict[str, list[Run]] = {m: [] for m in cfg.methods}

    def add(m: str, s: float) -> None:
        runs[m].append(Run(tokens=[1, 2], prefill_s=0.0, decode_s=s))

    assert _methods_for_repeat(cfg, 0, runs) == ["hf", "vanilla", "sparrow"]
    for m in cfg.methods:
        add(m, 0.3)
        add(m, 0.3)
    # the hf reference stops at --repeats; ours go on together while one of them is short of 1 s
    assert _methods_for_repeat(cfg, 2, runs) == ["vanilla", "sparrow"]
    add("vanilla", 0.5)
    add("sparrow", 0.1)
    assert _methods_for_repeat(cfg, 3, runs) == ["vanilla", "sparrow"]  # sparrow has 0.7 s
    add("vanilla", 0.5)
    add("sparrow", 0.3)
    assert _methods_for_repeat(cfg, 4, runs) == []  # both have >= 1 s
    assert _methods_for_repeat(cfg, 5, runs) == []  # and never past max_repeats
    off = BenchConfig(model=Path("m"), video=Path("v"), methods=("vanilla",), repeats=2)
    assert _methods_for_repeat(off, 2, {"vanilla": []}) == []  # min_decode_s 0: exactly --repeats
    with pytest.raises(ValueError):
        BenchConfig(model=Path("m"), video=Path("v"), repeats=5, max_repeats=3)


def test_paired_speedup_cancels_drift_between_repeats() -> None:
    from pipeline.bench import _ratio, paired_speedup, per_repeat_speedups

    def row(times: list[float], tokens: int = 100) -> dict:
        mid = sorted(times)[len(times) // 2]
        return {"repeats_decode_s": times, "decode_s": mid, "decode_tokens_per_s": tokens / mid}

    # the machine halves its speed after the second round; the method is 2x faster than vanilla throughout
    vanilla = row([1.0, 1.0, 2.0, 2.0, 2.0])
    method = row([0.5, 0.5, 1.0, 1.0, 1.0])
    assert per_repeat_speedups(method, vanilla) == pytest.approx([2.0] * 5)
    assert paired_speedup(method, vanilla) == pytest.approx(2.0)
    # the slowdown starts in the middle of round 3, after vanilla and before the method: one odd pair moves
    # the paired median nowhere, while both medians now come from different machine states
    vanilla = row([1.0, 1.0, 1.0, 2.0, 2.0])
    assert per_repeat_speedups(method, vanilla) == pytest.approx([2.0, 2.0, 1.0, 2.0, 2.0])
    assert paired_speedup(method, vanilla) == pytest.approx(2.0)
    assert _ratio(method, vanilla) == pytest.approx(1.0)
    assert paired_speedup(method, None) is None and per_repeat_speedups(method, {}) == []


def test_paired_speedup_pairs_answer_by_answer() -> None:
    """With per-answer times: drift between rounds cancels as before, and a pause inside one answer of one
    repeat, which moves that repeat's whole ratio, moves nothing (two answers, vanilla 1.0 and 3.0 s, the
    method 2x faster on each)."""
    from pipeline.bench import paired_speedup, per_answer_paired_speedup, per_repeat_speedups

    def row(rounds: list[list[float]], tokens: int = 100) -> dict:
        totals = [sum(r) for r in rounds]
        mid = sorted(totals)[len(totals) // 2]
        return {
            "repeats_decode_s": totals, "repeats_answer_decode_s": rounds,
            "decode_s": mid, "decode_tokens_per_s": tokens / mid,
        }  # fmt: skip

    drift = [1.0, 1.0, 2.0, 2.0]  # the machine halves its speed after round 2
    vanilla = row([[d * 1.0, d * 3.0] for d in drift])
    method = row([[d * 0.5, d * 1.5] for d in drift])
    assert per_answer_paired_speedup(method, vanilla) == pytest.approx(2.0)
    # pauses in half of the method's rounds, each inside one answer (answer 2 of round 1, answer 1 of round 3)
    paused = row([[0.5, 3.0], [0.5, 1.5], [1.5, 3.0], [1.0, 3.0]])
    by_repeat = sorted(per_repeat_speedups(paused, vanilla))
    assert (by_repeat[1] + by_repeat[2]) / 2 < 1.9  # whole repeats: two of four pairs hit, the median moves
    assert paired_speedup(paused, vanilla) == pytest.approx(2.0)  # per answer: one of four ratios each
    # without per-answer times (rows from before session 27): the median of the per-repeat ratios
    old = {k: v for k, v in method.items() if k != "repeats_answer_decode_s"}
    assert per_answer_paired_speedup(old, vanilla) is None
    assert paired_speedup(old, vanilla) == pytest.approx(2.0)


def test_bench_pools_a_sample_of_videos(tiny_checkpoints: dict, tmp_path: Path) -> None:
    """--video repeated: every method answers on every video in each repeat; a row pools them, in order,
    each video on its own session (the answers are those of one-video runs)."""
    videos = [_video(tmp_path, 4, 4), _video(tmp_path, 2, 5)]  # 8 and 4 frames: different visual lengths
    common = [
        "bench", "--model", str(tiny_checkpoints["qwen2_vl"]), "--max-frames", "8", "--method", "vanilla",
        "--method", "std", "--method", "hf", "--max-new-tokens", "6", "--ignore-eos", "--repeats", "1",
    ]  # fmt: skip
    docs = []
    for i, vs in enumerate(([videos[0]], [videos[1]], videos)):
        out = tmp_path / f"r{i}.json"
        args = [*common, *(x for v in vs for x in ("--video", str(v))), "--json", str(out)]
        assert main([*args, "--read-workers", "2"]) == 0  # the sample is read in two threads
        docs.append(json.loads(out.read_text()))
    one_a, _, both = docs
    assert both["video"] == [str(v) for v in videos] and one_a["video"] == str(videos[0])
    for method in ("vanilla", "std", "hf"):
        a, b, ab = (next(r for r in d["results"] if r["method"] == method) for d in docs)
        assert ab["tokens"] == a["tokens"] + b["tokens"] and ab["new_tokens"] == 12
        assert ab["visual_tokens_per_video"] == [a["visual_tokens"], b["visual_tokens"]]
        assert a["visual_tokens"] != b["visual_tokens"]
        assert ab["visual_tokens"] == round((a["visual_tokens"] + b["visual_tokens"]) / 2)
        assert "visual_tokens_per_video" not in a
        assert ab["decode_tokens_per_s"] == pytest.approx(10 / ab["decode_s"])  # 5 decoded per answer
        assert ab["identical_to_vanilla"]
    with pytest.raises(ValueError, match="--video"):
        BenchConfig(model=tmp_path, video=[])
    with pytest.raises(ValueError, match="--read-workers"):
        BenchConfig(model=tmp_path, video=videos, read_workers=0)


def test_read_ahead_keeps_the_order_and_bounds_the_reads_in_flight() -> None:
    """Videos are prepared in threads ahead of their use: results come in the order given, at most
    `workers` preparations run or wait unconsumed at once, they do overlap, and a failure reaches the caller."""
    lock, state = threading.Lock(), {"now": 0, "most": 0}
    both_started = threading.Barrier(2, timeout=10)  # broken (an error) if reads never overlap

    def prepare(path: Path) -> str:
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        if path.name in ("0", "1"):
            both_started.wait()
        time.sleep(0.01 * (5 - int(path.name)))  # later videos finish first
        with lock:
            state["now"] -= 1
        return path.name * 2

    paths = [Path(str(i)) for i in range(5)]
    out = [(p.name, v) for p, v, _ in read_ahead(paths, prepare, workers=2)]
    assert out == [(str(i), str(i) * 2) for i in range(5)]
    assert state["most"] == 2
    assert [v for _, v, _ in read_ahead(paths, lambda p: p.name, workers=1)] == list("01234")  # no threads

    def failing(path: Path) -> str:
        if path.name == "2":
            raise VideoError("cannot read video '2': broken")
        return path.name

    got = []
    with pytest.raises(VideoError, match="broken"):
        for _, v, _ in read_ahead(paths, failing, workers=3):
            got.append(v)
    assert got == ["0", "1"]


def test_bench_json_is_written_after_every_length_and_marked_complete_at_the_end(
    tiny_checkpoints: dict, tmp_path: Path
) -> None:
    """A time limit or a crash during a later length leaves the earlier lengths' rows on disk; lengths are
    measured in the order given (here the longer first) and listed by length."""
    from pipeline.bench import bench

    video = _video(tmp_path, 6, 6)
    out = tmp_path / "r.json"
    seen: list[dict] = []

    def log(line: str) -> None:
        if line.startswith("[2/2]"):  # the second length starts: the first one's rows are on disk
            seen.append(json.loads(out.read_text()))

    cfg = BenchConfig(
        model=tiny_checkpoints["qwen2_vl"], video=video, max_frames=(8, 4, 8), methods=("vanilla",),
        max_new_tokens=4, ignore_eos=True, repeats=1, json_out=out, log=log,
    )  # fmt: skip
    doc = bench(cfg)
    assert len(seen) == 1 and seen[0]["complete"] is False
    assert [r["visual_tokens"] for r in seen[0]["results"]] == [doc["results"][1]["visual_tokens"]]
    final = json.loads(out.read_text())
    assert final["complete"] is True and len(final["results"]) == 2  # 8 frames once
    assert final["results"][0]["visual_tokens"] < final["results"][1]["visual_tokens"]


def test_bench_refuses_to_calibrate_the_router_on_videos_of_different_lengths(
    tiny_checkpoints: dict, tmp_path: Path, capsys
) -> None:
    videos = [_video(tmp_path, 4, 7), _video(tmp_path, 2, 8)]
    model = tiny_checkpoints["qwen2_vl"]
    rc = main([
        "bench", "--model", str(model), "--video", str(videos[0]), "--video", str(videos[1]), "--max-frames",
        "8", "--method", "std", "--method", "sparrow", "--write-router", "--repeats", "1",
    ])  # fmt: skip
    assert rc != 0
    assert "one visual length per --max-frames value" in capsys.readouterr().err
    assert not (model / "sparrow" / "router.json").exists()


def test_merged_runs_keep_each_answers_drafter() -> None:
    from decoders.engine import SpecDecodeStats
    from pipeline.bench import Run, merge_runs

    parts = [Run([1, 2], 0.1, 0.2, SpecDecodeStats(method=m)) for m in ("sparrow", "std", "sparrow")]
    merged = merge_runs(parts)
    assert merged.methods == ["sparrow", "std", "sparrow"] and merged.tokens == [1, 2] * 3


def test_decode_time_takes_each_answers_median_over_the_repeats() -> None:
    """Pauses that hit half of the repeats, each in one answer, are gone from the per-answer estimate;
    the median over whole repeats keeps half of them."""
    from pipeline.bench import Run, answer_median_decode_s, merge_runs

    def repeat(times: list[float]) -> Run:
        return merge_runs([Run([1, 2], 0.0, t) for t in times])

    runs = [
        repeat([1.0, 1.0, 1.0]),
        repeat([1.5, 1.0, 1.0]),
        repeat([1.0, 1.0, 1.5]),
        repeat([1.0, 1.0, 1.0]),
    ]
    assert runs[1].answer_decode_s == [1.5, 1.0, 1.0]
    assert answer_median_decode_s(runs) == pytest.approx(3.0)
    assert sorted(r.decode_s for r in runs)[1:3] == [3.0, 3.5]  # the old estimator: 3.25
    # answers that do not line up (a different number per repeat): the median over repeats
    assert answer_median_decode_s([repeat([1.0]), repeat([1.0, 2.0]), repeat([4.0])]) == pytest.approx(3.0)


def test_timed_answers_run_with_the_garbage_collector_paused(
    tiny_checkpoints: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every timed repeat answers with the collector paused (and it is back on afterwards); warm-up answers
    are not timed and leave it alone."""
    import gc

    from pipeline import bench as B

    seen: list[bool] = []
    answer = B._answer

    def recording(*args: object) -> object:
        seen.append(gc.isenabled())
        return answer(*args)

    monkeypatch.setattr(B, "_answer", recording)
    video = _video(tmp_path, 2, 9)
    rc = main([
        "bench", "--model", str(tiny_checkpoints["qwen2_vl"]), "--video", str(video), "--max-frames", "4",
        "--method", "vanilla", "--method", "std", "--max-new-tokens", "4", "--repeats", "2", "--warmup", "1",
    ])  # fmt: skip
    assert rc == 0 and gc.isenabled()
    assert seen == [True, True] + [False] * 4  # the two warm-up answers, then 2 repeats x 2 methods
