"""The reference model: training reduces the loss, the shipped checkpoint loads and answers, eval runs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from decoders.train import reference as R
from decoders.train import world as W

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "vidspec-reference"

TINY_TRAIN = R.TrainConfig(
    size="test",
    steps=100,
    lr=3e-3,
    warmup_steps=1,
    warm_frames=(4, 8),
    warm_tokens_per_step=256,
    warm_max_videos=2,
    codec_prob=0.0,
)


def test_few_training_steps_reduce_the_loss(tmp_path: Path) -> None:
    trainer = R.Trainer(TINY_TRAIN, tmp_path / "work")
    _, samples = R.make_batch(trainer.lm, trainer.cfg, 0)
    assert samples[0].num_tokens == samples[0].aux.shape[0]
    with torch.no_grad():
        before = float(R.batch_loss(trainer.lm, trainer.aux, samples, trainer.cfg).loss)
    for g in trainer.opt.param_groups:
        g["lr"] = trainer.cfg.lr
    for _ in range(12):
        out = R.batch_loss(trainer.lm, trainer.aux, samples, trainer.cfg)
        trainer.opt.zero_grad()
        out.loss.backward()
        trainer.opt.step()
    with torch.no_grad():
        after = float(R.batch_loss(trainer.lm, trainer.aux, samples, trainer.cfg).loss)
    assert after < 0.8 * before, (before, after)


def test_batches_are_reproducible_and_training_resumes(tmp_path: Path) -> None:
    cfg = replace(TINY_TRAIN, steps=3)
    a = R.Trainer(cfg, tmp_path / "a")
    _, s1 = R.make_batch(a.lm, cfg, 5)
    _, s2 = R.make_batch(a.lm, cfg, 5)
    assert torch.equal(s1[0].pixel_values, s2[0].pixel_values)
    assert [t.answer for t in s1[0].tasks] == [t.answer for t in s2[0].tasks]
    a.train(max_steps=2, log_every=1)
    assert a.state_path.exists()
    b = R.Trainer(cfg, tmp_path / "a")
    b.load()
    assert b.step == 2
    for k, v in a.lm.model.state_dict().items():
        assert torch.equal(v, b.lm.model.state_dict()[k]), k
    b.train(log_every=1)
    assert b.step == 3
    out = R.export_checkpoint(b, tmp_path / "export")
    from decoders.model import load_model

    lm = load_model(out, device="cpu")
    assert lm.num_layers == R.SIZES["test"].layers


def test_aux_labels_follow_the_event_log() -> None:
    world = W.make_world(3, 6.0, 2.0, 112, 112, n_events=1)
    times = np.arange(12) / 2.0
    lab = R.aux_labels(world, times, 112).reshape(6, 4, 4, 3)
    e = world.events[0]
    for g in range(6):
        visible = any(e.visible_at(t) for t in times[2 * g : 2 * g + 2])
        assert bool((lab[g, ..., 0] > 0).any()) == visible
    on = lab[..., 0] > 0
    assert (lab[..., 0][on] == tuple(W.COLOURS).index(e.obj.colour) + 1).all()
    assert (lab[..., 1][on] == W.SHAPES.index(e.obj.shape) + 1).all()


# ------------------------------------------------------------------------------------ shipped model


@pytest.fixture(scope="module")
def shipped() -> object:
    from decoders.model import load_model

    if not (SHIPPED / "config.json").exists():
        pytest.fail(f"the reference checkpoint is not shipped at {SHIPPED}")
    return load_model(SHIPPED, device="cpu")


def test_shipped_checkpoint_layout(shipped: object) -> None:
    cfg = json.loads((SHIPPED / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_vl"
    text = cfg["text_config"]
    assert text["num_hidden_layers"] >= 8
    assert text["num_key_value_heads"] < text["num_attention_heads"]
    assert (SHIPPED / "model.safetensors").stat().st_size <= 30 * 2**20
    for name in (
        "tokenizer.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "generation_config.json",
    ):
        assert (SHIPPED / name).is_file(), name
    assert (SHIPPED / "README.md").is_file()


def test_shipped_checkpoint_answers_a_held_out_question(shipped: object, tmp_path: Path) -> None:
    from decoders.engine import run
    from decoders.sampling import DecodeConfig
    from decoders.session import VisualSession
    from decoders.train.eval import SETTINGS, eval_video
    from decoders.video import read_video

    lm = shipped
    # a held-out world (seed >= EVAL_SEED0, never trained on), through a real mp4 file; a two-word answer
    # (one of 20 colour-shape pairs), so a model that does not read the video fails
    world, path = eval_video(SETTINGS["short"], R.EVAL_SEED0 + 3, tmp_path)
    end = world.on_screen(world.end_time)
    assert len(end) == 1
    sampling = lm.default_sampling(fps=SETTINGS["short"].fps)
    visual = lm.prepare_video(read_video(path, sampling), sampling)
    session = VisualSession.create(lm, visual)
    out = run(session, lm.suffix_ids("what is there at the end ?"), DecodeConfig(max_new_tokens=8))
    assert " ".join(out.text.split()) == end[0].obj.name, out.text


def test_evaluate_runs_on_tiny_videos(shipped: object, tmp_path: Path) -> None:
    from decoders.train.eval import evaluate

    res = evaluate(SHIPPED, lengths=("tiny",), n_videos=2, work_dir=tmp_path, lm=shipped, log=None)
    assert res["method"] == "vanilla"
    r = res["lengths"]["tiny"]
    assert r["n_videos"] == 2
    for key in ("qa", "caption", "chance", "visual_tokens", "frames", "seconds"):
        assert key in r
    assert 0.0 <= r["qa"]["accuracy"] <= 1.0 and r["qa"]["n"] > 0
    assert set(r["caption"]) >= {"precision", "recall", "f1", "exact", "n"}
    for qt, v in r["qa"]["per_qtype"].items():
        assert qt in W.QTYPES
        assert set(v) >= {"accuracy", "n", "chance_uniform", "chance_majority"}
    assert len(res["records"]) == r["qa"]["n"] + 2
    with pytest.raises(ValueError):
        evaluate(SHIPPED, method="std", lengths=("tiny",), work_dir=tmp_path, lm=shipped, log=None)
