"""Shared fixtures: tiny random checkpoints of every family, built once per test session and saved in
Hugging Face layout so that they load through `load_model`, the path a real checkpoint takes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava_onevision")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from decoders.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {f: build_tiny_checkpoint(f, root / f, seed=3) for f in FAMILIES}


@pytest.fixture(scope="session")
def tiny_models(tiny_checkpoints: dict[str, Path]) -> dict[str, object]:
    from decoders.model import load_model

    return {f: load_model(p, device="cpu") for f, p in tiny_checkpoints.items()}


def random_video(num_frames: int, height: int, width: int, seed: int = 0, fps: float = 2.0) -> object:
    """A DecodedVideo of random frames (no file): for decoding tests that don't exercise PyAV."""
    from decoders.video import DecodedVideo

    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, size=(num_frames, height, width, 3), dtype=np.uint8)
    return DecodedVideo(
        frames=frames,
        timestamps=np.arange(num_frames) / fps,
        sample_fps=fps,
        source_fps=fps,
        duration_s=num_frames / fps,
        total_frames=num_frames,
    )
