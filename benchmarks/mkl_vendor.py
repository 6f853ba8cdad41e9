"""MKL's vendor check on AMD CPUs: decode and verify steps with and without the shim, side by side.

One run alternates child processes without and with `infra/cpu.py`'s shim preloaded (LD_PRELOAD can only
be chosen at process start), `--rounds` times each. Every child measures, on the reference model and one
video: the 128 -> 1024 GEMM of the MLP for 1 and 5 rows, and the lean step of the target for 1, 3 and 5
new tokens (a decode step, verifies of 2 and 4 drafts, lm_head included) at each length. Per child, a
time is the 25th percentile of a block; the report keeps the best child per setting and prints the ratios.
Usage: python benchmarks/mkl_vendor.py --max-frames 64,192,2048,3200 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from infra.cpu import MARK_VAR, cpu_vendor, shim_path


def child(a: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from decoders.model import load_model
    from decoders.session import VisualSession
    from decoders.video import read_video

    torch.set_grad_enabled(False)
    torch.set_num_threads(1)

    def q25(f: object, n: int) -> float:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        return ts[len(ts) // 4] * 1e3

    out: dict = {"gemm_ms": {}, "step_ms": {}}
    w = torch.randn(1024, 128)
    for rows in (1, 5):
        x = torch.randn(1, rows, 128)
        out["gemm_ms"][rows] = min(q25(lambda x=x: F.linear(x, w), 2000) for _ in range(3))
    lm = load_model(a.model)
    for frames in (int(x) for x in a.max_frames.split(",")):
        sampling = lm.default_sampling(fps=a.fps, max_frames=frames)
        s = VisualSession.create(lm, lm.prepare_video(read_video(a.video, sampling), sampling), headroom=256)
        s.extend(lm.suffix_ids("describe the video ."))
        base, n = s.length, (300 if s.num_visual_tokens < 4096 else 30)
        row = {}
        for rows in (1, 3, 5):
            ids = torch.full((1, rows), 5)

            def step(ids: torch.Tensor = ids, s: VisualSession = s, base: int = base) -> None:
                h = s.extend(ids)
                lm.logits(h[0]).argmax(-1).tolist()
                s.truncate(base)

            row[rows] = min(q25(step, n) for _ in range(3))
        out["step_ms"][s.num_visual_tokens] = row
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/vidspec-reference")
    p.add_argument("--video", default="runtime/ref-long.mp4")
    p.add_argument("--fps", type=float, default=2.0)
    p.add_argument("--max-frames", default="64,192,2048,3200")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default="benchmarks/results/mkl-vendor.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
        return
    shim = shim_path()
    if not shim.is_file():
        sys.exit(f"no shim at {shim}: run `python -m infra.cpu build` (needs cc)")
    base_env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", MARK_VAR)}
    settings = {"off": base_env, "on": {**base_env, "LD_PRELOAD": str(shim)}}
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(a.rounds):
        for name, env in settings.items():  # alternated, so drift on a shared machine hits both alike
            t0 = time.perf_counter()
            cmd = [sys.executable, __file__, "--child", *sys.argv[1:]]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{a.rounds} shim {name}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    best = {
        name: {
            "gemm_ms": {k: min(x["gemm_ms"][k] for x in rs) for k in rs[0]["gemm_ms"]},
            "step_ms": {
                n: {k: min(x["step_ms"][n][k] for x in rs) for k in rs[0]["step_ms"][n]}
                for n in rs[0]["step_ms"]
            },
        }
        for name, rs in runs.items()
    }
    off, on = best["off"], best["on"]
    print("| GEMM 128->1024 | without shim | with shim | ratio |\n|---|---:|---:|---:|")
    for k in off["gemm_ms"]:
        a1, b1 = off["gemm_ms"][k] * 1e3, on["gemm_ms"][k] * 1e3
        print(f"| {k} row(s) | {a1:.1f} us | {b1:.1f} us | {a1 / b1:.2f}x |")
    print(
        "\n| visual tokens | step 1 / 3 / 5 rows, without (ms) | with shim (ms) | 1-row step speedup "
        "| 5 rows / 1 row without | 5 rows / 1 row with |\n|---:|---|---|---:|---:|---:|"
    )
    for n in off["step_ms"]:
        x, y = off["step_ms"][n], on["step_ms"][n]
        print(
            f"| {n} | {' / '.join(f'{v:.2f}' for v in x.values())} | {' / '.join(f'{v:.2f}' for v in y.values())} "
            f"| {x['1'] / y['1']:.2f}x | {x['5'] / x['1']:.2f} | {y['5'] / y['1']:.2f} |"
        )
    doc = {
        "cpu_vendor": cpu_vendor(),
        "model": a.model,
        "video": a.video,
        "rounds": a.rounds,
        "best": best,
        "runs": runs,
    }
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
