"""The reference model: training reduces the loss, the shipped checkpoint loads and answers, eval runs."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from decoders import protocol as P
from decoders.train import card
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


@pytest.mark.parametrize("trace", [False, True], ids=["answers", "traced"])
def test_few_training_steps_reduce_the_loss(tmp_path: Path, trace: bool) -> None:
    trainer = R.Trainer(replace(TINY_TRAIN, qa_trace=trace), tmp_path / "work")
    _, samples = R.make_batch(trainer.lm, trainer.cfg, 0)
    assert samples[0].num_tokens == samples[0].aux.shape[0]
    assert any(t.traced for s in samples for t in s.tasks) == trace
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


def test_count_probe_trains_and_its_labels_follow_the_event_log(tmp_path: Path) -> None:
    world = W.make_world(11, 40.0, 2.0, 112, 112, n_events=4)
    times = np.arange(80) / 2.0
    aux = R.aux_labels(world, times, 112, with_rank=True)
    assert torch.equal(aux[:, :3], R.aux_labels(world, times, 112))
    lab = R.count_labels(world, times, aux[:, 3]).reshape(40, 16, R.COUNT_COMPONENTS)
    assert (lab[..., :-1] == lab[:, :1, :-1]).all()  # counts are per temporal group, ranks per token
    for g in range(40):
        # objects shown on a sampled frame of this group or an earlier one
        shown = [e for e in world.events if any(e.visible_at(t) for t in times[: 2 * g + 2])]
        assert int(lab[g, 0, 0]) == len(shown)
        for c in W.COLOURS:
            i = 1 + tuple(W.COLOURS).index(c)
            assert int(lab[g, 0, i]) == sum(e.obj.colour == c for e in shown)
    assert int(lab[-1, 0, 0]) == len(world.events)
    ranks = aux[:, 3].reshape(40, 16)
    for r, e in enumerate(world.events, start=1):  # a rank marks tokens only while its object is on screen
        groups = {int(g) for g in torch.nonzero(ranks == r)[:, 0]}
        assert groups and all(e.visible_at(times[2 * g]) or e.visible_at(times[2 * g + 1]) for g in groups)

    cfg = replace(TINY_TRAIN, count_weight=1.0, count_layer=1)
    trainer = R.Trainer(cfg, tmp_path / "count")
    assert trainer.aux.count is not None
    _, samples = R.make_batch(trainer.lm, cfg, 0)
    assert samples[0].counts is not None and samples[0].counts.shape == (
        samples[0].num_tokens,
        R.COUNT_COMPONENTS,
    )
    for g in trainer.opt.param_groups:
        g["lr"] = cfg.lr
    first = R.batch_loss(trainer.lm, trainer.aux, samples, cfg).count_loss
    for _ in range(12):
        out = R.batch_loss(trainer.lm, trainer.aux, samples, cfg)
        trainer.opt.zero_grad()
        out.loss.backward()
        trainer.opt.step()
    assert out.count_loss < 0.7 * first, (first, out.count_loss)
    off = R.batch_loss(trainer.lm, trainer.aux, samples, TINY_TRAIN)  # weight 0: no probe, no term
    assert np.isnan(off.count_loss)
    # --export-only rebuilds the trainer from the state's own config (the default one has no probe)
    trainer.train(max_steps=1, log_every=1)
    assert R.main(["--size", "test", "--work-dir", str(tmp_path / "count"), "--out", str(tmp_path / "x"),
                   "--export-only"]) == 0  # fmt: skip
    assert json.loads((tmp_path / "x" / "training_info.json").read_text())["config"]["count_weight"] == 1.0
    assert not (tmp_path / "x" / R.AUX_FILE).exists()


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


def test_a_resumed_run_can_be_replanned_before_its_decay_and_equals_the_run_planned_so(
    tmp_path: Path,
) -> None:
    a = R.Trainer(replace(TINY_TRAIN, steps=8), tmp_path / "a")  # decay from step 6
    a.train(max_steps=2, log_every=1)
    b = R.Trainer(replace(TINY_TRAIN, steps=8), tmp_path / "a")
    b.load()
    b.replan(6)  # decay from step 5: steps 0-1 had the same rate in both plans
    assert b.cfg.steps == 6 and b.replans == [{"step": 2, "from": 8, "to": 6}]
    b.train(max_steps=3, log_every=1)
    c = R.Trainer(replace(TINY_TRAIN, steps=6), tmp_path / "c")  # planned for 6 steps from scratch
    c.prefetch = False  # and without building the next batch in the background: the same batches
    c.train(max_steps=3, log_every=1)
    assert b._next_batch is not None and b._next_batch[0] == 3  # b prefetched step 3's batch
    for k, v in c.lm.model.state_dict().items():
        assert torch.equal(v, b.lm.model.state_dict()[k]), k
    info = json.loads((R.export_checkpoint(b, tmp_path / "export") / "training_info.json").read_text())
    assert info["replans"] == [{"step": 2, "from": 8, "to": 6}] and info["planned_steps"] == 6
    with pytest.raises(ValueError, match="replan"):
        b.replan(3)  # no more steps than taken
    c.cfg = replace(c.cfg, decay_frac=0.9)  # a plan whose decay started at step 0: step 0 was decayed
    with pytest.raises(ValueError, match="decay starts at step 0"):
        c.replan(20)
    with pytest.raises(SystemExit, match="needs --resume"):
        R.main(["--size", "test", "--work-dir", str(tmp_path / "x"), "--replan-steps", "5"])
    # a resumed run must name its saved plan in --steps, unless --replan-steps names the new one
    d = R.Trainer(replace(TINY_TRAIN, steps=12), tmp_path / "a")
    with pytest.raises(ValueError, match=r"other settings.*steps"):
        d.load()
    d.load(ignore=("steps",))
    assert d.cfg.steps == 6 and d.step == 3


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


def test_more_question_sets_add_distinct_questions_whose_answers_follow_the_event_log() -> None:
    world = W.make_world(5, 90.0, 1.0, 112, 112, n_events=8)
    one = R._tasks(world, np.random.default_rng(0), qa_sets=1)
    many = R._tasks(world, np.random.default_rng(0), qa_sets=4)
    qa_one = [t for t in one if t.kind != "caption"]
    qa_many = [t for t in many if t.kind != "caption"]
    # the first set is what qa_sets=1 draws; later sets only add (type, answer, refs) not asked yet
    assert [(t.prompt, t.answer) for t in qa_many[: len(qa_one)]] == [(t.prompt, t.answer) for t in qa_one]
    keys = [(t.kind, t.answer, t.refs) for t in qa_many]
    assert len(keys) == len(set(keys)) > len(qa_one)
    assert sum(t.kind == "caption" for t in many) == 1
    colours = [e.obj.colour for e in world.events]
    shapes = [e.obj.shape for e in world.events]
    for t in qa_many:  # every answer is read off the event log at the objects it names
        if t.kind == "colour_of_shape":
            assert [t.answer] == [colours[i] for i in t.refs]
        elif t.kind == "shape_of_colour":
            assert [t.answer] == [shapes[i] for i in t.refs]
        elif t.kind in ("count", "count_colour", "count_shape"):
            assert t.answer == W.NUMBER_WORDS[len(t.refs)]


# ------------------------------------------------------------------------------------ shipped model


@pytest.fixture(scope="module")
def shipped() -> object:
    from decoders.model import load_model

    if not (SHIPPED / "config.json").exists():
        pytest.fail(f"the reference checkpoint is not shipped at {SHIPPED}")
    return load_model(SHIPPED, device="cpu")


def test_continuation_from_an_export_counts_its_minutes_and_can_train_vision_only(tmp_path: Path) -> None:
    base = R.Trainer(replace(TINY_TRAIN, steps=1), tmp_path / "base")
    base.train(log_every=1)
    base.elapsed_s = 600.0  # pretend the parent took 10 minutes
    parent = R.export_checkpoint(base, tmp_path / "parent", use_ema=False)
    cfg = replace(TINY_TRAIN, steps=2, init_from=str(parent), vision_only_steps=1, aux_term_weights=(1, 3, 1))
    t = R.Trainer(cfg, tmp_path / "child")
    assert t.elapsed_s == pytest.approx(600.0, abs=6.0)  # the export rounds to 0.1 min
    start = {k: v.clone() for k, v in t.lm.model.state_dict().items()}
    for k, v in base.lm.model.state_dict().items():
        assert torch.equal(v, start[k]), k  # the parent's weights, not a fresh init
    t.train(log_every=1, max_steps=1)  # the vision-only step
    after = t.lm.model.state_dict()
    changed = {k for k in start if not torch.equal(start[k], after[k])}
    assert changed and all(k.startswith("model.visual.") for k in changed), sorted(changed)[:5]
    t.train(log_every=1)  # a joint step: the language model moves too
    assert any(
        k.startswith("model.language_model.") and not torch.equal(start[k], v)
        for k, v in t.lm.model.state_dict().items()
    )
    info = json.loads((R.export_checkpoint(t, tmp_path / "child-export") / "training_info.json").read_text())
    assert info["continued_from"]["train_minutes"] == pytest.approx(10.0)
    assert info["train_minutes"] >= 10.0
    with pytest.raises(FileNotFoundError):
        R.Trainer(replace(cfg, init_from=str(tmp_path / "nowhere")), tmp_path / "bad")


def test_a_continuation_exports_a_blend_with_the_export_it_started_from(tmp_path: Path) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    base = R.Trainer(replace(TINY_TRAIN, steps=1), tmp_path / "base")
    base.train(log_every=1)
    parent = R.export_checkpoint(base, tmp_path / "parent", use_ema=False)
    t = R.Trainer(replace(TINY_TRAIN, steps=2, init_from=str(parent)), tmp_path / "child")
    t.train(log_every=1)

    def weights(d: Path) -> dict[str, torch.Tensor]:
        return Qwen2VLForConditionalGeneration.from_pretrained(d).state_dict()

    own = weights(R.export_checkpoint(t, tmp_path / "own", use_ema=False))
    mid = R.export_checkpoint(t, tmp_path / "mid", use_ema=False, blend=0.25)
    p, m = weights(parent), weights(mid)
    moved = [k for k in own if not torch.equal(own[k], p[k])]
    assert moved  # the child trained away from its parent
    for k in own:
        torch.testing.assert_close(m[k], 0.75 * p[k] + 0.25 * own[k])
    info = json.loads((mid / "training_info.json").read_text())
    assert info["blend"] == {"alpha": 0.25, "parent": str(parent)}
    assert (
        info["train_minutes"]
        == json.loads((tmp_path / "own" / "training_info.json").read_text())["train_minutes"]
    )
    with pytest.raises(ValueError, match="alpha"):
        R.export_checkpoint(t, tmp_path / "bad", blend=1.5)
    # a parent export overwritten since the run started is refused
    R.export_checkpoint(t, parent, use_ema=False)
    with pytest.raises(ValueError, match="not the export this run started from"):
        R.export_checkpoint(t, tmp_path / "bad", blend=0.5)
    with pytest.raises(ValueError, match="--init-from"):
        R.export_checkpoint(base, tmp_path / "bad", blend=0.5)


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
    from decoders.protocol import after_list, ask_object_list, trained_with_turns
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
    question = "what is there at the end ?"
    if trained_with_turns(SHIPPED):  # asked as the model was trained: after its own object list
        question = after_list(ask_object_list(lm, session), question)
    out = run(session, lm.suffix_ids(question), DecodeConfig(max_new_tokens=8))
    assert W.final_answer(out.text) == end[0].obj.name, out.text


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
    rows = [x for x in res["records"] if x["qtype"] != "caption"]
    traced = [x for x in rows if x["qtype"] in W.TRACED_QTYPES]
    assert all(x["trace_right"] is None for x in rows if x not in traced)
    t = r["qa"]["traced"]
    assert t["n"] == len(traced) and t["with_trace"] == sum(x["trace_right"] is not None for x in traced)
    assert t["trace_right"] == sum(x["trace_right"] is True for x in traced)
    assert t["answer_right_after_right_trace"] == sum(x["correct"] for x in traced if x["trace_right"])
    with pytest.raises(ValueError):
        evaluate(SHIPPED, method="std", lengths=("tiny",), work_dir=tmp_path, lm=shipped, log=None)
    from decoders.protocol import trained_with_turns

    # asked as the shipped model was trained: directly, or after its own object list
    assert res["qa_protocol"] == ("after_list" if trained_with_turns(SHIPPED) else "direct")


def test_pooled_blocks_of_held_out_videos_score_as_one_invocation_over_them_all(
    shipped: object, tmp_path: Path
) -> None:
    from decoders.train.eval import evaluate, pool_results

    def ev(seed0: int, n: int) -> dict:
        return evaluate(
            SHIPPED, lengths=("tiny",), n_videos=n, seed0=seed0, work_dir=tmp_path, lm=shipped, log=None
        )

    s0 = R.EVAL_SEED0 + 7000
    whole, a, b = ev(s0, 3), ev(s0, 1), ev(s0 + 1, 2)  # a and b ask about whole's three videos
    pooled = pool_results([a, b])
    got, want = pooled["lengths"]["tiny"], whole["lengths"]["tiny"]
    for key in ("n_videos", "qa", "chance", "caption", "fps"):
        assert got[key] == want[key], key
    for key in ("visual_tokens", "frames"):
        assert {k: pytest.approx(v) for k, v in got[key].items()} == want[key], key
    assert pooled["blocks"] == [
        {"seed0": s0, "n_videos": {"tiny": 1}},
        {"seed0": s0 + 1, "n_videos": {"tiny": 2}},
    ]
    assert len(pooled["records"]) == len(whole["records"]) and "seed0 " in pooled["note"]
    with pytest.raises(ValueError, match="more than one"):
        pool_results([whole, b])  # the same videos twice
    with pytest.raises(ValueError, match="no records"):
        pool_results([a, {k: v for k, v in b.items() if k != "records"}])
    with pytest.raises(ValueError, match="methods or protocols"):
        pool_results([a, dict(b, method="std")])
    # another path is pooled only when its weights are the same bytes
    twin, other = tmp_path / "twin", tmp_path / "other"
    for d, data in ((twin, (SHIPPED / "model.safetensors").read_bytes()), (other, b"not these weights")):
        d.mkdir()
        (d / "model.safetensors").write_bytes(data)
    assert pool_results([a, dict(b, model=str(twin))])["models"] == sorted([str(SHIPPED), str(twin)])
    with pytest.raises(ValueError, match="different models"):
        pool_results([a, dict(b, model=str(other))])
    # the card shows the pooled figures under the block's own, with an interval
    from decoders.train.card import _wilson, render_card

    card = render_card(SHIPPED, a, None, pooled=pooled)
    assert "Every block of held-out videos measured, pooled" not in render_card(SHIPPED, a, None)
    section = card.split("Every block of held-out videos measured, pooled")[1]
    assert f"`--seed0 {s0}` tiny 1; `--seed0 {s0 + 1}` tiny 2" in section
    n = got["qa"]["n"]
    k = round(got["qa"]["accuracy"] * n)
    assert f"- tiny: QA {k} of {n} right" in section and "95% interval" in section
    assert _wilson(50, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)


def test_two_turn_eval_asks_each_question_after_the_models_own_list(
    shipped: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from decoders.protocol import after_list, trained_with_turns
    from decoders.train.eval import evaluate

    assert not trained_with_turns(tmp_path)
    res = evaluate(
        SHIPPED, lengths=("tiny",), n_videos=1, work_dir=tmp_path, lm=shipped, log=None, qa_turns=True
    )
    assert res["qa_protocol"] == "after_list"
    rows = [x for x in res["records"] if x["qtype"] != "caption"]
    assert rows and len({x["object_list"] for x in rows}) == 1  # one list per video, asked once
    assert all(isinstance(x["list_right"], bool) for x in rows)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "training_info.json").write_text(json.dumps({"config": {"qa_turns": True}}))
    assert trained_with_turns(tmp_path / "m")
    from decoders.protocol import captions_after_list

    assert not captions_after_list(tmp_path / "m") and not captions_after_list(tmp_path)
    info = {"config": {"qa_turns": True, "caption_turns": 0.5}}
    (tmp_path / "m" / "training_info.json").write_text(json.dumps(info))
    assert captions_after_list(tmp_path / "m")
    asked: list[str] = []
    plain_suffix = shipped.suffix_ids

    def spy(text: str) -> list[int]:
        asked.append(text)
        return plain_suffix(text)

    monkeypatch.setattr(shipped, "suffix_ids", spy)
    both = evaluate(
        SHIPPED, lengths=("tiny",), n_videos=1, work_dir=tmp_path, lm=shipped, log=None, caption_turns=True
    )
    assert both["caption_protocol"] == "after_list"
    assert res["caption_protocol"] == ("after_list" if captions_after_list(SHIPPED) else "direct")
    cap = next(x for x in both["records"] if x["qtype"] == "caption")
    assert after_list(cap["object_list"], "describe the video .") in asked  # the caption, after the list


def test_a_schedule_continues_through_an_export(tmp_path: Path) -> None:
    cfg = replace(TINY_TRAIN, steps=6, warmup_steps=1, ema_decay=0.5)
    a = R.Trainer(cfg, tmp_path / "a")
    a.train(log_every=1, max_steps=3)  # past the warm-up: the EMA differs from the raw weights
    a.elapsed_s = 120.0
    assert any(
        not torch.equal(v, a.lm.model.state_dict()[k]) for k, v in a.ema.items() if v.is_floating_point()
    )
    wip = R.export_checkpoint(a, tmp_path / "wip", with_aux=True)
    assert (wip / R.AUX_FILE).is_file()
    b = R.Trainer(replace(cfg, init_from=str(wip), continue_schedule=True), tmp_path / "b")
    assert b.step == 3 and b.restart_step == 3
    assert b.elapsed_s == pytest.approx(120.0)
    for k, v in a.ema.items():
        assert torch.equal(v, b.lm.model.state_dict()[k]), k  # resumes from the exported EMA weights
    for k, v in a.aux.state_dict().items():
        assert torch.equal(v, b.aux.state_dict()[k]), k  # and the exported aux head
    b.train(log_every=1, max_steps=4)
    c = R.Trainer(replace(cfg, init_from=str(wip), continue_schedule=True), tmp_path / "b", resuming=True)
    c.load()  # the restart bookkeeping survives save/load
    assert (c.step, c.restart_step, c.restarts) == (4, 3, b.restarts)
    c.train(log_every=1)
    assert c.step == 6
    info = json.loads((R.export_checkpoint(c, tmp_path / "done") / "training_info.json").read_text())
    assert info["steps"] == 6 and info["restarts"] == [{"step": 3, "train_minutes": 2.0}]
    assert "continued_from" not in info  # one schedule, not a second stage
    assert not (tmp_path / "done" / R.AUX_FILE).exists()
    with pytest.raises(ValueError, match="config differs"):
        R.Trainer(replace(cfg, lr=1e-4, init_from=str(wip), continue_schedule=True), tmp_path / "d")
    with pytest.raises(ValueError, match="other settings"):
        R.Trainer(replace(cfg, lr=1e-4), tmp_path / "b").load()  # --resume with other flags


def test_fresh_adam_moments_are_re_warmed() -> None:
    cfg = replace(TINY_TRAIN, steps=100, warmup_steps=4, vision_only_steps=10)
    t = R.Trainer.__new__(R.Trainer)  # lr_now reads only cfg and restart_step
    t.cfg, t.restart_step = cfg, None
    assert t.lr_now(9) == R.lr_at(cfg, 9)  # vision-only phase: the plain schedule
    assert t.lr_now(10) == pytest.approx(R.lr_at(cfg, 10) / 4)  # the language model joins
    assert t.lr_now(13) == R.lr_at(cfg, 13)
    t.restart_step = 50
    assert t.lr_now(50) == pytest.approx(R.lr_at(cfg, 50) / 4)
    assert t.lr_now(49) == R.lr_at(cfg, 49)


def test_model_card_describes_both_stages_of_a_continued_model(tmp_path: Path) -> None:
    from decoders.train.card import render_card

    for name in ("config.json", "preprocessor_config.json"):
        (tmp_path / name).write_text((SHIPPED / name).read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1024)
    parent = json.loads((SHIPPED / "training_info.json").read_text())
    # a parent without the later runs' options (the shipped model may use any of them)
    parent = {k: v for k, v in parent.items() if k not in ("continued_from", "replans")}
    parent["config"] = dict(parent["config"], count_weight=0.0, attn_weight=0.0, attn_count_target="objects")
    cfg = dict(
        parent["config"],
        init_from="x",
        vision_only_steps=2500,
        aux_term_weights=[1, 3, 1],
        warm_steps=0,
        count_weight=0.0,
    )
    info = dict(
        parent, steps=3400, planned_steps=3400, train_minutes=parent["train_minutes"] + 40.0, config=cfg
    )
    info["continued_from"] = parent
    (tmp_path / "training_info.json").write_text(json.dumps(info))
    card = render_card(tmp_path, None, None, draft="head section")
    assert "## Draft head (`sparrow/`)\n\nhead section" in card and "Count probe" not in card
    assert "Stage 1 (from scratch)" in card and f"**{parent['steps']} steps**" in card
    assert "--vision-only-steps 2500" in card and "40.0 minutes" in card
    stage1 = next(line for line in card.splitlines() if "Stage 1 (from scratch)" in line)
    command = stage1.split("`")[1]  # the from-scratch command: the parent's steps, no --init-from
    assert f"--steps {parent['config']['steps']} " in command + " " and "--init-from" not in command
    assert "--init-from <stage-1 export>" in card and "--aux-term-weights 1,3,1" in card
    info.pop("continued_from")
    info["restarts"] = [{"step": 3000, "train_minutes": 100.0}]
    info["config"] = dict(cfg, count_weight=0.5, count_layer=6)
    (tmp_path / "training_info.json").write_text(json.dumps(info))
    card = render_card(tmp_path, None, None)
    assert "Count probe (weight 0.5)" in card and "after decoder layer 6" in card and "Draft head" not in card
    assert "Stage 2" not in card and "step 3000 (100.0 min)" in card and "Attention supervision" not in card
    info["config"] = dict(info["config"], attn_weight=0.5, attn_layers=[2, 4], attn_head=1)
    (tmp_path / "training_info.json").write_text(json.dumps(info))
    card = render_card(tmp_path, None, None)
    assert "Attention supervision (weight 0.5)" in card and "layers 2,4, query head 1" in card
    assert "--attn-weight 0.5 --attn-layers 2,4 --attn-head 1" in card  # the command shows the flags
    assert "caption sentences about event i" in card  # the default rule, "events"
    info["config"] = dict(info["config"], caption_attn="none")
    (tmp_path / "training_info.json").write_text(json.dumps(info))
    card = render_card(tmp_path, None, None)
    assert "caption tokens had no attention targets" in card and "--caption-attn none" in card
    info["config"] = dict(info["config"], caption_attn="events")
    assert "--attn-count-target" not in card and "last temporal group" not in card  # the default: v4's
    info["config"] = dict(info["config"], attn_count_target="end")
    (tmp_path / "training_info.json").write_text(json.dumps(info))
    card = render_card(tmp_path, None, None)
    assert "--attn-head 1 --attn-count-target end" in card and "last temporal group" in card
    assert "replanned" not in card and "blend" not in card
    (tmp_path / "training_info.json").write_text(
        json.dumps(dict(info, continued_from=parent, blend={"alpha": 0.7}))
    )
    card = render_card(tmp_path, None, None)
    assert "0.3 x the stage-1 export" in card and "0.7 x its own final weights" in card
    assert "--blend-with-parent 0.7" in card
    (tmp_path / "training_info.json").write_text(json.dumps(info))
    info["replans"] = [{"step": 1800, "from": 6300, "to": 4400}]
    (tmp_path / "training_info.json").write_text(json.dumps(info))
    card = render_card(tmp_path, None, None)
    assert "planned for 6300 steps until step 1800, then replanned to 4400" in card
    info["config"] = dict(info["config"], qa_trace=False, qa_sets=1)
    (tmp_path / "training_info.json").write_text(json.dumps(info))
    card = render_card(tmp_path, None, None)
    assert "Traced answers" not in card and "--qa-trace" not in card and "times per video" not in card
    info["config"] = dict(
        info["config"], qa_trace=True, qa_trace_style="scan", attn_traced_answer=False, qa_sets=4
    )
    (tmp_path / "training_info.json").write_text(json.dumps(info))
    card = render_card(tmp_path, None, None)
    assert "--qa-sets 4" in card and "drawn 4 times per video" in card
    assert "--qa-trace scan --no-attn-traced-answer" in card and "(`--qa-trace scan`)" in card
    assert "`world.scan_list`" in card and "the answer after the list is not supervised" in card
    info["config"] = dict(info["config"], qa_trace_style="cued")
    (tmp_path / "training_info.json").write_text(json.dumps(info))
    card = render_card(tmp_path, None, None)
    assert "--qa-trace cued" in card and "`world.cued_scan`" in card


def _load_benchmark(name: str) -> object:
    """``benchmarks/<name>.py`` as a module (its sibling scripts importable while it loads)."""
    import importlib.util
    import sys

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(root))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", root / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(root))
    return mod


def test_the_vision_probe_reads_the_lm_states_at_the_visual_positions(tmp_path: Path) -> None:
    probe = _load_benchmark("vision_probe")
    lm = R.Trainer(TINY_TRAIN, tmp_path / "w").lm
    s = R.make_sample(lm, np.random.default_rng(5), 8, 2.0, TINY_TRAIN.frame_side, codec=False)
    with torch.no_grad():
        states = probe.lm_visual_states(lm, s, [0, lm.num_layers])
        merger = probe.visual_tokens(lm, s)
    assert states[0].shape == merger.shape == (s.num_tokens, lm.hidden_size)
    assert torch.allclose(states[0], merger, atol=1e-5)  # layer 0: the merger output the LM receives
    assert not torch.allclose(states[lm.num_layers], merger, atol=1e-2)


def test_the_direction_readout_scores_each_visible_listed_object(tmp_path: Path) -> None:
    mod = _load_benchmark("direction_readout")
    lm = R.Trainer(TINY_TRAIN, tmp_path / "w").lm
    s = R.make_sample(lm, np.random.default_rng(5), 8, 2.0, TINY_TRAIN.frame_side, codec=False)
    ids = [lm.encode_text(d)[0] for d in W.DIRECTIONS]
    with torch.no_grad():
        rows = mod.readout_rows(lm, s, ids)
    visible = [i for i in range(len(s.world.events)) if bool((s.ranks == i + 1).any())]
    assert len(rows) == len(visible) > 0
    for r, i in zip(rows, visible, strict=True):
        assert r["label"] == W.DIRECTIONS.index(s.world.events[i].direction)
        assert r["position"].shape == r["oracle"].shape == (lm.num_layers + 1, lm.hidden_size)
        assert r["attention"].shape == (lm.num_layers, lm.text_model.config.num_attention_heads)
        assert float(r["attention"].min()) >= 0 and float(r["attention"].max()) <= 1 + 1e-5
        w_o = lm.text_model.layers[0].self_attn.o_proj.weight[:, : r["head0_out"].shape[-1]]
        assert torch.allclose(r["head0_written"][0], r["head0_out"][0] @ w_o.T, atol=1e-5)


def test_question_types_can_be_weighted_up(tmp_path: Path) -> None:
    assert R.parse_type_weights("direction=3, first=2") == (("direction", 3.0), ("first", 2.0))
    with pytest.raises(ValueError, match="TYPE=WEIGHT"):
        R.parse_type_weights("sideways=2")
    trainer = R.Trainer(TINY_TRAIN, tmp_path / "w")
    _, samples = R.make_batch(trainer.lm, TINY_TRAIN, 0)
    kinds = {t.kind for s in samples for t in s.tasks if t.kind != "caption"}
    boosted = replace(TINY_TRAIN, qa_type_weights=tuple((k, 1e-6) for k in kinds))
    with torch.no_grad():
        base = R.batch_loss(trainer.lm, None, samples, TINY_TRAIN)
        low = R.batch_loss(trainer.lm, None, samples, boosted)
    # QA answers weighted (almost) to zero: the loss is the captions' alone; the per-part losses are unweighted
    assert abs(float(low.loss) - low.caption_loss) < 1e-3 and abs(float(base.loss) - low.caption_loss) > 1e-3
    assert low.qa_loss == pytest.approx(base.qa_loss)
    # and the weights travel with the saved config
    trainer.cfg = replace(trainer.cfg, qa_type_weights=(("direction", 3.0),))
    trainer.save()
    assert R._config_of(torch.load(trainer.state_path, weights_only=False)).qa_type_weights == (
        ("direction", 3.0),
    )


def _caption_ids(text: str) -> list[int]:
    """Any ids for a caption's words, one per word as the word-level tokenizer gives; "." is 0."""
    return [0 if w == "." else hash(w) % 1000 + 1 for w in text.split()]


def test_attention_targets_follow_the_caption_sentences_and_the_question_refs() -> None:
    world = W.make_world(5, 30.0, 2.0, 112, 112, n_events=3)
    sample = R.Sample(torch.zeros(1), (1, 1, 1), 0, torch.zeros(0, 3), [], world)
    end = tuple(i for i, e in enumerate(world.events) if e.visible_at(world.end_time))
    motion_sentences = 0
    for seed in range(12):  # wordings with and without motion sentences of their own (". it moves up")
        text = W.caption(world, np.random.default_rng(seed))
        words = text.split()
        task = R.Task("caption the video .", text, "caption")
        targets = dict(R.attention_targets(sample, task, _caption_ids(text), 0))
        event, first = -1, True  # the event of the sentence being read; at a sentence's first word
        for k, w in enumerate(words):
            if first and w == "it" and words[k + 1] in ("moves", "goes", "slides"):
                motion_sentences += 1  # a motion sentence: still the same event
            elif first and any(c in W.COLOURS for c in words[k : words.index(".", k)]):
                event += 1
            elif first:
                event = len(world.events)  # the closing sentence
            first = w == "."
            if event < len(world.events):
                assert targets[k] == (event,), (text, k)
                if w in W.COLOURS:  # the colour named in an event's sentence is that event's
                    assert world.events[event].obj.colour == w
            else:  # the closing sentence is about what is on screen at the end
                assert targets.get(k) == (end or None)
    assert motion_sentences > 0
    qa = next(q for q in W.questions(world, np.random.default_rng(0)) if q.qtype == "first")
    assert R.attention_targets(sample, R.Task(qa.question, qa.answer, qa.qtype, qa.refs), [7, 8], 0) == [
        (0, (0,))
    ]
    assert R.attention_targets(sample, R.Task("q", "zero", "count_colour", ()), [9], 0) == []
    # with the "end" count target every count, zero included, reads the last temporal group
    for qtype, refs in (("count_colour", ()), ("count", (0, 1, 2)), ("count_shape", (1,))):
        task = R.Task("q", "one", qtype, refs)
        assert R.attention_targets(sample, task, [9], 0, "end") == [(0, R.LAST_GROUP)]
        assert R.attention_targets(sample, task, [9], 0) == ([(0, refs)] if refs else [])
    assert R.attention_targets(sample, R.Task(qa.question, qa.answer, qa.qtype, qa.refs), [7], 0, "end") == [
        (0, (0,))
    ]  # other questions keep their refs
    with pytest.raises(ValueError, match="count_target"):
        R.attention_targets(sample, R.Task("q", "one", "count", (0,)), [9], 0, "last")


def test_caption_sentences_map_to_their_events_and_the_old_period_rule_is_kept_for_old_runs() -> None:
    text = "a red cross enters . it moves up . then we see a blue square . it slides left . it stays until the end ."
    assert W.caption_sentence_events(text) == [0, 0, 1, 1, None]
    assert W.caption_sentence_events("then nothing else happens .") == [None]
    world = W.make_world(2, 30.0, 2.0, 112, 112, n_events=2)  # the square stays to the end
    sample = R.Sample(torch.zeros(1), (1, 1, 1), 0, torch.zeros(0, 3), [], world)
    task = R.Task("caption the video .", text, "caption")
    ids = _caption_ids(text)
    end = tuple(i for i, e in enumerate(world.events) if e.visible_at(world.end_time))
    assert end  # the closing sentence has targets
    # "a red cross enters ." and "it moves up ." on the cross; the square's two sentences on it; then the end
    got = R.attention_targets(sample, task, ids, 0)
    assert got == list(enumerate([(0,)] * 9 + [(1,)] * 11 + [end] * 6))
    # the rule before session 47: sentence i on event i, so "it moves up ." went to the square, the square's
    # sentence to what is on screen at the end, and the rest nowhere
    periods = R.attention_targets(sample, task, ids, 0, caption_attn="periods")
    assert periods == list(enumerate([(0,)] * 5 + [(1,)] * 4 + [end] * 7))
    # a caption naming fewer objects than the world has no targets (they would not line up)
    assert (
        R.attention_targets(sample, R.Task("c", "a red cross enters .", "caption"), [1, 2, 3, 4, 0], 0) == []
    )
    # "none": captions are not supervised, QA still is
    assert R.attention_targets(sample, task, ids, 0, caption_attn="none") == []
    qa = R.Task("what colour is the cross ?", "red", "colour_of_shape", (0,))
    assert R.attention_targets(sample, qa, [9], 0, caption_attn="none") == [(0, (0,))]
    with pytest.raises(ValueError, match="caption_attn"):
        R.attention_targets(sample, task, ids, 0, caption_attn="sentences")
    # a config saved before the field was trained with the period rule; new runs read the events
    saved = {k: v for k, v in asdict(R.TrainConfig()).items() if k != "caption_attn"}
    assert R._config_of({"config": saved}).caption_attn == "periods"
    assert R.TrainConfig().caption_attn == "events"
    assert R.config_diff(saved, asdict(R.TrainConfig())) == {"caption_attn": ("periods", "events")}
    from decoders.train.card import _command

    assert "--caption-attn periods" in _command(saved) and "--caption-attn" not in _command(
        asdict(R.TrainConfig())
    )


@pytest.mark.parametrize("style", W.TRACE_STYLES)
def test_traced_questions_list_the_objects_and_supervise_each_item_and_the_answer(style: str) -> None:
    world = W.make_world(5, 60.0, 2.0, 112, 112, n_events=4)
    plain = R._tasks(world, np.random.default_rng(2), qa_sets=2)
    traced = R._tasks(world, np.random.default_rng(2), qa_sets=2, trace=True, trace_style=style)
    assert [(t.prompt, t.kind, t.refs) for t in plain] == [(t.prompt, t.kind, t.refs) for t in traced]
    for p, t in zip(plain, traced, strict=True):
        assert t.traced == (t.kind in W.TRACED_QTYPES)
        assert t.cue == p.cue and p.item_skip == 0
        assert t.item_skip == (len(t.cue.split()) if t.traced and style == "cued" else 0)
        qa = W.QA(p.prompt, p.answer, p.kind, p.refs, p.cue)
        assert t.answer == (W.answer_text(world, qa, style) if t.traced else p.answer)
        if t.traced and style == "list":
            assert t.answer == f"{W.object_list(world)} . {p.answer}"
    sample = R.Sample(torch.zeros(1), (1, 1, 1), 0, torch.zeros(0, 3), [], world)
    vocab = {",": 1, ".": 0}
    for task in (t for t in traced if t.traced):
        words = task.answer.split()
        ids = [vocab.get(w, 2 + len(w)) for w in words]
        k0 = words.index(".") + 1
        got = dict(R.attention_targets(sample, task, ids, 0, "end", comma_id=1))
        item = j = 0
        for k, w in enumerate(words[: k0 - 1]):  # item i's words (and its comma) read event i
            if j < task.item_skip:  # but a cued item's cue
                assert k not in got and w in task.cue.split()
            else:
                assert got[k] == (item,)
                if j == task.item_skip:
                    assert world.events[item].obj.colour == w
            j += 1
            if w == ",":
                item += 1
                j = 0
        assert k0 - 1 not in got  # the period closing the list
        # the answer's first token as the untraced question's first token
        untraced = R.attention_targets(sample, replace(task, traced=False), ids[k0:], 0, "end")
        assert [(k - k0, r) for k, r in got.items() if k >= k0] == untraced
        only_list = dict(R.attention_targets(sample, task, ids, 0, "end", comma_id=1, traced_answer=False))
        assert only_list == {k: r for k, r in got.items() if k < k0}
    with pytest.raises(ValueError, match="comma_id"):
        R.attention_targets(sample, next(t for t in traced if t.traced), [0, 5], 0)


def test_qa_trace_flag_takes_an_optional_style() -> None:
    parser = R.build_parser()
    assert parser.parse_args([]).qa_trace is None
    assert parser.parse_args(["--qa-trace"]).qa_trace == "list"
    assert parser.parse_args(["--qa-trace", "scan"]).qa_trace == "scan"
    assert parser.parse_args(["--qa-trace", "cued"]).qa_trace == "cued"
    with pytest.raises(SystemExit):
        parser.parse_args(["--qa-trace", "tree"])


def test_attention_supervision_reads_the_models_own_attention_and_trains(tmp_path: Path) -> None:
    cfg = replace(TINY_TRAIN, attn_weight=1.0, attn_layers=(0, 1), attn_head=1)
    trainer = R.Trainer(cfg, tmp_path / "attn")
    lm = trainer.lm
    _, samples = R.make_batch(lm, cfg, 0)
    assert samples[0].ranks is not None and samples[0].ranks.shape == (samples[0].num_tokens,)
    # the recomputed head projections are the attention's own: keys rebuilt from the captured inputs equal
    # the keys the layer wrote to the cache
    s = samples[0]
    from decoders.model import VisualInputs

    with torch.no_grad():
        vis = lm.model.model.get_video_features(s.pixel_values, torch.tensor([s.grid_thw])).pooler_output[0]
        layout = lm.prefix_ids(s.num_tokens)
        emb = torch.cat([lm.embed(torch.tensor([layout.ids[: layout.visual_start]])), vis[None]], dim=1)
        pos, _ = lm.prefix_positions(layout, VisualInputs(s.pixel_values[:0], s.num_tokens, s.grid_thw))
        from transformers import DynamicCache

        cache = DynamicCache(config=lm.model.config.text_config)
        with R.captured_attention_inputs(lm.text_model, (1,)) as cap:
            lm.text_model(inputs_embeds=emb, position_ids=pos, cache=cache, use_cache=True)
        attn = lm.text_model.layers[1].self_attn
        hs, (cos, sin) = cap[1]
        for kv in range(attn.config.num_key_value_heads):
            k = R.head_projection(attn.k_proj, hs[0], cos[0], sin[0], kv, attn.head_dim)
            torch.testing.assert_close(k, cache.layers[1].keys[0, kv], rtol=1e-5, atol=1e-5)
    assert not attn._forward_pre_hooks  # the hooks go with the block
    for g in trainer.opt.param_groups:
        g["lr"] = cfg.lr
    first = R.batch_loss(lm, trainer.aux, samples, cfg).attn_loss
    for _ in range(10):
        out = R.batch_loss(lm, trainer.aux, samples, cfg)
        trainer.opt.zero_grad()
        out.loss.backward()
        trainer.opt.step()
    assert out.attn_loss < 0.5 * first, (first, out.attn_loss)
    # the "end" count target: count questions now read the last temporal group, a different loss
    end_cfg = replace(cfg, attn_count_target="end")
    assert any(t.kind in R.COUNT_QTYPES for t in samples[0].tasks)
    with torch.no_grad():
        assert (
            R.batch_loss(lm, trainer.aux, samples, end_cfg).attn_loss
            != R.batch_loss(lm, trainer.aux, samples, cfg).attn_loss
        )
    assert np.isnan(R.batch_loss(lm, trainer.aux, samples, TINY_TRAIN).attn_loss)  # weight 0: off
    with pytest.raises(SystemExit, match="attn-layers"):
        R.main(
            ["--size", "test", "--work-dir", str(tmp_path / "x"), "--attn-weight", "1", "--attn-layers", "5"]
        )


def test_eval_results_of_split_invocations_merge_into_one(tmp_path: Path) -> None:
    from decoders.train.eval import main as eval_main
    from decoders.train.eval import merge_results

    def part(length: str, acc: float, model: str = "m") -> dict:
        rec = {"length": length, "seed": 1, "qtype": "count", "answer": "one", "prediction": "one"}
        return {
            "model": model,
            "method": "vanilla",
            "seed0": 5,
            "lengths": {length: {"qa": {"accuracy": acc}}},
            "records": [rec],
        }

    merged = merge_results([part("short", 0.75), part("long", 0.5)])
    assert merged["lengths"] == {"short": {"qa": {"accuracy": 0.75}}, "long": {"qa": {"accuracy": 0.5}}}
    assert [r["length"] for r in merged["records"]] == ["short", "long"]
    assert "short + long" in merged["note"] and merged["model"] == "m" and merged["seed0"] == 5
    with pytest.raises(ValueError, match="more than one"):
        merge_results([part("short", 0.75), part("short", 0.5)])
    with pytest.raises(ValueError, match="different runs"):
        merge_results([part("short", 0.75), part("long", 0.5, model="other")])
    no_records = {k: v for k, v in part("long", 0.5).items() if k != "records"}
    assert "records" not in merge_results([part("short", 0.75), no_records])
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    a.write_text(json.dumps(part("short", 0.75)))
    b.write_text(json.dumps(part("long", 0.5)))
    assert eval_main(["--merge", str(a), str(b), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["lengths"]["long"]["qa"]["accuracy"] == 0.5
    with pytest.raises(SystemExit, match="--merge"):
        eval_main(["--merge", str(a), str(a)])


def test_batched_vision_attention_equals_the_stock_per_group_loop(tmp_path: Path) -> None:
    lm = R.build_lm(tmp_path / "tok", R.SIZES["test"], seed=0, side=56)
    model = lm.model
    torch.manual_seed(0)
    with torch.no_grad():  # weights of unit scale, so that the attention shapes the output (init is 0.02)
        for prm in model.model.visual.parameters():
            prm.normal_(0.0, 0.5)
    # three temporal groups of a 56 px video (16 patches each); a second grid of another size
    grids = {"equal": torch.tensor([[3, 4, 4]]), "mixed": torch.tensor([[2, 4, 4], [1, 2, 2]])}
    dim = model.config.vision_config.in_channels * 2 * 14 * 14

    def run(grid: torch.Tensor, batched: bool) -> tuple[torch.Tensor, torch.Tensor]:
        for block in model.model.visual.blocks:
            block.attn.__dict__.pop("forward", None)
        if batched:
            R.use_batched_vision_attention(model)
        gen = torch.Generator().manual_seed(1)
        px = torch.randn(int(grid.prod(-1).sum()), dim, generator=gen, requires_grad=True)
        out = torch.cat(list(model.model.get_video_features(px, grid).pooler_output))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        assert px.grad is not None
        return out.detach(), px.grad

    for name, grid in grids.items():
        out_s, grad_s = run(grid, batched=False)
        out_b, grad_b = run(grid, batched=True)
        assert out_s.abs().max() > 1.0, name  # the comparison below is not swamped by its tolerance
        assert torch.allclose(out_s, out_b, atol=1e-4, rtol=1e-4), name
        assert torch.allclose(grad_s, grad_b, atol=1e-4, rtol=1e-4), name
    # the trainer uses it: every vision block's attention runs the batched forward
    tr = R.Trainer(TINY_TRAIN, tmp_path / "t")
    assert all("forward" in b.attn.__dict__ for b in tr.lm.model.model.visual.blocks)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"qa_trace": True, "attn_traced_answer": False, "qa_sets": 4, "qa_token_weight": 3.0, "seed": 13},
        {"qa_trace": True, "qa_trace_style": "scan", "qa_type_weights": (("direction", 3.0),), "lr": 1e-3},
        {
            "attn_weight": 0.5,
            "attn_layers": (3, 5, 7),
            "attn_count_target": "end",
            "aux_term_weights": (1, 3, 1),
        },
        {"random_events": ((0, 0.6),), "qa_trace": True, "trace_decision_weight": 3.0},
        {"random_events": ((0, 0.3), (2100, 0.6))},
        {"qa_turns": True, "qa_cue": True, "attn_list": ((0, 0.0), (2272, 1.0)), "attn_list_head": 1},
        {"qa_turns": True, "attn_list": ((0, 0.5),), "altered_lists": ((0, 0.0), (3300, 0.5))},
        {"qa_turns": True, "attn_list": ((0, 1.0),), "list_copy": ((0, 0.0), (1600, 2.0))},
        {"attn_weight": 0.5, "caption_attn": "periods", "caption_turns": 0.5, "qa_turns": True},
        {"attn_weight": 0.5, "caption_attn": "none", "caption_turns": 1.0, "qa_turns": True},
    ],
)
def test_the_cards_training_command_rebuilds_the_config(changes: dict) -> None:
    from dataclasses import asdict

    from decoders.train.card import _command

    cfg = asdict(replace(R.TrainConfig(steps=4280), **changes))
    command = _command(cfg).strip("`").split()
    assert command[:2] == ["vidspec", "train-reference"]
    rebuilt = R.config_from_args(R.build_parser().parse_args(command[2:]))
    assert R.config_diff(asdict(rebuilt), cfg) == {}


def test_a_replys_trace_is_right_when_it_is_the_worlds_list_or_scan() -> None:
    from decoders.train.eval import trace_right

    world = W.make_world(5, 60.0, 2.0, 112, 112, n_events=4)
    qas = W.questions(world, np.random.default_rng(3))
    lookup = next(q for q in qas if q.qtype == "colour_of_shape")
    assert trace_right(world, lookup, W.answer_text(world, lookup)) is True
    assert trace_right(world, lookup, W.answer_text(world, lookup, "scan") + " ") is True
    assert trace_right(world, lookup, W.answer_text(world, lookup, "cued")) is True
    assert trace_right(world, lookup, W.cued_answer(lookup)) is True  # a cued two-turn reply: its cue
    other = next(s for s in W.SHAPES if s != lookup.cue)
    assert trace_right(world, lookup, f"{other} . {lookup.answer}") is False
    # the answer is not judged
    assert trace_right(world, lookup, W.object_list(world) + " . anything") is True
    wrong = W.object_list(world).replace(world.events[0].obj.colour, "nothing", 1)
    assert trace_right(world, lookup, f"{wrong} . {lookup.answer}") is False
    assert trace_right(world, lookup, lookup.answer) is None  # no trace
    plain = next(q for q in qas if q.qtype == "first")
    assert trace_right(world, plain, W.object_list(world) + " . x") is None  # not a traced type


def test_random_events_schedules_parse_and_reject_bad_input() -> None:
    assert R.parse_random_events("0.6") == ((0, 0.6),)
    assert R.parse_random_events("0:0.3, 2100:0.6") == ((0, 0.3), (2100, 0.6))
    cfg = R.TrainConfig(random_events=((0, 0.3), (10, 0.6)))
    assert [R.random_events_share(cfg, s) for s in (0, 9, 10, 500)] == [0.3, 0.3, 0.6, 0.6]
    for bad in ("", "1.5", "x", "5:0.3", "0:0.3,0:0.5", "0:0.3,20:0.5,10:0.1", "-1:0.2"):
        with pytest.raises(ValueError, match="--random-events"):
            R.parse_random_events(bad)


def test_the_default_event_share_draws_the_counts_it_always_drew() -> None:
    def old_rule(rng: np.random.Generator, duration: float, fps: float) -> int | None:  # v1-v8's code
        if rng.random() < 0.7:
            return None
        lo_vis, gap = max(3.0, 5.0 / fps), max(1.0, 2.0 / fps)
        cap = max(1, min(10, int((duration - 0.01) // (lo_vis + gap))))
        return int(rng.integers(1, cap + 1))

    for seed in range(200):
        args = (float(10 + seed * 7), 0.5 + (seed % 7) / 2)
        assert R._n_events(np.random.default_rng(seed), *args) == old_rule(np.random.default_rng(seed), *args)
    # a larger share draws more videos with a drawn count, and counts above the default range
    many = [R._n_events(np.random.default_rng(s), 100.0, 2.0, share=1.0) for s in range(200)]
    assert all(n is not None for n in many) and max(many) == 10


def test_a_resumed_runs_data_schedule_changes_only_untrained_steps_and_equals_that_run(
    tmp_path: Path,
) -> None:
    a = R.Trainer(replace(TINY_TRAIN, steps=6), tmp_path / "a")
    a.train(max_steps=2, log_every=1)
    b = R.Trainer(replace(TINY_TRAIN, steps=6), tmp_path / "a")
    b.load()
    with pytest.raises(ValueError, match="differs at step 1"):
        b.change_data(((0, 0.3), (1, 1.0)))  # step 1 was trained with 0.3
    b.change_data(((0, 0.3), (2, 1.0)))
    assert b.data_changes == [{"step": 2, "from": [[0, 0.3]], "to": [[0, 0.3], [2, 1.0]]}]
    b.train(max_steps=4, log_every=1)
    c = R.Trainer(replace(TINY_TRAIN, steps=6, random_events=((0, 0.3), (2, 1.0))), tmp_path / "c")
    c.prefetch = False
    c.train(max_steps=4, log_every=1)
    for k, v in c.lm.model.state_dict().items():
        assert torch.equal(v, b.lm.model.state_dict()[k]), k
    info = json.loads((R.export_checkpoint(b, tmp_path / "export") / "training_info.json").read_text())
    assert info["data_changes"] == b.data_changes
    assert info["config"]["random_events"] == [[0, 0.3], [2, 1.0]]
    # a change draws other worlds from its step on (clips long enough for more than one object)
    longer = {"warm_frames": (60, 80), "warm_tokens_per_step": 4096}
    old, new = replace(a.cfg, **longer), replace(c.cfg, **longer)
    assert R.make_batch(a.lm, old, 1)[1][0].world == R.make_batch(a.lm, new, 1)[1][0].world
    counts = [[len(s.world.events) for s in R.make_batch(a.lm, cfg, 2)[1]] for cfg in (old, new)]
    assert counts[0] != counts[1], counts


def test_a_traces_decision_tokens_can_be_weighted_like_answers(tmp_path: Path) -> None:
    # ids: 1 = ',', 2 = '.', 3 = a number word, others words; k0 = 6 (after the trace's '.')
    ans = [10, 11, 3, 1, 12, 2, 13, 99]
    assert R.answer_weights(ans, 6, 3.0, frozenset({1, 2, 3}), 5.0) == [1, 1, 5, 5, 1, 5, 3, 3]
    assert R.answer_weights(ans, 0, 3.0, frozenset({1, 2, 3}), 5.0) == [3.0] * 8  # untraced: all answer
    assert R.answer_weights(ans, 6, 3.0, frozenset({1, 2, 3}), 1.0) == [1, 1, 1, 1, 1, 1, 3, 3]
    cfg = replace(TINY_TRAIN, qa_trace=True, qa_trace_style="scan")
    trainer = R.Trainer(cfg, tmp_path / "w")
    _, samples = R.make_batch(trainer.lm, cfg, 0)
    assert any(t.traced for s in samples for t in s.tasks)
    with torch.no_grad():
        base = R.batch_loss(trainer.lm, None, samples, cfg)
        heavy = R.batch_loss(trainer.lm, None, samples, replace(cfg, trace_decision_weight=4.0))
        plain_cfg = replace(cfg, qa_trace=False)
        _, plain = R.make_batch(trainer.lm, plain_cfg, 0)  # answers alone: no trace, no decision
        untraced = R.batch_loss(trainer.lm, None, plain, plain_cfg)
        untraced_heavy = R.batch_loss(trainer.lm, None, plain, replace(plain_cfg, trace_decision_weight=4.0))
    assert abs(float(heavy.loss) - float(base.loss)) > 1e-4  # the decisions' share of the loss changed
    assert heavy.qa_loss == pytest.approx(base.qa_loss)  # the per-part losses are unweighted
    assert float(untraced_heavy.loss) == pytest.approx(float(untraced.loss))  # nothing traced: no change


def test_cued_traces_train_with_their_cue_outside_the_attention_supervision(tmp_path: Path) -> None:
    cfg = replace(TINY_TRAIN, qa_trace=True, qa_trace_style="cued", attn_weight=0.5, attn_layers=(1,))
    trainer = R.Trainer(cfg, tmp_path / "w")
    _, samples = R.make_batch(trainer.lm, cfg, 0)
    cued = [t for s in samples for t in s.tasks if t.traced and s.world.events]
    assert cued and all(t.item_skip == len(t.cue.split()) > 0 for t in cued)
    unk = trainer.lm.tokenizer.unk_token_id
    for t in cued:  # every word of a cued trace is in the vocabulary, one token each
        ids = trainer.lm.encode_text(t.answer)
        assert unk not in ids and len(ids) == len(t.answer.split())
    with torch.no_grad():
        out = R.batch_loss(trainer.lm, None, samples, cfg)
    assert torch.isfinite(out.loss) and out.attn_loss > 0


def test_list_reading_drills_answer_from_another_worlds_trace_and_supervise_only_the_answer(
    tmp_path: Path,
) -> None:
    assert R.answer_targets([10, 11, 2, 13, 99], 3, drill=True) == [-100, -100, -100, 13, 99]
    assert R.answer_targets([10, 11, 2, 13, 99], 3) == [10, 11, 2, 13, 99]
    cfg = replace(TINY_TRAIN, qa_trace=True, drill_tasks=3, attn_weight=0.5, attn_layers=(1,))
    trainer = R.Trainer(cfg, tmp_path / "w")
    _, samples = R.make_batch(trainer.lm, cfg, 0)
    undrilled = R.make_batch(trainer.lm, replace(cfg, drill_tasks=0), 0)[1]
    assert samples[0].world == undrilled[0].world  # the drills are drawn after the video's own tasks
    assert [t for t in samples[0].tasks if not t.drill] == undrilled[0].tasks
    for s in samples:
        drills = [t for t in s.tasks if t.drill]
        assert len(drills) == 3 and all(t.traced and t.kind in W.TRACED_QTYPES for t in drills)
        for t in drills:
            trace, _, answer = t.answer.rpartition(" . ")
            items = [item.split() for item in trace.split(" , ")]
            assert 1 <= len(items) <= 10 and all(len(i) == 3 for i in items)
            if t.kind == "count_colour":  # the answer is the trace's, whatever the video shows
                colour = t.cue
                assert answer == W.NUMBER_WORDS[sum(i[0] == colour for i in items)]
                assert [items[r][0] for r in t.refs] == [colour] * len(t.refs)  # refs: items of the trace
            elif t.kind == "colour_of_shape":
                assert [i[0] for i in items if i[1] == t.cue] == [answer]
    with torch.no_grad():
        out = R.batch_loss(trainer.lm, trainer.aux, samples, cfg)
        plain = R.batch_loss(trainer.lm, trainer.aux, samples, replace(cfg, drill_tasks=0))
    assert 0.0 <= out.drill_acc <= 1.0 and torch.isfinite(out.loss) and out.attn_loss > 0
    assert out.qa_first_acc == pytest.approx(plain.qa_first_acc)  # drills are counted apart
    with pytest.raises(SystemExit, match="drill"):
        R.main(["--size", "test", "--drill-tasks", "2", "--work-dir", str(tmp_path / "x"), "--no-export"])


def test_two_turn_qa_asks_every_question_after_the_list_turn_and_packs_like_inference(tmp_path: Path) -> None:
    cfg = replace(TINY_TRAIN, qa_turns=True, attn_weight=0.5, attn_layers=(1,))
    trainer = R.Trainer(cfg, tmp_path / "w")
    lm = trainer.lm
    _, samples = R.make_batch(lm, cfg, 0)
    s = samples[0]
    assert s.tasks[0].turn == "list" and s.tasks[0].answer == W.object_list(s.world)
    asked = [t for t in s.tasks if t.turn == "question"]
    assert asked and all(not t.traced and t.answer == W.final_answer(t.answer) for t in asked)
    assert [t.kind for t in s.tasks if not t.turn] == ["caption"]
    unk = lm.tokenizer.unk_token_id
    # the list turn then a question turn, packed, are the tokens of the two-turn prompt at inference
    im_end = lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    packed = lm.suffix_ids(P.LIST_PROMPT) + lm.encode_text(s.tasks[0].answer) + [im_end]
    packed += R.question_turn_ids(lm, asked[0].prompt)
    assert packed == lm.suffix_ids(P.after_list(s.tasks[0].answer, asked[0].prompt)) and unk not in packed
    with torch.no_grad():
        out = R.batch_loss(lm, trainer.aux, samples, cfg)
    assert torch.isfinite(out.loss) and out.attn_loss > 0 and 0.0 <= out.qa_first_acc <= 1.0
    # the question turns see the list turn: another list changes the answers' loss (QA tokens only)
    other = W.object_list(W.make_world(5, 60.0, 2.0, 112, 112, n_events=6))
    relisted = [replace(samples[0], tasks=[replace(s.tasks[0], answer=other), *s.tasks[1:]]), *samples[1:]]
    with torch.no_grad():
        assert abs(R.batch_loss(lm, trainer.aux, relisted, cfg).qa_loss - out.qa_loss) > 1e-6
    with pytest.raises(SystemExit, match="qa-turns"):
        R.main(
            ["--size", "test", "--qa-turns", "--qa-trace", "--work-dir", str(tmp_path / "x"), "--no-export"]
        )


def test_the_list_turns_tokens_can_be_weighted_up(tmp_path: Path) -> None:
    cfg = replace(TINY_TRAIN, qa_turns=True)
    trainer = R.Trainer(cfg, tmp_path / "w")
    _, samples = R.make_batch(trainer.lm, cfg, 0)
    assert all(s.tasks[0].turn == "list" for s in samples)
    with torch.no_grad():
        base = R.batch_loss(trainer.lm, None, samples, cfg)
        heavy = R.batch_loss(trainer.lm, None, samples, replace(cfg, list_token_weight=6.0))
        unweighted = R.batch_loss(trainer.lm, None, samples, replace(cfg, list_token_weight=0.0))
        # a list turn of weight 0 is one that is no target (an altered world's list turn, ``drill``)
        untargeted = [replace(s, tasks=[replace(s.tasks[0], drill=True), *s.tasks[1:]]) for s in samples]
        dropped = R.batch_loss(trainer.lm, None, untargeted, cfg)
    assert abs(float(heavy.loss) - float(base.loss)) > 1e-4  # the list's share of the loss changed
    assert float(unweighted.loss) == pytest.approx(float(dropped.loss), rel=1e-5)
    assert heavy.qa_loss == pytest.approx(base.qa_loss) and heavy.caption_loss == pytest.approx(
        base.caption_loss
    )
    # the card's command carries the flag; the CLI wants two-turn QA for it
    assert "--list-token-weight 6" in card._command(asdict(replace(cfg, list_token_weight=6.0)))
    with pytest.raises(SystemExit, match="qa-turns"):
        R.main(
            ["--size", "test", "--list-token-weight", "6", "--work-dir", str(tmp_path / "x"), "--no-export"]
        )


def test_list_turn_weights_weigh_direction_words_on_top_of_the_list_weight() -> None:
    # ids: 7 = a direction word, 9 = another word, 3 = a comma
    got = R.list_turn_weights([1.0, 1.0, 1.0, 2.0], [9, 9, 7, 3], 6.0, 4.0, frozenset({7}))
    assert got == [6.0, 6.0, 24.0, 12.0]
    assert R.list_turn_weights([1.0, 1.0], [7, 9], 0.0, 4.0, frozenset({7})) == [0.0, 0.0]
    with pytest.raises(ValueError):
        R.list_turn_weights([1.0], [7, 9], 1.0, 1.0, frozenset({7}))


def test_the_list_turns_direction_words_can_be_weighted_up_and_their_accuracy_is_reported(
    tmp_path: Path,
) -> None:
    cfg = replace(TINY_TRAIN, qa_turns=True)
    trainer = R.Trainer(cfg, tmp_path / "w")
    _, samples = R.make_batch(trainer.lm, cfg, 0)
    with torch.no_grad():
        base = R.batch_loss(trainer.lm, None, samples, cfg)
        heavy = R.batch_loss(trainer.lm, None, samples, replace(cfg, list_direction_weight=5.0))
    assert abs(float(heavy.loss) - float(base.loss)) > 1e-4
    assert heavy.qa_loss == pytest.approx(base.qa_loss)
    assert 0.0 <= base.list_direction_acc <= 1.0 and base.list_direction_acc == heavy.list_direction_acc
    # without a list turn there are no listed directions to score
    _, plain = R.make_batch(trainer.lm, TINY_TRAIN, 0)
    assert not any(t.turn == "list" for s in plain for t in s.tasks)
    with torch.no_grad():
        assert math.isnan(R.batch_loss(trainer.lm, None, plain, TINY_TRAIN).list_direction_acc)
    assert "--list-direction-weight 5" in card._command(asdict(replace(cfg, list_direction_weight=5.0)))
    with pytest.raises(SystemExit, match="qa-turns"):
        R.main(
            [
                "--size",
                "test",
                "--list-direction-weight",
                "5",
                "--work-dir",
                str(tmp_path / "x"),
                "--no-export",
            ]
        )


def test_the_list_directions_early_read_out_loss_trains_the_layers_below_it_only(tmp_path: Path) -> None:
    cfg = replace(TINY_TRAIN, qa_turns=True, list_direction_lens=2.0, list_direction_layer=1)
    trainer = R.Trainer(cfg, tmp_path / "w")
    _, samples = R.make_batch(trainer.lm, cfg, 0)
    text = trainer.lm.text_model
    off = R.batch_loss(trainer.lm, None, samples, replace(cfg, list_direction_lens=0.0))
    assert math.isnan(off.list_direction_lens)
    out = R.batch_loss(trainer.lm, None, samples, cfg)
    assert out.list_direction_lens > 0 and math.isfinite(out.list_direction_lens)
    lens = out.loss - off.loss  # the read-out loss alone (the two forwards are otherwise the same)
    assert float(lens.detach()) == pytest.approx(2.0 * out.list_direction_lens, rel=1e-3)
    # its gradient reaches layer 0's output projection, not the layers above the read-out
    text.zero_grad()
    lens.backward()
    o0 = text.layers[0].self_attn.o_proj.weight.grad
    assert o0 is not None and float(o0.abs().sum()) > 0
    top = text.layers[len(text.layers) - 1].self_attn.o_proj.weight.grad
    assert top is None or float(top.abs().sum()) < 1e-4 * float(o0.abs().sum())
    assert "--list-direction-lens 2" in card._command(asdict(cfg))
    with pytest.raises(ValueError, match="list_direction_layer"):
        R.batch_loss(trainer.lm, None, samples, replace(cfg, list_direction_layer=99))
    with pytest.raises(SystemExit, match="qa-turns"):
        R.main(
            ["--size", "test", "--list-direction-lens", "1", "--work-dir", str(tmp_path / "x"), "--no-export"]
        )


def test_cued_two_turn_replies_repeat_the_cue_then_answer_and_supervise_no_attention_on_the_cue(
    tmp_path: Path,
) -> None:
    cfg = replace(TINY_TRAIN, qa_turns=True, qa_cue=True, attn_weight=0.5, attn_layers=(1,))
    trainer = R.Trainer(cfg, tmp_path / "w")
    lm = trainer.lm
    _, samples = R.make_batch(lm, cfg, 0)
    period = lm.tokenizer.convert_tokens_to_ids(".")
    comma = lm.tokenizer.convert_tokens_to_ids(",")
    cued = 0
    for s in samples:
        for t in (t for t in s.tasks if t.turn == "question"):
            assert W.final_answer(t.answer) != t.answer or not t.cue
            if t.cue:
                cued += 1
                assert t.traced and t.answer == f"{t.cue} . {W.final_answer(t.answer)}"
                assert t.item_skip == len(t.cue.split())
                ids = lm.encode_text(t.answer)
                targets = R.attention_targets(s, t, ids, period, cfg.attn_count_target, comma, True)
                # the cue's tokens have no attention target; the answer's first token has its refs (if any)
                assert all(k >= R._answer_start(ids, period) for k, _ in targets)
    assert cued > 0
    with torch.no_grad():
        out = R.batch_loss(lm, trainer.aux, samples, cfg)
        plain = R.batch_loss(lm, trainer.aux, samples, replace(cfg, qa_cue=False))
    assert torch.isfinite(out.loss) and 0.0 <= out.qa_first_acc <= 1.0 and torch.isfinite(plain.loss)
    with pytest.raises(SystemExit, match="qa-turns"):
        R.main(["--size", "test", "--qa-cue", "--work-dir", str(tmp_path / "x"), "--no-export"])


def test_sparsity_measures_top_k_shares_of_the_prompts_as_the_model_is_asked(
    shipped: object, tmp_path: Path
) -> None:
    import shutil

    from decoders.train.sparsity import measure_sparsity

    shares = []
    for turns in (False, True):
        model = tmp_path / f"m{turns}"
        shutil.copytree(SHIPPED, model, ignore=shutil.ignore_patterns("sparrow", "*.md"))
        info = json.loads((model / "training_info.json").read_text())
        info["config"]["qa_turns"] = turns
        (model / "training_info.json").write_text(json.dumps(info))
        out = measure_sparsity(
            model, ("tiny",), 1, questions_per_video=2, ks=(8, 64), work_dir=tmp_path, lm=shipped, log=None
        )
        t = out["lengths"]["tiny"]
        assert t["prompts"] == 2 and 0.0 < t["visual_mass_share"] <= 1.0
        assert 0.0 < t["share_top8"]["mean"] <= t["share_top64"]["mean"] <= 1.0 + 1e-6
        shares.append(t["visual_mass_share"])
    assert shares[0] != shares[1]  # the question was asked after the model's list: other attention


def _adam_losses(
    trainer: R.Trainer, samples: list, cfg: R.TrainConfig, name: str, **weights: float
) -> list[float]:
    """``BatchLoss.<name>`` over six Adam steps on one batch's ``batch_loss`` with ``weights``."""
    opt = torch.optim.Adam(trainer.lm.model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        out = R.batch_loss(trainer.lm, trainer.aux, samples, cfg, **weights)
        losses.append(getattr(out, name))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return losses


def test_list_attention_targets_point_each_lookup_at_the_list_item_holding_its_answer(tmp_path: Path) -> None:
    cfg = replace(TINY_TRAIN, qa_turns=True, qa_cue=True)
    lm = R.Trainer(cfg, tmp_path / "w").lm
    period = lm.tokenizer.convert_tokens_to_ids(".")
    comma = lm.tokenizer.convert_tokens_to_ids(",")
    assert R.item_spans([5, comma, 6, 7, comma, 8], comma) == [range(0, 1), range(2, 4), range(5, 6)]
    assert R.find_last([1, 2, 3, 1, 2], [1, 2]) == range(3, 5) and R.find_last([1, 2], [3]) is None
    assert R.find_last([1, 2], []) is None
    world = W.make_world(3, 60.0, 2.0, 112, 112, n_events=4)
    list_ids = lm.encode_text(W.object_list(world))
    items = R.item_spans(list_ids, comma)
    assert len(items) == len(world.events)
    rng = np.random.default_rng(0)
    seen: set[str] = set()
    for task in R._tasks(world, rng, qa_sets=3, turns=True, cue=True):
        ans = lm.encode_text(task.answer)
        prompt = R.question_turn_ids(lm, task.prompt)
        cue = R.find_last(prompt, lm.encode_text(task.cue)) if task.cue else None
        targets = R.list_attention_targets(task, ans, period, items, list(cue or ()))
        if task.turn != "question":
            assert targets == []
            continue
        k0 = R._answer_start(ans, period) if task.traced else 0
        looked_up = [keys for k, keys in targets if k == k0]
        if task.kind in R.LIST_LOOKUP_QTYPES and len(task.refs) == 1:
            seen.add(task.kind)
            # the item attended to holds the answer's first word (the next object's, for *_after)
            (keys,) = looked_up
            assert ans[k0] in [list_ids[k] for k in keys], (task.kind, task.answer)
        else:
            assert looked_up == []
        # a cue's tokens attend to the question's cue words, which are the tokens they repeat
        for k, keys in targets:
            if k < k0:
                assert cue is not None and [prompt[c] for c in keys] == ans[: k0 - 1]
    assert {"colour_of_shape", "shape_of_colour", "direction", "colour_after", "first"} <= seen
    # a ref past the list (a list that does not split into every object) has no target
    lookup = next(t for t in R._tasks(world, rng, turns=True) if t.kind == "last")
    assert R.list_attention_targets(lookup, lm.encode_text(lookup.answer), period, items[:2]) == []


def test_the_list_attention_loss_adds_its_weight_and_trains_the_head_towards_the_item(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = replace(TINY_TRAIN, qa_turns=True, qa_cue=True, attn_weight=0.5, attn_layers=(1,), attn_list_head=2)
    trainer = R.Trainer(cfg, tmp_path / "w")
    _, samples = R.make_batch(trainer.lm, cfg, 0)
    with torch.no_grad():
        plain = R.batch_loss(trainer.lm, trainer.aux, samples, cfg)
        out = R.batch_loss(trainer.lm, trainer.aux, samples, cfg, list_weight=2.0)
    assert math.isnan(plain.list_loss) and out.list_loss > 0
    # in the packed rows, every supervised position attends to tokens holding the token it predicts
    spied: list = []
    real = R._list_attention_loss

    def spy(*args: object) -> object:
        spied.append(args[4])
        return real(*args)

    monkeypatch.setattr(R, "_list_attention_loss", spy)
    with torch.no_grad():
        R.batch_loss(trainer.lm, trainer.aux, samples, cfg, list_weight=1.0)
    im_end = trainer.lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    n_sel = 0
    for s, sel in zip(samples, spied[0], strict=True):
        row: list[int] = []
        for t in s.tasks:
            asked = t.turn == "question"
            prompt = R.question_turn_ids(trainer.lm, t.prompt) if asked else trainer.lm.suffix_ids(t.prompt)
            row += prompt + trainer.lm.encode_text(t.answer) + [im_end]
        for pos, keys in sel:
            assert row[pos + 1] in [row[k] for k in keys] and max(keys) < pos
            n_sel += 1
    assert n_sel > 0
    assert float(out.loss) == pytest.approx(float(plain.loss) + 2.0 * out.list_loss, rel=1e-5)
    # the loss's gradient reaches head 2's query rows; steps on a heavily weighted list loss lower it
    q_proj = trainer.lm.text_model.layers[1].self_attn.q_proj
    rows = slice(2 * q_proj.out_features // 4, 3 * q_proj.out_features // 4)
    grads = []
    for w in (0.0, 1.0):
        trainer.lm.model.zero_grad()
        R.batch_loss(trainer.lm, trainer.aux, samples, cfg, list_weight=w).loss.backward()
        grads.append(q_proj.weight.grad[rows].clone())
    assert not torch.allclose(grads[0], grads[1])
    losses = _adam_losses(trainer, samples, cfg, "list_loss", list_weight=50.0)
    assert losses[-1] < losses[0], losses
    with pytest.raises(SystemExit, match="qa-turns"):
        R.main(
            ["--size", "test", "--attn-list", "1", "--attn-layers", "1", "--work-dir", str(tmp_path / "x")]
        )
    with pytest.raises(SystemExit, match="attn-list-head"):
        argv = [
            "--size",
            "test",
            "--qa-turns",
            "--attn-list",
            "1",
            "--attn-list-head",
            "4",
            "--attn-layers",
            "1",
        ]
        R.main([*argv, "--work-dir", str(tmp_path / "x"), "--no-export"])


def test_a_resumed_run_may_switch_the_list_attention_loss_on_for_its_untrained_steps(tmp_path: Path) -> None:
    base = replace(TINY_TRAIN, steps=6, qa_turns=True, qa_cue=True, attn_layers=(1,))
    a = R.Trainer(base, tmp_path / "a")
    a.train(max_steps=2, log_every=1)
    b = R.Trainer(base, tmp_path / "a")
    b.load(ignore=R.SCHEDULE_FIELDS)
    with pytest.raises(ValueError, match="--attn-list at step 2: the new schedule differs at step 1"):
        b.change_schedule("attn_list", ((0, 0.0), (1, 1.0)))
    b.change_schedule("attn_list", ((0, 0.0), (2, 1.0)))
    assert b.data_changes == [
        {"field": "attn_list", "step": 2, "from": [[0, 0.0]], "to": [[0, 0.0], [2, 1.0]]}
    ]
    b.train(max_steps=4, log_every=1)
    assert "lst" in b.log[-1] and "lst" not in b.log[0]
    c = R.Trainer(replace(base, attn_list=((0, 0.0), (2, 1.0))), tmp_path / "c")
    c.prefetch = False
    c.train(max_steps=4, log_every=1)
    for k, v in c.lm.model.state_dict().items():
        assert torch.equal(v, b.lm.model.state_dict()[k]), k
    with pytest.raises(ValueError, match="not a schedule field"):
        b.change_schedule("steps", ((0, 1.0),))
    assert R.parse_schedule("0:0,3200:1.5", "--attn-list", hi=100.0, what="WEIGHT") == ((0, 0.0), (3200, 1.5))
    with pytest.raises(ValueError, match="--attn-list"):
        R.parse_schedule("3200:1", "--attn-list", hi=100.0)


def test_an_altered_world_changes_one_attribute_of_some_objects_and_keeps_the_video() -> None:
    world = W.make_world(3, 60.0, 2.0, 112, 112, n_events=4)
    for seed in range(20):
        alt = W.altered_world(world, np.random.default_rng(seed), 2)
        changed = [(a, b) for a, b in zip(world.events, alt.events, strict=True) if a != b]
        assert len(changed) == 2
        for a, b in changed:  # exactly one of colour, shape, direction differs; times and places are kept
            diffs = [a.obj.colour != b.obj.colour, a.obj.shape != b.obj.shape, a.direction != b.direction]
            assert sum(diffs) == 1 and (a.enter_s, a.leave_s, a.start_xy) == (
                b.enter_s,
                b.leave_s,
                b.start_xy,
            )
    assert W.altered_world(world, np.random.default_rng(0), 9).events != world.events
    empty = W.make_world(3, 2.0, 2.0, 112, 112, n_events=0)
    assert W.altered_world(empty, np.random.default_rng(0)) == empty


def test_altered_lists_ask_the_altered_worlds_questions_after_its_list_which_is_no_target(
    tmp_path: Path,
) -> None:
    cfg = replace(TINY_TRAIN, qa_turns=True, qa_cue=True, attn_weight=0.5, attn_layers=(1,))
    trainer = R.Trainer(cfg, tmp_path / "w")
    lm = trainer.lm
    longer = {"warm_frames": (60, 80), "warm_tokens_per_step": 4096}
    base, alt_cfg = replace(cfg, **longer), replace(cfg, altered_lists=((0, 1.0),), **longer)
    # share 0 draws nothing more: the batches of a run without it
    assert [s.tasks for s in R.make_batch(lm, base, 3)[1]] == [
        s.tasks for s in R.make_batch(lm, replace(base, altered_lists=((0, 0.0),)), 3)[1]
    ]
    _, samples = R.make_batch(lm, alt_cfg, 3)
    differ = 0
    for s in samples:
        listed = s.tasks[0]
        assert listed.turn == "list" and listed.drill and not s.tasks[-1].turn  # the caption is the video's
        assert s.tasks[-1].kind == "caption"
        differ += listed.answer != W.object_list(s.world)
    assert differ > 0
    with torch.no_grad():
        out = R.batch_loss(lm, trainer.aux, samples, alt_cfg, list_weight=1.0)
        # the altered list is no target: another altered list changes no caption-side (unasked) loss
        relisted = [
            replace(s, tasks=[replace(s.tasks[0], answer=W.object_list(s.world)), *s.tasks[1:]])
            for s in samples
        ]
        again = R.batch_loss(lm, trainer.aux, relisted, alt_cfg, list_weight=1.0)
        targeted = [replace(s, tasks=[replace(s.tasks[0], drill=False), *s.tasks[1:]]) for s in samples]
        as_target = R.batch_loss(lm, trainer.aux, targeted, alt_cfg, list_weight=1.0)
    assert torch.isfinite(out.loss) and out.list_loss > 0
    assert again.caption_loss == pytest.approx(out.caption_loss, rel=1e-5) and again.qa_loss != out.qa_loss
    assert as_target.caption_loss != pytest.approx(out.caption_loss, rel=1e-4)  # a target list would count
    with pytest.raises(ValueError, match="turns"):
        R._tasks(samples[0].world, np.random.default_rng(0), altered=samples[0].world)
    with pytest.raises(SystemExit, match="qa-turns"):
        R.main(["--size", "test", "--altered-lists", "0.5", "--work-dir", str(tmp_path / "x"), "--no-export"])


def test_caption_turns_ask_the_caption_after_the_list_which_it_then_sees(tmp_path: Path) -> None:
    cfg = replace(TINY_TRAIN, qa_turns=True, attn_weight=0.5, attn_layers=(1,))
    trainer = R.Trainer(cfg, tmp_path / "w")
    lm = trainer.lm
    longer = {"warm_frames": (60, 80), "warm_tokens_per_step": 4096}
    base, cap_cfg = replace(cfg, **longer), replace(cfg, caption_turns=1.0, **longer)
    # share 0 draws nothing: a share too small ever to come up draws, and so changes the later draws
    assert [s.tasks for s in R.make_batch(lm, base, 3)[1]] != [
        s.tasks for s in R.make_batch(lm, replace(base, caption_turns=1e-300), 3)[1]
    ]
    _, samples = R.make_batch(lm, cap_cfg, 3)
    for s in samples:
        assert s.tasks[0].turn == "list" and s.tasks[-1].kind == "caption" and s.tasks[-1].turn == "question"
    alone = [replace(s, tasks=[*s.tasks[:-1], replace(s.tasks[-1], turn="")]) for s in samples]

    def relist(batch: list) -> list:  # another list turn of as many tokens: its first colour word changed
        out = []
        for s in batch:
            first = s.tasks[0]
            words = first.answer.split()
            words[0] = next(c for c in W.COLOURS if c != words[0]) if words[0] in W.COLOURS else "red"
            out.append(replace(s, tasks=[replace(first, answer=" ".join(words)), *s.tasks[1:]]))
        return out

    def caption_only(batch: list) -> list:  # the list turn and the caption (the questions are unasked)
        return [replace(s, tasks=[s.tasks[0], s.tasks[-1]]) for s in batch]

    with torch.no_grad():
        after = R.batch_loss(lm, trainer.aux, caption_only(samples), cap_cfg)
        after_relisted = R.batch_loss(lm, trainer.aux, caption_only(relist(samples)), cap_cfg)
        alone_l = R.batch_loss(lm, trainer.aux, caption_only(alone), cap_cfg)
        alone_relisted = R.batch_loss(lm, trainer.aux, caption_only(relist(alone)), cap_cfg)
    # ``caption_loss`` is over the unasked tokens: the list's and the caption's. The list's change is the same
    # either way (same tokens, same positions); only a caption asked after the list sees its changed word
    assert torch.isfinite(after.loss)
    d_after = after_relisted.caption_loss - after.caption_loss
    d_alone = alone_relisted.caption_loss - alone_l.caption_loss
    assert d_after != pytest.approx(d_alone, rel=1e-4, abs=1e-6)
    # weighted as a caption (QA weights leave it alone), with the caption's attention targets on the video and
    # none on the list
    with torch.no_grad():
        heavier = R.batch_loss(lm, trainer.aux, caption_only(samples), replace(cap_cfg, qa_token_weight=9.0))
    assert float(heavier.loss) == pytest.approx(float(after.loss), rel=1e-6)
    cap_task = samples[0].tasks[-1]
    ids = lm.encode_text(cap_task.answer)
    period = lm.tokenizer.convert_tokens_to_ids(".")
    assert R.list_attention_targets(cap_task, ids, period, [range(0, 2)] * 10) == []
    assert R.attention_targets(samples[0], cap_task, ids, period) != []
    with pytest.raises(ValueError, match="turns"):
        R._tasks(samples[0].world, np.random.default_rng(0), caption_turn=True)
    # never after an altered list: the caption is the video's
    alt = R._tasks(
        samples[0].world,
        np.random.default_rng(0),
        turns=True,
        caption_turn=True,
        altered=W.altered_world(samples[0].world, np.random.default_rng(1), 1),
    )
    assert alt[-1].kind == "caption" and alt[-1].turn == ""
    with pytest.raises(ValueError, match="qa_turns"):
        R.make_sample(lm, np.random.default_rng(0), 4, 2.0, 56, False, caption_turn_share=0.5)
    for bad in (["--caption-turns", "0.5"], ["--qa-turns", "--caption-turns", "1.5"]):
        with pytest.raises(SystemExit, match="qa-turns"):
            R.main(["--size", "test", *bad, "--work-dir", str(tmp_path / "x"), "--no-export"])


def test_the_copy_loss_reads_the_list_heads_output_through_the_lm_head_and_trains_it(tmp_path: Path) -> None:
    cfg = replace(TINY_TRAIN, qa_turns=True, qa_cue=True, attn_layers=(0, 1), attn_list_head=2)
    trainer = R.Trainer(cfg, tmp_path / "w")
    _, samples = R.make_batch(trainer.lm, cfg, 0)
    with torch.no_grad():
        plain = R.batch_loss(trainer.lm, trainer.aux, samples, cfg, list_weight=1.0)
        out = R.batch_loss(trainer.lm, trainer.aux, samples, cfg, list_weight=1.0, copy_weight=2.0)
        off = R.batch_loss(trainer.lm, trainer.aux, samples, cfg, copy_weight=2.0)  # needs the attention loss
    assert math.isnan(plain.copy_loss) and math.isnan(off.copy_loss) and out.copy_loss > 0
    assert float(out.loss) == pytest.approx(float(plain.loss) + 2.0 * out.copy_loss, rel=1e-5)
    # its gradient reaches the output weights of head 2 in the last supervised layer
    attn = trainer.lm.text_model.layers[1].self_attn
    cols = slice(2 * attn.head_dim, 3 * attn.head_dim)
    trainer.lm.model.zero_grad()
    R.batch_loss(trainer.lm, trainer.aux, samples, cfg, list_weight=1e-9, copy_weight=1.0).loss.backward()
    with_copy = attn.o_proj.weight.grad[:, cols].clone()
    trainer.lm.model.zero_grad()
    R.batch_loss(trainer.lm, trainer.aux, samples, cfg, list_weight=1e-9).loss.backward()
    assert not torch.allclose(with_copy, attn.o_proj.weight.grad[:, cols])
    losses = _adam_losses(trainer, samples, cfg, "copy_loss", list_weight=1.0, copy_weight=50.0)
    assert losses[-1] < losses[0], losses
    with pytest.raises(SystemExit, match="attn-list"):
        argv = ["--size", "test", "--qa-turns", "--list-copy", "1", "--attn-layers", "1"]
        R.main([*argv, "--work-dir", str(tmp_path / "x"), "--no-export"])


def test_the_list_turns_end_can_be_weighted_up_and_its_accuracy_is_reported(tmp_path: Path) -> None:
    cfg = replace(TINY_TRAIN, qa_turns=True, list_token_weight=6.0)
    trainer = R.Trainer(cfg, tmp_path / "w")
    _, samples = R.make_batch(trainer.lm, cfg, 0)
    lists = [t for s in samples for t in s.tasks if t.turn == "list" and not t.drill]
    assert lists
    with torch.no_grad():
        base = R.batch_loss(trainer.lm, None, samples, cfg)
        heavy = R.batch_loss(trainer.lm, None, samples, replace(cfg, list_end_weight=6.0))
        # the end of a list that is no target (``drill``) weighs nothing whatever its weight
        untargeted = [
            replace(s, tasks=[replace(t, drill=t.turn == "list") for t in s.tasks]) for s in samples
        ]
        plain_drop = R.batch_loss(trainer.lm, None, untargeted, cfg)
        heavy_drop = R.batch_loss(trainer.lm, None, untargeted, replace(cfg, list_end_weight=6.0))
    assert abs(float(heavy.loss) - float(base.loss)) > 1e-4  # the ends' share of the loss changed
    assert float(heavy_drop.loss) == pytest.approx(float(plain_drop.loss), rel=1e-6)
    assert heavy.qa_loss == pytest.approx(base.qa_loss) and heavy.caption_loss == pytest.approx(
        base.caption_loss
    )
    # one end per list turn: its accuracy is a share of them
    assert 0.0 <= base.list_end_acc <= 1.0 and base.list_end_acc == heavy.list_end_acc
    assert base.list_end_acc * len(lists) == pytest.approx(round(base.list_end_acc * len(lists)))
    assert math.isnan(plain_drop.list_end_acc)
    _, plain = R.make_batch(trainer.lm, TINY_TRAIN, 0)
    with torch.no_grad():
        assert math.isnan(R.batch_loss(trainer.lm, None, plain, TINY_TRAIN).list_end_acc)
    assert "--list-end-weight 6" in card._command(asdict(replace(cfg, list_end_weight=6.0)))
    with pytest.raises(SystemExit, match="qa-turns"):
        R.main(["--size", "test", "--list-end-weight", "6", "--work-dir", str(tmp_path / "x"), "--no-export"])
    with pytest.raises(SystemExit, match=">= 0"):
        R.main(
            [
                *("--size", "test", "--qa-turns", "--list-end-weight", "-1"),
                *("--work-dir", str(tmp_path / "y"), "--no-export"),
            ]
        )
