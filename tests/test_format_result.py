"""`vidspec result` / the demo's text rendering of a job result (pure logic)."""

from __future__ import annotations

from pipeline.service_cli import format_result


def _result(texts: list[tuple[str, str, str]]) -> dict:
    stats = {"mean_accepted_length": 3.5}
    return {
        "job_id": "j",
        "model": "m",
        "attempt": 1,
        "video": {
            "visual_tokens": 8,
            "frames": 2,
            "cache": "miss",
            "ingest_s": 0.1,
            "encode_s": 0.1,
            "prefill_s": 0.1,
        },
        "timings": {"queue_s": 0.0, "time_to_first_token_s": 0.1},
        "tasks": [
            {
                "type": kind,
                "question": q,
                "text": text,
                "stats": stats,
                "method": "auto",
                "num_tokens": 3,
                "tokens_per_target_forward": 2.0,
                "ttft_s": 0.1,
                "decode_s": 0.1,
            }
            for kind, q, text in texts
        ],
    }


def test_a_traced_reply_shows_its_final_answer_beside_the_expected_one() -> None:
    out = format_result(
        _result(
            [
                ("qa", "how many red objects appear ?", "red circle up one , blue square left one . one"),
                ("qa", "what is the first object ?", "red circle"),
                ("caption", "describe the video .", "a red circle enters . it moves up ."),
            ]
        ),
        {"how many red objects appear ?": "one", "what is the first object ?": "red circle"},
    ).splitlines()
    traced = out.index("  [qa] how many red objects appear ?")
    assert out[traced + 2 : traced + 4] == ["    answer: 'one'", "    expected: 'one'"]
    plain = out.index("  [qa] what is the first object ?")
    assert out[plain + 2] == "    expected: 'red circle'"  # a one-word reply is its own answer
    assert not any("answer:" in line for line in out[out.index("  [caption] describe the video .") :])
