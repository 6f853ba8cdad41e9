"""Where a vanilla decode step's time goes, per op, at several video lengths (for a GPU lease; runs on CPU too).

The H200 run of session 24 measured our vanilla step at 2.5 ms at 0.5k visual tokens and 7.2 ms at 25.6k on
the reference model (float32), though the extra KV it reads at 25.6k is ~0.2 GB a step, ~0.05 ms at that
GPU's bandwidth; and 24.7 ms a step for the 7B shape against ~6 ms of weight reads. This profiles N greedy
steps (after one untimed answer) with torch.profiler and prints the ops with the most device time (CPU time
where there is no GPU), with wall time per step, so the next lease can see which op grows with the video.
Usage: python benchmarks/gpu_profile.py --device cuda --max-frames 64,3200 [--json OUT]
"""

from __future__ import annotations

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)
import torch
from torch.profiler import ProfilerActivity, profile

from decoders.engine import run
from decoders.model import load_model
from decoders.sampling import DecodeConfig
from pipeline.bench import DTYPES


def main() -> None:
    p = common.parser(__doc__, "64,3200", "")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    if a.steps < 2:
        p.error("--steps must be >= 2 (a step's time is decode time over steps - 1)")
    torch.set_num_threads(a.threads)
    lm = load_model(a.model, device=a.device, dtype=DTYPES[a.dtype])
    on_gpu = lm.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"  # (self_cuda_* is gone in torch 2.13)
    prompt = lm.suffix_ids("describe the video .")
    cfg = DecodeConfig(max_new_tokens=a.steps, ignore_eos=True)
    doc = {
        "model": a.model,
        "device": str(lm.device),
        "dtype": str(lm.dtype),
        "steps": a.steps,
        "lengths": [],
    }
    for mf in common.frame_counts(a.max_frames):
        session = common.session_at(lm, a.video, mf)
        run(session, prompt, cfg)  # untimed: kernels loaded, algorithms picked
        plain_s = run(session, prompt, cfg).stats.decode_s  # first token to last: steps - 1 steps
        with profile(activities=activities) as prof:
            run(session, prompt, cfg)
            if on_gpu:
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by=key, row_limit=a.top)
        print(
            f"== {session.num_visual_tokens} visual tokens: {plain_s / (a.steps - 1) * 1e3:.2f} ms a step unprofiled"
        )
        print(table)
        rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
        doc["lengths"].append(
            {
                "visual_tokens": session.num_visual_tokens,
                "ms_per_step": plain_s / (a.steps - 1) * 1e3,
                "top": [{"op": e.key, "calls": e.count, "self_us": getattr(e, key)} for e in rows[: a.top]],
            }
        )
    if a.json:
        common.write_json(a.json, doc)


if __name__ == "__main__":
    main()
