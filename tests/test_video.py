"""Tests for decoders/video.py: sampling and sizing rules, Qwen patch layout, decoding and its failures."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from decoders import video
from decoders.video import (
    CLIP_MEAN,
    CLIP_STD,
    SamplingConfig,
    VideoError,
    normalize,
    patchify_qwen,
    read_video,
    resize_frames,
    sample_indices,
    smart_nframes,
    smart_resize,
    video_token_count_qwen,
    write_video,
)

# --------------------------------------------------------------------------------------------------
# Synthetic clips: the left half is grey with a level that encodes the frame index, the right half is
# pure red (to catch RGB/BGR mix-ups). 30 frames at 10 fps = 3 s.
# --------------------------------------------------------------------------------------------------

H, W, N_FRAMES, FPS = 48, 64, 30, 10.0
LEVEL0, LEVEL_STEP = 10, 8  # frame i has grey level 10 + 8 i (max 242); codec error is ~1-3 levels


def index_frames(n: int = N_FRAMES, height: int = H, width: int = W) -> Iterator[np.ndarray]:
    for i in range(n):
        frame = np.empty((height, width, 3), dtype=np.uint8)
        frame[:, : width // 2] = LEVEL0 + LEVEL_STEP * i
        frame[:, width // 2 :] = (255, 0, 0)
        yield frame


def decoded_indices(frames: np.ndarray) -> np.ndarray:
    """Frame index encoded in each [H, W, 3] frame (inner part of the grey half, away from the edge)."""
    level = frames[:, 4:-4, 4 : W // 2 - 4].astype(np.float64).mean(axis=(1, 2, 3))
    return np.rint((level - LEVEL0) / LEVEL_STEP).astype(np.int64)


def make_clip(tmp_path: Path, codec: str, suffix: str, n: int = N_FRAMES) -> Path:
    path = tmp_path / f"clip_{codec}{suffix}"
    write_video(path, index_frames(n), fps=FPS, codec=codec)
    return path


def mp4_atoms(data: bytes) -> dict[bytes, tuple[int, int]]:
    """Top-level MP4 boxes: type -> (offset, size)."""
    atoms, pos = {}, 0
    while pos + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        atoms[kind] = (pos, size)
        if size < 8:
            break
        pos += size
    return atoms


def write_audio_only(path: Path, codec: str, sample_format: str, cover_art: bool = False) -> None:
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=16000)
        stream.layout = "mono"  # before any mux: the first mux opens every codec
        if cover_art:  # a one-picture mjpeg "video" stream flagged attached_pic, as music files carry
            cover = container.add_stream("mjpeg", rate=1)
            cover.width, cover.height, cover.pix_fmt = W, H, "yuvj420p"
            cover.disposition = av.stream.Disposition.attached_pic
            picture = av.VideoFrame.from_ndarray(np.zeros((H, W, 3), dtype=np.uint8), format="rgb24")
            picture.pts = 0
            container.mux(cover.encode(picture) + cover.encode(None))
        dtype = np.float32 if sample_format.startswith("flt") else np.int16
        for k in range(8):
            frame = av.AudioFrame.from_ndarray(
                np.zeros((1, 1024), dtype=dtype), format=sample_format, layout="mono"
            )
            frame.sample_rate = 16000
            frame.pts = k * 1024
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


# --------------------------------------------------------------------------------------------------
# SamplingConfig
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fps": 0.0},
        {"fps": -1.0},
        {"fps": math.nan},
        {"fps": math.inf},
        {"min_frames": 0},
        {"max_frames": 0},
        {"min_frames": 10, "max_frames": 8},
        {"min_pixels": 0},
        {"min_pixels": 1000, "max_pixels": 999},
        {"frame_factor": 0},
        {"min_frames": 3, "max_frames": 3},  # no even frame count in [3, 3]
        {"max_frames": 2.5},
    ],
)
def test_sampling_config_rejects_invalid_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="SamplingConfig"):
        SamplingConfig(**kwargs)


def test_sampling_config_defaults_follow_qwen_vl_utils() -> None:
    cfg = SamplingConfig()
    assert (cfg.fps, cfg.min_frames, cfg.max_frames, cfg.frame_factor) == (2.0, 4, 768, 2)
    assert (cfg.min_pixels, cfg.max_pixels) == (4 * 28 * 28, 768 * 28 * 28)


# --------------------------------------------------------------------------------------------------
# smart_nframes / sample_indices / smart_resize against hand-computed values
# --------------------------------------------------------------------------------------------------


def test_smart_nframes_samples_cfg_fps_frames_per_second() -> None:
    assert smart_nframes(300, 30.0, SamplingConfig()) == 20  # 10 s x 2 fps
    assert smart_nframes(300, 30.0, SamplingConfig(fps=1.0)) == 10


def test_smart_nframes_rounds_down_to_frame_factor() -> None:
    assert smart_nframes(95, 10.0, SamplingConfig()) == 18  # 9.5 s x 2 = 19 -> 18
    assert smart_nframes(95, 10.0, SamplingConfig(frame_factor=4)) == 16


def test_smart_nframes_clamps_up_to_min_frames_rounded_up() -> None:
    assert smart_nframes(20, 10.0, SamplingConfig()) == 4  # 2 s x 2 = 4
    assert smart_nframes(10, 10.0, SamplingConfig()) == 4  # 1 s x 2 = 2 -> min 4
    assert smart_nframes(20, 10.0, SamplingConfig(min_frames=5)) == 6  # min 5 -> ceil to 6


def test_smart_nframes_clamps_down_to_max_frames_rounded_down() -> None:
    assert smart_nframes(30000, 30.0, SamplingConfig()) == 768  # 1000 s x 2 = 2000
    assert smart_nframes(30000, 30.0, SamplingConfig(max_frames=101)) == 100


def test_smart_nframes_never_exceeds_total_frames() -> None:
    assert smart_nframes(5, 1.0, SamplingConfig()) == 4  # wants 10, has 5 -> 4
    assert smart_nframes(3, 1.0, SamplingConfig()) == 2  # below min_frames: all it has, rounded down
    assert smart_nframes(7, 1.0, SamplingConfig(fps=10.0)) == 6


def test_smart_nframes_gives_at_least_frame_factor_for_a_single_frame_video() -> None:
    assert smart_nframes(1, 25.0, SamplingConfig()) == 2


def test_smart_nframes_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="total_frames"):
        smart_nframes(0, 10.0, SamplingConfig())
    with pytest.raises(ValueError, match="video_fps"):
        smart_nframes(10, 0.0, SamplingConfig())


def test_sample_indices_are_rounded_linspace_over_all_frames() -> None:
    # linspace(0, 29, 6) = 0, 5.8, 11.6, 17.4, 23.2, 29
    np.testing.assert_array_equal(sample_indices(30, 6), [0, 6, 12, 17, 23, 29])
    np.testing.assert_array_equal(sample_indices(30, 4), [0, 10, 19, 29])  # 0, 9.67, 19.33, 29
    np.testing.assert_array_equal(sample_indices(10, 4), [0, 3, 6, 9])
    np.testing.assert_array_equal(sample_indices(6, 6), np.arange(6))
    assert sample_indices(30, 6).dtype == np.int64


def test_sample_indices_repeat_frames_when_asked_for_more_than_exist() -> None:
    np.testing.assert_array_equal(sample_indices(1, 2), [0, 0])
    np.testing.assert_array_equal(sample_indices(2, 4), [0, 0, 1, 1])  # 0, 1/3, 2/3, 1


def test_smart_resize_rounds_each_side_to_nearest_multiple_of_28() -> None:
    assert smart_resize(480, 640) == (476, 644)  # 17.14 -> 17, 22.86 -> 23
    # ties go to even like Python's round (qwen-vl-utils): 42/28 = 1.5 -> 2, 70/28 = 2.5 -> 2
    assert smart_resize(42, 70) == (56, 56)


def test_smart_resize_scales_down_to_max_pixels() -> None:
    h, w = smart_resize(1080, 1920)  # 1092 x 1932 is too many pixels
    assert (h, w) == (560, 1008)  # beta = 1.8558: floor(581.97/28)*28, floor(1034.6/28)*28
    assert h * w <= 768 * 28 * 28
    # beta = 2.969: floor(363.7/28)*28, floor(646.6/28)*28
    assert smart_resize(1080, 1920, max_pixels=300 * 28 * 28) == (336, 644)


def test_smart_resize_scales_up_to_min_pixels() -> None:
    h, w = smart_resize(20, 30)  # 28 x 28 = 784 < 3136
    assert (h, w) == (56, 84)  # beta = 2.286: ceil(45.7/28)*28, ceil(68.6/28)*28
    assert h * w >= 4 * 28 * 28


def test_smart_resize_honours_factor() -> None:
    h, w = smart_resize(100, 150, factor=32, min_pixels=32 * 32, max_pixels=10**6)
    assert (h % 32, w % 32) == (0, 0)
    assert (h, w) == (96, 160)


def test_smart_resize_rejects_aspect_ratio_above_200() -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2010)
    assert smart_resize(10, 2000) == (28, 1988)  # exactly 200 is allowed


def test_smart_resize_matches_transformers_for_ordinary_sizes() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    for height in range(28, 1500, 37):
        for width in range(28, 2000, 53):
            for lo, hi in [(4 * 784, 768 * 784), (128 * 784, 256 * 784)]:
                ours = smart_resize(height, width, 28, lo, hi)
                assert ours == hf_smart_resize(height, width, 28, lo, hi), (height, width, lo, hi)


# --------------------------------------------------------------------------------------------------
# resize / normalise / patchify
# --------------------------------------------------------------------------------------------------


def test_resize_frames_returns_channels_first_float_at_target_size() -> None:
    frames = np.zeros((3, 48, 64, 3), dtype=np.uint8)
    frames[..., 0], frames[..., 1], frames[..., 2] = 200, 50, 10
    out = resize_frames(frames, 56, 84)
    assert out.shape == (3, 3, 56, 84) and out.dtype == torch.float32
    # a constant image stays constant under bicubic resampling: also proves channel order is kept
    torch.testing.assert_close(out[:, 0], torch.full((3, 56, 84), 200.0))
    torch.testing.assert_close(out[:, 1], torch.full((3, 56, 84), 50.0))
    torch.testing.assert_close(out[:, 2], torch.full((3, 56, 84), 10.0))


def test_resize_frames_antialiases_when_downscaling() -> None:
    # one-pixel lines every 4 px, shrunk 4x: an antialiased filter averages them to 255/4 everywhere;
    # plain bicubic samples between the lines (its negative lobe lands on them) and sees black
    frames = np.zeros((1, 112, 112, 3), dtype=np.uint8)
    frames[:, :, ::4] = 255
    out = resize_frames(frames, 28, 28)
    interior = out[..., 2:-2, 2:-2]
    assert interior.mean().item() == pytest.approx(255 / 4, abs=3.0)
    assert interior.min().item() > 40.0


def test_resize_frames_clamps_bicubic_overshoot_to_0_255() -> None:
    frames = np.zeros((1, 8, 8, 3), dtype=np.uint8)
    frames[:, :, 4:] = 255  # a hard edge rings under bicubic upscaling
    out = resize_frames(frames, 56, 56)
    assert out.min().item() == 0.0 and out.max().item() == 255.0


def test_normalize_rescales_by_255_then_standardises_per_channel() -> None:
    frames = torch.zeros(1, 3, 2, 2)
    frames[:, :, 0, 0] = 255.0
    out = normalize(frames, CLIP_MEAN, CLIP_STD)
    for c in range(3):
        assert out[0, c, 0, 0].item() == pytest.approx((1.0 - CLIP_MEAN[c]) / CLIP_STD[c], rel=1e-6)
        assert out[0, c, 1, 1].item() == pytest.approx(-CLIP_MEAN[c] / CLIP_STD[c], rel=1e-6)
    with pytest.raises(ValueError, match="mean and std"):
        normalize(frames, (0.5, 0.5), (0.5, 0.5))


def loop_patchify(frames: torch.Tensor, p: int, tp: int, m: int) -> torch.Tensor:
    """Independent construction of the Qwen2-VL layout, one patch at a time.

    Rows run over time groups, then merge windows (row-major), then the m x m patches inside a window
    (row-major); a row is the patch's pixels ordered (channel, frame-in-group, y, x).
    """
    t_total, _, height, width = frames.shape
    rows = []
    for t in range(t_total // tp):
        for wy in range(height // (p * m)):
            for wx in range(width // (p * m)):
                for iy in range(m):
                    for ix in range(m):
                        y0, x0 = (wy * m + iy) * p, (wx * m + ix) * p
                        patch = frames[t * tp : (t + 1) * tp, :, y0 : y0 + p, x0 : x0 + p]  # [tp, C, p, p]
                        rows.append(patch.permute(1, 0, 2, 3).reshape(-1))
    return torch.stack(rows)


def test_patchify_qwen_matches_a_loop_built_reference() -> None:
    torch.manual_seed(0)
    frames = torch.randn(4, 3, 56, 84)
    pixel_values, grid = patchify_qwen(frames)
    assert grid == (2, 4, 6)
    assert pixel_values.shape == (2 * 4 * 6, 3 * 2 * 14 * 14)
    torch.testing.assert_close(pixel_values, loop_patchify(frames, 14, 2, 2), rtol=0, atol=0)


def test_patchify_qwen_orders_patches_by_merge_window() -> None:
    # every pixel holds 100 * t + 10 * patch_row + patch_col (patch 2 x 2 px, tp=1, merge 2)
    t_idx = torch.arange(2).view(2, 1, 1, 1)
    row = (torch.arange(8) // 2).view(1, 1, 8, 1)
    col = (torch.arange(8) // 2).view(1, 1, 1, 8)
    frames = (100 * t_idx + 10 * row + col).float().expand(2, 1, 8, 8).contiguous()
    pixel_values, grid = patchify_qwen(frames, patch_size=2, temporal_patch_size=1, merge_size=2)
    assert grid == (2, 4, 4)
    first_value = pixel_values[:, 0].long().tolist()
    # window (0,0) holds patches (0,0) (0,1) (1,0) (1,1); then window (0,1) starts with patch (0,2)
    assert first_value[:8] == [0, 1, 10, 11, 2, 3, 12, 13]
    assert first_value[8:12] == [20, 21, 30, 31]  # second window row
    assert first_value[16] == 100  # the second time step follows all patches of the first
    assert torch.all(pixel_values == pixel_values[:, :1])  # each row is one patch, constant here


def test_patchify_qwen_pads_odd_frame_count_by_repeating_last_frame() -> None:
    torch.manual_seed(1)
    frames = torch.randn(3, 3, 28, 28)
    pixel_values, grid = patchify_qwen(frames)
    assert grid == (2, 2, 2)
    padded = torch.cat([frames, frames[-1:]], dim=0)
    torch.testing.assert_close(pixel_values, loop_patchify(padded, 14, 2, 2), rtol=0, atol=0)


def test_patchify_qwen_matches_transformers_image_patchify_for_a_still_clip() -> None:
    # transformers' numpy image patchify (no torchvision) repeats one image over the temporal patch:
    # the same layout as a two-frame clip of that image.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.manual_seed(2)
    image = torch.randn(3, 56, 84)
    expected, gh, gw = Qwen2VLImageProcessorPil.patchify(
        None, image.numpy(), patch_size=14, merge_size=2, temporal_patch_size=2
    )
    pixel_values, grid = patchify_qwen(torch.stack([image, image]))
    assert grid == (1, gh, gw)
    np.testing.assert_array_equal(pixel_values.numpy(), expected)


def test_patchify_qwen_rejects_sizes_not_multiple_of_patch_times_merge() -> None:
    with pytest.raises(ValueError, match="multiples of 28"):
        patchify_qwen(torch.zeros(2, 3, 42, 56))


def test_video_token_count_qwen_divides_patches_by_merge_area() -> None:
    assert video_token_count_qwen((2, 4, 6)) == 12
    assert video_token_count_qwen(torch.tensor([[30, 16, 22]])) == 2640  # the e2e example in feasibility.md
    _, grid = patchify_qwen(torch.zeros(8, 3, 56, 112))
    assert video_token_count_qwen(grid) == 4 * 4 * 8 // 4


# --------------------------------------------------------------------------------------------------
# write_video / read_video round trips
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("codec", "suffix"),
    [("h264", ".mp4"), ("mpeg4", ".mp4"), ("mpeg4", ".avi"), ("vp9", ".webm"), ("h264", ".avi")],
)
def test_read_video_round_trip_samples_the_expected_frames(tmp_path: Path, codec: str, suffix: str) -> None:
    path = make_clip(tmp_path, codec, suffix)
    decoded = read_video(path, SamplingConfig())  # 3 s x 2 fps = 6 frames
    expected = np.array([0, 6, 12, 17, 23, 29])
    assert decoded.frames.shape == (6, H, W, 3) and decoded.frames.dtype == np.uint8
    np.testing.assert_array_equal(decoded_indices(decoded.frames), expected)
    red = decoded.frames[:, 4:-4, W // 2 + 4 : -4].reshape(-1, 3).astype(int)
    assert red[:, 0].min() > 240 and red[:, 1:].max() < 15  # RGB, not BGR
    # h264-in-AVI has reordered pts; timestamps must still be each sampled frame's time
    np.testing.assert_allclose(decoded.timestamps, expected / FPS, atol=1e-6)
    assert decoded.total_frames == N_FRAMES  # WebM declares no frame count: counted
    assert decoded.source_fps == pytest.approx(FPS)
    assert decoded.duration_s == pytest.approx(3.0)
    assert decoded.sample_fps == pytest.approx(2.0)


def test_read_video_honours_max_frames(tmp_path: Path) -> None:
    path = make_clip(tmp_path, "h264", ".mp4")
    decoded = read_video(path, SamplingConfig(max_frames=4))
    np.testing.assert_array_equal(decoded_indices(decoded.frames), [0, 10, 19, 29])
    assert decoded.sample_fps == pytest.approx(4 / 3)


def test_read_video_of_a_single_frame_repeats_it(tmp_path: Path) -> None:
    path = make_clip(tmp_path, "h264", ".mp4", n=1)
    decoded = read_video(path, SamplingConfig())
    assert decoded.total_frames == 1
    np.testing.assert_array_equal(decoded_indices(decoded.frames), [0, 0])


@pytest.mark.parametrize("declared", [40, 20])
def test_read_video_resamples_when_declared_frame_count_is_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, declared: int
) -> None:
    path = make_clip(tmp_path, "mpeg4", ".mp4")
    wrong = video._StreamInfo(total_frames=declared, fps=FPS, duration_s=declared / FPS)
    monkeypatch.setattr(video, "_probe", lambda _path: wrong)
    decoded = read_video(path, SamplingConfig())
    assert decoded.total_frames == N_FRAMES
    np.testing.assert_array_equal(decoded_indices(decoded.frames), [0, 6, 12, 17, 23, 29])
    assert decoded.duration_s == pytest.approx(3.0)


def test_write_video_rejects_odd_sizes_and_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "odd.mp4"
    with pytest.raises(ValueError, match="even"):
        write_video(path, [np.zeros((47, 64, 3), np.uint8)], fps=10)
    assert not path.exists()


def test_write_video_rejects_a_frame_of_another_size_and_removes_the_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "mixed.mp4"
    frames = [np.zeros((48, 64, 3), np.uint8), np.zeros((32, 64, 3), np.uint8)]
    with pytest.raises(ValueError, match="differs"):
        write_video(path, frames, fps=10)
    assert not path.exists()


@pytest.mark.parametrize(
    ("name", "codec", "match"),
    [("a.webm", "h264", "cannot hold"), ("a.mkv", "h264", "suffix"), ("a.mp4", "av1", "codec")],
)
def test_write_video_rejects_unsupported_codec_or_container(
    tmp_path: Path, name: str, codec: str, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        write_video(tmp_path / name, index_frames(2), fps=10, codec=codec)


def test_write_video_rejects_an_empty_frame_sequence(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no frames"):
        write_video(tmp_path / "none.mp4", [], fps=10)
    assert not (tmp_path / "none.mp4").exists()


# --------------------------------------------------------------------------------------------------
# Bad inputs: always VideoError naming the file and the cause, never a raw av exception
# --------------------------------------------------------------------------------------------------


def assert_video_error(path: Path, cause: str) -> VideoError:
    with pytest.raises(VideoError) as info:
        read_video(path, SamplingConfig())
    message = str(info.value)
    assert str(path) in message, message
    assert cause in message, message
    assert not isinstance(info.value, av.error.FFmpegError)
    return info.value


def test_missing_file_is_a_video_error(tmp_path: Path) -> None:
    assert_video_error(tmp_path / "nope.mp4", "file not found")


def test_directory_is_a_video_error(tmp_path: Path) -> None:
    assert_video_error(tmp_path, "directory")


def test_empty_file_is_a_video_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.mp4"
    path.touch()
    assert_video_error(path, "empty (0 bytes)")


def test_random_bytes_are_a_video_error(tmp_path: Path) -> None:
    path = tmp_path / "noise.mp4"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    error = assert_video_error(path, "not a recognised media file")
    assert isinstance(error.__cause__, av.error.FFmpegError)  # wrapped, with the cause chained


def test_text_file_named_mp4_is_a_video_error(tmp_path: Path) -> None:
    path = tmp_path / "notes.mp4"
    path.write_text("this is not a video\n" * 100)
    assert_video_error(path, "not a recognised media file")


def test_truncated_mp4_without_its_index_is_a_video_error(tmp_path: Path) -> None:
    data = make_clip(tmp_path, "h264", ".mp4").read_bytes()
    path = tmp_path / "first30.mp4"
    path.write_bytes(data[: int(len(data) * 0.3)])  # the moov box sits at the end: it is cut off
    assert_video_error(path, "corrupt or truncated")


def test_mp4_with_garbage_payload_is_a_video_error(tmp_path: Path) -> None:
    data = bytearray(make_clip(tmp_path, "h264", ".mp4").read_bytes())
    offset, size = mp4_atoms(bytes(data))[b"mdat"]
    data[offset + 8 : offset + size] = np.random.default_rng(1).bytes(size - 8)  # valid header and index
    path = tmp_path / "garbage.mp4"
    path.write_bytes(bytes(data))
    assert_video_error(path, "corrupt or truncated h264 stream")


def test_mp4_truncated_mid_stream_is_a_video_error(tmp_path: Path) -> None:
    full = tmp_path / "faststart.mp4"  # index first, so a cut keeps the index but loses frames
    rng = np.random.default_rng(2)
    with av.open(str(full), mode="w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("libx264", rate=Fraction(10))
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for i in range(20):
            frame = av.VideoFrame.from_ndarray(
                rng.integers(0, 256, (H, W, 3), dtype=np.uint8), format="rgb24"
            )
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    data = full.read_bytes()
    path = tmp_path / "cut.mp4"
    path.write_bytes(data[: int(len(data) * 0.6)])
    assert_video_error(path, "decoding failed")


@pytest.mark.parametrize(
    ("name", "codec", "sample_format"), [("tone.wav", "pcm_s16le", "s16"), ("tone.m4a", "aac", "fltp")]
)
def test_audio_only_file_is_a_video_error(tmp_path: Path, name: str, codec: str, sample_format: str) -> None:
    path = tmp_path / name
    write_audio_only(path, codec, sample_format)
    error = assert_video_error(path, "no video stream")
    assert f"audio:{codec}" in str(error)


def test_audio_with_cover_art_is_a_video_error(tmp_path: Path) -> None:
    path = tmp_path / "song.mp4"
    write_audio_only(path, "aac", "fltp", cover_art=True)
    error = assert_video_error(path, "no video stream")
    assert "video:mjpeg (cover art)" in str(error)


def test_video_stream_without_frames_is_a_video_error(tmp_path: Path) -> None:
    path = tmp_path / "no_frames.avi"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        container.start_encoding()  # header only, no packets
    assert_video_error(path, "has no frames")


def test_webm_cut_inside_its_header_is_a_video_error(tmp_path: Path) -> None:
    data = make_clip(tmp_path, "vp9", ".webm").read_bytes()
    path = tmp_path / "header_only.webm"
    path.write_bytes(data[:200])  # Matroska reports EIO here, not invalid data
    assert_video_error(path, "truncated")
