"""Ingest: from a video URI to model-ready pixels, under an input policy, with bounded memory.

Contract:
- `IngestWorker(model_dir, policy, scratch_dir).ingest(source)` checks the URI against the `InputPolicy`
  (local files that resolve, symlinks followed, under one of `policy.roots`; `http`/`https` only when
  `policy.allow_http`, downloaded to `scratch_dir` with the size limit enforced while streaming and
  deleted afterwards; every other scheme is refused), probes the container (size, duration, resolution
  against the limits), then decodes and samples it (`decoders.video.read_video`) and preprocesses the
  frames for the model (`VideoLM.prepare_video`). It returns an `IngestedVideo`.
- Every refusal raises `InputRejected` (a `ValueError`) and every unreadable file `VideoError`, each with a
  message a user can act on; the service turns both into a failed job, never a crash.
- Memory is bounded before decoding starts: the sampled frames (frames x width x height x 3 bytes, at the
  source resolution) must fit in `policy.max_sample_bytes`, and at most `policy.max_frames` frames are
  sampled whatever the request asks; resizing then works through the frames in chunks.
- The worker needs no model weights: `preprocess_view(model_dir)` is a `VideoLM` built from the
  checkpoint's config and preprocessor config only, which is all `prepare_video` reads.
- `IngestActor` is the Ray actor: a thin shell that pins torch threads and delegates to `IngestWorker`;
  `ingest_with_summary` returns the pixels and a small `IngestSummary` as two objects.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import av
import av.error
import ray
import torch

from decoders.model import VideoLM, VisualInputs, check_checkpoint_dir
from decoders.video import VideoError, read_video
from infra.config import InputPolicy
from workers.tasks import VideoSource

HTTP_SCHEMES = ("http", "https")
_CHUNK = 1 << 20


class InputRejected(ValueError):
    """The input policy refuses this video; the message says which rule and how to comply."""


@dataclass(frozen=True)
class IngestedVideo:
    visual: VisualInputs
    frames: int  # sampled frames
    duration_s: float
    width: int  # source resolution
    height: int
    source_bytes: int
    ingest_s: float  # everything: fetch, probe, decode, preprocess
    decode_s: float
    prepare_s: float

    def summary(self) -> IngestSummary:
        return IngestSummary(
            frames=self.frames,
            duration_s=self.duration_s,
            width=self.width,
            height=self.height,
            source_bytes=self.source_bytes,
            visual_tokens=self.visual.num_tokens,
            ingest_s=self.ingest_s,
        )


@dataclass(frozen=True)
class IngestSummary:
    """What a dispatcher needs to know about an ingested video (bytes, not megabytes of pixels)."""

    frames: int
    duration_s: float
    width: int
    height: int
    source_bytes: int
    visual_tokens: int
    ingest_s: float


@dataclass(frozen=True)
class Probe:
    width: int
    height: int
    duration_s: float | None
    codec: str


class _ConfigOnlyModel:
    """Stands in for the model inside a `VideoLM` that only preprocesses: it has the config, no weights."""

    def __init__(self, config: object) -> None:
        self.config = config


def preprocess_view(model_dir: str | os.PathLike[str]) -> VideoLM:
    """A weightless `VideoLM` for `default_sampling` / `prepare_video` (see the module docstring)."""
    from transformers import AutoConfig

    path = Path(model_dir)
    family, _ = check_checkpoint_dir(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    preprocessor = json.loads((path / "preprocessor_config.json").read_text())
    return VideoLM(
        family=family,
        model=_ConfigOnlyModel(config),  # type: ignore[arg-type]
        tokenizer=None,
        path=path,
        device=torch.device("cpu"),
        dtype=torch.float32,
        eos_token_ids=(),
        preprocessor=preprocessor,
        name=path.name,
    )


def _http_opener() -> urllib.request.OpenerDirector:
    """HTTP(S) and redirects between them only: no file://, ftp:// or data: behind a redirect."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.HTTPHandler(),
        urllib.request.HTTPSHandler(),
        urllib.request.HTTPRedirectHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


def probe(path: Path) -> Probe:
    """Resolution, duration (None if the container does not say) and codec of the first video stream."""
    try:
        with av.open(str(path)) as container:
            streams = [s for s in container.streams.video]
            if not streams:
                raise VideoError(f"cannot read video '{path}': it has no video stream")
            s = streams[0]
            width, height = int(s.codec_context.width or 0), int(s.codec_context.height or 0)
            duration = None
            if s.duration and s.time_base:
                duration = float(s.duration * s.time_base)
            elif container.duration and container.duration > 0:
                duration = container.duration / av.time_base
            return Probe(width, height, duration, s.codec_context.name or "?")
    except (av.error.FFmpegError, OSError) as exc:
        raise VideoError(
            f"cannot read video '{path}': not a readable media file ({type(exc).__name__}: {exc})"
        ) from exc


class IngestWorker:
    def __init__(
        self, model_dir: str | os.PathLike[str], policy: InputPolicy, scratch_dir: str | os.PathLike[str]
    ) -> None:
        self.policy = policy
        self.view = preprocess_view(model_dir)
        self.scratch = Path(scratch_dir)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.ingested = 0

    # -- policy -----------------------------------------------------------------------------------
    def local_path(self, uri: str) -> Path:
        """The file a local URI names, if the policy allows it (see the module docstring)."""
        parts = urllib.parse.urlsplit(uri)
        if parts.scheme == "file":
            if parts.netloc not in ("", "localhost"):
                raise InputRejected(f"file:// URIs must name a local file (no host), got {uri!r}")
            raw = urllib.parse.unquote(parts.path)
        elif parts.scheme == "":
            raw = uri
        else:
            raise InputRejected(self._scheme_message(parts.scheme))
        path = Path(raw).expanduser()
        if not path.is_absolute():
            raise InputRejected(f"video path {raw!r} is relative: give an absolute path or a file:// URI")
        try:
            real = path.resolve(strict=True)
        except FileNotFoundError:
            raise InputRejected(f"video file not found: {raw}") from None
        except OSError as exc:
            raise InputRejected(f"cannot access video file {raw}: {exc.strerror or exc}") from None
        if not any(real.is_relative_to(root) for root in self.policy.roots):
            roots = ", ".join(str(r) for r in self.policy.roots)
            raise InputRejected(
                f"video file {real} is not under an allowed input root ({roots}); "
                "move it there or add its directory to VIDSPEC_INPUT_ROOTS"
            )
        st = real.stat()
        if not stat.S_ISREG(st.st_mode):
            raise InputRejected(f"video {real} is not a regular file")
        self._check_size(st.st_size, str(real))
        return real

    def _scheme_message(self, scheme: str) -> str:
        if scheme in HTTP_SCHEMES:
            return (
                f"{scheme} video URIs are disabled on this service (set VIDSPEC_ALLOW_HTTP=1 to allow them)"
            )
        allowed = "absolute paths, file://" + (", http://, https://" if self.policy.allow_http else "")
        return f"URI scheme {scheme!r} is not accepted; use {allowed}"

    def _check_size(self, size: int, what: str) -> None:
        if size > self.policy.max_bytes:
            raise InputRejected(
                f"video {what} is {size} bytes, above the limit of {self.policy.max_bytes} bytes "
                "(VIDSPEC_MAX_VIDEO_BYTES)"
            )
        if size == 0:
            raise InputRejected(f"video {what} is empty (0 bytes)")

    def download(self, uri: str) -> Path:
        """Fetch an http(s) URI into the scratch dir, enforcing the size limit while streaming."""
        scheme = urllib.parse.urlsplit(uri).scheme
        if scheme not in HTTP_SCHEMES or not self.policy.allow_http:
            raise InputRejected(self._scheme_message(scheme))
        fd, name = tempfile.mkstemp(prefix="fetch-", suffix=".video", dir=self.scratch)
        path = Path(name)
        try:
            with (
                os.fdopen(fd, "wb") as out,
                _http_opener().open(uri, timeout=self.policy.http_timeout_s) as resp,
            ):
                declared = resp.headers.get("Content-Length")
                if declared and declared.isdigit():
                    self._check_size(int(declared), uri)
                total = 0
                while chunk := resp.read(_CHUNK):
                    total += len(chunk)
                    if total > self.policy.max_bytes:
                        self._check_size(total, uri)
                    out.write(chunk)
            self._check_size(total, uri)
            return path
        except urllib.error.HTTPError as exc:
            path.unlink(missing_ok=True)
            raise InputRejected(f"cannot fetch {uri}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            path.unlink(missing_ok=True)
            reason = getattr(exc, "reason", exc)
            raise InputRejected(f"cannot fetch {uri}: {reason}") from None
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    # -- ingest -----------------------------------------------------------------------------------
    def ingest(self, source: VideoSource) -> IngestedVideo:
        t0 = time.perf_counter()
        scheme = urllib.parse.urlsplit(source.uri).scheme
        fetched = scheme in HTTP_SCHEMES
        path = self.download(source.uri) if fetched else self.local_path(source.uri)
        try:
            return self._ingest_file(path, source, t0)
        finally:
            if fetched:
                path.unlink(missing_ok=True)

    def _ingest_file(self, path: Path, source: VideoSource, t0: float) -> IngestedVideo:
        p = self.policy
        info = probe(path)
        if info.width > p.max_width or info.height > p.max_height:
            raise InputRejected(
                f"video {source.uri} is {info.width}x{info.height}, above the limit of "
                f"{p.max_width}x{p.max_height} (VIDSPEC_MAX_VIDEO_WIDTH / _HEIGHT)"
            )
        if info.duration_s is not None and info.duration_s > p.max_duration_s:
            raise InputRejected(
                f"video {source.uri} lasts {info.duration_s:.0f}s, above the limit of {p.max_duration_s:.0f}s "
                "(VIDSPEC_MAX_VIDEO_DURATION_S)"
            )
        max_frames = min(source.max_frames, p.max_frames)
        sampling = self.view.default_sampling(fps=source.fps, max_frames=max_frames)
        frames = max_frames
        if info.duration_s is not None:
            frames = min(max_frames, max(sampling.min_frames, math.ceil(info.duration_s * source.fps)))
        held = frames * max(1, info.width) * max(1, info.height) * 3
        if held > p.max_sample_bytes:
            raise InputRejected(
                f"sampling {frames} frames of {info.width}x{info.height} from {source.uri} would hold {held} bytes, "
                f"above the ingest memory limit of {p.max_sample_bytes} (VIDSPEC_INGEST_MEMORY_BYTES); "
                "ask for a lower sampling fps or max_frames"
            )
        t1 = time.perf_counter()
        decoded = read_video(path, sampling)
        if decoded.duration_s > p.max_duration_s:  # containers that do not declare a duration
            raise InputRejected(
                f"video {source.uri} lasts {decoded.duration_s:.0f}s, above the limit of {p.max_duration_s:.0f}s"
            )
        t2 = time.perf_counter()
        visual = self.view.prepare_video(decoded, sampling)
        t3 = time.perf_counter()
        self.ingested += 1
        return IngestedVideo(
            visual=visual,
            frames=decoded.num_frames,
            duration_s=float(decoded.duration_s),
            width=info.width,
            height=info.height,
            source_bytes=path.stat().st_size,
            ingest_s=t3 - t0,
            decode_s=t2 - t1,
            prepare_s=t3 - t2,
        )


@ray.remote
class IngestActor:
    """Ray shell over `IngestWorker` (create with `.options(max_restarts=..., num_cpus=...)`)."""

    def __init__(self, model_dir: str, policy: InputPolicy, scratch_dir: str, torch_threads: int = 1) -> None:
        torch.set_num_threads(torch_threads)
        self.core = IngestWorker(model_dir, policy, scratch_dir)

    def ingest(self, source: VideoSource) -> IngestedVideo:
        return self.core.ingest(source)

    @ray.method(num_returns=2)
    def ingest_with_summary(self, source: VideoSource) -> tuple[IngestSummary, IngestedVideo]:
        """Two objects: the small summary for the dispatcher, the pixels for the video worker (the
        dispatcher passes that ref on without ever fetching it)."""
        video = self.core.ingest(source)
        return video.summary(), video

    @ray.method(max_task_retries=-1)  # answered once the actor is up again: how restarts are awaited
    def ping(self) -> bool:
        return True
