"""The model card (README.md) of the shipped reference checkpoint, written from measured results.

Contract: ``write_card(model_dir, eval_result, sparsity_result, notes)`` renders ``model_dir/README.md`` from
``training_info.json`` (written by ``reference.export_checkpoint``), an ``evaluate`` result and a
``measure_sparsity`` result; every figure in the card comes from those inputs, none is typed by hand.
``main`` reads them from JSON files (``python -m decoders.train.card --eval E.json --sparsity S.json``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from decoders.protocol import captions_after_list
from decoders.train import world as W


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``k / n``."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _pooled_section(pooled: dict) -> list[str]:
    """The card's figures over every block of held-out videos measured (``vidspec eval --pool``)."""
    blocks = "; ".join(
        f"`--seed0 {b['seed0']}` " + ", ".join(f"{n} {k}" for n, k in b["n_videos"].items())
        for b in pooled["blocks"]
    )
    lines = [
        "### Every block of held-out videos measured, pooled",
        "",
        "The table above is one block of videos; a few videos swing a figure by several points (one one-hour "
        f"video has 10-11 questions). Blocks measured ({blocks}), pooled with `vidspec eval --pool` (the figures "
        "recomputed from every block's per-question records):",
        "",
        *_eval_tables(pooled),
        "",
    ]
    for name, r in pooled["lengths"].items():
        n = r["qa"]["n"]
        k = round(r["qa"]["accuracy"] * n)
        lo, hi = _wilson(k, n)
        lines.append(
            f"- {name}: QA {k} of {n} right, {_pct(k / n)} (95% interval {_pct(lo)}-{_pct(hi)}) over "
            f"{r['n_videos']} videos."
        )
    return [*lines, ""]


def _eval_tables(ev: dict) -> list[str]:
    lines: list[str] = []
    lengths = ev.get("lengths", {})
    lines += [
        "| setting | videos | frames (mean) | visual tokens (min-max) | QA accuracy | chance (majority) | "
        "caption P | caption R | caption F1 | caption exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in lengths.items():
        vt = r["visual_tokens"]
        c = r["caption"]
        lines.append(
            f"| {name} ({r['fps']:g} fps) | {r['n_videos']} | {r['frames']['mean']:.0f} | {vt['min']}-{vt['max']} | "
            f"**{_pct(r['qa']['accuracy'])}** ({r['qa']['n']}) | {_pct(r['chance'])} | {c['precision']:.3f} | "
            f"{c['recall']:.3f} | **{c['f1']:.3f}** | {_pct(c['exact'])} |"
        )
    lines += [
        "",
        "Per question type (accuracy / n; chance = best constant answer, uniform = 1 / distinct answers):",
        "",
    ]
    names = list(lengths)
    lines.append(
        "| question type | " + " | ".join(f"{n} acc (n) | {n} chance / uniform" for n in names) + " |"
    )
    lines.append("|---|" + "---|---|" * len(names))
    for qt in W.QTYPES:
        cells = []
        for n in names:
            v = lengths[n]["qa"]["per_qtype"].get(qt)
            if v is None:
                cells += ["-", "-"]
            else:
                cells += [
                    f"{_pct(v['accuracy'])} ({v['n']})",
                    f"{_pct(v['chance_majority'])} / {_pct(v['chance_uniform'])}",
                ]
        lines.append(f"| {qt} | " + " | ".join(cells) + " |")
    return lines


def _sparsity_tables(sp: dict) -> list[str]:
    ks = sp.get("ks", [])
    lines = [
        "| setting | visual tokens (mean) | prompts | visual share of suffix attention | "
        + " | ".join(f"top-{k} share (mean / min; uniform)" for k in ks)
        + " |",
        "|---|---|---|---|" + "---|" * len(ks),
    ]
    for name, e in sp.get("lengths", {}).items():
        cells = [
            f"{e[f'share_top{k}']['mean']:.3f} / {e[f'share_top{k}']['min']:.3f}; "
            f"{e[f'share_top{k}']['uniform_baseline']:.3f}"
            for k in ks
        ]
        lines.append(
            f"| {name} | {e['visual_tokens']['mean']:.0f} | {e['prompts']} | {_pct(e['visual_mass_share'])} | "
            + " | ".join(cells)
            + " |"
        )
    lines += ["", "Top-1024 share per layer (mean over KV heads and prompts):", ""]
    for name, e in sp.get("lengths", {}).items():
        if "share_top1024" in e:
            per = ", ".join(f"{x:.3f}" for x in e["share_top1024"]["per_layer"])
            lines.append(f"- {name}: {per}")
    return lines


_FLAGS = (  # TrainConfig field -> train-reference flag, in the order a command line shows them
    ("seed", "--seed"),
    ("steps", "--steps"),
    ("lr", "--lr"),
    ("decay_frac", "--decay-frac"),
    ("warm_steps", "--warm-steps"),
    ("aux_weight", "--aux-weight"),
    ("aux_term_weights", "--aux-term-weights"),
    ("count_weight", "--count-weight"),
    ("count_layer", "--count-layer"),
    ("qa_token_weight", "--qa-token-weight"),
    ("list_token_weight", "--list-token-weight"),
    ("list_direction_weight", "--list-direction-weight"),
    ("list_end_weight", "--list-end-weight"),
    ("list_direction_lens", "--list-direction-lens"),
    ("list_direction_layer", "--list-direction-layer"),
    ("caption_turns", "--caption-turns"),
    ("caption_attn", "--caption-attn"),
    ("qa_sets", "--qa-sets"),
    ("qa_type_weights", "--qa-type-weights"),
    ("trace_decision_weight", "--trace-decision-weight"),
    ("attn_weight", "--attn-weight"),
    ("attn_layers", "--attn-layers"),
    ("attn_head", "--attn-head"),
    ("attn_count_target", "--attn-count-target"),
    ("attn_list_head", "--attn-list-head"),
    ("vision_only_steps", "--vision-only-steps"),
)


def _fmt(v: object) -> str:
    if isinstance(v, list | tuple) and v and all(isinstance(x, list | tuple) for x in v):
        return ",".join(f"{k}={_fmt(w)}" for k, w in v)  # qa_type_weights: name=weight pairs
    if isinstance(v, list | tuple):
        return ",".join(_fmt(x) for x in v)
    return f"{v:g}" if isinstance(v, float) else str(v)


def _caption_attn_line(rule: str) -> str:
    """How the card's attention-supervision line ends for a run's ``caption_attn`` rule."""
    if rule == "none":
        return " (caption tokens had no attention targets)"
    if rule == "periods":
        return (
            ", and on event i's tokens over the i-th caption sentence (sentences counted by periods: a motion "
            "sentence of its own, 'it moves up .', shifted the later sentences onto the next event; the rule "
            "before session 47)"
        )
    return (
        ", and on event i's tokens over the caption sentences about event i (its object's sentence and a motion "
        "sentence after it)"
    )


def _command(cfg: dict, extra: str = "") -> str:
    """The train-reference command of a config: seed, steps and every flag that differs from the default."""
    from decoders.train.reference import LEGACY_DEFAULTS, SCHEDULE_FIELDS, config_diff

    cfg = {**LEGACY_DEFAULTS, **cfg}  # a field the config was saved without: what it was trained with
    changed = config_diff(cfg, {})  # against the defaults
    flags = [
        f"{flag} {_fmt(cfg[k])}"
        for k, flag in _FLAGS
        if k in cfg and (k in ("seed", "steps") or k in changed)
    ]
    if cfg.get("qa_trace"):  # switches (a trace style other than the default is the flag's value)
        style = cfg.get("qa_trace_style", "list")
        flags.append("--qa-trace" if style == "list" else f"--qa-trace {style}")
    if cfg.get("attn_traced_answer", True) is False:
        flags.append("--no-attn-traced-answer")
    flags += [flag for k, flag in (("qa_turns", "--qa-turns"), ("qa_cue", "--qa-cue")) if cfg.get(k)]
    for name in SCHEDULE_FIELDS:  # schedules of (from_step, value) pieces
        if name in changed:
            pieces = cfg[name]
            spec = _fmt(pieces[0][1]) if len(pieces) == 1 else ",".join(f"{s}:{_fmt(v)}" for s, v in pieces)
            flags.append(f"--{name.replace('_', '-')} {spec}")
    return "`vidspec train-reference " + " ".join([*([extra] if extra else []), *flags]) + "`"


def _stages(info: dict) -> list[dict]:
    """The chain of training_info dicts from the from-scratch run to this one."""
    chain = [info]
    while "continued_from" in chain[-1]:
        chain.append(chain[-1]["continued_from"])
    return chain[::-1]


def _training_lines(info: dict) -> list[str]:
    """Command, steps and minutes per stage; restarts of a schedule through exports."""
    ema = info["config"]["ema_decay"]
    lines = []
    stages = _stages(info)
    prev_min = 0.0
    for i, st in enumerate(stages):
        c = st["config"]
        minutes = round(st["train_minutes"] - prev_min, 1)
        prev_min = st["train_minutes"]
        what = "from scratch" if i == 0 else f"continued from the stage-{i} export"
        label = f"Stage {i + 1}" if len(stages) > 1 else "Run"
        line = (
            f"- {label} ({what}): {_command(c, '' if i == 0 else f'--init-from <stage-{i} export>')}: "
            f"**{st['steps']} steps** (planned: {st['planned_steps']}), {minutes} minutes."
        )
        if c.get("vision_only_steps"):
            line += (
                f" Its first {c['vision_only_steps']} steps train only the vision tower and the auxiliary head "
                f"on {c['warm_frames'][0]}-{c['warm_frames'][1]}-frame clips; then everything trains (fresh "
                "AdamW moments for the language model, the rate re-warmed)."
            )
        if i > 0:
            line += " Its optimizer state starts fresh (only weights are exported)."
        for r in st.get("replans", []):
            line += (
                f" It was planned for {r['from']} steps until step {r['step']}, then replanned to {r['to']} "
                "(`--resume --replan-steps`) before either plan's decay started: step for step the run planned "
                f"for {r['to']} steps from its start."
            )
        for r in st.get("data_changes", []):
            flag = "--" + r.get("field", "random_events").replace("_", "-")
            line += (
                f" Its `{flag}` schedule was changed at step {r['step']} (`--resume {flag}`) "
                "for the steps not yet trained only: step for step the run of the command above from its start."
            )
        restarts = st.get("restarts", [])
        if restarts:
            at = ", ".join(f"step {r['step']} ({r['train_minutes']} min)" for r in restarts)
            line += (
                f" The schedule was carried across sessions through its own exports at {at} "
                "(`--init-from <export> --continue-schedule`: the same flags and data by step, training resumed "
                "from the exported EMA weights with fresh AdamW moments, the rate re-warmed)."
            )
        lines.append(line)
    if "blend" in info:
        a = info["blend"]["alpha"]
        lines.append(
            f"- **The weights are a blend** along the last stage: {1 - a:g} x the stage-{len(stages) - 1} export it "
            f"started from + {a:g} x its own final weights (`vidspec train-reference --work-dir <last stage> "
            f"--export-only --blend-with-parent {a:g}`): no training, both ends are checkpoints of this lineage."
        )
    lines.append(
        f"- **{info['train_minutes']} minutes** of wall-clock training on the 2-core CPU in all; weights are the "
        f"EMA (decay {ema}) of the training weights."
    )
    return lines


def _trace_line(tc: dict) -> str:
    """The traced answers of a ``--qa-trace`` run (``world.answer_text``)."""
    style = tc.get("qa_trace_style", "list")
    scan = (
        "a filtered count writes the running count after each item, a lookup's list stops at the object its "
        "answer is read from"
    )
    how = {
        "list": "a list of every object in entry order (`<colour> <shape> <direction>`, comma-separated; "
        "`world.object_list`)",
        "scan": f"a scan of the objects in entry order (`world.scan_list`): {scan}",
        "cued": f"a scan of the objects in entry order with the question's cue (the colour, shape or object "
        f"it asks about) before every item (`world.cued_scan`): {scan}",
    }[style]
    attn = (
        "; with attention supervision, list item i attends to event i"
        + ("" if tc.get("attn_traced_answer", True) else " and the answer after the list is not supervised")
        if tc.get("attn_weight", 0) > 0
        else ""
    )
    return (
        "- Traced answers (`--qa-trace"
        + ("" if style == "list" else f" {style}")
        + "`): the lookup and filtered-count question types (`world.TRACED_QTYPES`) are answered after "
        + how
        + ", then ` . ` and the answer. The trace's tokens weigh like caption tokens, the answer as a QA answer"
        + attn
        + "."
    )


def render_card(
    model_dir: Path,
    ev: dict | None,
    sp: dict | None,
    notes: str = "",
    draft: str = "",
    pooled: dict | None = None,
) -> str:
    info = json.loads((model_dir / "training_info.json").read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    t, v = cfg["text_config"], cfg["vision_config"]
    size_mb = (model_dir / "model.safetensors").stat().st_size / 2**20
    pre = json.loads((model_dir / "preprocessor_config.json").read_text())
    side = int(pre["max_pixels"] ** 0.5)
    from decoders.train.reference import LEGACY_DEFAULTS

    tc = _stages(info)[0]["config"]  # stage 1 (from scratch); a continuation is described by _training_lines
    lines = [
        "# vidspec-reference",
        "",
        "A small video LLM trained from scratch on CPU on the project's synthetic video world "
        "(`decoders/train/world.py`: coloured shapes entering, moving and leaving a dim background). It is a "
        "**stock `Qwen2VLForConditionalGeneration`** in standard Hugging Face layout: it loads with "
        "`from_pretrained` / `decoders.model.load_model` with no hooks or code changes. It exists so that "
        "acceptance rates, attention sparsity and answer quality of the decoders are measured on a model that "
        "has learned to look at the video.",
        "",
        "## Architecture",
        "",
        f"- LLM: {t['num_hidden_layers']} decoder layers, hidden {t['hidden_size']}, "
        f"{t['num_attention_heads']} query heads / {t['num_key_value_heads']} KV heads (GQA), head dim "
        f"{t['hidden_size'] // t['num_attention_heads']}, MLP {t['intermediate_size']}, vocabulary "
        f"{t['vocab_size']} (word level, Qwen2-VL special tokens and chat template), mRoPE sections "
        f"{t['rope_parameters']['mrope_section']}, rope theta {t['rope_parameters']['rope_theta']:g}.",
        f"- Vision tower: Qwen2-VL ViT, depth {v['depth']}, width {v['embed_dim']}, patch 14, temporal patch 2, "
        "2x2 merger.",
        f"- fp32 safetensors: {size_mb:.1f} MB.",
        f"- Input frames: {side}x{side} (the preprocessor's min = max pixels), i.e. {(side // 28) ** 2} visual "
        f"tokens per 2 frames. Pixels are normalised with mean {pre['image_mean'][0]} / std "
        f"{pre['image_std'][0]} (close to the world's dark background).",
        "- Prompt: the Qwen2-VL chat layout (`VideoLM.prefix_ids` + `suffix_ids`); positions follow the original "
        "Qwen mRoPE rule (text after the video starts at the largest vision position + 1), passed explicitly "
        "(transformers' `get_rope_index` differs for long videos; see `decoders/model.py`). Questions are the "
        "world's (`world.questions`), captions are asked with `describe the video .`"
        + (
            " after the model's own object list (`--caption-turns`)."
            if captions_after_list(model_dir)
            else "."
        ),
        "",
        "## Training",
        "",
        "- Commands below (`vidspec train-reference` = `python -m decoders.train.reference`); a run is resumed "
        "with `--resume` across invocations (the batch of a step is a pure function of the seed and the step, "
        "so a resumed run sees the same data as an uninterrupted one; the runs are listed under the notes).",
        *_training_lines(info),
        f"- AdamW, lr {tc['lr']:g} (warm-up {tc['warmup_steps']} steps, then constant, linear decay over the "
        f"last {_pct(tc['decay_frac'])} of the plan), weight decay {tc['weight_decay']} on LLM matrices only, "
        f"gradient clip {tc['grad_clip']}.",
        "- Data: fresh worlds every step (seeds below 1e9; evaluation uses seeds from 1e9 up), every question "
        "type plus one caption per video (answers only are supervised; QA answer tokens weighted "
        f"x{tc['qa_token_weight']:g}); a quarter of the videos go through h264 and back. Each video's prompts "
        "share one prefill of its visual prefix (block mask), as at inference. Warm phase: the first "
        f"{tc['warm_steps']} steps use many cheap {tc['warm_frames'][0]}-{tc['warm_frames'][1]}-frame videos "
        f"(up to {tc['warm_max_videos']} per step). Then a length mix: short "
        f"({tc['short_frames'][0]}-{tc['short_frames'][1]} frames at {side}px, 0.5-4 fps), medium "
        f"({tc['medium_frames'][0]}-{tc['medium_frames'][1]} frames), long ({tc['long_frames'][0]}-"
        f"{tc['long_frames'][1]} frames at {tc['small_side']}px: the temporal positions of an hour of video for "
        f"few tokens) and very long ({tc['xl_frames'][0]}-{tc['xl_frames'][1]} frames at {side}px, 16k-17.6k "
        f"visual tokens), with probabilities {list(tc['bucket_probs'])}."
        + (
            f" Questions are drawn {tc['qa_sets']} times per video (repeats dropped), so a video asks about "
            "more of its objects."
            if tc.get("qa_sets", 1) > 1
            else ""
        ),
        *([_trace_line(tc)] if tc.get("qa_trace") else []),
        "- Against the collapse of visual features seen in an earlier from-scratch run (the merger output "
        "drifting to a near-constant vector): pixels normalised around the background, no weight decay on the "
        "vision tower, and a training-only auxiliary head on the RMS-normalised merger output predicting the "
        "colour, shape and motion direction of the object under each visual token (labels from the event "
        f"log; weight {tc['aux_weight']}, terms colour/shape/direction weighted "
        f"{_fmt(tc.get('aux_term_weights', (1.0, 1.0, 1.0)))}). The head is not part of the checkpoint: inference "
        "is the stock model.",
        *(
            [
                f"- Count probe (weight {tc['count_weight']:g}): a second training-only linear head, on the LM's "
                f"hidden states after decoder layer {tc['count_layer']} at the visual positions, predicting at "
                "every visual token the running counts of the objects shown so far (in all, per colour, per "
                "shape) and the entry rank of the object under the token (labels from the event log). Also "
                "dropped at export."
            ]
            if tc.get("count_weight", 0) > 0
            else []
        ),
        *(
            [
                f"- Attention supervision (weight {tc['attn_weight']:g}): in decoder layers "
                f"{_fmt(tc['attn_layers'])}, query head {tc['attn_head']} is trained to put its attention on the "
                "visual tokens of the objects an answer is read from (from the event log) at the position "
                "predicting a QA answer's first token"
                + _caption_attn_line({**LEGACY_DEFAULTS, **tc}["caption_attn"])
                + "; a loss of -log(attention mass there), in training only (hooks, no change to the model)."
                + (
                    " Count questions attend to the video's last temporal group, whose running counts are "
                    "the answer."
                    if tc.get("attn_count_target", "objects") == "end"
                    else ""
                )
            ]
            if tc.get("attn_weight", 0) > 0
            else []
        ),
        "",
    ]
    if ev:
        lines += [
            "## Quality (`vidspec eval`)",
            "",
            "Held-out worlds (seeds from 1e9, never used in training), written to mp4 and read back with "
            "`read_video`, prefilled once into a `VisualSession`, greedy vanilla decoding. Command: "
            "`python -m decoders.train.eval --model models/vidspec-reference --lengths short,long "
            f"--n-short {ev['lengths'].get('short', {}).get('n_videos', 0)} "
            f"--n-long {ev['lengths'].get('long', {}).get('n_videos', 0)}`. QA is exact match of the answer with the "
            "reply's final answer (what follows its last ` . `, the whole reply when it has none: a model trained "
            "with `--qa-trace` lists the objects before some answers); caption events "
            "are the ordered `(colour, shape)` pairs of the caption matched to the event log by longest common "
            "subsequence. Short: 10-110 s at 2 fps; long: one hour at 0.6 fps.",
            "",
            *_eval_tables(ev),
            "",
            *(_pooled_section(pooled) if pooled else []),
        ]
    if draft:  # the Sparrow head's section (its training command and measured figures), as written
        lines += ["## Draft head (`sparrow/`)", "", draft.strip(), ""]
    if sp:
        lines += [
            "## Attention sparsity",
            "",
            "Share of the text->visual attention mass of the prompt suffix (question, end of turn, assistant "
            "header; scores summed over each GQA query group) held by the top-K visual KV entries per layer "
            "and KV head: the premise of StD's sparse draft cache. Measured with "
            "`python -m decoders.train.sparsity` on held-out videos.",
            "",
            *_sparsity_tables(sp),
            "",
        ]
    if notes:
        lines += ["## Notes and limitations", "", notes.strip(), ""]
    return "\n".join(lines)


def write_card(
    model_dir: str | Path,
    ev: dict | None,
    sp: dict | None,
    notes: str = "",
    draft: str = "",
    pooled: dict | None = None,
) -> Path:
    model_dir = Path(model_dir)
    path = model_dir / "README.md"
    path.write_text(render_card(model_dir, ev, sp, notes, draft, pooled))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m decoders.train.card")
    p.add_argument("--model", default="models/vidspec-reference")
    p.add_argument("--eval")
    p.add_argument("--sparsity")
    p.add_argument("--notes", help="a markdown file with notes and limitations")
    p.add_argument("--draft", help="a markdown file: the Sparrow draft head's section")
    p.add_argument(
        "--pooled", help="a `vidspec eval --pool` result over every block of held-out videos measured"
    )
    args = p.parse_args(argv)
    ev = json.loads(Path(args.eval).read_text()) if args.eval else None
    sp = json.loads(Path(args.sparsity).read_text()) if args.sparsity else None
    notes = Path(args.notes).read_text() if args.notes else ""
    draft = Path(args.draft).read_text() if args.draft else ""
    pooled = json.loads(Path(args.pooled).read_text()) if args.pooled else None
    print(write_card(args.model, ev, sp, notes, draft, pooled))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
