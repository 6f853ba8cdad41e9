"""Checks that need a CUDA device (marker `gpu`; skipped everywhere else, run by `pytest -m gpu` and first in
benchmarks/gpu_check.sh): every family's tiny checkpoint on the GPU, in float32, decodes greedily
token-identical with every lossless drafter to its own vanilla there."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, random_video

from decoders.engine import run
from decoders.model import load_model
from decoders.proposers.sparrow import SparrowProposer, init_head
from decoders.proposers.std import StDConfig, StDProposer
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession

DEVICE = "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("frames", [(4, 112, 112), (48, 56, 84)], ids=["short", "long"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_lossless_drafter_is_token_identical_on_the_gpu(
    tiny_checkpoints: dict, family: str, frames: tuple[int, int, int]
) -> None:
    lm = load_model(tiny_checkpoints[family], device=DEVICE, dtype=torch.float32)
    assert lm.device.type == DEVICE
    session = VisualSession.create(lm, lm.prepare_video(random_video(*frames, seed=5)))
    prompt = lm.suffix_ids("what moves then leaves ?")
    cfg = DecodeConfig(max_new_tokens=24, ignore_eos=True)
    vanilla = run(session, prompt, cfg).tokens
    std = run(session, prompt, cfg, StDProposer(StDConfig(budget=8, gamma=3)))
    sparrow = run(session, prompt, cfg, SparrowProposer(init_head(lm, seed=1), gamma=3))
    assert std.tokens == vanilla and sparrow.tokens == vanilla
    assert std.stats.num_drafts > 0 and sparrow.stats.num_drafts > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_the_sparrow_chain_is_a_cuda_graph_and_drafts_as_the_eager_chain(
    tiny_checkpoints: dict, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA the head's greedy chain is captured as a graph; its replays draft what the per-step path
    drafts (VIDSPEC_CUDA_GRAPHS=0: accepted counts within rounding), and the answers stay vanilla's."""
    lm = load_model(tiny_checkpoints[family], device=DEVICE, dtype=torch.float32)
    session = VisualSession.create(lm, lm.prepare_video(random_video(48, 56, 84, seed=6)))
    prompt = lm.suffix_ids("what moves then leaves ?")
    cfg = DecodeConfig(max_new_tokens=24, ignore_eos=True)
    vanilla = run(session, prompt, cfg).tokens
    answers, graphs = [], []
    for graphs_on in ("1", "0"):
        monkeypatch.setenv("VIDSPEC_CUDA_GRAPHS", graphs_on)
        head = init_head(lm, seed=2)
        out = run(session, prompt, cfg, SparrowProposer(head, gamma=4, adaptive=False))
        answers.append((out.tokens, out.stats.num_accepted_tokens))
        chain = getattr(head, "_static_chain", None)
        graphs.append(chain is not None and chain.graph is not None)
    assert graphs == [True, False]  # switched off: no chain, the per-step path
    assert answers[0][0] == answers[1][0] == vanilla
    # the same drafts up to rounding (the chain attends over a masked fixed buffer: other GEMM shapes)
    assert abs(answers[0][1] - answers[1][1]) <= max(2, answers[1][1] // 5)
