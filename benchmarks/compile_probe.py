"""Does torch.compile make the lean decode/verify step cheaper on this CPU? (one-off probe)

Times `FastDecoder.forward` (the lean step used for vanilla decode, verification and StD drafts) on the
reference model at ~0.5k visual tokens for 1 row (a vanilla step) and 5 rows (a typical verify), eager and
compiled with inductor (`dynamic=True`: the cache length changes every step). Prints ms per step.
Usage: python benchmarks/compile_probe.py   (compilation takes ~2 minutes)
"""

from __future__ import annotations

import time

import torch

from decoders.model import load_model
from decoders.session import VisualSession
from decoders.video import read_video


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(1)
    lm = load_model("models/vidspec-reference")
    sampling = lm.default_sampling(fps=2, max_frames=64)
    session = VisualSession.create(
        lm, lm.prepare_video(read_video("runtime/ref-long.mp4", sampling), sampling)
    )
    session.extend(lm.suffix_ids("describe the video ."))
    base = session.length
    if lm.fast is None:
        raise SystemExit("this model has no lean path")

    def bench(fn: callable, n: int, reps: int = 1000) -> float:
        x = torch.tensor([[7] * n])
        for i in range(reps + 50):
            if i == 50:
                t0 = time.perf_counter()
            fn(x, base + session.rope_delta, session.cache)
            session.truncate(base)
        return (time.perf_counter() - t0) / reps * 1e3

    for n in (1, 5):
        print(f"eager    {n} rows: {bench(lm.fast.forward, n):.3f} ms")
    compiled = torch.compile(lm.fast.forward, dynamic=True)
    t0 = time.perf_counter()
    for n in (1, 5):
        bench(compiled, n, reps=10)  # compile both shapes first
    print(f"compiled in {time.perf_counter() - t0:.0f} s")
    for n in (1, 5):
        print(f"compiled {n} rows: {bench(compiled, n):.3f} ms")


if __name__ == "__main__":
    main()
