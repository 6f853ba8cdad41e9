"""The `vidspec` command line. Parses arguments at the edge and hands frozen configs to the code below."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pipeline.service_cli import REFERENCE_MODEL, add_service_commands

RUNTIME_DIR = Path(os.environ.get("VIDSPEC_RUNTIME_DIR", "runtime"))


def _env_defaults() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str((RUNTIME_DIR / "inductor").resolve()))


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _size(s: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, got {s!r}") from None
    return w, h


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    import torch

    from decoders.proposers.router import LVSpecSettings
    from decoders.proposers.std import StDConfig
    from pipeline.bench import BenchConfig, bench, format_table

    torch.set_num_threads(args.threads or min(2, os.cpu_count() or 1))
    cfg = BenchConfig(
        model=Path(args.model),
        video=[Path(v) for v in args.video],
        fps=args.fps,
        max_frames=args.max_frames,
        question=args.question or "describe the video .",
        methods=args.method or ["hf", "vanilla"],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        repeats=args.repeats,
        min_decode_s=args.min_decode_s,
        max_repeats=max(args.max_repeats, args.repeats),
        ignore_eos=args.ignore_eos,
        read_workers=args.read_workers,
        std=StDConfig(
            budget=args.std_budget,
            gamma=args.gamma,
            adaptive=not args.fixed_gamma,
            refresh_every=StDConfig.refresh_every if args.std_refresh is None else args.std_refresh,
            refresh_decay=StDConfig.refresh_decay
            if args.std_refresh_decay is None
            else args.std_refresh_decay,
            compile_draft=args.std_compile_draft,
            native_draft=not args.std_torch_draft,
            selection=args.std_selection,
        ),
        sparrow_gamma=args.sparrow_gamma,
        sparrow_native=not args.sparrow_torch_draft,
        torch_forward=args.torch_forward,
        lvspec=LVSpecSettings(
            base=args.lvspec_base,
            lam=args.lam,
            relevance_threshold=args.relevance_threshold,
            shift_window=args.shift_window,
            representation=args.relevance_repr,
        ),
        write_router=args.write_router,
        device=args.device,
        dtype=args.dtype,
        warmup=args.warmup,
        json_out=Path(args.json) if args.json else None,
        plot_out=Path(args.plot) if args.plot else None,
    )
    doc = bench(cfg)
    print(format_table(doc))
    if not args.json:
        print(
            json.dumps({"results": [{k: v for k, v in r.items() if k != "tokens"} for r in doc["results"]]})
        )
    return 0


def cmd_make_video(args: argparse.Namespace) -> int:
    from decoders.train.world import make_video

    w, h = args.size
    t0 = time.perf_counter()
    path = make_video(args.out, args.duration, args.fps, w, h, args.seed, codec=args.codec)
    print(
        f"wrote {path} ({args.duration:g}s at {args.fps:g} fps, {w}x{h}, seed {args.seed}) in {time.perf_counter() - t0:.1f}s"
    )
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    import torch

    from decoders.tiny import build_tiny_checkpoint

    out = build_tiny_checkpoint(
        args.family,
        args.out,
        size=args.size,
        seed=args.seed,
        init_std=args.init_std,
        dtype=getattr(torch, args.dtype),
        device=args.device,
    )
    print(f"wrote a random-weight {args.family} checkpoint ({args.size}) to {out}")
    return 0


PASSTHROUGH = ("train-reference", "eval", "train-draft")


def cmd_passthrough(args: argparse.Namespace) -> int:
    """`train-reference` and `eval` keep their own argument parsers (their modules' `main`)."""
    if args.command == "train-reference":
        from decoders.train.reference import main as run_main
    elif args.command == "train-draft":
        from decoders.train.draft import main as run_main
    else:
        from decoders.train.eval import main as run_main
    return run_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vidspec", description="Fast video understanding with video LLMs.")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="decode speed of methods side by side at several video lengths")
    b.add_argument(
        "--model",
        default=str(REFERENCE_MODEL),
        help="local checkpoint directory (default: the reference model)",
    )
    b.add_argument(
        "--video",
        required=True,
        action="append",
        help="video file; repeatable: a sample of videos, every method answers on each in every repeat",
    )
    b.add_argument("--fps", type=float, default=2.0)
    b.add_argument(
        "--max-frames",
        type=_int_list,
        default=[768],
        help="N[,N...]: one length per value, measured in the order given (listed by length)",
    )
    b.add_argument(
        "--question",
        action="append",
        help="repeatable: every method answers each (default: a caption request)",
    )
    b.add_argument("--method", action="append", help="repeatable: hf, hf-prompt-lookup, vanilla, std, ...")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument(
        "--min-decode-s",
        type=float,
        default=0.0,
        help="after --repeats, repeat our methods until each has this much decode time (noisy short decodes)",
    )
    b.add_argument("--max-repeats", type=int, default=40, help="cap for --min-decode-s")
    b.add_argument(
        "--read-workers",
        type=int,
        help="videos decoded at once, ahead of their sessions (default: min(videos, 4, half the cores))",
    )
    b.add_argument(
        "--warmup",
        type=int,
        help="untimed answers (to the first question) per method and video before each length "
        "(default: 1 on a GPU, 0 on the CPU)",
    )
    b.add_argument("--device", default="auto")
    b.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV cache (auto: float32 on CPU, the checkpoint's own dtype elsewhere)",
    )
    b.add_argument(
        "--ignore-eos", action="store_true", help="always decode --max-new-tokens (random weights)"
    )
    b.add_argument(
        "--std-budget", type=int, default=1024, help="StD draft-cache entries: top-K visual + text"
    )
    b.add_argument(
        "--std-refresh",
        type=int,
        help="StD: re-select the top-K visual entries every N cycles from where the answer looks "
        "(0: never; default: StDConfig's)",
    )
    b.add_argument(
        "--std-refresh-decay", type=float, help="StD: per-cycle weight of older scores (default: StDConfig's)"
    )
    b.add_argument(
        "--std-compile-draft",
        action="store_true",
        help="StD: draft steps through torch.compile (compiled once, untimed, before the first length)",
    )
    b.add_argument(
        "--std-torch-draft",
        action="store_true",
        help="StD: draft steps through the torch forward instead of the native one-call step (to compare)",
    )
    b.add_argument(
        "--std-selection",
        default="shared",  # decoders.proposers.std.SELECTIONS (not imported here: the parser stays light)
        choices=["shared", "per_head"],
        help="StD: one top-K for all layers and KV heads (shared) or the paper's per layer and KV head",
    )
    b.add_argument("--gamma", type=int, default=6, help="initial StD draft length")
    b.add_argument("--fixed-gamma", action="store_true", help="switch off the adaptive draft length")
    b.add_argument("--sparrow-gamma", type=int, default=6, help="initial Sparrow draft length")
    b.add_argument(
        "--sparrow-torch-draft",
        action="store_true",
        help="Sparrow: one torch step per draft token instead of the native one-call chain (to compare)",
    )
    b.add_argument(
        "--torch-forward",
        action="store_true",
        help="every decode step and verify pass through torch ops instead of the native stack (to compare)",
    )
    b.add_argument("--lvspec-base", default="std", choices=["std", "sparrow"], help="drafter under lvspec")
    b.add_argument("--lam", type=float, default=0.5, help="lvspec relaxation ratio (0 = lossless)")
    b.add_argument("--relevance-threshold", type=float, default=0.3, help="lvspec anchor threshold")
    b.add_argument("--shift-window", type=int, default=0, help="lvspec position-shift tolerance")
    b.add_argument("--relevance-repr", default="input", choices=["input", "final"])
    b.add_argument(
        "--write-router", action="store_true", help="store the std/sparrow threshold beside the model"
    )
    b.add_argument("--threads", type=int, default=0, help="torch threads (0: min(2, cores))")
    b.add_argument("--json", help="write the JSON results here")
    b.add_argument("--plot", help="write a PNG plot of decode tokens/s against visual tokens here")
    b.set_defaults(func=cmd_bench)

    v = sub.add_parser("make-video", help="write a deterministic synthetic video (moving coloured shapes)")
    v.add_argument("--out", required=True)
    v.add_argument("--duration", type=float, default=60.0, help="seconds")
    v.add_argument("--fps", type=float, default=4.0)
    v.add_argument("--size", type=_size, default=(224, 224), help="WIDTHxHEIGHT")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--codec", default="h264", choices=["h264", "mpeg4", "vp9"])
    v.set_defaults(func=cmd_make_video)

    t = sub.add_parser("make-tiny-model", help="write a tiny random-weight checkpoint (tests, benchmarks)")
    t.add_argument("--family", default="qwen2_vl", choices=["qwen2_vl", "qwen2_5_vl", "llava_onevision"])
    t.add_argument("--out", required=True)
    t.add_argument("--size", default="bench", choices=["test", "bench", "7b"])
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--init-std", type=float, default=0.2, help="weight init (0.02 for the 7b shape)")
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    t.add_argument(
        "--device", default="cpu", help="where the weights are drawn (cuda: the 7b shape in seconds)"
    )
    t.set_defaults(func=cmd_make_tiny_model)

    for name, text in (  # parsed by their own modules (see PASSTHROUGH in `main`)
        ("train-reference", "train the reference video LLM (resumable; see --help of the command)"),
        ("eval", "answer quality (QA, captions) on held-out videos, for any decoding method"),
    ):
        pt = sub.add_parser(name, help=text, add_help=False)
        pt.add_argument("rest", nargs=argparse.REMAINDER)
        pt.set_defaults(func=cmd_passthrough)

    td = sub.add_parser(
        "train-draft", help="train a Sparrow draft head for a target checkpoint", add_help=False
    )
    td.add_argument("rest", nargs=argparse.REMAINDER)
    td.set_defaults(func=cmd_passthrough)

    add_service_commands(sub)  # serve, submit, status, result, cancel, demo (pipeline/service_cli.py)
    return p


def main(argv: list[str] | None = None) -> int:
    _env_defaults()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASSTHROUGH:  # these commands own their argument parsers
        return cmd_passthrough(argparse.Namespace(command=argv[0], rest=argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, NotImplementedError, FileNotFoundError) as exc:
        print(f"vidspec {args.command}: error: {exc}", file=sys.stderr)
        return 2


def entry() -> None:
    """The `vidspec` console script: on AMD CPUs first re-execute with MKL's fast kernels (infra/cpu.py)."""
    from infra.cpu import ensure_fast_blas

    ensure_fast_blas()
    sys.exit(main())


if __name__ == "__main__":
    entry()
