"""Pure logic of the service's edges: the job request contract (pipeline/schema.py), settings from the
environment (infra/config.py), and how a producer finds a local service (pipeline/client.py)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

from infra.config import ConfigError, InputPolicy, QueueSettings, Settings
from pipeline.client import NoService, read_service_file, resolve_redis_url, write_service_file
from pipeline.schema import RequestError, build_request, parse_request
from workers.tasks import CAPTION_PROMPT, VideoSource

FULL = {
    "job_id": "job-7",
    "video": {"uri": "/data/clip.mp4", "id": "clip"},
    "tasks": [{"type": "caption"}, {"type": "qa", "question": "what colour is the circle ?"}],
    "decoding": {"method": "std", "max_new_tokens": 64, "temperature": 0.7, "top_p": 0.9, "seed": 3},
    "sampling": {"fps": 1.0, "max_frames": 256},
    "timeout_s": 30,
}


def test_a_minimal_request_gets_the_contract_defaults_and_a_generated_job_id() -> None:
    a = parse_request({"video": {"uri": "/v.mp4"}, "tasks": [{"type": "caption"}]})
    b = parse_request({"video": {"uri": "/v.mp4"}, "tasks": [{"type": "caption"}]})
    assert a.job_id != b.job_id and len(a.job_id) == 32
    assert a.decoding.method == "auto" and a.decoding.temperature == 0.0 and a.decoding.max_new_tokens == 128
    assert a.video.fps == 2.0 and a.video.max_frames == 768 and a.timeout_s is None
    assert a.tasks[0].prompt == CAPTION_PROMPT


def test_the_canonical_json_round_trips_and_keys_videos_by_id_and_sampling() -> None:
    req = parse_request(json.dumps(FULL))
    again = parse_request(req.to_json())
    assert again == req and req.job_id == "job-7" and req.timeout_s == 30.0
    assert req.tasks[1].prompt == "what colour is the circle ?" and req.decoding.seed == 3
    assert req.video.key == VideoSource("/elsewhere.mp4", fps=1.0, max_frames=256, video_id="clip").key
    assert req.video.key != VideoSource("/data/clip.mp4", fps=2.0, max_frames=256, video_id="clip").key


def _with(path: str, value: object) -> dict:
    obj = copy.deepcopy(FULL)
    *parents, last = path.split(".")
    node = obj
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    if value is KeyError:
        del node[int(last) if last.isdigit() else last]
    elif last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return obj


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("video", KeyError, r"video: required"),
        ("video.uri", "clip.mp4", r"video.uri: 'clip.mp4' is a relative path"),
        ("video.uri", "rtsp://cam/1", r"video.uri: scheme 'rtsp' is not supported"),
        ("video.uri", "", r"video.uri: expected a non-empty string"),
        ("tasks", [], r"tasks: expected a non-empty list"),
        ("tasks.1", {"type": "qa"}, r"tasks\[1\].question: required"),
        ("tasks.0", {"type": "summary"}, r"tasks\[0\].type: must be one of \['caption', 'qa'\]"),
        ("tasks.0", {"type": "caption", "question": "x"}, r"tasks\[0\]: unknown field\(s\) \['question'\]"),
        ("decoding.method", "beam", r"decoding.method: must be one of"),
        ("decoding.max_new_tokens", 0, r"decoding.max_new_tokens: must be in \[1, 1024\]"),
        ("decoding.max_new_tokens", 1.5, r"decoding.max_new_tokens: expected an integer"),
        ("decoding.temperature", -1, r"decoding.temperature: must be in"),
        ("sampling.fps", 0, r"sampling.fps: must be in \(0.0"),
        ("sampling.max_frames", 2, r"sampling.max_frames: must be in \[4, 16384\]"),
        ("job_id", "has space", r"job_id: job_id must be 1-128 characters"),
        ("taks", [], r"request: unknown field\(s\) \['taks'\]"),
        ("timeout_s", 0, r"timeout_s: must be in \(0.0"),
    ],
)
def test_bad_requests_name_the_field_and_what_is_allowed(path: str, value: object, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        parse_request(_with(path, value))


def test_a_request_that_is_not_json_is_a_request_error() -> None:
    with pytest.raises(RequestError, match="not valid JSON"):
        parse_request("{nope")


def test_build_request_maps_cli_options_onto_the_contract() -> None:
    req = build_request(
        "/v.mp4", [{"type": "qa", "question": "q ?"}], job_id="x", method="vanilla", max_new_tokens=5, fps=4.0
    )
    d = req.to_dict()
    assert (
        d["job_id"] == "x" and d["decoding"]["method"] == "vanilla" and d["decoding"]["max_new_tokens"] == 5
    )
    assert d["sampling"] == {"fps": 4.0, "max_frames": 768} and d["tasks"] == [
        {"type": "qa", "question": "q ?"}
    ]


def test_settings_come_from_the_environment_with_errors_naming_the_variable(tmp_path: Path) -> None:
    env = {
        "VIDSPEC_REDIS_URL": "rediss://:secret@redis.example:6380/2",
        "VIDSPEC_RAY_ADDRESS": "ray://head:10001",
        "VIDSPEC_RUNTIME_DIR": str(tmp_path),
        "VIDSPEC_INPUT_ROOTS": f"{tmp_path}/a{os.pathsep}{tmp_path}/b",
        "VIDSPEC_ALLOW_HTTP": "yes",
        "VIDSPEC_MAX_DELIVERIES": "5",
        "VIDSPEC_CLAIM_IDLE_S": "30",
        "VIDSPEC_HEARTBEAT_S": "5",
        "VIDSPEC_VIDEO_WORKERS": "2",
        "VIDSPEC_SESSION_CACHE_BYTES": "1000000",
    }
    s = Settings.from_env(env)
    assert s.redis_url == env["VIDSPEC_REDIS_URL"] and s.ray_address == "ray://head:10001"
    assert s.runtime_dir == tmp_path.resolve() and s.input.roots == ((tmp_path / "a"), (tmp_path / "b"))
    assert s.input.allow_http and s.queue.max_deliveries == 5 and s.queue.claim_idle_s == 30.0
    assert s.workers.video_workers == 2 and s.workers.session_cache_bytes == 1_000_000
    defaults = Settings.from_env({})
    assert defaults.redis_url is None and defaults.ray_address is None and not defaults.input.allow_http
    for var, value, message in (
        ("VIDSPEC_MAX_DELIVERIES", "many", "VIDSPEC_MAX_DELIVERIES must be an integer"),
        ("VIDSPEC_ALLOW_HTTP", "maybe", "VIDSPEC_ALLOW_HTTP must be 1/0"),
        ("VIDSPEC_REDIS_URL", "localhost:6379", "must start with redis://"),
        ("VIDSPEC_MAX_DELIVERIES", "0", "max_deliveries must be an int >= 1"),
    ):
        with pytest.raises(ConfigError, match=message):
            Settings.from_env({var: value})


def test_a_heartbeat_slower_than_half_the_claim_idle_time_is_refused() -> None:
    with pytest.raises(ConfigError, match="at most half of claim_idle_s"):
        QueueSettings(claim_idle_s=10, heartbeat_s=6)
    with pytest.raises(ConfigError, match="at least one directory"):
        InputPolicy(roots=())


def test_producers_find_a_local_serve_through_its_service_file(tmp_path: Path) -> None:
    settings = Settings(runtime_dir=tmp_path)
    with pytest.raises(NoService, match="vidspec serve"):
        resolve_redis_url(None, settings)
    write_service_file(tmp_path, "redis://127.0.0.1:7001/0", "me")
    assert resolve_redis_url(None, settings) == "redis://127.0.0.1:7001/0"
    assert resolve_redis_url("redis://other:1/0", settings) == "redis://other:1/0"
    (tmp_path / "service.json").write_text(json.dumps({"redis_url": "redis://x:1/0", "pid": 2**22 + 12345}))
    assert read_service_file(tmp_path) is None  # a dead server's file is ignored
