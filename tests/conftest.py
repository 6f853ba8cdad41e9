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
torch.set_num_threads(1)  # tiny models: one thread is as fast and immune to a busy neighbour

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


def _ks_uniform_stat(u: np.ndarray) -> float:
    u = np.sort(u)
    i = np.arange(1, len(u) + 1)
    return float(max(np.max(i / len(u) - u), np.max(u - (i - 1) / len(u))))


def assert_sampling_matches_target(
    session: object, make_proposer: object, question: str, runs: int = 60
) -> None:
    """Every speculatively sampled token, given its prefix, must follow the target's distribution.

    For each sampled token we compute the exact target distribution given the tokens before it (a dense
    forward pass) and its randomised probability integral transform, which is Uniform(0, 1) exactly when
    the sampler is right; a Kolmogorov-Smirnov test checks that at the 0.001 level. The same transform under
    a wrong distribution (uniform over the nucleus) must fail it, so the test has power."""
    import math

    from decoders.engine import run
    from decoders.sampling import DecodeConfig, target_probs

    lm = session.lm
    prompt = lm.suffix_ids(question)
    temperature, top_p = 0.8, 0.95
    rng = np.random.default_rng(0)
    u_right: list[float] = []
    u_wrong: list[float] = []
    for seed in range(runs):
        cfg = DecodeConfig(max_new_tokens=5, temperature=temperature, top_p=top_p, seed=seed, ignore_eos=True)
        res = run(session, prompt, cfg, make_proposer())
        assert res.stats.num_drafts > 0
        with session.prompt(), torch.inference_mode():
            hidden = session.extend(prompt + res.tokens[:-1])
            probs = target_probs(lm.logits(hidden[0, len(prompt) - 1 :]), temperature, top_p)  # [n, V]
        for i, tok in enumerate(res.tokens[1:], start=1):  # token 0 is sampled directly, not speculated
            p = probs[i].double().numpy()
            u_right.append(p[:tok].sum() + rng.uniform() * p[tok])
            wrong = (p > 0).astype(float) / (p > 0).sum()
            u_wrong.append(wrong[:tok].sum() + rng.uniform() * wrong[tok])
    critical = 1.95 / math.sqrt(len(u_right))  # KS critical value at alpha = 0.001
    assert _ks_uniform_stat(np.array(u_right)) < critical
    assert _ks_uniform_stat(np.array(u_wrong)) > critical


# -- the service: one real redis-server and one local Ray for the whole test session -----------------


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> object:
    """A real, private redis-server (infra/redis_server.py) on a free loopback port."""
    from infra.redis_server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    url = server.start()
    yield url
    server.stop()


@pytest.fixture
def redis_db(redis_url: str) -> object:
    """A client on an empty database (each test starts from nothing)."""
    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def ray_session() -> object:
    """One small local Ray for the whole session (starting Ray costs seconds); stopped at the end."""
    import shutil
    import tempfile

    from infra.config import Settings
    from infra.ray_runtime import start_ray

    temp = Path(tempfile.mkdtemp(prefix="vsray", dir="/tmp"))  # Ray's socket paths must stay short
    runtime = start_ray(Settings(ray_num_cpus=2, ray_object_store_bytes=200 * 1024**2), temp_dir=temp)
    yield runtime
    runtime.stop()
    shutil.rmtree(temp, ignore_errors=True)


def make_sessions(tiny_models: dict, lengths: dict, seed: int) -> dict:
    """One VisualSession per (family, length name) on random frames of the given (frames, H, W)."""
    from decoders.session import VisualSession

    return {
        (f, name): VisualSession.create(
            tiny_models[f], tiny_models[f].prepare_video(random_video(*dims, seed=seed))
        )
        for f in FAMILIES
        for name, dims in lengths.items()
    }
