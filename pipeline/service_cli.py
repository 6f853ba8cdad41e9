"""The service commands of `vidspec`: serve, submit, status, result, cancel, and the all-local demo.

Contract (CLI names are a DESIGN.md contract):
- `vidspec serve` runs one dispatcher with its actors until SIGINT/SIGTERM. Redis: `VIDSPEC_REDIS_URL`, else
  an embedded redis-server whose URL is written to `<runtime>/service.json` so that `submit` & co on this
  machine find it. Ray: `VIDSPEC_RAY_ADDRESS`, else a local Ray. Unfinished jobs are handed back on exit.
  Before anything else it listens on `VIDSPEC_METRICS_HOST`:`VIDSPEC_METRICS_PORT` (`--metrics-port`;
  default 0.0.0.0:9464; 0 picks a free port) and prints the URL: `/metrics` (Prometheus), `/healthz` (200
  while the process lives) and `/readyz` (200 once Redis answers PING and at least one video worker answers
  a ping, 503 before, e.g. while the model loads, and while stopping). A port that is taken is an error
  (exit status 2) before any model is loaded.
- `vidspec submit VIDEO [--task caption] [--question Q]... [--method M] [--max-new-tokens N]
  [--temperature T] [--fps F] [--max-frames N] [--job-id ID] [--timeout S] [--wait] [--json]`, or
  `vidspec submit --request FILE.json`. A local path is made absolute (the service has its own cwd). With
  `--wait` it follows the progress events and prints the result; exit status 0 only if the job succeeded.
- `vidspec status|result|cancel JOB_ID` (`--json` for machine-readable output). Exit status 2 for an unknown
  job or an unreachable Redis, 1 for a job that failed/was cancelled or has no result yet.
- `vidspec demo` runs everything in this process (embedded Redis, local Ray, the dispatcher in a thread),
  makes a sample video with the synthetic world, submits a caption job and a question job on the same
  video, shows the progress events, prints answers with per-task speculative stats, and exits cleanly.
  Its metrics are served on a free loopback port (URL printed) while it runs.
- Without a model (`--model`, `VIDSPEC_MODEL`, or the shipped `models/vidspec-reference`) the service
  builds a tiny random-weight checkpoint under the runtime dir and says so: its answers are gibberish.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from infra.config import Settings
from infra.queue import Event, JobInfo, JobStatus, QueueError
from monitoring.metrics import MetricsServer, ServiceMetrics
from pipeline.client import Client, JobFailed, JobNotFinished, write_service_file
from pipeline.schema import RequestError, build_request, parse_request
from workers.tasks import CAPTION_PROMPT

REFERENCE_MODEL = Path(__file__).resolve().parent.parent / "models" / "vidspec-reference"
TINY_FALLBACK = "tiny-qwen2-vl"

log = logging.getLogger("vidspec")


class ServeError(RuntimeError):
    """The service could not start (the message says why and what to change)."""


# -- shared helpers -------------------------------------------------------------------------------
def resolve_model(
    settings: Settings, explicit: str | None = None, say: Callable[[str], None] = print
) -> Path:
    """The checkpoint to serve: --model, VIDSPEC_MODEL, the shipped reference model, else a tiny random one."""
    if explicit:
        return Path(explicit)
    if settings.model_dir is not None:
        return settings.model_dir
    if (REFERENCE_MODEL / "config.json").is_file():
        return REFERENCE_MODEL
    path = settings.runtime_dir / TINY_FALLBACK
    say(
        "note: the trained reference model is not shipped yet (models/vidspec-reference); using a tiny "
        f"RANDOM-weight Qwen2-VL checkpoint ({path}), so the answers are gibberish: the point is the pipeline."
    )
    if not (path / "config.json").is_file():
        from decoders.tiny import build_tiny_checkpoint

        build_tiny_checkpoint("qwen2_vl", path, size="bench", seed=0)
    return path


def _video_uri(video: str) -> str:
    if urllib.parse.urlsplit(video).scheme:
        return video
    return str(Path(video).expanduser().resolve())


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else (f"{x * 1000:.0f}ms" if x < 1 else f"{x:.2f}s")


def _fmt_time(ts: float | None) -> str:
    return (
        "-"
        if ts is None
        else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 1000):03d}"
    )


def format_event(ev: Event, label: str = "") -> str:
    d = ev.data
    head = f"  {label}{ev.type:<14}"
    if ev.type == "started":
        return f"{head} attempt {d.get('attempt')} on {d.get('consumer')}"
    if ev.type == "ingested":
        if d.get("shared"):
            return f"{head} shares the ingest of another job on the same video ({d.get('frames')} frames)"
        return (
            f"{head} {d.get('frames')} frames sampled from {d.get('duration_s', 0):.1f}s of "
            f"{d.get('width')}x{d.get('height')} video in {_fmt_s(d.get('ingest_s'))}"
        )
    if ev.type == "session":
        if d.get("cache") == "hit":
            return f"{head} cache HIT: reusing the video's visual KV ({d.get('visual_tokens')} tokens), no prefill"
        return (
            f"{head} cache miss: {d.get('visual_tokens')} visual tokens; vision tower {_fmt_s(d.get('encode_s'))}, "
            f"prefill {_fmt_s(d.get('prefill_s'))} (once per video)"
        )
    if ev.type == "task":
        mal = d.get("mean_accepted_length")
        return (
            f"{head} #{d.get('index')} [{d.get('type')}] {d.get('num_tokens')} tokens, method {d.get('method')}, "
            f"mean accepted length {'-' if mal is None else f'{mal:.2f}'}, ttft {_fmt_s(d.get('ttft_s'))}"
        )
    if ev.type in ("failed", "retry", "dead_lettered", "cancelled"):
        return f"{head} {d.get('error') or d.get('reason') or ''}".rstrip()
    return head.rstrip()


def format_result(result: dict[str, Any], expected: dict[str, str] | None = None) -> str:
    from decoders.train.world import final_answer

    v = result["video"]
    lines = [
        f"job {result['job_id']} (model {result['model']}, attempt {result['attempt']}): "
        f"{v['visual_tokens']} visual tokens from {v['frames']} frames; cache {v['cache']}; "
        f"ingest {_fmt_s(v['ingest_s'])}, vision tower {_fmt_s(v['encode_s'])}, prefill {_fmt_s(v['prefill_s'])}; "
        f"queued {_fmt_s(result['timings']['queue_s'])}, first token after {_fmt_s(result['timings']['time_to_first_token_s'])}"
    ]
    for t in result["tasks"]:
        st = t["stats"]
        mal = st.get("mean_accepted_length")
        lines.append(f"  [{t['type']}] {t['question']}")
        lines.append(f"    -> {t['text']!r}")
        final = final_answer(t["text"])
        if t["type"] == "qa" and final != " ".join(t["text"].split()):
            lines.append(f"    answer: {final!r}")  # a traced reply lists the objects before its answer
        if expected and t["question"] in expected:
            lines.append(f"    expected: {expected[t['question']]!r}")
        lines.append(
            f"    method={t['method']} tokens={t['num_tokens']} mean_accepted_length="
            f"{'-' if mal is None else f'{mal:.2f}'} tokens/target-forward={t['tokens_per_target_forward']:.2f} "
            f"ttft={_fmt_s(t['ttft_s'])} decode={_fmt_s(t['decode_s'])}"
        )
    return "\n".join(lines)


def _info_dict(info: JobInfo) -> dict[str, Any]:
    return info.to_dict()


def _client_errors(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn the client's expected failures into a message and an exit status (never a traceback)."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (QueueError, redis.ConnectionError, redis.TimeoutError, RequestError) as exc:
            print(f"vidspec {args.command}: error: {exc}", file=sys.stderr)
            return 1 if isinstance(exc, JobFailed | JobNotFinished) else 2

    wrapped.__name__ = fn.__name__
    return wrapped


# -- producer commands ----------------------------------------------------------------------------
@_client_errors
def cmd_submit(args: argparse.Namespace) -> int:
    if args.request:
        req = parse_request(Path(args.request).read_text())
    else:
        if not args.video:
            raise RequestError("give a video file or URI (or --request FILE.json)")
        tasks: list[dict[str, Any]] = [{"type": "caption"} for _ in range(args.task.count("caption"))]
        tasks += [{"type": "qa", "question": q} for q in args.question or []]
        req = build_request(
            _video_uri(args.video),
            tasks or [{"type": "caption"}],
            job_id=args.job_id,
            method=args.method,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            fps=args.fps,
            max_frames=args.max_frames,
            timeout_s=args.timeout,
        )
    client = Client.connect()
    try:
        sub = client.submit(req)
        if args.json and not args.wait:
            print(json.dumps({"job_id": sub.job_id, "created": sub.created, "status": sub.status.value}))
        else:
            what = "submitted" if sub.created else "already exists (nothing changed):"
            print(f"job {sub.job_id} {what} {sub.status.value}")
        if not args.wait:
            return 0
        info = client.wait(sub.job_id, on_event=None if args.json else (lambda ev: print(format_event(ev))))
        return _print_outcome(client, info, args.json)
    finally:
        client.close()


def _print_outcome(client: Client, info: JobInfo, as_json: bool) -> int:
    if info.status is JobStatus.SUCCEEDED:
        result = client.result(info.job_id)
        print(json.dumps(result, indent=1) if as_json else format_result(result))
        return 0
    if as_json:
        print(json.dumps(_info_dict(info)))
    else:
        print(f"job {info.job_id} {info.status.value}: {info.error or ''}".rstrip(": "))
    return 1


@_client_errors
def cmd_status(args: argparse.Namespace) -> int:
    client = Client.connect()
    try:
        info = client.status(args.job_id)
        if args.json:
            doc = _info_dict(info)
            if args.events:
                doc["events"] = [dataclasses.asdict(e) for e in client.events(args.job_id)]
            print(json.dumps(doc, indent=1))
            return 0
        print(f"job {info.job_id}: {info.status.value} (attempts {info.attempts})")
        print(
            f"  submitted {_fmt_time(info.submitted_at)}  started {_fmt_time(info.started_at)}  finished {_fmt_time(info.finished_at)}"
        )
        if info.cancel_requested and not info.status.terminal:
            print("  cancel requested")
        if info.error:
            print(f"  error: {info.error}")
        if info.last_error:
            print(f"  last retried error: {info.last_error}")
        if args.events:
            for ev in client.events(args.job_id):
                print(f"{_fmt_time(ev.ts)} {format_event(ev)}")
        return 0
    finally:
        client.close()


@_client_errors
def cmd_result(args: argparse.Namespace) -> int:
    client = Client.connect()
    try:
        result = client.result(args.job_id)
        print(json.dumps(result, indent=1) if args.json else format_result(result))
        return 0
    finally:
        client.close()


@_client_errors
def cmd_cancel(args: argparse.Namespace) -> int:
    client = Client.connect()
    try:
        status = client.cancel(args.job_id)
    finally:
        client.close()
    if status is JobStatus.CANCELLED:
        print(f"job {args.job_id} cancelled")
    elif status is JobStatus.RUNNING:
        print(f"job {args.job_id} is running: cancel requested, it stops at its next decoded chunk")
    else:
        print(f"job {args.job_id} already {status.value}; nothing to cancel")
    return 0


# -- running the service --------------------------------------------------------------------------
@contextmanager
def local_service(
    settings: Settings, model_dir: Path, *, log_to_driver: bool = True
) -> Iterator[tuple[str, Any]]:
    """Redis (given or embedded) + Ray (given or local) + the worker pool; everything stopped on exit."""
    from infra.ray_runtime import start_ray
    from infra.redis_server import EmbeddedRedis
    from pipeline.dispatcher import WorkerPool

    server = None
    url = settings.redis_url
    if url is None:
        server = EmbeddedRedis(settings.runtime_dir / "redis")
        url = server.start()
    ray_rt = None
    pool = None
    try:
        ray_rt = start_ray(settings, log_to_driver=log_to_driver)
        pool = WorkerPool.start(settings, model_dir)
        yield url, pool
    finally:
        if pool is not None:
            pool.shutdown()
        if ray_rt is not None:
            ray_rt.stop()
        if server is not None:
            server.stop()


def start_metrics_server(
    metrics: ServiceMetrics, host: str, port: int, ready: Callable[[], dict[str, Any]]
) -> MetricsServer:
    """Listen on host:port (0: a free port) for /metrics, /healthz, /readyz; `ServeError` if it can't."""
    try:
        server = MetricsServer(metrics, host, port, ready=ready)
    except OSError as exc:
        raise ServeError(
            f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} (choose another port with "
            "--metrics-port or VIDSPEC_METRICS_PORT; 0 picks a free one)"
        ) from exc
    return server.start()


def metrics_url(host: str, port: int) -> str:
    shown = "localhost" if host in ("", "0.0.0.0", "::") else (f"[{host}]" if ":" in host else host)
    return f"http://{shown}:{port}/metrics"


def serve(
    settings: Settings,
    model: Path,
    stop: threading.Event,
    on_started: Callable[[Any, MetricsServer], None] | None = None,
) -> dict[str, int]:
    """Run the service until `stop` is set (see the module docstring); return the finished jobs by status.

    `on_started(dispatcher, metrics_server)` is called once the workers are up, before the dispatcher runs
    (tests use it to find the port and the dispatcher)."""
    from infra.queue import JobQueue
    from pipeline.dispatcher import Dispatcher
    from pipeline.recorder import Readiness

    metrics = ServiceMetrics()
    readiness = Readiness()
    server = start_metrics_server(metrics, settings.metrics_host, settings.metrics_port, readiness)
    print(
        f"metrics: {metrics_url(settings.metrics_host, server.port)} (liveness /healthz, readiness /readyz)",
        flush=True,
    )
    workers = settings.workers
    service_file = None
    try:
        with local_service(settings, model) as (url, pool):
            queue = JobQueue.from_url(url, settings.queue)
            dispatcher = Dispatcher(queue, settings, pool, metrics=metrics)
            if settings.redis_url is None:
                service_file = write_service_file(settings.runtime_dir, url, dispatcher.consumer)
                log.info(
                    "embedded Redis at %s (export VIDSPEC_REDIS_URL=%s for producers elsewhere)", url, url
                )
            log.info(
                "serving model %s: %d video worker(s), %d ingest actor(s), up to %d jobs in flight; consumer %s",
                model, len(pool.video), len(pool.ingest), workers.max_in_flight, dispatcher.consumer,
            )  # fmt: skip
            readiness.attach(url, pool.video)
            try:
                if on_started is not None:
                    on_started(dispatcher, server)
                dispatcher.run(stop)
            finally:
                readiness.detach()
                if service_file is not None:
                    service_file.unlink(missing_ok=True)
                queue.close()
                log.info("stopped (%s)", dict(dispatcher.stats.finished))
            return dict(dispatcher.stats.finished)
    finally:
        server.stop()


def cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_env()
    workers = settings.workers
    if args.workers:
        workers = dataclasses.replace(workers, video_workers=args.workers)
    if args.max_in_flight:
        workers = dataclasses.replace(workers, max_in_flight=args.max_in_flight)
    settings = dataclasses.replace(settings, workers=workers)
    if args.metrics_port is not None:
        settings = dataclasses.replace(settings, metrics_port=args.metrics_port)
    model = resolve_model(settings, args.model, say=log.warning)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve(settings, model, stop)
    except ServeError as exc:
        print(f"vidspec serve: error: {exc}", file=sys.stderr)
        return 2
    return 0


# -- the demo -------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    import numpy as np

    from decoders.train import world as W
    from infra.queue import JobQueue
    from pipeline.dispatcher import Dispatcher
    from pipeline.recorder import Readiness

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    env = Settings.from_env()
    if env.redis_url or env.ray_address:
        print("note: the demo runs everything locally; VIDSPEC_REDIS_URL / VIDSPEC_RAY_ADDRESS are not used")
    runtime = env.runtime_dir
    settings = dataclasses.replace(
        env,
        redis_url=None,
        ray_address=None,
        input=dataclasses.replace(
            env.input, roots=(*env.input.roots, runtime)
        ),  # the sample video lives there
        workers=dataclasses.replace(env.workers, device=args.device),
    )
    runtime.mkdir(parents=True, exist_ok=True)
    model = resolve_model(settings, args.model)

    video = runtime / "demo.mp4"
    print(
        f"[1/5] making a sample video {video} ({args.duration:g}s of the synthetic world, {args.fps:g} fps)",
        flush=True,
    )
    W.make_video(video, args.duration, args.fps, 112, 112, args.seed)
    world = W.world_from_json(json.loads(video.with_suffix(".json").read_text()))
    expected = {CAPTION_PROMPT: W.caption(world)}
    if args.question:
        questions = list(args.question)
    else:
        qas = W.questions(world, np.random.default_rng(args.seed))[: args.num_questions]
        questions = [qa.question for qa in qas]
        expected.update({qa.question: qa.answer for qa in qas})

    t0 = time.perf_counter()
    print(
        "[2/5] starting an embedded Redis, a local Ray and the actors (model loads once per worker)...",
        flush=True,
    )
    with local_service(settings, model, log_to_driver=False) as (url, pool):
        print(
            f"      redis {url}; {len(pool.video)} video worker(s), {len(pool.ingest)} ingest actor(s); ready in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )
        queue = JobQueue.from_url(url, settings.queue)
        dispatcher = Dispatcher(queue, settings, pool, consumer="demo")
        readiness = Readiness()
        readiness.attach(url, pool.video)
        server = start_metrics_server(dispatcher.metrics, "127.0.0.1", 0, readiness)
        print(f"      metrics {metrics_url('127.0.0.1', server.port)} (while the demo runs)", flush=True)
        stop = threading.Event()
        thread = threading.Thread(target=dispatcher.run, args=(stop,), name="dispatcher", daemon=True)
        thread.start()
        client = Client.from_url(url, settings.queue)
        ok = False
        try:
            decoding: dict[str, Any] = {"method": args.method, "max_new_tokens": args.max_new_tokens}
            sampling = {"fps": args.fps, "max_frames": args.max_frames}
            jobs = [
                {"job_id": "demo-caption", "tasks": [{"type": "caption"}]},
                {"job_id": "demo-questions", "tasks": [{"type": "qa", "question": q} for q in questions]},
            ]
            print("[3/5] submitting a caption job and a question job on the same video", flush=True)
            for j in jobs:
                sub = client.submit(
                    {**j, "video": {"uri": str(video.resolve())}, "decoding": decoding, "sampling": sampling}
                )
                print(
                    f"      {sub.job_id}: {sub.status.value}" + ("" if sub.created else " (existed already)")
                )
            print("[4/5] progress:", flush=True)
            infos = []
            for j in jobs:
                infos.append(
                    client.wait(
                        j["job_id"],
                        timeout_s=args.timeout,
                        on_event=lambda ev, n=j["job_id"]: print(format_event(ev, f"{n:<15}"), flush=True),
                    )
                )
            print(
                "[5/5] answers (speedup estimate = tokens per forward pass of the target model; vanilla = 1.00):"
            )
            ok = True
            for info in infos:
                if info.status is JobStatus.SUCCEEDED:
                    print(format_result(client.result(info.job_id), expected))
                else:
                    ok = False
                    print(f"job {info.job_id} {info.status.value}: {info.error}")
        finally:
            stop.set()
            thread.join(timeout=30)
            server.stop()
            readiness.detach()
            client.close()
            queue.close()
    print(f"done in {time.perf_counter() - t0:.1f}s; Redis, Ray and the actors are stopped.")
    return 0 if ok else 1


# -- registration ---------------------------------------------------------------------------------
def add_service_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("serve", help="run the service: dispatcher + Ray actors, until Ctrl-C / SIGTERM")
    s.add_argument("--model", help="checkpoint directory (default: VIDSPEC_MODEL, else the reference model)")
    s.add_argument(
        "--workers", type=int, default=0, help="video workers (default VIDSPEC_VIDEO_WORKERS or 1)"
    )
    s.add_argument(
        "--max-in-flight", type=int, default=0, help="jobs at once (default VIDSPEC_MAX_IN_FLIGHT or 4)"
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        help="port of /metrics, /healthz, /readyz (default VIDSPEC_METRICS_PORT or 9464; 0: a free port)",
    )
    s.set_defaults(func=cmd_serve)

    p = sub.add_parser("submit", help="submit a job: a video file or URI and tasks")
    p.add_argument("video", nargs="?", help="video file (made absolute) or file:// / http(s):// URI")
    p.add_argument("--request", help="submit this request JSON file instead (the job request contract)")
    p.add_argument("--task", action="append", default=[], choices=["caption"], help="add a caption task")
    p.add_argument("--question", action="append", help="add a question (repeatable)")
    p.add_argument("--method", choices=["auto", "std", "sparrow", "vanilla", "lvspec"])
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--fps", type=float, help="sampling fps (default 2)")
    p.add_argument("--max-frames", type=int, help="most frames sampled (default 768)")
    p.add_argument("--job-id", help="idempotency key: resubmitting the same id changes nothing")
    p.add_argument("--timeout", type=float, help="seconds the job may run once started")
    p.add_argument("--wait", action="store_true", help="follow the progress and print the result")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_submit)

    for name, func, helptext in (
        ("status", cmd_status, "a job's status, attempts, times and error"),
        ("result", cmd_result, "a finished job's result"),
        ("cancel", cmd_cancel, "cancel a queued or running job"),
    ):
        c = sub.add_parser(name, help=helptext)
        c.add_argument("job_id")
        if name != "cancel":
            c.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "status":
            c.add_argument("--events", action="store_true", help="also list the job's progress events")
        c.set_defaults(func=func)

    d = sub.add_parser("demo", help="the main job: everything local, end to end (Redis, Ray, dispatcher)")
    d.add_argument("--model", help="checkpoint directory (default: the shipped reference model)")
    d.add_argument("--duration", type=float, default=60.0, help="seconds of sample video")
    d.add_argument("--fps", type=float, default=2.0, help="frames per second of the video and of sampling")
    d.add_argument("--max-frames", type=int, default=768)
    d.add_argument("--seed", type=int, default=7)
    d.add_argument("--method", default="auto", choices=["auto", "std", "vanilla", "sparrow", "lvspec"])
    d.add_argument("--max-new-tokens", type=int, default=96)
    d.add_argument(
        "--question", action="append", help="ask this (repeatable; default: questions from the world)"
    )
    d.add_argument("--num-questions", type=int, default=3)
    d.add_argument("--timeout", type=float, default=600.0, help="give up waiting for a job after this long")
    d.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    d.set_defaults(func=cmd_demo)
