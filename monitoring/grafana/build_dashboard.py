"""Builds `vidspec-dashboard.json` (importable into Grafana) from the panel list below.

Run `python monitoring/grafana/build_dashboard.py` after changing a panel; the JSON is committed.
Every PromQL expression filters on the `model_name` dashboard variable where the metric has that label.
"""

from __future__ import annotations

import json
from pathlib import Path

M = '{model_name=~"$model_name"}'
R = "[$__rate_interval]"


def q(expr: str, legend: str = "") -> dict:
    return {"expr": expr, "legendFormat": legend, "refId": "A"}


def quantiles(metric: str, by: str = "") -> list[dict]:
    grp = f"le{', ' + by if by else ''}"
    return [
        q(
            f"histogram_quantile({p}, sum by ({grp}) (rate({metric}_bucket{M}{R})))",
            f"p{int(p * 100)} {{{{{by}}}}}" if by else f"p{int(p * 100)}",
        )
        for p in (0.5, 0.95, 0.99)
    ]


ROWS: list[tuple[str, list[tuple[str, str, list[dict]]]]] = [
    ("Speculative decoding", [
        ("Acceptance rate by method", "percentunit", [q(
            f"sum by (method) (rate(vidspec_spec_decode_num_accepted_tokens_total{M}{R})) / "
            f"sum by (method) (rate(vidspec_spec_decode_num_draft_tokens_total{M}{R}))", "{{method}}")]),
        ("Mean accepted length by method (incl. bonus token)", "none", [q(
            f"1 + sum by (method) (rate(vidspec_spec_decode_num_accepted_tokens_total{M}{R})) / "
            f"sum by (method) (rate(vidspec_spec_decode_num_drafts_total{M}{R}))", "{{method}}")]),
        ("Acceptance by draft position", "percentunit", [q(
            f"sum by (method, position) (rate(vidspec_spec_decode_num_accepted_tokens_per_pos_total{M}{R})) / "
            f"ignoring(position) group_left sum by (method) (rate(vidspec_spec_decode_num_drafts_total{M}{R}))",
            "{{method}} pos {{position}}")]),
        ("Draft tokens / s by method", "short", [q(
            f"sum by (method) (rate(vidspec_spec_decode_num_draft_tokens_total{M}{R}))", "{{method}}")]),
        ("Lossy answers (LVSpec) share", "percentunit", [q(
            f'sum(rate(vidspec_tasks_total{{model_name=~"$model_name", lossy="true"}}{R})) / '
            f"sum(rate(vidspec_tasks_total{M}{R}))", "lossy share")]),
    ]),
    ("Throughput and latency", [
        ("Generated tokens / s by method", "short", [q(
            f"sum by (method) (rate(vidspec_generation_tokens_total{M}{R}))", "{{method}}")]),
        ("Time to first token", "s", quantiles("vidspec_time_to_first_token_seconds")),
        ("Inter-token latency by method", "s", quantiles("vidspec_inter_token_latency_seconds", "method")),
        ("End-to-end job latency", "s", quantiles("vidspec_e2e_job_latency_seconds")),
        ("Queue time", "s", quantiles("vidspec_queue_time_seconds")),
        ("Task decode time", "s", quantiles("vidspec_task_decode_seconds")),
    ]),
    ("Pipeline", [
        ("Queue depth / running jobs", "short", [
            q("sum(vidspec_queue_depth)", "queued"), {**q("sum(vidspec_jobs_running)", "running"), "refId": "B"}]),
        ("Job outcomes / s", "short", [q(f"sum by (status) (rate(vidspec_jobs_total{R}))", "{{status}}")]),
        ("Frames decoded / s", "short", [q(f"sum(rate(vidspec_frames_decoded_total{M}{R}))", "frames/s")]),
        ("Visual tokens prefilled / s", "short", [q(f"sum(rate(vidspec_visual_tokens_total{M}{R}))", "tokens/s")]),
        ("Visual prefill time", "s", quantiles("vidspec_visual_prefill_seconds")),
        ("Ingest time", "s", quantiles("vidspec_ingest_seconds")),
        ("Dead-lettered jobs and worker restarts", "short", [
            q(f"sum(increase(vidspec_jobs_dead_lettered_total{R}))", "dead-lettered"),
            {**q(f"sum(increase(vidspec_worker_restarts_total{R}))", "worker restarts"), "refId": "B"}]),
    ]),
    ("Memory and cached videos", [
        ("KV cache bytes (cached visual sessions)", "bytes", [q(f"sum(vidspec_kv_cache_bytes{M})", "bytes")]),
        ("Cached sessions", "short", [q(f"sum(vidspec_cached_sessions{M})", "sessions")]),
        ("Session cache hit ratio", "percentunit", [q(
            f"sum(rate(vidspec_session_cache_hits_total{M}{R})) / (sum(rate(vidspec_session_cache_hits_total{M}{R})) + "
            f"sum(rate(vidspec_session_cache_misses_total{M}{R})))", "hit ratio")]),
        ("Session evictions / s", "short", [q(f"sum(rate(vidspec_session_cache_evictions_total{M}{R}))", "evictions/s")]),
    ]),
]  # fmt: skip


def build() -> dict:
    panels: list[dict] = []
    pid, y = 1, 0
    for title, row in ROWS:
        panels.append(
            {
                "type": "row",
                "title": title,
                "id": pid,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            }
        )
        pid, y = pid + 1, y + 1
        for i, (ptitle, unit, targets) in enumerate(row):
            panels.append({
                "type": "timeseries", "title": ptitle, "id": pid,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": y + (i // 3) * 8},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [{**t, "datasource": {"type": "prometheus", "uid": "${datasource}"}} for t in targets],
            })  # fmt: skip
            pid += 1
        y += 8 * ((len(row) + 2) // 3)
    return {
        "title": "vidspec — video LLM serving",
        "uid": "vidspec-main",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "tags": ["vidspec", "llm", "speculative-decoding"],
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                {
                    "name": "model_name",
                    "type": "query",
                    "label": "model",
                    "includeAll": True,
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "definition": "label_values(vidspec_generation_tokens_total, model_name)",
                    "query": {
                        "query": "label_values(vidspec_generation_tokens_total, model_name)",
                        "refId": "v",
                    },
                },
            ]
        },
        "panels": panels,
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("vidspec-dashboard.json")
    out.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {out}")
