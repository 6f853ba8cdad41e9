#!/usr/bin/env bash
# Issue 4's GPU check: StD vs vanilla (and stock generate) on a random-weight Qwen2-VL whose language model
# has the shape of Qwen2-VL-7B (decoders/tiny.py size "7b", bf16), at ~16k visual tokens, on one GPU.
# Random weights decide nothing about acceptance: read the speedup together with the mean accepted length it
# reports, and compare with benchmarks/roofline.py run at that same accepted length.
# Runs in about 5 minutes on one H200 (checkpoint build ~1-2 min, 16k prefill, 3 methods x 2 repeats).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runtime/gpu}
CKPT=${CKPT:-runtime/q7b}
FRAMES=${FRAMES:-512}  # 224x224 frames: 64 visual tokens per 2 frames -> 16384 tokens
mkdir -p "$OUT" runtime
[ -f "$CKPT/config.json" ] || .venv/bin/vidspec make-tiny-model --size 7b --init-std 0.02 --dtype bfloat16 --out "$CKPT"
[ -f runtime/gpu-video.mp4 ] || .venv/bin/vidspec make-video --out runtime/gpu-video.mp4 --duration 300 --fps 2 --size 224x224 --seed 7
.venv/bin/vidspec bench --model "$CKPT" --device cuda --video runtime/gpu-video.mp4 --fps 2 --max-frames "$FRAMES" \
  --method vanilla --method std --method hf --repeats 2 --max-new-tokens 128 --ignore-eos \
  --json "$OUT/gpu-std-7b.json"
echo "compare with: .venv/bin/python benchmarks/roofline.py --tau <mean accepted length above> --gamma 6"
