"""Pure helpers of the benchmark scripts that README figures come from (no model needed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str) -> object:
    if str(ROOT) not in sys.path:  # scripts import their siblings (common, gamma_policy) as top-level modules
        sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_auc_counts_pairs_and_ties() -> None:
    auc = _load("lvspec_relevance").auc
    assert auc(torch.tensor([0.9, 0.8]), torch.tensor([0.1, 0.2])) == 1.0
    assert auc(torch.tensor([0.1]), torch.tensor([0.5, 0.6])) == 0.0
    assert auc(torch.tensor([0.5]), torch.tensor([0.5])) == 0.5  # a tie counts half
    assert abs(auc(torch.tensor([0.3, 0.7]), torch.tensor([0.5])) - 0.5) < 1e-9  # one above, one below


def test_spread_pairs_each_repeat_with_vanillas_same_repeat() -> None:
    tables = _load("tables")
    doc = {
        "results": [
            # 100 decode tokens in every repeat; the medians of the times are 2.0 and 1.0
            {"visual_tokens": 512, "method": "vanilla", "repeats_decode_s": [1.0, 2.0, 4.0], "decode_s": 2.0,
             "decode_tokens_per_s": 50.0},
            {"visual_tokens": 512, "method": "sparrow", "repeats_decode_s": [0.5, 2.0, 1.0], "decode_s": 1.0,
             "decode_tokens_per_s": 100.0},
        ]
    }  # fmt: skip
    lines = tables.spread_table(doc)
    assert lines[0].count("sparrow") == 1 and "std" not in lines[0]
    # repeat by repeat: 1.0 / 0.5, 2.0 / 2.0, 4.0 / 1.0 = 2, 1, 4 (min - median - max)
    assert lines[2] == "| 512 | 1.00 - 2.00 - 4.00 |"


def test_tree_replay_accepts_while_every_rank_is_inside_the_shape() -> None:
    dt = _load("draft_tree")
    assert dt.tree_nodes((1, 1, 1)) == [1, 1, 1]
    assert dt.tree_nodes((3, 2, 1)) == [3, 6, 6]
    data = [
        ([0, 0, 0], 0.9),  # the chain gets all three
        ([1, 0, 5], 0.4),  # second choice at depth 1: only a tree with k_1 >= 2 follows it
        ([0, 2, 0], 0.4),  # third choice at depth 2
    ]
    # tokens per cycle = 1 + accepted depth, averaged over positions
    assert dt.replay(data, (1, 1, 1)) == (4 + 1 + 2) / 3
    assert dt.replay(data, (2, 1, 1)) == (4 + 3 + 2) / 3
    assert dt.replay(data, (2, 3, 1)) == (4 + 3 + 4) / 3
    assert dt.replay(data, (1,)) == (2 + 1 + 2) / 3  # capped at the shape's depth


def test_accepted_length_ratios_pair_each_video_with_its_own_first_length() -> None:
    ratios = _load("sparrow_heads")._ratios

    def row(video: str, mf: int, tau: float, head: str = "h") -> dict:
        return {"length": video, "head": head, "max_frames": mf, "mean_accepted_length": tau}

    rows = [
        row("a.mp4", 192, 4.0),
        row("a.mp4", 3200, 3.0),
        row("b.mp4", 192, 8.0),
        row("b.mp4", 3200, 2.0),
        row("pooled", 192, 5.0),
        row("pooled", 3200, 4.5),
        row("c.mp4", 3200, 9.0),  # no first length: no ratio
    ]
    got = {r["video"]: r["ratio"] for r in ratios(rows, [192, 3200])}
    assert got == {"a.mp4": 0.75, "b.mp4": 0.25, "pooled": 0.9}
    assert ratios(rows, [192]) == []  # one length: nothing to compare


def test_pooled_ratio_interval_resamples_videos_and_leaves_out_the_skipped_one() -> None:
    ci = _load("sparrow_heads").pooled_ratio_ci

    def row(video: str, mf: int, tau: float, cycles: int = 10) -> dict:
        return {"length": video, "head": "h", "max_frames": mf, "mean_accepted_length": tau, "cycles": cycles}

    same = [row(v, mf, 3.0) for v in ("a", "b", "c") for mf in (192, 3200)]
    assert ci(same, [192, 3200], "h") == (1.0, 1.0)  # every resample has the same ratio
    spread = [row("a", 192, 5.0), row("a", 3200, 2.0), row("b", 192, 2.0), row("b", 3200, 5.0)]
    lo, hi = ci(spread, [192, 3200], "h")
    assert (lo, hi) == (0.4, 2.5)  # all-a (2 / 5) and all-b (5 / 2) resamples are both drawn
    bench = [
        row("bench", 192, 9.0),
        row("bench", 3200, 1.0),
        row("pooled", 192, 9.0),
        row("pooled", 3200, 1.0),
    ]
    assert ci(same + bench, [192, 3200], "h", skip="bench") == (1.0, 1.0)


def test_training_logs_are_compared_step_by_step(tmp_path: Path) -> None:
    mod = _load("compare_training_logs")
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    tail = "lr 2.00e-03 vis tok/s 1500 {'short': 20}"
    a.write_text(
        "model: 2.57M parameters\n"
        f"step 20/100 [0.1 min] loss 2.0 qa 1.0 cap 2.0 aux 1.0 acc1 0.50 {tail}\n"
        f"step 40/100 [0.2 min] loss 2.0 qa 0.8 cap 1.0 aux 1.0 acc1 0.60 {tail}\n"
        f"step 60/100 [0.3 min] loss 2.0 qa 0.6 cap 1.0 aux 1.0 acc1 0.70 {tail}\n"
    )
    b.write_text(
        f"step 20/100 [0.1 min] loss 2.0 qa 0.9 cap 2.5 aux 1.0 acc1 0.55 cnt 0.700 {tail}\n"
        f"step 40/100 [0.2 min] loss 2.0 qa 0.9 cap 1.0 aux 1.0 acc1 0.50 cnt 0.600 {tail}\n"
    )
    rows = mod.compare(mod.parse([a]), mod.parse([b]), window=40)
    assert len(rows) == 1 and rows[0]["n"] == 2  # step 60 is in A only
    qa = rows[0]["qa"]
    assert abs(qa["a"] - 0.9) < 1e-9 and abs(qa["b"] - 0.9) < 1e-9 and qa["b_better"] == 1
    assert rows[0]["acc1"]["b_better"] == 1  # accuracy: higher is better
    assert abs(rows[0]["cap"]["b_minus_a"] - 0.25) < 1e-9


def test_trace_parts_finds_the_wrong_part_of_a_cued_trace() -> None:
    from decoders.train import world as W
    from decoders.train.eval import SETTINGS, eval_questions, eval_world

    trace_parts = _load("trace_parts").trace_parts
    seed = 1_000_000_000  # the first short held-out world of vidspec eval
    w = eval_world(SETTINGS["short"], seed)
    qas = [q for q in eval_questions(w, seed) if q.qtype in W.TRACED_QTYPES]
    assert qas and len(w.events) >= 2
    right = [
        {
            "length": "short",
            "seed": seed,
            "qtype": q.qtype,
            "question": q.question,
            "reply": f"{W.cued_scan(w, q)} . {q.answer}",
        }
        for q in qas
    ]
    st = trace_parts(right, "short", cued=True)
    assert st["items"] > 0
    for part in ("cue_right", "colour_shape_right", "dir_right", "obj_right"):
        assert st[part] == st["items"], part
    assert st["count_word_right"] == st["count_items"] and st["lookup_len_right"] == st["lookups"]
    # every direction flipped to one that is wrong: only the directions (and whole objects) count as wrong
    flip = {d: next(x for x in W.DIRECTIONS if x != d) for d in W.DIRECTIONS}
    wrong = []
    for r in right:
        trace, _, answer = r["reply"].rpartition(" . ")
        items = []
        for item in trace.split(" , "):
            words = item.split()
            for i, word in enumerate(words):
                if word in flip and words[i - 1] in W.SHAPES:
                    words[i] = flip[word]
            items.append(" ".join(words))
        wrong.append({**r, "reply": " , ".join(items) + " . " + answer})
    st2 = trace_parts(wrong, "short", cued=True)
    assert st2["dir_right"] == 0 and st2["obj_right"] == 0
    assert st2["colour_shape_right"] == st2["cue_right"] == st2["items"] == st["items"]


def test_list_reading_drills_target_the_answer_and_a_scans_decisions(tmp_path: Path) -> None:
    import numpy as np
    import pytest

    lr = _load("list_reading")
    assert lr.parse_variant("theta=1e4;layers=4") == {"theta": 1e4, "layers": 4.0}
    with pytest.raises(ValueError, match="unknown"):
        lr.parse_variant("heads=8")
    lm = lr.build_model(tmp_path / "tok", {"theta": 1e4}, seed=0)
    assert lm.model.config.text_config.rope_parameters["rope_theta"] == 1e4
    rng = np.random.default_rng(3)
    for style in ("list", "scan"):
        tasks = [lr.R.drill_task(rng, style) for _ in range(12)]
        _, tg, first = lr.encode_drills(lm, tasks, decisions=style == "scan")
        assert int(first.sum()) == len(tasks)
        for i, t in enumerate(tasks):
            answer = t.answer.rpartition(" . ")[2]
            assert lm.decode([int(tg[i][first[i]])]) == answer.split()[0]  # the first answer word
            trace_targets = [lm.decode([int(x)]) for x in tg[i][~first[i]] if x != -100]
            n_answer = len(answer.split()) - 1 + 1  # the answer's later words and <|im_end|>
            decided = trace_targets[: len(trace_targets) - n_answer]
            if style == "list":
                assert decided == []  # another world's list: nothing in it is a target
            elif t.kind in lr.W.COUNTING_QTYPES:
                assert decided and all(w in lr.W.NUMBER_WORDS for w in decided)
            else:  # a lookup: go on at every item but the last, stop there
                assert decided == [","] * (len(decided) - 1) + ["."]


def test_list_reading_item_mask_marks_the_referenced_items_of_the_trace(tmp_path: Path) -> None:
    import numpy as np

    lr = _load("list_reading")
    lm = lr.build_model(tmp_path / "tok", {}, seed=0)
    rng = np.random.default_rng(5)
    tasks = [lr.R.drill_task(rng, "list") for _ in range(16)]
    ids, _, first = lr.encode_drills(lm, tasks)
    mask = lr.item_mask(lm, tasks, ids, first)
    for i, t in enumerate(tasks):
        items = t.answer.rpartition(" . ")[0].split(" , ")
        assert lm.decode(ids[i][mask[i]].tolist()).split() == " ".join(items[r] for r in t.refs).split()


def test_list_reading_after_style_asks_each_question_in_its_own_turn_after_the_list(tmp_path: Path) -> None:
    import numpy as np

    lr = _load("list_reading")
    lm = lr.build_model(tmp_path / "tok", {}, seed=0)
    ids, tg, first, kinds = lr.encode_after(lm, np.random.default_rng(1), 3, 4)
    assert first.sum(1).tolist() == [4, 4, 4] and len(kinds) == 12 and set(kinds) <= lr.W.TRACED_QTYPES
    im_end = lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i in range(3):
        text = lm.tokenizer.decode(ids[i].tolist())
        assert text.count("<|im_start|> user") == 5 and "<|im_end|> <|im_end|>" not in text  # 1 + 4 turns
        answers = [lm.tokenizer.decode([int(t)]) for t in tg[i][first[i]]]
        # the targets are each answer's words and its <|im_end|>, nothing of the list or the questions
        assert (tg[i] == im_end).sum() == 4 and (tg[i] != -100).sum() == 8  # one-word answers
        assert all(a in text for a in answers)


def test_list_reading_after_style_with_cue_predicts_the_answer_after_the_repeated_cue(tmp_path: Path) -> None:
    import numpy as np

    lr = _load("list_reading")
    lm = lr.build_model(tmp_path / "tok", {}, seed=0)
    plain = lr.encode_after(lm, np.random.default_rng(1), 3, 4)
    ids, tg, first, kinds = lr.encode_after(lm, np.random.default_rng(1), 3, 4, cue=True)
    assert kinds == plain[3] and first.sum() == plain[2].sum()
    period = lm.tokenizer.convert_tokens_to_ids(".")
    for i in range(3):
        for k in first[i].nonzero()[:, 0].tolist():
            # the position predicting the answer holds the period after the cue, and the cue word before it
            assert int(ids[i, k]) == period and int(tg[i, k]) == int(ids[i, k + 1])
            word = lm.tokenizer.decode([int(ids[i, k - 1])]).strip()
            assert word in (*lr.W.COLOURS, *lr.W.SHAPES)
    assert [lm.tokenizer.decode([int(t)]) for t in tg[first]] == [
        lm.tokenizer.decode([int(t)]) for t in plain[1][plain[2]]
    ]


def test_cue_forced_prompt_starts_the_reply_with_the_right_cue_and_summary_counts(tmp_path: Path) -> None:
    cf = _load("cue_forced")
    lr = _load("list_reading")
    lm = lr.build_model(tmp_path / "tok", {}, seed=0)
    qa = cf.W.QA("how many blue objects appear ?", "zero", "count_colour", (), "blue")
    listed = "red square up , blue cross left"
    ids = cf.forced_prompt(lm, listed, qa)
    asked = lm.suffix_ids(cf.after_list(listed, qa.question))
    assert ids[: len(asked)] == asked and lm.decode(ids[len(asked) :]).split() == ["blue", "."]
    assert cf.colour_shape(listed) == ["red square", "blue cross"]
    rows = [
        {"qtype": "count_colour", "cue_right": True, "answer_right": False, "forced_right": True},
        {"qtype": "direction", "cue_right": False, "answer_right": True, "forced_right": True},
    ]
    s = cf.summarise(rows)
    assert s["all"] == {"n": 2, "cue_right": 1, "answer_right": 1, "answer_right_cue_forced": 2}
    assert s["direction"]["cue_right"] == 0 and s["count_colour"]["answer_right"] == 0


def test_list_forced_alters_the_answers_word_in_the_looked_up_item_only(tmp_path: Path) -> None:
    lf = _load("list_forced")
    W = lf.W
    world = W.make_world(3, 60.0, 2.0, 112, 112, n_events=4)
    listed = W.object_list(world)
    seen = set()
    for qa in W.questions(world, np.random.default_rng(0)):
        alt = lf.counterfactual_list(world, qa)
        if qa.qtype not in lf.LIST_LOOKUP_QTYPES or len(qa.refs) != 1:
            assert alt is None
            continue
        assert alt is not None, qa
        seen.add(qa.qtype)
        new_list, new_answer = alt
        old_items, new_items = listed.split(" , "), new_list.split(" , ")
        changed = [j for j, (a, b) in enumerate(zip(old_items, new_items, strict=True)) if a != b]
        assert changed == [qa.refs[0]] and new_answer != qa.answer
        # one word of the item changed, to the new answer's word; the question's object stays unique
        diff = [
            (a, b)
            for a, b in zip(old_items[changed[0]].split(), new_items[changed[0]].split(), strict=True)
            if a != b
        ]
        assert len(diff) == 1 and diff[0] == (qa.answer.split()[0], new_answer.split()[0])
        if diff[0][1] in W.COLOURS:
            assert sum(item.split()[0] == diff[0][1] for item in new_items) == 1
    assert {"colour_of_shape", "shape_of_colour", "direction", "first", "colour_after"} <= seen
    rows = [
        {
            "qtype": "direction",
            "own_right": True,
            "true_right": True,
            "altered_answer": "up",
            "follows_list": True,
            "follows_video": False,
        },
        {
            "qtype": "first",
            "own_right": False,
            "true_right": True,
            "altered_answer": None,
            "follows_list": False,
            "follows_video": False,
        },
    ]
    s = lf.summarise(rows)
    assert s["all"] == {
        "n": 2,
        "right_own_list": 1,
        "right_true_list": 2,
        "altered": 1,
        "follows_list": 1,
        "follows_video": 0,
    }


def test_list_fields_scores_each_written_item_against_the_worlds_by_position() -> None:
    lf = _load("list_fields")
    true = "red square up , blue cross left , green circle down"
    sc = lf.score_list("red square down , blue circle left", true)
    assert (sc["items"], sc["colour"], sc["shape"], sc["directed"], sc["direction"]) == (2, 2, 1, 1, 0)
    assert sc["length_right"] is False and sc["confusion"] == {("up", "down"): 1}
    assert lf.score_list(true, true)["direction"] == 3 and lf.score_list(true, true)["length_right"] is True
    assert lf.score_list("red", true)["colour"] == 1 and lf.score_list("", true)["items"] == 0
    # a two-turn record holds its first turn; a traced reply its list before the answer; others none
    assert lf.written_lists({"object_list": "a b c"}) == ["a b c"]
    assert lf.written_lists({"object_list": None, "reply": "a b c , d e f . red"}) == ["a b c , d e f"]
    assert lf.written_lists({"reply": "four"}) == []


def test_list_fields_scores_a_list_once_per_video_against_the_eval_world() -> None:
    lf = _load("list_fields")
    from decoders.train.eval import SETTINGS, eval_world
    from decoders.train.world import object_list

    seed = 1_000_000_000
    true = object_list(eval_world(SETTINGS["short"], seed))
    rec = {"length": "short", "seed": seed, "object_list": true}
    out = lf.collect([rec, dict(rec), {**rec, "length": "long"}], "short")
    n = len(true.split(" , "))
    assert out["videos"] == 1 and out["lists"] == 1 and out["items"] == out["direction"] == n
    traced = [{"length": "short", "seed": seed, "reply": f"{true} . red"}] * 2  # a traced list per reply
    assert lf.collect(traced, "short")["lists"] == 2
