"""Video decoding, frame sampling, resizing and Qwen-VL patchifying, without torchvision.

Contract:

- Sampling follows qwen-vl-utils: sample ``fps`` frames per second of video, clamp to
  ``[min_frames, max_frames]`` and to the frames the video has, round to a multiple of ``frame_factor``
  (the model's temporal patch size), and pick evenly spaced frame indices (``linspace`` over
  ``[0, total_frames - 1]``, rounded). Frame sizes are rounded to multiples of 28 with the pixel count kept
  inside ``[min_pixels, max_pixels]`` (``smart_resize``).
- ``read_video`` decodes the first video stream with PyAV, every frame, and keeps only the sampled ones (at
  the resolutions served here decoding everything beats seeking). Memory is bounded by the sampled frames.
  Every bad input (missing, empty, unknown format, corrupt or truncated, audio only, no decodable frame)
  raises ``VideoError`` with a message naming the file and the cause; PyAV's own exception types never
  escape.
- ``resize_frames`` -> ``normalize`` -> ``patchify_qwen`` turn sampled frames into ``pixel_values_videos``
  and ``video_grid_thw`` with exactly the layout of transformers' ``Qwen2VLVideoProcessor``.
- ``write_video`` is the encoder helper used by tests and the synthetic-video generator.

This module knows no model, cache, queue or metrics; it imports only numpy, torch and av.
"""

from __future__ import annotations

import logging
import math
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import av.container
import av.error
import av.stream
import av.video.stream
import numpy as np
import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# OpenAI CLIP statistics, the image_mean / image_std of the Qwen2-VL / Qwen2.5-VL processors.
CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

MAX_ASPECT_RATIO = 200.0

# write_video: our codec names -> FFmpeg encoder, and which codecs each container accepts.
_ENCODERS: dict[str, str] = {"h264": "libx264", "mpeg4": "mpeg4", "vp9": "libvpx-vp9"}
_CONTAINERS: dict[str, tuple[str, frozenset[str]]] = {
    ".mp4": ("mp4", frozenset({"h264", "mpeg4", "vp9"})),
    ".avi": ("avi", frozenset({"h264", "mpeg4"})),
    ".webm": ("webm", frozenset({"vp9"})),
}


class VideoError(ValueError):
    """A video file that cannot be used; the message names the file and the cause."""


# --------------------------------------------------------------------------------------------------
# Configuration and result types
# --------------------------------------------------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingConfig:
    """How frames are sampled from a video and how large each sampled frame may be.

    ``min_pixels`` / ``max_pixels`` bound one frame after resizing (``smart_resize``), not the whole video.
    """

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    frame_factor: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.fps, bool) or not isinstance(self.fps, int | float):
            raise ValueError(f"SamplingConfig.fps must be a number, got {self.fps!r}")
        if not (math.isfinite(self.fps) and self.fps > 0):
            raise ValueError(f"SamplingConfig.fps must be a finite number > 0, got {self.fps!r}")
        for name in ("min_frames", "max_frames", "min_pixels", "max_pixels", "frame_factor"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"SamplingConfig.{name} must be an int >= 1, got {value!r}")
        if self.min_frames > self.max_frames:
            raise ValueError(
                f"SamplingConfig.min_frames ({self.min_frames}) must be <= max_frames ({self.max_frames})"
            )
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"SamplingConfig.min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})"
            )
        lo = _ceil_by(self.min_frames, self.frame_factor)
        hi = _floor_by(self.max_frames, self.frame_factor)
        if hi < self.frame_factor or lo > hi:
            raise ValueError(
                f"SamplingConfig: no multiple of frame_factor={self.frame_factor} lies in "
                f"[min_frames={self.min_frames}, max_frames={self.max_frames}]"
            )


@dataclass(frozen=True, eq=False)  # eq=False: field-wise == on numpy arrays is ambiguous
class DecodedVideo:
    """The sampled frames of one video plus what is known about its source stream."""

    frames: np.ndarray  # [T, H, W, 3] uint8 RGB, original size
    timestamps: np.ndarray  # [T] float64 seconds from the stream's first frame
    sample_fps: float  # T / (total_frames / source_fps), as qwen-vl-utils reports it
    source_fps: float
    duration_s: float
    total_frames: int  # decodable frames in the source stream

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


# --------------------------------------------------------------------------------------------------
# Sampling and sizing rules (qwen-vl-utils semantics)
# --------------------------------------------------------------------------------------------------


def _round_by(x: float, factor: int) -> int:
    return round(x / factor) * factor  # Python round: half to even, as qwen-vl-utils


def _ceil_by(x: float, factor: int) -> int:
    return math.ceil(x / factor) * factor


def _floor_by(x: float, factor: int) -> int:
    return math.floor(x / factor) * factor


def smart_nframes(total_frames: int, video_fps: float, cfg: SamplingConfig) -> int:
    """Number of frames to sample: ``total_frames / video_fps * cfg.fps`` clamped and rounded.

    Clamped to ``[ceil(min_frames), floor(max_frames)]`` and to ``floor(total_frames)`` (all rounded to
    ``cfg.frame_factor``), then rounded down to a multiple of ``frame_factor``. Never below ``frame_factor``:
    a video shorter than that is sampled with repeated frames (qwen-vl-utils raises instead).
    """
    if not _is_int(total_frames) or total_frames < 1:
        raise ValueError(f"total_frames must be an int >= 1, got {total_frames!r}")
    if not (math.isfinite(video_fps) and video_fps > 0):
        raise ValueError(f"video_fps must be a finite number > 0, got {video_fps!r}")
    factor = cfg.frame_factor
    min_frames = _ceil_by(cfg.min_frames, factor)
    max_frames = _floor_by(min(cfg.max_frames, total_frames), factor)
    nframes = total_frames / video_fps * cfg.fps
    nframes = min(max(nframes, min_frames), max_frames)
    return max(factor, _floor_by(nframes, factor))


def sample_indices(total_frames: int, nframes: int) -> np.ndarray:
    """``nframes`` evenly spaced frame indices in ``[0, total_frames - 1]``, int64, non-decreasing.

    Computed exactly as qwen-vl-utils does (``torch.linspace`` in float32, round half to even) so the same
    frames are picked. Indices repeat when ``nframes > total_frames``.
    """
    if not _is_int(total_frames) or total_frames < 1:
        raise ValueError(f"total_frames must be an int >= 1, got {total_frames!r}")
    if not _is_int(nframes) or nframes < 1:
        raise ValueError(f"nframes must be an int >= 1, got {nframes!r}")
    idx = torch.linspace(0, total_frames - 1, nframes).round().long()
    return idx.numpy().astype(np.int64)


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 4 * 28 * 28,
    max_pixels: int = 768 * 28 * 28,
) -> tuple[int, int]:
    """Target ``(height, width)``: multiples of ``factor``, ``min_pixels <= h * w <= max_pixels``, aspect kept.

    Each side is first rounded to the nearest multiple of ``factor`` (half to even, as qwen-vl-utils); if
    the area is then out of bounds both sides are rescaled by the same factor and rounded down (too large)
    or up (too small). Raises ``ValueError`` for an aspect ratio above 200.
    """
    if height < 1 or width < 1:
        raise ValueError(f"height and width must be >= 1, got {height}x{width}")
    if factor < 1 or min_pixels < 1 or min_pixels > max_pixels:
        raise ValueError(
            f"need factor >= 1 and 1 <= min_pixels <= max_pixels, got {factor}, {min_pixels}, {max_pixels}"
        )
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"aspect ratio must be at most {MAX_ASPECT_RATIO:g}, got {ratio:g} ({height}x{width})"
        )
    h_bar = max(factor, _round_by(height, factor))
    w_bar = max(factor, _round_by(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, _floor_by(height / beta, factor))
        w_bar = max(factor, _floor_by(width / beta, factor))
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = _ceil_by(height * beta, factor)
        w_bar = _ceil_by(width * beta, factor)
    return h_bar, w_bar


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------


def _ffmpeg_reason(exc: BaseException) -> str:
    strerror = getattr(exc, "strerror", None)
    return f"{type(exc).__name__}: {strerror or exc}"


@contextmanager
def _open_input(path: str) -> Iterator[av.container.InputContainer]:
    """Open ``path`` for reading, turning PyAV's open errors into VideoError."""
    try:
        container = av.open(path, mode="r")
    except (av.error.InvalidDataError, av.error.EOFError) as exc:
        raise VideoError(
            f"cannot read video '{path}': not a recognised media file, or its container is corrupt or "
            f"truncated ({_ffmpeg_reason(exc)})"
        ) from exc
    except PermissionError as exc:
        raise VideoError(f"cannot read video '{path}': permission denied ({_ffmpeg_reason(exc)})") from exc
    except (av.error.FFmpegError, OSError) as exc:  # e.g. EIO from a Matroska header cut short
        raise VideoError(
            f"cannot read video '{path}': cannot open it, the file is corrupt, truncated or unreadable "
            f"({_ffmpeg_reason(exc)})"
        ) from exc
    try:
        yield container
    finally:
        container.close()


def _video_stream(path: str, container: av.container.InputContainer) -> av.video.stream.VideoStream:
    """The first real video stream (cover art / attached pictures do not count)."""
    for stream in container.streams.video:
        if not stream.disposition & av.stream.Disposition.attached_pic:
            return stream
    kinds = ", ".join(
        f"{s.type}:{s.codec_context.name if s.codec_context else '?'}"
        + (" (cover art)" if s.disposition & av.stream.Disposition.attached_pic else "")
        for s in container.streams
    )
    raise VideoError(f"cannot read video '{path}': it has no video stream (streams: {kinds or 'none'})")


@dataclass(frozen=True)
class _StreamInfo:
    total_frames: int
    fps: float
    duration_s: float | None  # None: not declared and not measurable from timestamps


def _probe(path: str) -> _StreamInfo:
    """Frame count, frame rate and duration: from the stream header where it gives them, else from packets.

    WebM/Matroska declare neither a frame count nor a stream duration, so the packets are counted and their
    pts span measured in one demux-only pass (no decoding, cheap). The container-level duration is the last
    resort: it covers all streams and outlives truncation.
    """
    with _open_input(path) as container:
        stream = _video_stream(path, container)
        time_base = stream.time_base
        total = stream.frames if stream.frames and stream.frames > 0 else 0
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        duration = float(stream.duration * time_base) if stream.duration and time_base else 0.0

        if total == 0 or fps <= 0 or duration <= 0:
            count, first_pts, last_end = 0, math.inf, -math.inf
            try:
                for packet in container.demux(stream):
                    if packet.size == 0:  # the flush packet at end of stream
                        continue
                    count += 1
                    if packet.pts is not None and time_base:
                        start = float(packet.pts * time_base)
                        first_pts = min(first_pts, start)
                        last_end = max(last_end, start + float((packet.duration or 0) * time_base))
            except (av.error.FFmpegError, OSError) as exc:
                raise VideoError(
                    f"cannot read video '{path}': corrupt or truncated container after {count} packets "
                    f"({_ffmpeg_reason(exc)})"
                ) from exc
            total = total or count
            if duration <= 0 and last_end > first_pts:
                duration = last_end - first_pts
        if duration <= 0 and container.duration and container.duration > 0:
            duration = container.duration / av.time_base
        if total == 0:
            raise VideoError(f"cannot read video '{path}': its video stream has no frames")
        if fps <= 0:
            if duration <= 0:
                raise VideoError(f"cannot read video '{path}': cannot determine its frame rate")
            fps = total / duration
        return _StreamInfo(total_frames=total, fps=fps, duration_s=duration if duration > 0 else None)


def _decode_sampled(path: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Decode every frame, keep those at ``indices`` (sorted, may repeat).

    Returns (frames [n, H, W, 3] uint8, timestamps [n] seconds or None, frames decoded). Frames past the
    last index are still decoded so the true frame count is known. Timestamps come from the frames' pts,
    relative to the first frame, and are None when the pts cannot be trusted: missing, or not strictly
    increasing in output order (AVI has no pts, so h264-in-AVI frames carry reordered decode timestamps).
    If fewer frames decode than ``indices`` needs, the frames array is empty and the caller resamples.
    """
    n = len(indices)
    out: np.ndarray | None = None
    times = np.zeros(n, dtype=np.float64)
    pts_ok = True
    first_time: float | None = None
    prev_time: float | None = None
    ptr = 0  # next slot of `indices` to fill
    decoded = 0
    with _open_input(path) as container:
        stream = _video_stream(path, container)
        # Frame threading is left off on purpose: with it, FFmpeg drops the error of a truncated last
        # packet and a damaged file would decode "fine".
        codec = stream.codec_context.name
        try:
            for frame in container.decode(stream):
                i = decoded
                decoded += 1
                t = frame.time
                if t is None or (prev_time is not None and t <= prev_time):
                    pts_ok = False
                elif first_time is None:
                    first_time = t
                prev_time = t
                if ptr >= n or indices[ptr] != i:
                    continue
                if out is None:
                    image = frame.to_ndarray(format="rgb24")
                    out = np.empty((n, *image.shape), dtype=np.uint8)
                else:  # a mid-stream size change is scaled back to the first sampled frame's size
                    image = frame.to_ndarray(format="rgb24", width=out.shape[2], height=out.shape[1])
                while ptr < n and indices[ptr] == i:
                    out[ptr] = image
                    if pts_ok and t is not None and first_time is not None:
                        times[ptr] = t - first_time
                    ptr += 1
        except (av.error.FFmpegError, OSError) as exc:
            raise VideoError(
                f"cannot read video '{path}': corrupt or truncated {codec} stream, decoding failed after "
                f"{decoded} frames ({_ffmpeg_reason(exc)})"
            ) from exc
    if decoded == 0:
        raise VideoError(f"cannot read video '{path}': its {codec} video stream has no decodable frames")
    if ptr < n or out is None:
        return np.empty((0, 0, 0, 3), dtype=np.uint8), None, decoded
    return out, (times if pts_ok else None), decoded


def read_video(path: str | os.PathLike[str], cfg: SamplingConfig) -> DecodedVideo:
    """Decode ``path`` and return the frames chosen by ``smart_nframes`` / ``sample_indices``.

    The declared frame count is checked against the frames actually decoded; when they differ (a truncated
    tail, edit lists) the video is sampled again with the true count, so indices never point past the end.
    """
    path_str = os.fspath(path)
    try:
        st = os.stat(path_str)
    except FileNotFoundError as exc:
        raise VideoError(f"cannot read video '{path_str}': file not found") from exc
    except OSError as exc:
        raise VideoError(f"cannot read video '{path_str}': cannot access it ({exc.strerror or exc})") from exc
    if stat.S_ISDIR(st.st_mode):
        raise VideoError(f"cannot read video '{path_str}': it is a directory, not a file")
    if stat.S_ISREG(st.st_mode) and st.st_size == 0:
        raise VideoError(f"cannot read video '{path_str}': the file is empty (0 bytes)")

    info = _probe(path_str)
    total, fps = info.total_frames, info.fps
    for attempt in range(2):
        nframes = smart_nframes(total, fps, cfg)
        indices = sample_indices(total, nframes)
        frames, times, decoded = _decode_sampled(path_str, indices)
        if decoded == total:
            break
        if attempt == 1:
            raise VideoError(
                f"cannot read video '{path_str}': frame count is unstable ({total} then {decoded} frames decoded)"
            )
        logger.warning("%s: header says %d frames but %d decode; resampling", path_str, total, decoded)
        total = decoded
    if times is None:  # no trustworthy pts: assume a constant frame rate
        times = indices.astype(np.float64) / fps
    # A declared duration describes the declared frames; after a recount it would overstate the video.
    if info.duration_s is not None and total == info.total_frames:
        duration = info.duration_s
    else:
        duration = total / fps
    return DecodedVideo(
        frames=frames,
        timestamps=times,
        sample_fps=nframes / total * fps,
        source_fps=fps,
        duration_s=duration,
        total_frames=total,
    )


# --------------------------------------------------------------------------------------------------
# Resize, normalise, patchify
# --------------------------------------------------------------------------------------------------


def resize_frames(frames: np.ndarray, height: int, width: int, chunk: int = 32) -> torch.Tensor:
    """[T, H, W, 3] uint8 -> [T, 3, height, width] float32 in [0, 255]: bicubic, antialiased, clamped.

    Works through ``chunk`` frames at a time so the float copy of the full-size video never exists at once.
    """
    if (
        not isinstance(frames, np.ndarray)
        or frames.dtype != np.uint8
        or frames.ndim != 4
        or frames.shape[-1] != 3
    ):
        raise ValueError(
            f"frames must be a uint8 array [T, H, W, 3], got {getattr(frames, 'shape', frames)!r}"
        )
    if height < 1 or width < 1:
        raise ValueError(f"target size must be >= 1x1, got {height}x{width}")
    num = frames.shape[0]
    out = torch.empty((num, 3, height, width), dtype=torch.float32)
    src = torch.from_numpy(frames)
    for start in range(0, num, chunk):
        x = src[start : start + chunk].permute(0, 3, 1, 2).float()  # [t, 3, H, W]
        if x.shape[-2:] != (height, width):
            x = F.interpolate(x, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
        out[start : start + chunk] = x.clamp_(0.0, 255.0)
    return out


def normalize(frames: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """[T, C, H, W] in [0, 255] -> ``(x / 255 - mean) / std`` per channel, float."""
    if frames.ndim != 4:
        raise ValueError(f"frames must be [T, C, H, W], got shape {tuple(frames.shape)}")
    channels = frames.shape[1]
    if len(mean) != channels or len(std) != channels:
        raise ValueError(f"need {channels} mean and std values, got {len(mean)} and {len(std)}")
    if any(s == 0 for s in std):
        raise ValueError(f"std must be non-zero, got {list(std)}")
    x = frames if frames.is_floating_point() else frames.float()
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, channels, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, channels, 1, 1)
    return (x * (1.0 / 255.0) - m) / s


def patchify_qwen(
    frames: torch.Tensor, patch_size: int = 14, temporal_patch_size: int = 2, merge_size: int = 2
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[T, C, H, W] normalised frames -> (pixel_values [grid_t*grid_h*grid_w, C*tp*p*p], (grid_t, grid_h, grid_w)).

    The layout of transformers' ``Qwen2VLVideoProcessor.patchify`` (batch dim dropped): patches run over
    time, then over merge windows row-major, then over the ``merge x merge`` patches inside a window; each
    row is ordered (channel, time-in-patch, y, x). T is padded to a multiple of ``temporal_patch_size`` by
    repeating the last frame; H and W must be multiples of ``patch_size * merge_size``.
    """
    if frames.ndim != 4:
        raise ValueError(f"frames must be [T, C, H, W], got shape {tuple(frames.shape)}")
    num, channels, height, width = frames.shape
    if num < 1:
        raise ValueError("frames must hold at least one frame")
    unit = patch_size * merge_size
    if height % unit or width % unit:
        raise ValueError(f"height and width must be multiples of {unit}, got {height}x{width}")
    if pad := -num % temporal_patch_size:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)], dim=0)
        num += pad
    grid_t, grid_h, grid_w = num // temporal_patch_size, height // patch_size, width // patch_size
    m, p, tp = merge_size, patch_size, temporal_patch_size
    x = frames.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
    # -> [grid_t, gh/m, gw/m, m(y), m(x), C, tp, p(y), p(x)]
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    pixel_values = x.reshape(grid_t * grid_h * grid_w, channels * tp * p * p)
    return pixel_values, (grid_t, grid_h, grid_w)


def video_token_count_qwen(grid_thw: Sequence[int] | torch.Tensor, merge_size: int = 2) -> int:
    """LLM tokens for one video of grid ``(t, h, w)``: ``t * h * w // merge_size**2``."""
    values = grid_thw.flatten().tolist() if isinstance(grid_thw, torch.Tensor) else list(grid_thw)
    if len(values) != 3:
        raise ValueError(f"grid_thw must hold 3 values (t, h, w), got {values!r}")
    t, h, w = (int(v) for v in values)
    if h % merge_size or w % merge_size:
        raise ValueError(f"grid h and w must be multiples of merge_size={merge_size}, got {h}x{w}")
    return t * h * w // (merge_size * merge_size)


# --------------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------------


def _encoder_options(codec: str, crf: int) -> dict[str, str]:
    if codec == "h264":
        return {"crf": str(crf), "preset": "veryfast"}
    if codec == "vp9":  # constant-quality mode needs a zero target bitrate
        return {"crf": str(crf), "b": "0", "deadline": "realtime", "cpu-used": "8"}
    # mpeg4 has no CRF: a fixed quantiser, crf 23 -> q 8 (2 = best, 31 = worst)
    q = min(31, max(2, round(crf / 3)))
    return {"flags": "+qscale", "global_quality": str(q * 118)}  # 118 = FF_QP2LAMBDA


def write_video(
    path: str | os.PathLike[str], frames: Iterable[np.ndarray], fps: float, codec: str = "h264", crf: int = 23
) -> None:
    """Encode [H, W, 3] uint8 RGB frames to ``path`` as yuv420p, streaming (frames may be a generator).

    ``codec`` is one of h264, mpeg4, vp9; the container follows the suffix (.mp4, .avi, .webm; webm takes
    vp9 only, avi not vp9). Width and height must be even (yuv420p). On any error the partial file is removed.
    """
    path_str = os.fspath(path)
    suffix = Path(path_str).suffix.lower()
    if codec not in _ENCODERS:
        raise ValueError(f"codec must be one of {sorted(_ENCODERS)}, got {codec!r}")
    if suffix not in _CONTAINERS:
        raise ValueError(f"{path_str}: suffix must be one of {sorted(_CONTAINERS)}, got {suffix!r}")
    container_format, allowed = _CONTAINERS[suffix]
    if codec not in allowed:
        raise ValueError(f"{path_str}: a {suffix} file cannot hold {codec}; use one of {sorted(allowed)}")
    if isinstance(fps, bool) or not (isinstance(fps, int | float) and math.isfinite(fps) and fps > 0):
        raise ValueError(f"fps must be a finite number > 0, got {fps!r}")
    if not _is_int(crf) or not 0 <= crf <= 63:
        raise ValueError(f"crf must be an int in [0, 63], got {crf!r}")
    rate = Fraction(fps).limit_denominator(1001)  # mpeg4 allows time-base denominators up to 65535
    if rate <= 0:
        raise ValueError(f"fps {fps!r} is too small to encode")

    written = 0
    try:
        with av.open(path_str, mode="w", format=container_format) as container:
            stream = None
            shape: tuple[int, ...] = ()
            for image in frames:
                if (
                    not isinstance(image, np.ndarray)
                    or image.dtype != np.uint8
                    or image.ndim != 3
                    or image.shape[2] != 3
                ):
                    raise ValueError(
                        f"frame {written}: need a uint8 array [H, W, 3], got {getattr(image, 'shape', image)!r}"
                    )
                if stream is None:
                    height, width = image.shape[:2]
                    if height % 2 or width % 2:
                        raise ValueError(f"frame size must be even for yuv420p, got {height}x{width}")
                    shape = image.shape
                    stream = container.add_stream(_ENCODERS[codec], rate=rate)
                    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
                    stream.options = _encoder_options(codec, crf)
                elif image.shape != shape:
                    raise ValueError(
                        f"frame {written}: size {image.shape} differs from the first frame's {shape}"
                    )
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
                frame.pts = written
                frame.time_base = 1 / rate
                container.mux(stream.encode(frame))
                written += 1
            if stream is None:
                raise ValueError(f"{path_str}: no frames to write")
            container.mux(stream.encode(None))  # flush the encoder
    except BaseException:
        Path(path_str).unlink(missing_ok=True)
        raise
