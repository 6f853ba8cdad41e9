"""`vidspec bench`: decode speed of every method on one video (or a sample of videos) at several lengths,
side by side.

Contract (DESIGN.md): one entry in `results` per (length, method) with `method`, `visual_tokens`,
`prompt_tokens`, `new_tokens`, `tokens`, `text`, `prefill_s`, `decode_s`, `decode_tokens_per_s`,
`mean_accepted_length`, `acceptance_rate`, `identical_to_vanilla`, `speedup_vs_vanilla`, `speedup_vs_hf`.
Times are medians over repeats; all methods of one length run interleaved in the same process, the running
order rotated by one method per repeat.

Definitions used here:
- `prefill_s`: from the start of the request to the first token's logits. For our methods that is the
  prompt-suffix prefill on the cached `VisualSession` (the visual prefix is built once per length and
  reported separately as `session_prefill_s`); for `hf*` it is the whole prefill inside `generate`
  (vision tower included), measured by a logits processor that timestamps its first call.
- `decode_s`: from the first token to the last; `decode_tokens_per_s` = (new_tokens - 1) / decode_s.
- Several questions (`--question` repeated): every method answers all of them at each length; tokens,
  decode times and speculative counters are summed over the prompts (`decode_tokens_per_s` =
  (new_tokens - prompts) / decode_s), and `identical_to_vanilla` requires every answer to match.
- Several videos (`--video` repeated): the same, over every (video, prompt) pair: each repeat answers every
  prompt on every video, so a row pools the sample; `visual_tokens` is the videos' mean (each video's in
  `visual_tokens_per_video`), `session_prefill_s` the median over the videos.
- `decode_s` with several answers a repeat: the sum over answers of each answer's median over the repeats
  (`answer_median_decode_s`; each repeat's answers in `repeats_answer_decode_s`).
- `speedup_vs_*`: the ratio of the two median decode speeds (the contract's figure);
  `paired_speedup_vs_*`: each answer's time set against the same answer's in the same round (repeat i of
  every method ran in the same round), the median of those ratios taken per answer, which neither the
  machine's drift between rounds nor a pause inside one answer moves (`paired_speedup`).
- `mean_accepted_length` (1 + accepted / cycles with drafts) and `acceptance_rate` (accepted / drafted) count
  every cycle of every repeat (since session 23; before, the last repeat's alone); each repeat's own value is in
  `mean_accepted_length_per_repeat`.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from decoders.engine import Proposer, SpecDecodeStats, run
from decoders.model import VideoLM, VisualInputs, hf_generate_inputs, load_model
from decoders.proposers import router
from decoders.proposers.router import LVSpecSettings
from decoders.proposers.std import StDConfig
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from decoders.video import SamplingConfig, read_video
from infra.cpu import status as cpu_status

OUR_METHODS = ("vanilla", "std", "sparrow", "auto", "lvspec")
HF_METHODS = ("hf", "hf-prompt-lookup")
ALL_METHODS = HF_METHODS + OUR_METHODS
IMPLEMENTED = ALL_METHODS
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEFAULT_QUESTION = "describe the video ."
T = TypeVar("T")


@dataclass
class BenchConfig:
    model: Path
    # one video, or several: then every method answers every prompt on every video in each repeat (one
    # measurement over a sample of videos: rows pool them, `visual_tokens` is their mean)
    video: Path | Sequence[Path]
    fps: float = 2.0
    max_frames: Sequence[int] = (768,)
    question: str | Sequence[str] = DEFAULT_QUESTION  # one prompt, or several answered in turn
    methods: Sequence[str] = ("hf", "vanilla")
    max_new_tokens: int = 64
    temperature: float = 0.0
    repeats: int = 3
    # short decodes are noisy on a shared machine: after `repeats`, keep repeating our methods (interleaved;
    # the hf references stop at `repeats`) until each has `min_decode_s` of decode time, at most `max_repeats`
    min_decode_s: float = 0.0
    max_repeats: int = 40
    # untimed answers per method and video (to the first prompt) before each length's timed repeats (a GPU's
    # first calls load kernels and pick matmul algorithms by shape: without them the first-measured method
    # looks slower; each video's draft-length controllers start warm too); None: 1 off the CPU, 0 on it
    warmup: int | None = None
    ignore_eos: bool = False
    device: str = "auto"
    # auto: float32 on CPU, the checkpoint's dtype elsewhere (decoders.model.default_dtype)
    dtype: str = "auto"
    prompt_lookup_num_tokens: int = 10
    std: StDConfig = field(default_factory=StDConfig)
    sparrow_gamma: int = 6
    sparrow_native: bool = True  # greedy Sparrow drafts in one native call per cycle (decoders.kernels)
    torch_forward: bool = False  # every forward through the torch ops, not the native stack (to compare)
    lvspec: LVSpecSettings = field(default_factory=LVSpecSettings)
    # videos decoded and prepared at once, in threads, ahead of the sessions that use them (PyAV and torch
    # release the GIL: 3200 frames take ~10 s a video; None: min(videos, 4, half the cores)); with more than
    # one, reads overlap the sessions' vision encoding and prefill, whose logged times then include that
    # contention (decode timings never overlap a read: every read of a length ends before its repeats)
    read_workers: int | None = None
    write_router: bool = False
    json_out: Path | None = None
    plot_out: Path | None = None
    log: Callable[[str], None] = field(default=lambda s: print(s, file=sys.stderr, flush=True))

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in ALL_METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {list(ALL_METHODS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {list(DTYPES)}")
        if not self.methods:
            raise ValueError("at least one --method is needed")
        if self.warmup is not None and self.warmup < 0:
            raise ValueError("--warmup must be >= 0")
        if self.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        if self.min_decode_s < 0 or self.max_repeats < self.repeats:
            raise ValueError("need --min-decode-s >= 0 and --max-repeats >= --repeats")
        if any(n < 1 for n in self.max_frames):
            raise ValueError("--max-frames values must be >= 1")
        if not self.questions or not all(q.strip() for q in self.questions):
            raise ValueError("questions must be non-empty")
        if not self.videos:
            raise ValueError("at least one --video is needed")
        if self.read_workers is not None and self.read_workers < 1:
            raise ValueError("--read-workers must be >= 1")

    @property
    def questions(self) -> tuple[str, ...]:
        return (self.question,) if isinstance(self.question, str) else tuple(self.question)

    @property
    def videos(self) -> tuple[Path, ...]:
        return (Path(self.video),) if isinstance(self.video, (str, Path)) else tuple(map(Path, self.video))


@dataclass
class Run:
    tokens: list[int]
    prefill_s: float
    decode_s: float
    stats: SpecDecodeStats | None = None
    answers: list[list[int]] = field(default_factory=list)  # per prompt (set by `merge_runs`)
    methods: list[str] = field(default_factory=list)  # the drafter of each answer (set by `merge_runs`)
    answer_decode_s: list[float] = field(default_factory=list)  # per prompt (set by `merge_runs`)

    @property
    def decode_tokens(self) -> int:
        """Tokens produced after each prompt's first token (what `decode_s` measures)."""
        return len(self.tokens) - max(1, len(self.answers))


def merge_runs(runs: Sequence[Run]) -> Run:
    """One run over several prompts: tokens concatenated, times and speculative counters summed."""
    stats = [r.stats for r in runs]
    return Run(
        tokens=[t for r in runs for t in r.tokens],
        prefill_s=sum(r.prefill_s for r in runs) / len(runs),
        decode_s=sum(r.decode_s for r in runs),
        stats=SpecDecodeStats.combined(stats) if all(s is not None for s in stats) else None,
        answers=[r.tokens for r in runs],
        methods=[r.stats.method for r in runs if r.stats is not None],
        answer_decode_s=[r.decode_s for r in runs],
    )


def answer_median_decode_s(runs: Sequence[Run]) -> float:
    """Decode time of one repeat with every answer at its median over the repeats: the sum over answers
    of each answer's median time. A pause of the host (another process, a clock change) lands in one answer
    of one repeat; a median over whole repeats keeps it whenever pauses hit half the repeats of a method,
    which on a shared launch-bound GPU they did (session 27, H200, 16k: two rows of one computation, Sparrow
    and `auto`, read 1.28-1.33 s and 1.26-1.61 s a repeat). Falls back to the median over repeats where the
    repeats' answers do not line up."""
    per = [r.answer_decode_s for r in runs]
    if not per or not per[0] or any(len(a) != len(per[0]) for a in per):
        return _median([r.decode_s for r in runs])
    return sum(_median([a[j] for a in per]) for j in range(len(per[0])))


class _Clock:
    """A logits processor that timestamps every call: the first is right after `generate`'s prefill."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls.append(time.perf_counter())
        return scores


def run_hf(lm: VideoLM, visual: VisualInputs, prompt: list[int], cfg: DecodeConfig, lookup: int = 0) -> Run:
    from transformers import LogitsProcessorList

    kw = hf_generate_inputs(lm, visual, prompt)
    clock = _Clock()
    extra: dict = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    if cfg.ignore_eos:
        extra["min_new_tokens"] = cfg.max_new_tokens
    if cfg.greedy:
        extra["do_sample"] = False
    else:
        extra.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p)
    if hasattr(lm.model.model, "rope_deltas"):
        lm.model.model.rope_deltas = None
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = lm.model.generate(
            **kw,
            max_new_tokens=cfg.max_new_tokens,
            eos_token_id=list(lm.eos_token_ids),
            pad_token_id=lm.eos_token_ids[-1],
            logits_processor=LogitsProcessorList([clock]),
            **extra,
        )
    t_end = time.perf_counter()
    tokens = out[0, kw["input_ids"].shape[1] :].tolist()
    first = clock.calls[0] if clock.calls else t_end
    last = clock.calls[-1] if clock.calls else t_end
    return Run(tokens=tokens, prefill_s=first - t0, decode_s=last - first)


def run_ours(session: VisualSession, prompt: list[int], cfg: DecodeConfig, proposer: Proposer | None) -> Run:
    res = run(session, prompt, cfg, proposer)
    return Run(tokens=res.tokens, prefill_s=res.stats.prefill_s, decode_s=res.stats.decode_s, stats=res.stats)


def make_proposer(method: str, cfg: BenchConfig, session: VisualSession) -> Proposer | None:
    if method in router.METHODS:
        return router.make_proposer(
            method,
            session,
            std=cfg.std,
            sparrow_gamma=cfg.sparrow_gamma,
            lvspec=cfg.lvspec,
            sparrow_native=cfg.sparrow_native,
        )
    raise NotImplementedError(f"method {method!r} is not available yet (available: {list(IMPLEMENTED)})")


def _methods_for_repeat(cfg: BenchConfig, r: int, runs: dict[str, list[Run]]) -> list[str]:
    """The methods that run in repeat r (0-based): all of them for the first `cfg.repeats`; after that our
    own methods, and only while one of them has less than `cfg.min_decode_s` of decode time in total
    (they keep running together, interleaved, so every method gets the same number of repeats)."""
    if r < cfg.repeats:
        return list(cfg.methods)
    ours = [m for m in cfg.methods if m not in HF_METHODS]
    if r >= cfg.max_repeats or not any(sum(x.decode_s for x in runs[m]) < cfg.min_decode_s for m in ours):
        return []
    return ours


def _answer(
    cfg: BenchConfig,
    method: str,
    lm: VideoLM,
    videos: Sequence[tuple[VisualInputs | None, VisualSession]],
    prompts: list[list[int]],
    dcfg: DecodeConfig,
) -> Run:
    """`method` answers every prompt once on every video (in that order); the runs merged into one."""
    parts = []
    for visual, session in videos:
        for p in prompts:
            if method in HF_METHODS:
                assert visual is not None  # kept whenever an hf method is benchmarked
                lookup = cfg.prompt_lookup_num_tokens if method == "hf-prompt-lookup" else 0
                parts.append(run_hf(lm, visual, p, dcfg, lookup))
            else:
                parts.append(run_ours(session, p, dcfg, make_proposer(method, cfg, session)))
    return merge_runs(parts)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Around a timed answer: garbage collected before, the collector paused during (a collection inside a
    decode is a pause of the host that the method did not cause; on a launch-bound GPU it shows)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _rotated(methods: list[str], r: int) -> list[str]:
    """Repeat r's running order: the list rotated by r, so that no method always runs right after the same
    one (a method that follows another inherits its cache state and the machine's drift of the moment)."""
    if not methods:
        return methods
    k = r % len(methods)
    return methods[k:] + methods[:k]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def read_ahead(
    paths: Sequence[Path], prepare: Callable[[Path], T], workers: int
) -> Iterator[tuple[Path, T, float]]:
    """Yield ``(path, prepare(path), seconds it took)`` in the order of ``paths``, with up to ``workers``
    preparations running in threads ahead of the consumer (at most ``workers`` results held unconsumed)."""

    def timed(path: Path) -> tuple[T, float]:
        t0 = time.perf_counter()
        return prepare(path), time.perf_counter() - t0

    if workers <= 1 or len(paths) <= 1:
        for path in paths:
            yield (path, *timed(path))
        return
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bench-read")
    try:
        pending: deque[Future[tuple[T, float]]] = deque()
        queue = iter(paths)
        for path in itertools.islice(queue, workers):
            pending.append(pool.submit(timed, path))
        for path in paths:
            value, seconds = pending.popleft().result()
            nxt = next(queue, None)
            if nxt is not None:
                pending.append(pool.submit(timed, nxt))
            yield path, value, seconds
            del value
    finally:  # a failure (here or in the caller) does not wait for the reads still in flight
        pool.shutdown(wait=False, cancel_futures=True)


def bench(cfg: BenchConfig) -> dict:
    """Run the benchmark; return the JSON document (also written/plotted when asked)."""
    log = cfg.log
    lm = load_model(cfg.model, device=cfg.device, dtype=DTYPES[cfg.dtype])
    if cfg.torch_forward and lm.fast is not None:
        lm.fast.native_forward = False
    dcfg = DecodeConfig(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=0, ignore_eos=cfg.ignore_eos
    )
    missing = [m for m in cfg.methods if m not in IMPLEMENTED]
    if missing:  # fail before any long work
        raise NotImplementedError(
            f"method(s) {missing} are not available yet (available: {list(IMPLEMENTED)})"
        )
    warmup = cfg.warmup if cfg.warmup is not None else (0 if lm.device.type == "cpu" else 1)
    prompts = [lm.suffix_ids(q) for q in cfg.questions]
    prompt = max(prompts, key=len)
    results: list[dict] = []
    # measured in the order given (the lengths a run must not lose to a time limit first); listed by length
    lengths = list(dict.fromkeys(cfg.max_frames))

    def document(complete: bool) -> dict:
        return {
            "model": str(cfg.model),
            "family": lm.family.value,
            "video": str(cfg.videos[0]) if len(cfg.videos) == 1 else [str(v) for v in cfg.videos],
            "fps": cfg.fps,
            "question": cfg.questions[0] if len(cfg.questions) == 1 else list(cfg.questions),
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "repeats": cfg.repeats,
            "warmup": warmup,
            "min_decode_s": cfg.min_decode_s,
            "max_repeats": cfg.max_repeats,
            "ignore_eos": cfg.ignore_eos,
            "device": str(lm.device),
            "dtype": str(lm.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "blas": cpu_status(),  # whether MKL ran with its fast kernels on this AMD CPU (infra/cpu.py)
            "std_config": dataclasses.asdict(cfg.std),
            "sparrow_config": {"gamma": cfg.sparrow_gamma, "native_draft": cfg.sparrow_native},
            # every decode step and verify pass through the native stack (the default where the kernel applies:
            # CPU, float32; off with --torch-forward)
            "native_forward": bool(
                lm.fast is not None and lm.fast.native_forward and lm.fast.native_step() is not None
            ),
            "results": sorted(results, key=lambda r: r["visual_tokens"]),  # stable: methods keep their order
            "complete": complete,  # False: written after a length, more were to come
        }

    workers = cfg.read_workers or max(1, min(len(cfg.videos), 4, (os.cpu_count() or 2) // 2))
    for li, max_frames in enumerate(lengths, 1):
        items = []  # (visual, session) per video, all held for the length's repeats
        sampling = lm.default_sampling(fps=cfg.fps, max_frames=max_frames)

        def prepare(path: Path, sampling: SamplingConfig = sampling) -> tuple[int, VisualInputs]:
            video = read_video(path, sampling)
            return video.frames.shape[0], lm.prepare_video(video, sampling)

        for vi, (path, (frames, visual), seconds) in enumerate(read_ahead(cfg.videos, prepare, workers), 1):
            which = f" video {vi}/{len(cfg.videos)} ({path.name})" if len(cfg.videos) > 1 else ""
            log(
                f"[{li}/{len(lengths)}] max_frames={max_frames}{which}: {frames} frames -> "
                f"{visual.num_tokens} visual tokens (read {seconds:.1f}s); building session..."
            )
            session = VisualSession.create(lm, visual, headroom=len(prompt) + cfg.max_new_tokens + 64)
            log(f"    session: vision {session.encode_s:.2f}s, prefix prefill {session.prefill_s:.2f}s")
            # the pixels only for `generate` (hf*): at 25.6k visual tokens they are ~0.5 GB a video
            items.append((visual if any(m in HF_METHODS for m in cfg.methods) else None, session))
            del visual
        if cfg.write_router and len({x.num_visual_tokens for _, x in items}) > 1:  # before the long part
            raise ValueError(
                f"--write-router needs one visual length per --max-frames value; at {max_frames} frames the "
                f"videos have {sorted({x.num_visual_tokens for _, x in items})} visual tokens"
            )
        session = items[0][1]
        if li == 1 and cfg.std.compile_draft and any(m in ("std", "auto", "lvspec") for m in cfg.methods):
            t = time.perf_counter()  # compile StD's draft step before anything is timed
            run_ours(session, prompts[0], dcfg, make_proposer("std", cfg, session))
            log(f"    compiled StD's draft step (untimed warm-up, {time.perf_counter() - t:.0f}s)")
        if warmup:  # at every length: a GPU picks its kernels by shape
            t = time.perf_counter()
            for _ in range(warmup):
                for m in cfg.methods:
                    _answer(cfg, m, lm, items, prompts[:1], dcfg)
            log(
                f"    warm-up: {warmup} untimed answer(s) per method and video "
                f"({time.perf_counter() - t:.1f}s)"
            )
        runs: dict[str, list[Run]] = {m: [] for m in cfg.methods}
        for r in range(cfg.max_repeats):
            methods = _methods_for_repeat(cfg, r, runs)
            if not methods:
                break
            for m in _rotated(methods, r):  # interleaved, rotated: drift hits every method alike
                t = time.perf_counter()
                with _collector_paused():
                    one = _answer(cfg, m, lm, items, prompts, dcfg)
                runs[m].append(one)
                n = len(one.tokens)
                tps = one.decode_tokens / one.decode_s if one.decode_s > 0 else 0.0
                log(
                    f"    repeat {r + 1} {m:>16}: {n} tokens, prefill {one.prefill_s:.3f}s, "
                    f"decode {tps:.1f} tok/s ({time.perf_counter() - t:.1f}s)"
                )
        tokens = [x.num_visual_tokens for _, x in items]
        rows = {
            m: _summarise(m, runs[m], tokens, len(prompt), lm, [x for _, x in items]) for m in cfg.methods
        }
        base_v, base_h = rows.get("vanilla"), rows.get("hf")
        for m, row in rows.items():
            same = runs[m][-1].answers == runs["vanilla"][-1].answers if base_v else None
            row["identical_to_vanilla"] = same
            row["speedup_vs_vanilla"] = _ratio(row, base_v)
            row["speedup_vs_hf"] = _ratio(row, base_h)
            row["paired_speedup_vs_vanilla"] = paired_speedup(row, base_v)
            row["paired_speedup_vs_hf"] = paired_speedup(row, base_h)
            results.append(row)
        if cfg.json_out and li < len(lengths):  # what is done survives a time limit or a crash
            Path(cfg.json_out).write_text(json.dumps(document(complete=False), indent=2))
    doc = document(complete=True)
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(doc, indent=2))
        log(f"wrote {cfg.json_out}")
    if cfg.write_router:
        threshold, evidence = calibrate_router(results)
        threads = torch.get_num_threads()
        path = router.write_router(cfg.model, threshold, evidence, threads=threads, device=lm.device.type)
        doc["router_threshold_visual_tokens"] = threshold
        where = f"{threads} threads" if lm.device.type == "cpu" else lm.device.type
        log(f"router ({where}): sparrow below {threshold} visual tokens, std at or above; wrote {path}")
    if cfg.plot_out:
        plot(doc, Path(cfg.plot_out))
        log(f"wrote {cfg.plot_out}")
    return doc


def calibrate_router(results: list[dict]) -> tuple[int, dict]:
    """The visual length from which `auto` uses StD instead of Sparrow, from measured rows.

    Candidates: 0 (StD everywhere), the geometric mean of each pair of neighbouring lengths, and a huge
    number (Sparrow everywhere). Each is scored by the decode-speed loss it causes at every measured length,
    1 - tok/s(chosen) / tok/s(better of the two); the threshold with the smallest worst-case loss wins (then
    the smallest total loss). A single noisy crossover cannot flip the choice for all longer videos.
    """
    tps = {(r["method"], r["visual_tokens"]): r["decode_tokens_per_s"] or 0.0 for r in results}
    lengths = sorted({n for m, n in tps if m in ("std", "sparrow")})
    if not all(("std", n) in tps and ("sparrow", n) in tps for n in lengths) or not lengths:
        raise ValueError("--write-router needs both --method std and --method sparrow")
    evidence = {str(n): {"std": tps[("std", n)], "sparrow": tps[("sparrow", n)]} for n in lengths}
    candidates = [0, *(round(math.sqrt(a * b)) for a, b in itertools.pairwise(lengths)), 10**9]

    def losses(threshold: int) -> list[float]:
        out = []
        for n in lengths:
            std, sparrow = tps[("std", n)], tps[("sparrow", n)]
            chosen = std if n >= threshold else sparrow
            out.append(1.0 - chosen / max(std, sparrow, 1e-12))
        return out

    best = min(candidates, key=lambda t: (round(max(losses(t)), 6), sum(losses(t))))
    return best, evidence


def _summarise(
    method: str,
    runs: list[Run],
    visual_tokens: list[int],
    prompt_tokens: int,
    lm: VideoLM,
    sessions: list[VisualSession],
) -> dict:
    """One row: `runs` are the repeats (each answered every prompt on every video); `visual_tokens` and
    `sessions` one per video."""
    last = runs[-1]
    decode_s = answer_median_decode_s(runs)
    n = len(last.tokens)
    stats = last.stats
    # accepted length and acceptance over every cycle of every repeat (until session 23: the last repeat's
    # alone, which followed whatever draft lengths the controller chose in that one repeat)
    every = [r.stats for r in runs]
    pooled = SpecDecodeStats.combined(every) if stats and all(s is not None for s in every) else None
    session_s = _median([x.encode_s + x.prefill_s for x in sessions])
    return {
        "method": method,
        "visual_tokens": round(statistics.mean(visual_tokens)),
        **({"visual_tokens_per_video": visual_tokens} if len(visual_tokens) > 1 else {}),
        "prompt_tokens": prompt_tokens,
        "new_tokens": n,
        "tokens": last.tokens,
        "text": lm.decode(last.tokens),
        "prefill_s": _median([r.prefill_s for r in runs]),
        "session_prefill_s": session_s if method in OUR_METHODS else None,  # median over the videos
        "decode_s": decode_s,
        "decode_tokens_per_s": last.decode_tokens / decode_s if decode_s > 0 else None,
        # `auto` may pick a different drafter for videos of different lengths: then "sparrow+std"
        "method_used": "+".join(sorted(set(last.methods)))
        if last.methods
        else (stats.method if stats else method),
        "mean_accepted_length": pooled.mean_accepted_length if pooled else None,
        "acceptance_rate": pooled.acceptance_rate if pooled else None,
        "mean_accepted_length_per_repeat": [r.stats.mean_accepted_length for r in runs] if pooled else None,
        "repeats": len(runs),
        "repeats_decode_s": [r.decode_s for r in runs],
        "repeats_answer_decode_s": [r.answer_decode_s for r in runs],
        # the estimator of `decode_s` up to session 26 (the median over whole repeats)
        "decode_s_median_of_repeats": _median([r.decode_s for r in runs]),
        **_breakdown(runs),
    }


def _breakdown(runs: list[Run]) -> dict:
    """Cost of one cycle, medians over repeats: draft step, verify pass, gather, everything else."""
    if not runs[0].stats:
        return {}
    out: dict = {}
    steps = [r.stats for r in runs if r.stats and r.stats.num_steps]
    if steps:
        out["step_s"] = _median([s.decode_s / s.num_steps for s in steps])  # one cycle (vanilla: one token)
        out["verify_s"] = _median([s.verify_s / s.num_steps for s in steps])
        out["cycle_overhead_s"] = _median(
            [(s.decode_s - s.verify_s - s.draft_s) / s.num_steps for s in steps]
        )
    drafted = [r.stats for r in runs if r.stats and r.stats.num_draft_tokens]
    if drafted:
        out["draft_step_s"] = _median([s.draft_s / s.num_draft_tokens for s in drafted])
        out["draft_tokens_per_cycle"] = _median([s.num_draft_tokens / s.num_drafts for s in drafted])
        out["accepted_per_pos"] = drafted[-1].accepted_per_pos
    extra = runs[-1].stats.extra if runs[-1].stats else {}
    out.update({k: v for k, v in extra.items() if isinstance(v, (int, float))})
    return out


def per_repeat_speedups(row: dict, base: dict | None) -> list[float]:
    """Speedup of `row` over `base` in each repeat: repeat i of every method ran in the same round of the
    interleaved loop, minutes apart at most, so the machine's drift between rounds cancels in each pair."""
    if not base or not row.get("decode_tokens_per_s") or not base.get("decode_tokens_per_s"):
        return []
    a, b = row.get("repeats_decode_s") or [], base.get("repeats_decode_s") or []
    tokens = _decode_token_ratio(row, base)
    return [tokens * y / x for x, y in zip(a, b) if x > 0 and y > 0]


def _decode_token_ratio(row: dict, base: dict) -> float:
    """Decode tokens of `row` over `base`'s (each the same in every repeat; 1 when the answers match)."""
    return (row["decode_tokens_per_s"] * row["decode_s"]) / (base["decode_tokens_per_s"] * base["decode_s"])


def per_answer_paired_speedup(row: dict, base: dict | None) -> float | None:
    """Pairs answer by answer: for answer j, the median over rounds of base's time over row's (both ran in
    round i, seconds apart), applied to base's median time of that answer; summed over the answers. A pause of
    the host inside one answer of one repeat moves one ratio of that answer's median, not a whole repeat's
    total. None where the rows lack per-answer times or their answers do not line up."""
    if not base or not row.get("decode_tokens_per_s") or not base.get("decode_tokens_per_s"):
        return None
    a, b = row.get("repeats_answer_decode_s") or [], base.get("repeats_answer_decode_s") or []
    if not a or not b or not a[0] or any(len(x) != len(a[0]) for x in (*a, *b)):
        return None
    base_s = row_s = 0.0
    for j in range(len(a[0])):
        ratios = [y[j] / x[j] for x, y in zip(a, b) if x[j] > 0 and y[j] > 0]
        if not ratios:
            return None
        base_j = _median([y[j] for y in b])
        base_s += base_j
        row_s += base_j / _median(ratios)
    return _decode_token_ratio(row, base) * base_s / row_s if row_s > 0 else None


def paired_speedup(row: dict, base: dict | None) -> float | None:
    """`per_answer_paired_speedup` where the rows have per-answer times (since session 27), else the median
    of `per_repeat_speedups`. The ratio of the two medians (`speedup_vs_*`) can set one method's fast rounds
    against another's slow ones when the machine drifts within a length; pairing cannot (on the Dec 3
    evening run at 4k: two rows of the same computation, Sparrow and `auto`, read 1.38x and 1.10x as a ratio
    of medians, 1.56x and 1.56x paired). Pairing whole repeats still keeps a pause that hits half of them
    (session 27, H200, 16k: Sparrow and `auto` 0.947 paired by repeat, 0.995 by per-answer medians)."""
    per_answer = per_answer_paired_speedup(row, base)
    if per_answer is not None:
        return per_answer
    ratios = per_repeat_speedups(row, base)
    return _median(ratios) if ratios else None


def _ratio(row: dict, base: dict | None) -> float | None:
    if not base or not row["decode_tokens_per_s"] or not base["decode_tokens_per_s"]:
        return None
    return row["decode_tokens_per_s"] / base["decode_tokens_per_s"]


def plot(doc: dict, out: Path) -> None:
    """Decode tokens/s against visual tokens per method; with speculative methods, also the speedup over
    vanilla and the mean accepted length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    spec = any(r["mean_accepted_length"] for r in rows)
    panels = [("decode_tokens_per_s", "decode tokens / s")]
    if spec and any(r["speedup_vs_vanilla"] for r in rows):
        panels += [
            ("speedup_vs_vanilla", "decode speedup vs vanilla"),
            ("mean_accepted_length", "mean accepted length"),
        ]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for m in methods:
            pts = sorted(
                (r["visual_tokens"], r[key]) for r in rows if r["method"] == m and r[key] is not None
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_xscale("log")
        ax.set_xlabel("visual tokens")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{Path(doc['model']).name} ({doc['family']}, {doc['device']}, {doc['threads']} threads)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def format_table(doc: dict) -> str:
    """A Markdown table of the results (for the README); `auto` rows name the method it resolved to."""

    def f(x: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if x is None else fmt.format(x)

    lines = [
        "| visual tokens | method | new tokens | decode tok/s | speedup vs vanilla | paired speedup vs vanilla "
        "| speedup vs hf | mean accepted length | acceptance | identical |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    vanilla = {r["visual_tokens"]: r for r in doc["results"] if r["method"] == "vanilla"}
    for r in doc["results"]:
        used = r.get("method_used", r["method"])
        method = r["method"] if used == r["method"] else f"{r['method']} ({used})"
        paired = r.get("paired_speedup_vs_vanilla") or paired_speedup(r, vanilla.get(r["visual_tokens"]))
        lines.append(
            f"| {r['visual_tokens']} | {method} | {r['new_tokens']} | {f(r['decode_tokens_per_s'], '{:.1f}')} "
            f"| {f(r['speedup_vs_vanilla'])} | {f(paired)} | {f(r['speedup_vs_hf'])} "
            f"| {f(r['mean_accepted_length'])} | {f(r['acceptance_rate'])} | {r['identical_to_vanilla']} |"
        )
    return "\n".join(lines)
