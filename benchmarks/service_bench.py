"""Service benchmark (not a timed test): queue overhead per job, and time to first token on a cached video.

1. Queue overhead: `--jobs` cheap jobs (one question, one new token, on a video whose session is cached)
   submitted one at a time; overhead = the job's `started_at - submitted_at` (submit to start, both Unix
   times written to the job hash). Median and p99; also the whole round trip (submit to finished) and, for
   contrast, the queueing delay when all jobs are submitted at once (a burst: that one includes waiting
   behind earlier jobs, so it is queueing, not overhead).
2. Time to first token on a long synthetic video (`--video-minutes`, default 10): the first question on a
   fresh video (its TTFT includes ingest, vision tower and prefill) vs a second question on the same,
   now cached, video. TTFT = first token's Unix time - submit time. `--repeats` fresh videos.

Runs everything locally (embedded Redis, local Ray, the dispatcher in a thread), like `vidspec demo`.
Model: `--model`, else the shipped reference model, else the tiny random "bench" checkpoint with the
reference model's frame sizing (112x112 frames, 16 visual tokens per 2 frames). Writes JSON to `--out`.

    .venv/bin/python benchmarks/service_bench.py [--jobs 200] [--video-minutes 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from infra.config import InputPolicy, QueueSettings, Settings, WorkerSettings  # noqa: E402
from infra.queue import JobQueue, JobStatus  # noqa: E402
from pipeline.client import Client  # noqa: E402
from pipeline.dispatcher import Dispatcher  # noqa: E402
from pipeline.service_cli import REFERENCE_MODEL, local_service  # noqa: E402


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def bench_model(runtime: Path, explicit: str | None) -> tuple[Path, str]:
    if explicit:
        return Path(explicit), "given"
    if (REFERENCE_MODEL / "config.json").is_file():
        return REFERENCE_MODEL, "reference"
    from decoders.tiny import build_tiny_checkpoint

    path = runtime / "tiny-bench-112"
    if not (path / "config.json").is_file():
        build_tiny_checkpoint("qwen2_vl", path, size="bench", seed=0)
        pre = json.loads((path / "preprocessor_config.json").read_text())
        pre.update(min_pixels=112 * 112, max_pixels=112 * 112)  # the reference model's frame sizing
        (path / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    return path, "tiny random-weight bench checkpoint (hidden 256, 4 layers), 112x112 frames"


def run_job(client: Client, request: dict[str, Any], timeout_s: float = 900.0) -> dict[str, Any]:
    sub = client.submit(request)
    info = client.wait(sub.job_id, timeout_s=timeout_s, poll_s=0.5)
    if info.status is not JobStatus.SUCCEEDED:
        raise RuntimeError(f"job {sub.job_id} {info.status.value}: {info.error}")
    return {"info": info, "result": client.result(sub.job_id)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--video-minutes", type=float, default=10.0)
    ap.add_argument("--fps", type=float, default=2.0, help="video fps and sampling fps")
    ap.add_argument("--max-frames", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--runtime", default=str(REPO / "runtime" / "service-bench"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "service-bench.json"))
    args = ap.parse_args()

    from decoders.train.world import make_video

    runtime = Path(args.runtime).resolve()
    media = runtime / "media"
    media.mkdir(parents=True, exist_ok=True)
    model, model_note = bench_model(runtime, args.model)
    settings = Settings(
        runtime_dir=runtime,
        queue=QueueSettings(block_s=1.0, poll_s=0.005),
        input=InputPolicy(roots=(media,)),
        workers=WorkerSettings(
            max_in_flight=4, device="cpu", torch_threads=1, worker_cpus=1.0, ingest_cpus=0.5
        ),
    )
    print(f"model: {model} ({model_note})", flush=True)
    small = make_video(media / "small.mp4", 4.0, args.fps, 112, 112, seed=1)
    t = time.perf_counter()
    long_src = make_video(media / "long.mp4", args.video_minutes * 60, args.fps, 112, 112, seed=2)
    print(f"made a {args.video_minutes:g}-minute video in {time.perf_counter() - t:.1f}s", flush=True)
    long_copies = []
    for i in range(args.repeats):  # a fresh file is a fresh video key: nothing cached
        p = media / f"long-{i}.mp4"
        shutil.copyfile(long_src, p)
        long_copies.append(p)

    doc: dict[str, Any] = {
        "model": str(model),
        "model_note": model_note,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_at_start": os.getloadavg(),
        },
        "settings": {"torch_threads": 1, "video_workers": 1, "ingest_workers": 1},
    }
    with local_service(settings, model, log_to_driver=False) as (url, pool):
        queue = JobQueue.from_url(url, settings.queue)
        dispatcher = Dispatcher(queue, settings, pool, consumer="bench")
        stop = threading.Event()
        thread = threading.Thread(target=dispatcher.run, args=(stop,), daemon=True)
        thread.start()
        client = Client.from_url(url, settings.queue)
        try:
            # -- 1. queue overhead ---------------------------------------------------------------
            cheap = {"video": {"uri": str(small)}, "tasks": [{"type": "qa", "question": "what is the first object ?"}],
                     "decoding": {"max_new_tokens": 1}, "sampling": {"fps": args.fps}}  # fmt: skip
            run_job(client, {**cheap, "job_id": "warm-up"})  # ingest + prefill once
            overhead, round_trip = [], []
            for i in range(args.jobs):
                t0 = time.time()
                out = run_job(client, {**cheap, "job_id": f"seq-{i}"})
                info = out["info"]
                overhead.append(info.started_at - info.submitted_at)
                round_trip.append(time.time() - t0)
            ids = [client.submit({**cheap, "job_id": f"burst-{i}"}).job_id for i in range(args.jobs)]
            burst = []
            for j in ids:
                info = client.wait(j, timeout_s=600, poll_s=0.5)
                burst.append(info.started_at - info.submitted_at)
            doc["queue_overhead"] = {
                "jobs": args.jobs,
                "submit_to_start_median_ms": 1000 * statistics.median(overhead),
                "submit_to_start_p99_ms": 1000 * percentile(overhead, 0.99),
                "submit_to_finished_median_ms": 1000 * statistics.median(round_trip),
                "submit_to_finished_p99_ms": 1000 * percentile(round_trip, 0.99),
                "burst_submit_to_start_median_ms": 1000 * statistics.median(burst),
                "burst_submit_to_start_p99_ms": 1000 * percentile(burst, 0.99),
            }
            print(json.dumps(doc["queue_overhead"], indent=1), flush=True)

            # -- 2. TTFT on a long video: first question (cold) vs second (cached) ------------------
            runs = []
            for i, path in enumerate(long_copies):
                base = {"video": {"uri": str(path)}, "sampling": {"fps": args.fps, "max_frames": args.max_frames},
                        "decoding": {"max_new_tokens": args.max_new_tokens}}  # fmt: skip
                first = run_job(
                    client,
                    {
                        **base,
                        "job_id": f"long-{i}-q1",
                        "tasks": [{"type": "qa", "question": "what is the first object ?"}],
                    },
                )
                second = run_job(
                    client,
                    {
                        **base,
                        "job_id": f"long-{i}-q2",
                        "tasks": [{"type": "qa", "question": "what is the last object ?"}],
                    },
                )
                r1, r2 = first["result"], second["result"]
                assert r1["video"]["cache"] == "miss" and r2["video"]["cache"] == "hit"
                run = {
                    "visual_tokens": r1["video"]["visual_tokens"],
                    "frames": r1["video"]["frames"],
                    "first": {
                        "ttft_s": r1["timings"]["submit_to_first_token_s"],
                        "queue_s": r1["timings"]["queue_s"],
                        "ingest_s": r1["video"]["ingest_s"],
                        "vision_tower_s": r1["video"]["encode_s"],
                        "prefill_s": r1["video"]["prefill_s"],
                        "question_ttft_s": r1["tasks"][0]["ttft_s"],
                    },
                    "second": {
                        "ttft_s": r2["timings"]["submit_to_first_token_s"],
                        "queue_s": r2["timings"]["queue_s"],
                        "question_ttft_s": r2["tasks"][0]["ttft_s"],
                        "method": r2["tasks"][0]["method"],
                        "mean_accepted_length": r2["tasks"][0]["stats"]["mean_accepted_length"],
                    },
                }
                runs.append(run)
                print(json.dumps(run), flush=True)
            f1 = [r["first"]["ttft_s"] for r in runs]
            f2 = [r["second"]["ttft_s"] for r in runs]
            doc["ttft_long_video"] = {
                "video_minutes": args.video_minutes,
                "fps": args.fps,
                "max_frames": args.max_frames,
                "runs": runs,
                "first_question_ttft_median_s": statistics.median(f1),
                "second_question_ttft_median_s": statistics.median(f2),
                "speedup": statistics.median(f1) / statistics.median(f2),
            }
        finally:
            stop.set()
            thread.join(timeout=30)
            client.close()
            queue.close()
    doc["load_avg_at_end"] = os.getloadavg()

    q, t = doc["queue_overhead"], doc["ttft_long_video"]
    r0 = t["runs"][0]
    print()
    print("| measure | median | p99 |")
    print("|---|---|---|")
    print(
        f"| queue overhead, submit -> start ({q['jobs']} sequential jobs) | {q['submit_to_start_median_ms']:.1f} ms | {q['submit_to_start_p99_ms']:.1f} ms |"
    )
    print(
        f"| cheap job round trip, submit -> finished | {q['submit_to_finished_median_ms']:.1f} ms | {q['submit_to_finished_p99_ms']:.1f} ms |"
    )
    print(
        f"| burst of {q['jobs']}: submit -> start (queueing) | {q['burst_submit_to_start_median_ms']:.0f} ms | {q['burst_submit_to_start_p99_ms']:.0f} ms |"
    )
    print()
    print(
        f"| {t['video_minutes']:g}-min video, {r0['frames']} frames, {r0['visual_tokens']} visual tokens | TTFT (submit -> first token), median of {len(t['runs'])} |"
    )
    print("|---|---|")
    print(f"| first question (ingest + vision tower + prefill) | {t['first_question_ttft_median_s']:.2f} s |")
    print(f"| second question (cached visual KV) | {1000 * t['second_question_ttft_median_s']:.0f} ms |")
    print(f"| ratio | {t['speedup']:.0f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
