"""Cost of one native forward (`vidspec_stepn`) of n new tokens on the reference model's real session caches.

What a verify pass of n rows costs against a one-token step, per visual length: the number the draft-length
controller trades against acceptance. With `--lib`, other builds of the kernel library (e.g. the previous
commit's, from `.venv/lib/vidspec-kernels/`) run interleaved with the current one, call by call, and their
medians are reported side by side (an A/B of kernel changes; a library must take the current weight layout).
Usage: python benchmarks/native_rows.py --max-frames 64,192,3200 --rows 1,2,4,8,12,16
"""

from __future__ import annotations

import ctypes
import statistics
import time

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)
import torch

from decoders import kernels


def main() -> None:
    p = common.parser(__doc__, "64,192,3200", "benchmarks/results/native-rows.json")
    p.add_argument("--rows", default="1,2,4,8,12,16")
    p.add_argument("--rounds", type=int, default=100, help="interleaved rounds of 5 calls per library")
    p.add_argument("--lib", action="append", default=[], help="another build of the library to compare")
    p.add_argument(
        "--lib-unpacked",
        action="append",
        default=[],
        help="a build from before session 22, which reads the projections as [in, out] (not panel-packed)",
    )
    a = p.parse_args()
    lm, _ = common.model_and_head(a)
    native = lm.fast.native_step()
    assert native is not None, "needs the native kernels"
    current = kernels.load()
    packed = native._w
    unpacked_weights = []  # the [in, out] layout of the builds before panel packing
    for w1, _, wqkv, bqkv, wo, w2, _, wgu, wdown, _ in lm.fast.layers:
        unpacked_weights += [t.detach().contiguous() for t in (w1, wqkv, bqkv, wo, w2, wgu, wdown)]
    unpacked = (ctypes.c_void_p * len(unpacked_weights))(*(t.data_ptr() for t in unpacked_weights))
    libs = {"current": (current, packed)}
    for path, weights in [(x, packed) for x in a.lib] + [(x, unpacked) for x in a.lib_unpacked]:
        libs[path] = (
            common.earlier_build(path, current, ("vidspec_stepn", "vidspec_stepn_scratch")),
            weights,
        )
    rows = []
    for mf in common.frame_counts(a.max_frames):
        session = common.session_at(lm, a.video, mf)
        cache, length = session.cache, session.cache.length
        for n in common.frame_counts(a.rows):
            ids = torch.randint(0, 200, (1, n), generator=torch.Generator().manual_seed(n))
            times: dict[str, list[float]] = {name: [] for name in libs}
            for _ in range(a.rounds):
                for name, (lib, weights) in libs.items():
                    native.lib, native._w = lib, weights
                    native._scratch_need.clear()  # scratch sizes differ between builds
                    t0 = time.perf_counter()
                    for _ in range(5):
                        native.step(ids, length, cache, a.threads)
                        cache.truncate(length)
                    times[name].append((time.perf_counter() - t0) / 5)
            native.lib, native._w = current, packed
            native._scratch_need.clear()
            med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            rows.append({"visual_tokens": session.num_visual_tokens, "rows": n, "ms": med})
            print(
                f"{session.num_visual_tokens:6d} n={n:2d} "
                + "  ".join(f"{k}: {v:.3f} ms" for k, v in med.items())
            )
    common.write_json(a.json, {"model": a.model, "threads": a.threads, "libs": list(libs), "results": rows})


if __name__ == "__main__":
    with torch.inference_mode():
        main()
