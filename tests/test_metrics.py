"""Metrics: contract names, what the counters move by, the HTTP endpoint, and the dashboard's PromQL."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

from conftest import random_video

from decoders.engine import run
from decoders.proposers.std import StDConfig, StDProposer
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from monitoring.metrics import MetricsServer, ServiceMetrics, exported_metric_names

DASHBOARD = Path(__file__).resolve().parent.parent / "monitoring" / "grafana" / "vidspec-dashboard.json"
CONTRACT = [
    "vidspec_spec_decode_num_drafts_total", "vidspec_spec_decode_num_draft_tokens_total",
    "vidspec_spec_decode_num_accepted_tokens_total", "vidspec_spec_decode_num_accepted_tokens_per_pos_total",
    "vidspec_time_to_first_token_seconds_bucket", "vidspec_inter_token_latency_seconds_bucket",
    "vidspec_e2e_job_latency_seconds_bucket", "vidspec_queue_time_seconds_bucket",
    "vidspec_visual_prefill_seconds_bucket", "vidspec_queue_depth", "vidspec_jobs_running",
    "vidspec_kv_cache_bytes", "vidspec_jobs_total", "vidspec_frames_decoded_total", "vidspec_visual_tokens_total",
]  # fmt: skip


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _metrics_after_real_decoding(tiny_models: dict) -> tuple[ServiceMetrics, list[dict]]:
    lm = tiny_models["qwen2_vl"]
    session = VisualSession.create(lm, lm.prepare_video(random_video(16, 56, 84, seed=2)))
    m = ServiceMetrics()
    stats = []
    for q in ("what colour is the circle ?", "describe the video ."):
        res = run(
            session,
            lm.suffix_ids(q),
            DecodeConfig(max_new_tokens=12, ignore_eos=True),
            StDProposer(StDConfig(budget=64, gamma=3)),
        )
        stats.append(res.stats.to_dict())
        m.observe_task("tiny", res.stats.to_dict())
    m.observe_video(
        "tiny", frames=16, visual_tokens=session.num_visual_tokens, ingest_s=0.1, prefill_s=session.prefill_s
    )
    m.observe_job("tiny", "succeeded", queue_s=0.01, e2e_s=1.0)
    m.queue_depth.set(0)
    m.jobs_running.set(0)
    m.kv_cache_bytes.labels(model_name="tiny").set(session.kv_bytes())
    m.cached_sessions.labels(model_name="tiny").set(1)
    m.session_hits.labels(model_name="tiny").inc()
    m.session_evictions.labels(model_name="tiny").inc(0)
    m.worker_restarts.inc(0)
    m.dead_lettered.inc(0)
    return m, stats


def test_counters_move_by_the_sum_of_the_tasks_stats_and_are_served_over_http(tiny_models: dict) -> None:
    m, stats = _metrics_after_real_decoding(tiny_models)
    server = MetricsServer(m, "127.0.0.1", 0, ready=lambda: {"redis": True, "workers": 1}).start()
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics").read().decode()
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz").read())
        ready = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/readyz").read())
    finally:
        server.stop()
    lab = {"model_name": "tiny", "method": "std"}
    assert _sample(text, "vidspec_spec_decode_num_accepted_tokens_total", **lab) == sum(
        s["num_accepted_tokens"] for s in stats
    )
    assert _sample(text, "vidspec_spec_decode_num_draft_tokens_total", **lab) == sum(
        s["num_draft_tokens"] for s in stats
    )
    assert _sample(text, "vidspec_spec_decode_num_drafts_total", **lab) == sum(s["num_drafts"] for s in stats)
    assert _sample(text, "vidspec_spec_decode_num_accepted_tokens_per_pos_total", position="0", **lab) == sum(
        s["accepted_per_pos"][0] for s in stats
    )
    assert _sample(text, "vidspec_generation_tokens_total", **lab) == 24
    assert _sample(text, "vidspec_time_to_first_token_seconds_count", **lab) == 2
    assert _sample(text, "vidspec_inter_token_latency_seconds_count", **lab) == 22
    assert _sample(text, "vidspec_jobs_total", status="succeeded") == 1
    for name in CONTRACT:
        assert re.search(rf"^{name}[{{ ]", text, re.M), name
    assert "job_id" not in text
    assert health["status"] == "alive" and ready["ready"] is True


def test_readiness_fails_when_a_dependency_does_not_answer() -> None:
    server = MetricsServer(
        ServiceMetrics(), "127.0.0.1", 0, ready=lambda: {"redis": True, "workers": 0}
    ).start()
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/readyz")
        code = 200
    except urllib.error.HTTPError as exc:
        code = exc.code
    finally:
        server.stop()
    assert code == 503


def test_every_dashboard_panel_queries_metrics_the_service_exports(tiny_models: dict) -> None:
    m, _ = _metrics_after_real_decoding(tiny_models)
    exported = exported_metric_names(m)
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]
    assert len(exprs) >= 20
    used = {name for e in exprs for name in re.findall(r"vidspec_[a-z0-9_]+", e)}
    missing = used - exported
    assert not missing, missing
    assert any(v["name"] == "model_name" for v in dash["templating"]["list"])
