"""The metrics of the running service: `serve()` (what `vidspec serve` runs) against a real redis-server and
the shared local Ray, real jobs, `/metrics` scraped over HTTP and checked against the jobs' results; the
dashboard's PromQL against what the service exports; health endpoints; settings and the recorder's rules."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import ray
import redis
from prometheus_client.parser import text_string_to_metric_families

from decoders.train.world import make_video
from infra.config import ConfigError, InputPolicy, QueueSettings, Settings, WorkerSettings
from monitoring.metrics import MetricsServer, ServiceMetrics, exported_metric_names
from pipeline.cli import build_parser
from pipeline.client import Client
from pipeline.recorder import MetricsRecorder, concrete_method
from pipeline.service_cli import ServeError, serve

DASHBOARD = Path(__file__).resolve().parent.parent / "monitoring" / "grafana" / "vidspec-dashboard.json"


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text exposition: (name, labels, value)."""
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    return sum(
        v for n, lab, v in samples(text) if n == name and all(lab.get(k) == x for k, x in labels.items())
    )


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@dataclass
class Run:
    """What one run of the service left behind, for the tests below to check."""

    text: str  # /metrics after the jobs
    results: dict[str, dict[str, Any]]  # job id -> result
    healthz: tuple[int, bytes]
    readyz: tuple[int, bytes]
    worker: dict[str, Any]  # the video worker's own stats after the jobs
    metrics: ServiceMetrics
    model: str
    errors: list[BaseException] = field(default_factory=list)


@pytest.fixture(scope="module")
def run(
    redis_url: str,
    ray_session: object,
    tiny_checkpoints: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Run]:
    """`serve()` in a thread on a free metrics port; three jobs one after the other:
    A: video 1, caption + question, std (a miss: ingest + prefill);  B: video 1, question, vanilla (a hit);
    C: video 2, caption, std (a miss that evicts video 1: the session cache holds one video, 1-byte budget)."""
    media = tmp_path_factory.mktemp("metrics-media")
    v1 = str(make_video(media / "v1.mp4", 4.0, 4, 112, 112, seed=11))
    v2 = str(make_video(media / "v2.mp4", 4.0, 4, 112, 112, seed=12))
    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(
        redis_url=redis_url,
        runtime_dir=tmp_path_factory.mktemp("metrics-runtime"),
        queue=QueueSettings(claim_idle_s=5.0, heartbeat_s=1.0, reclaim_every_s=0.5, block_s=0.1, poll_s=0.01),
        input=InputPolicy(roots=(media,)),
        workers=WorkerSettings(session_cache_bytes=1, device="cpu", worker_cpus=0.5, ingest_cpus=0.5),
        metrics_host="127.0.0.1",
        metrics_port=0,
    )
    stop = threading.Event()
    started = threading.Event()
    handles: dict[str, Any] = {}
    errors: list[BaseException] = []

    def on_started(dispatcher: Any, server: MetricsServer) -> None:
        handles.update(dispatcher=dispatcher, server=server)
        started.set()

    def target() -> None:
        try:
            serve(settings, tiny_checkpoints["qwen2_vl"], stop, on_started=on_started)
        except BaseException as exc:  # surfaced below and by the test
            errors.append(exc)
            started.set()
            raise

    thread = threading.Thread(target=target, name="serve", daemon=True)
    thread.start()
    client = Client.from_url(redis_url, settings.queue)
    try:
        assert started.wait(120) and not errors, errors
        base = f"http://127.0.0.1:{handles['server'].port}"
        decoding = {"max_new_tokens": 12, "ignore_eos": True}
        jobs = {
            "job-a": {"video": {"uri": v1}, "tasks": [{"type": "caption"}, {"type": "qa", "question": "what is the first object ?"}], "decoding": {**decoding, "method": "std"}},
            "job-b": {"video": {"uri": v1}, "tasks": [{"type": "qa", "question": "how many objects appear ?"}], "decoding": {**decoding, "method": "vanilla"}},
            "job-c": {"video": {"uri": v2}, "tasks": [{"type": "caption"}], "decoding": {**decoding, "method": "std"}},
        }  # fmt: skip
        results = {}
        for job_id, body in jobs.items():
            client.submit({"job_id": job_id, **body})
            info = client.wait(job_id, timeout_s=90, poll_s=0.2)
            assert info.status.value == "succeeded", (job_id, info.error, errors)
            results[job_id] = client.result(job_id)
        deadline = time.monotonic() + 10  # the gauges follow within a dispatcher loop (queue depth: 1 s)
        while True:
            text = http_get(base + "/metrics")[1].decode()
            if total(text, "vidspec_jobs_running") == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        worker = ray.get(handles["dispatcher"].pool.video[0].stats.remote()).to_dict()
        yield Run(
            text=text,
            results=results,
            healthz=http_get(base + "/healthz"),
            readyz=http_get(base + "/readyz"),
            worker=worker,
            metrics=handles["dispatcher"].metrics,
            model=results["job-a"]["model"],
            errors=errors,
        )
    finally:
        stop.set()
        thread.join(timeout=60)
        client.close()
    assert not thread.is_alive() and not errors, errors


def _tasks(run: Run) -> list[dict[str, Any]]:
    return [t for r in run.results.values() for t in r["tasks"]]


@pytest.mark.redis
@pytest.mark.ray
def test_speculative_counters_move_by_the_sum_of_the_jobs_stats(run: Run) -> None:
    tasks = _tasks(run)
    assert {t["method"] for t in tasks} == {"std", "vanilla"}
    assert sum(t["stats"]["num_draft_tokens"] for t in tasks) > 0  # something to count
    assert run.model == "qwen2_vl"  # the model directory's name
    for method in ("std", "vanilla"):
        mine = [t for t in tasks if t["method"] == method]
        lab = {"model_name": run.model, "method": method}
        for metric, key in (
            ("vidspec_spec_decode_num_accepted_tokens_total", "num_accepted_tokens"),
            ("vidspec_spec_decode_num_draft_tokens_total", "num_draft_tokens"),
            ("vidspec_spec_decode_num_drafts_total", "num_drafts"),
            ("vidspec_generation_tokens_total", "new_tokens"),
            ("vidspec_prompt_tokens_total", "prompt_tokens"),
        ):
            assert total(run.text, metric, **lab) == sum(t["stats"][key] for t in mine), (metric, method)
        longest = max(len(t["stats"]["accepted_per_pos"]) for t in mine)
        for pos in range(longest):
            expect = sum(
                t["stats"]["accepted_per_pos"][pos] for t in mine if pos < len(t["stats"]["accepted_per_pos"])
            )
            got = total(
                run.text, "vidspec_spec_decode_num_accepted_tokens_per_pos_total", position=str(pos), **lab
            )
            assert got == expect, (method, pos)
        assert total(run.text, "vidspec_tasks_total", **lab) == len(mine)
        assert total(run.text, "vidspec_time_to_first_token_seconds_count", **lab) == len(mine)
        assert total(run.text, "vidspec_inter_token_latency_seconds_count", **lab) == sum(
            t["num_tokens"] - 1 for t in mine
        )
        assert total(run.text, "vidspec_time_to_first_token_seconds_sum", **lab) == pytest.approx(
            sum(t["stats"]["ttft_s"] for t in mine)
        )
    assert total(run.text, "vidspec_spec_decode_num_drafts_total", method="vanilla") == 0
    assert total(run.text, "vidspec_tasks_total") == len(tasks)


@pytest.mark.redis
@pytest.mark.ray
def test_job_outcomes_video_and_session_cache_metrics_match_the_results(run: Run) -> None:
    n = len(run.results)
    assert total(run.text, "vidspec_jobs_total", status="succeeded") == n
    assert total(run.text, "vidspec_jobs_total") == n
    assert total(run.text, "vidspec_queue_time_seconds_count", model_name=run.model) == n
    assert total(run.text, "vidspec_e2e_job_latency_seconds_count", model_name=run.model) == n
    assert total(run.text, "vidspec_queue_time_seconds_sum") == pytest.approx(
        sum(r["timings"]["queue_s"] for r in run.results.values()), abs=1e-3
    )
    videos = [r["video"] for r in run.results.values()]
    misses = [v for v in videos if v["cache"] == "miss"]
    rebuilt = [t for t in _tasks(run) if t["session_cache"] == "miss"]
    assert [v["cache"] for v in videos] == ["miss", "hit", "miss"] and not rebuilt
    lab = {"model_name": run.model}
    assert (
        total(run.text, "vidspec_session_cache_misses_total", **lab)
        == len(misses)
        == run.worker["sessions_built"]
    )
    assert total(run.text, "vidspec_session_cache_hits_total", **lab) == len(videos) - len(misses)
    assert total(run.text, "vidspec_session_cache_evictions_total", **lab) == run.worker["evictions"] == 1
    assert total(run.text, "vidspec_frames_decoded_total", **lab) == sum(v["frames"] for v in misses)
    assert total(run.text, "vidspec_visual_tokens_total", **lab) == sum(v["visual_tokens"] for v in misses)
    assert total(run.text, "vidspec_visual_prefill_seconds_count", **lab) == len(misses)
    assert total(run.text, "vidspec_visual_prefill_seconds_sum", **lab) == pytest.approx(
        sum(v["encode_s"] + v["prefill_s"] for v in misses)
    )
    assert total(run.text, "vidspec_ingest_seconds_sum", **lab) == pytest.approx(
        sum(v["ingest_s"] for v in misses)
    )
    # gauges: what the worker holds now, nothing running or waiting
    assert total(run.text, "vidspec_kv_cache_bytes", **lab) == run.worker["cached_bytes"] > 0
    assert total(run.text, "vidspec_cached_sessions", **lab) == len(run.worker["cached_videos"]) == 1
    assert total(run.text, "vidspec_jobs_running") == 0 and total(run.text, "vidspec_queue_depth") == 0
    assert total(run.text, "vidspec_worker_restarts_total") == 0
    assert total(run.text, "vidspec_jobs_dead_lettered_total") == 0
    # no job id anywhere in the exposition, as a label or otherwise
    assert "job_id" not in run.text and not any(job_id in run.text for job_id in run.results)


@pytest.mark.redis
@pytest.mark.ray
def test_health_and_readiness_answer_with_the_workers_up(run: Run) -> None:
    code, body = run.healthz
    assert code == 200 and json.loads(body)["status"] == "alive"
    code, body = run.readyz
    doc = json.loads(body)
    assert code == 200 and doc["ready"] is True and doc["checks"] == {"redis": True, "workers": 1}


@pytest.mark.redis
@pytest.mark.ray
def test_every_dashboard_panel_queries_metrics_the_service_exports_after_a_run(run: Run) -> None:
    exported = exported_metric_names(run.metrics)
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]
    assert len(exprs) >= 20
    used = {name for e in exprs for name in re.findall(r"vidspec_[a-z0-9_]+", e)}
    assert not used - exported, sorted(used - exported)
    scraped = {name for name, _, _ in samples(run.text)}  # and on the wire, not only in the registry
    assert not used - scraped, sorted(used - scraped)


# -- no service needed ------------------------------------------------------------------------------
def test_metrics_port_comes_from_the_environment_and_the_command_line() -> None:
    assert Settings.from_env({}).metrics_port == 9464
    assert Settings.from_env({"VIDSPEC_METRICS_PORT": "0"}).metrics_port == 0
    assert Settings.from_env({"VIDSPEC_METRICS_HOST": "127.0.0.1"}).metrics_host == "127.0.0.1"
    for bad in ("-1", "70000", "http"):
        with pytest.raises(ConfigError, match="VIDSPEC_METRICS_PORT"):
            Settings.from_env({"VIDSPEC_METRICS_PORT": bad})
    assert build_parser().parse_args(["serve", "--metrics-port", "0"]).metrics_port == 0
    assert build_parser().parse_args(["serve"]).metrics_port is None  # then the environment decides


def test_serve_refuses_a_taken_metrics_port_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = Settings(runtime_dir=tmp_path, metrics_host="127.0.0.1", metrics_port=port)
        with pytest.raises(ServeError, match=f"127.0.0.1:{port}.*--metrics-port"):
            serve(settings, tmp_path / "no-model", threading.Event())
    assert not (tmp_path / "redis").exists()  # no embedded Redis was started


def test_concrete_method_labels() -> None:
    assert [concrete_method(m) for m in ("std", "auto:std", "auto:sparrow", "vanilla", "lvspec:std", "")] == [
        "std", "std", "sparrow", "vanilla", "lvspec:std", "vanilla",
    ]  # fmt: skip


def test_evictions_and_cache_gauges_follow_worker_reports_across_restarts() -> None:
    m = ServiceMetrics()
    rec = MetricsRecorder(m, "tiny")

    def report(worker: int, inc: str, seq: int, evictions: int, videos: int, nbytes: int) -> None:
        rec.worker_state(
            worker,
            {
                "incarnation": inc,
                "seq": seq,
                "evictions": evictions,
                "cached_videos": videos,
                "cached_bytes": nbytes,
            },
        )

    def value(name: str) -> float:
        return m.registry.get_sample_value(name, {"model_name": "tiny"}) or 0.0

    report(0, "a", 1, 0, 1, 100)
    report(1, "x", 1, 2, 2, 50)  # a worker first seen with evictions: all of them count
    report(0, "a", 3, 3, 1, 120)
    report(0, "a", 2, 1, 2, 999)  # an older report processed late: moves nothing
    assert value("vidspec_session_cache_evictions_total") == 5
    assert value("vidspec_kv_cache_bytes") == 170 and value("vidspec_cached_sessions") == 3
    rec.worker_down(0)  # crashed: its restart starts empty
    assert value("vidspec_kv_cache_bytes") == 50
    report(0, "b", 1, 1, 1, 30)  # the new incarnation counts from zero
    report(0, "a", 9, 9, 9, 9)  # a straggler of the old one is ignored
    assert value("vidspec_session_cache_evictions_total") == 6
    assert value("vidspec_kv_cache_bytes") == 80 and value("vidspec_cached_sessions") == 3
