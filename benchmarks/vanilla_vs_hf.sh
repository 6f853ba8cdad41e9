#!/usr/bin/env bash
# Reproduces the README table "vanilla vs stock generate": a tiny random-weight Qwen2-VL (hidden 256,
# 4 layers, GQA 4/2) on a 448x448 synthetic video at ~1k, 4k, 16k and 25.6k visual tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results}
mkdir -p runtime "$out"
[ -f runtime/tiny-bench/config.json ] || .venv/bin/vidspec make-tiny-model --family qwen2_vl --size bench --seed 0 --out runtime/tiny-bench
[ -f runtime/v448.mp4 ] || .venv/bin/vidspec make-video --out runtime/v448.mp4 --duration 400 --fps 2 --size 448x448 --seed 1
.venv/bin/vidspec bench --model runtime/tiny-bench --video runtime/v448.mp4 --fps 2 --max-frames 8,32,128,200 \
  --method hf --method hf-prompt-lookup --method vanilla --repeats 3 --max-new-tokens 64 --ignore-eos --threads "${THREADS:-1}" \
  --json "$out/issue2-vanilla-vs-hf.json" --plot "$out/issue2-vanilla-vs-hf.png"
