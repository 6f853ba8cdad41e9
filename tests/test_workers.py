"""The plain classes behind the Ray actors, tested without Ray: the ingest input policy and preprocessing
(workers/ingest.py) and the video worker's session cache, decoding, cancel and deadline
(workers/video_worker.py). Real files, a real local HTTP server, a real tiny checkpoint."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from decoders.train.world import make_video
from decoders.video import VideoError, read_video
from infra.config import InputPolicy
from workers.ingest import IngestWorker, InputRejected, preprocess_view
from workers.tasks import DecodeInput, TaskInput, VideoSource
from workers.video_worker import JobCancelled, JobTimedOut, SessionMissing, VideoWorkerCore


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("media")
    outside = tmp_path_factory.mktemp("outside")
    files = {
        name: make_video(root / f"{name}.mp4", 4, 4, 112, 112, seed)
        for name, seed in (("a", 1), ("b", 2), ("c", 3))
    }
    (root / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 40)
    files["corrupt"] = root / "corrupt.mp4"
    files["outside"] = make_video(outside / "o.mp4", 4, 4, 112, 112, 4)
    (root / "link.mp4").symlink_to(files["outside"])
    files["link"] = root / "link.mp4"
    (root / "subdir").mkdir()
    files["subdir"] = root / "subdir"
    files["root"] = root
    return files


def _worker(ckpt: Path, media: dict[str, Path], tmp_path: Path, **policy: object) -> IngestWorker:
    return IngestWorker(ckpt, InputPolicy(roots=(media["root"],), **policy), tmp_path / "scratch")


@pytest.fixture
def qwen(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["qwen2_vl"]


# -- ingest --------------------------------------------------------------------------------------
def test_ingest_preprocesses_exactly_like_the_loaded_model_without_its_weights(
    qwen: Path, tiny_models: dict, media: dict[str, Path], tmp_path: Path
) -> None:
    lm = tiny_models["qwen2_vl"]
    view = preprocess_view(qwen)
    sampling = lm.default_sampling(fps=2.0)
    assert view.default_sampling(fps=2.0) == sampling
    decoded = read_video(media["a"], sampling)
    ours, theirs = view.prepare_video(decoded, sampling), lm.prepare_video(decoded, sampling)
    assert ours.grid_thw == theirs.grid_thw and ours.num_tokens == theirs.num_tokens
    assert torch.equal(ours.pixel_values, theirs.pixel_values)
    got = _worker(qwen, media, tmp_path).ingest(VideoSource(str(media["a"]), fps=2.0))
    assert torch.equal(got.visual.pixel_values, theirs.pixel_values)
    assert got.frames == decoded.num_frames and got.width == 112 and got.height == 112 and got.ingest_s > 0


def test_ingest_accepts_paths_and_file_uris_under_the_roots(
    qwen: Path, media: dict[str, Path], tmp_path: Path
) -> None:
    w = _worker(qwen, media, tmp_path)
    a = w.ingest(VideoSource(str(media["a"])))
    b = w.ingest(VideoSource(media["a"].as_uri()))
    assert a.visual.num_tokens == b.visual.num_tokens > 0


@pytest.mark.parametrize(
    ("uri", "policy", "reason"),
    [
        ("relative/clip.mp4", {}, "is relative"),
        ("{outside}", {}, "not under an allowed input root"),
        ("{link}", {}, "not under an allowed input root"),  # symlinks are followed before the check
        ("{root}/missing.mp4", {}, "not found"),
        ("{subdir}", {}, "not a regular file"),
        ("http://127.0.0.1:9/v.mp4", {}, "VIDSPEC_ALLOW_HTTP=1"),
        ("ftp://example.org/v.mp4", {"allow_http": True}, "scheme 'ftp' is not accepted"),
        ("{a}", {"max_bytes": 1000}, "VIDSPEC_MAX_VIDEO_BYTES"),
        ("{a}", {"max_duration_s": 2.0}, "VIDSPEC_MAX_VIDEO_DURATION_S"),
        ("{a}", {"max_width": 64}, "above the limit of 64x2160"),
        ("{a}", {"max_sample_bytes": 10_000}, "ingest memory limit"),
    ],
)
def test_the_input_policy_refuses_with_an_actionable_reason(
    qwen: Path, media: dict[str, Path], tmp_path: Path, uri: str, policy: dict, reason: str
) -> None:
    w = _worker(qwen, media, tmp_path, **policy)
    with pytest.raises(InputRejected, match=reason):
        w.ingest(VideoSource(uri.format(**{k: str(v) for k, v in media.items()})))


def test_a_corrupt_file_is_a_video_error_naming_the_file(
    qwen: Path, media: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(VideoError, match=r"corrupt\.mp4"):
        _worker(qwen, media, tmp_path).ingest(VideoSource(str(media["corrupt"])))


@pytest.fixture
def http_root(media: dict[str, Path]) -> object:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # keep the test output clean
            return

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(media["root"]))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_videos_are_fetched_only_when_enabled_and_never_left_behind(
    qwen: Path, media: dict[str, Path], tmp_path: Path, http_root: str
) -> None:
    w = _worker(qwen, media, tmp_path, allow_http=True)
    got = w.ingest(VideoSource(f"{http_root}/a.mp4"))
    assert got.visual.num_tokens > 0 and got.source_bytes == media["a"].stat().st_size
    with pytest.raises(InputRejected, match="HTTP 404"):
        w.ingest(VideoSource(f"{http_root}/nope.mp4"))
    small = _worker(qwen, media, tmp_path, allow_http=True, max_bytes=1000)
    with pytest.raises(InputRejected, match="VIDSPEC_MAX_VIDEO_BYTES"):
        small.ingest(VideoSource(f"{http_root}/a.mp4"))
    assert list((tmp_path / "scratch").iterdir()) == []  # downloads are deleted, failed or not


# -- the video worker ----------------------------------------------------------------------------
@pytest.fixture
def core(qwen: Path, tiny_models: dict, media: dict[str, Path], tmp_path: Path) -> VideoWorkerCore:
    ingest = _worker(qwen, media, tmp_path)
    return VideoWorkerCore(qwen, lm=tiny_models["qwen2_vl"], ingest=ingest.ingest, cache_bytes=1 << 30)


def test_a_video_is_prefilled_once_and_every_task_reuses_its_session(
    core: VideoWorkerCore, media: dict[str, Path]
) -> None:
    src = VideoSource(str(media["a"]))
    first = core.open_video(src)
    assert first.cache == "miss" and first.prefill_s > 0 and first.encode_s > 0 and first.visual_tokens > 0
    second = core.open_video(src)
    assert second.cache == "hit" and second.prefill_s == second.encode_s == second.ingest_s == 0
    for q in ("how many objects appear ?", "what colour is the circle ?"):
        r = core.answer("j", src, TaskInput("qa", q), DecodeInput(max_new_tokens=8))
        assert r.session_cache == "hit" and 1 <= r.num_tokens == len(r.tokens) <= 8
    s = core.stats()
    assert (
        s.sessions_built == 1
        and s.session_hits == 3
        and s.tasks_answered == 2
        and s.cached_videos == [src.key]
    )


def test_auto_records_the_concrete_method_and_is_lossless_at_temperature_zero(
    core: VideoWorkerCore, media: dict[str, Path]
) -> None:
    src, task = VideoSource(str(media["a"])), TaskInput("caption")
    auto = core.answer("j", src, task, DecodeInput(method="auto", max_new_tokens=24, ignore_eos=True))
    vanilla = core.answer("j", src, task, DecodeInput(method="vanilla", max_new_tokens=24, ignore_eos=True))
    assert auto.method == "std" and auto.requested_method == "auto" and vanilla.method == "vanilla"
    assert (
        auto.tokens == vanilla.tokens
        and auto.text == vanilla.text
        and auto.question == "describe the video ."
    )
    assert auto.stats["mean_accepted_length"] >= 1.0 and vanilla.stats["mean_accepted_length"] is None
    assert vanilla.tokens_per_target_forward == 1.0 and auto.tokens_per_target_forward >= 1.0
    assert auto.ttft_s > 0 and auto.decode_s > 0 and auto.first_token_at > 0


def test_sessions_beyond_the_memory_budget_are_evicted_least_recently_used(
    qwen: Path, tiny_models: dict, media: dict[str, Path], tmp_path: Path
) -> None:
    a, b, c = (VideoSource(str(media[n])) for n in "abc")
    probe = VideoWorkerCore(qwen, lm=tiny_models["qwen2_vl"], ingest=_worker(qwen, media, tmp_path).ingest)
    one = probe.open_video(a).kv_bytes
    core = VideoWorkerCore(
        qwen,
        lm=tiny_models["qwen2_vl"],
        ingest=_worker(qwen, media, tmp_path).ingest,
        cache_bytes=int(2.5 * one),
    )
    core.open_video(a)
    core.open_video(b)
    core.open_video(a)  # a is now the most recently used
    core.open_video(c)  # over budget: b goes
    assert core.cached_keys() == [a.key, c.key] and core.stats().evictions == 1
    assert core.cached_bytes <= core.cache_bytes
    r = core.answer("j", b, TaskInput("qa", "what is the first object ?"), DecodeInput(max_new_tokens=4))
    assert (
        r.session_cache == "miss" and core.stats().sessions_built == 4
    )  # rebuilt through the ingest fallback
    assert b.key in core.cached_keys() and len(core.cached_keys()) == 2


def test_cancel_stops_a_task_mid_decode_and_the_session_is_back_at_its_prefix(
    core: VideoWorkerCore, media: dict[str, Path]
) -> None:
    src = VideoSource(str(media["a"]))
    core.open_video(src)
    session = core._sessions[src.key].session
    # far more tokens than the poll below needs to see decoding under way (1024 took < 0.2 s on an idle core)
    long = DecodeInput(method="vanilla", max_new_tokens=32768, ignore_eos=True)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            core.answer("job-x", src, TaskInput("caption"), long, attempt=1)
        except JobCancelled as exc:
            outcome.append(exc)

    t = threading.Thread(target=run)
    t0 = time.monotonic()
    t.start()
    while session.length <= session.prefix_len + 8 and t.is_alive() and time.monotonic() - t0 < 30:
        time.sleep(0.001)  # cancel once tokens are being decoded
    assert t.is_alive(), "the decode ended before it could be cancelled"
    core.cancel("job-x", attempt=1)
    t.join(timeout=30)
    assert outcome and time.monotonic() - t0 < 30
    assert session.length == session.prefix_len
    assert core.stats().tasks_answered == 0
    # the cancel belongs to attempt 1: a redelivered attempt 2 of the same job runs normally
    r = core.answer("job-x", src, TaskInput("caption"), DecodeInput(max_new_tokens=4), attempt=2)
    assert r.num_tokens >= 1


def test_a_passed_deadline_stops_decoding_with_job_timed_out(
    core: VideoWorkerCore, media: dict[str, Path]
) -> None:
    src = VideoSource(str(media["a"]))
    long = DecodeInput(method="std", max_new_tokens=1024, ignore_eos=True)
    with pytest.raises(JobTimedOut):
        core.answer("job-t", src, TaskInput("caption"), long, remaining_s=0.05)
    session = core._sessions[src.key].session
    assert session.length == session.prefix_len


def test_unknown_or_unavailable_methods_and_missing_sessions_are_clear_errors(
    qwen: Path, tiny_models: dict, core: VideoWorkerCore, media: dict[str, Path]
) -> None:
    src = VideoSource(str(media["a"]))
    with pytest.raises(ValueError, match="unknown decoding method 'nope'"):
        core.answer("j", src, TaskInput("caption"), DecodeInput(method="nope"))
    with pytest.raises(ValueError, match="Sparrow draft head"):
        core.answer("j", src, TaskInput("caption"), DecodeInput(method="sparrow"))
    bare = VideoWorkerCore(qwen, lm=tiny_models["qwen2_vl"])
    with pytest.raises(SessionMissing, match="not cached"):
        bare.answer("j", src, TaskInput("caption"), DecodeInput())


def test_a_model_trained_with_two_turn_qa_is_asked_after_its_own_list_made_once_per_video(
    qwen: Path, tiny_models: dict, media: dict[str, Path], tmp_path: Path
) -> None:
    from decoders.engine import generate
    from decoders.protocol import LIST_MAX_TOKENS, LIST_PROMPT, after_list
    from decoders.sampling import DecodeConfig

    lm = tiny_models["qwen2_vl"]
    ingest = _worker(qwen, media, tmp_path).ingest
    assert not VideoWorkerCore(qwen, lm=lm, ingest=ingest).qa_turns  # no training_info.json: asked directly
    core = VideoWorkerCore(qwen, lm=lm, ingest=ingest, qa_turns=True)
    src, q = VideoSource(str(media["a"])), "what colour is the circle ?"
    r = core.answer("j", src, TaskInput("qa", q), DecodeInput(method="auto", max_new_tokens=6))
    entry = core._sessions[src.key]
    listed = entry.object_list
    assert listed is not None and r.question == q
    session = entry.session
    first = [
        t for c in generate(session, lm.suffix_ids(LIST_PROMPT), DecodeConfig(LIST_MAX_TOKENS)) for t in c
    ]
    assert listed == " ".join(lm.decode(first).split())  # the greedy list, whatever method drafted it
    want = [t for c in generate(session, lm.suffix_ids(after_list(listed, q)), DecodeConfig(6)) for t in c]
    assert r.tokens == want
    again = core.answer("j", src, TaskInput("qa", "how many objects appear ?"), DecodeInput(max_new_tokens=4))
    assert entry.object_list is listed and again.num_tokens >= 1  # the list is made once per video
    caption = core.answer("j", src, TaskInput("caption"), DecodeInput(method="vanilla", max_new_tokens=6))
    direct = [t for c in generate(session, lm.suffix_ids("describe the video ."), DecodeConfig(6)) for t in c]
    assert caption.tokens == direct  # captions are asked directly
    # a model trained to caption after its list (--caption-turns) is asked for captions after it too
    both = VideoWorkerCore(qwen, lm=lm, ingest=ingest, qa_turns=True, caption_turns=True)
    capt = both.answer("j", src, TaskInput("caption"), DecodeInput(method="vanilla", max_new_tokens=6))
    listed2 = both._sessions[src.key].object_list
    assert listed2 == listed
    prompt = lm.suffix_ids(after_list(listed, "describe the video ."))
    assert capt.tokens == [
        t for c in generate(both._sessions[src.key].session, prompt, DecodeConfig(6)) for t in c
    ]
    # as trained: training_info.json's config.caption_turns above 0 (with qa_turns)
    trained = tmp_path / "trained"
    shutil.copytree(qwen, trained)
    (trained / "training_info.json").write_text(
        json.dumps({"config": {"qa_turns": True, "caption_turns": 0.5}})
    )
    auto = VideoWorkerCore(trained, lm=lm, ingest=ingest)
    assert auto.qa_turns and auto.caption_turns and not core.caption_turns
