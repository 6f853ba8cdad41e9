#!/usr/bin/env bash
# Reproduces the README tables for StD / Sparrow / auto on the shipped reference model:
#  1. calibrates the router (std vs sparrow at each length; writes MODEL/sparrow/router.json),
#  2. runs every method side by side at ~0.5k, 1k, 1.5k, 4k, 16k and 25.6k visual tokens.
# Every method answers the four caption requests at each length (times and counters summed).
# The model samples 112x112 frames (8 visual tokens per frame) at 2 fps from a 28-minute synthetic video.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-models/vidspec-reference}
out=${OUT:-benchmarks/results}
threads=${THREADS:-1}
suffix=${SUFFIX:-}  # e.g. SUFFIX=-v4s: results named reference-*-v4s.json (the older results stay)
mkdir -p runtime "$out"
[ -f runtime/ref-long.mp4 ] || .venv/bin/vidspec make-video --out runtime/ref-long.mp4 --duration 1700 --fps 2 --size 224x224 --seed 424242
frames=64,128,192,512,2048,3200
# the four caption requests the model was trained with: ~4x the decoded tokens of one answer per measurement
qs=(--question "describe the video ." --question "what happens in the video ?" \
    --question "describe what happens ." --question "caption the video .")
.venv/bin/vidspec bench --model "$MODEL" --video runtime/ref-long.mp4 --fps 2 --max-frames "$frames" \
  --method std --method sparrow "${qs[@]}" --repeats 5 --min-decode-s 8 --max-repeats 60 --max-new-tokens 96 --threads "$threads" --write-router \
  --json "$out/reference-router-calibration$suffix.json"
.venv/bin/vidspec bench --model "$MODEL" --video runtime/ref-long.mp4 --fps 2 --max-frames "$frames" \
  --method vanilla --method std --method sparrow --method auto --method hf --method hf-prompt-lookup \
  "${qs[@]}" --repeats 5 --min-decode-s 8 --max-repeats 60 --max-new-tokens 96 --threads "$threads" \
  --json "$out/reference-methods$suffix.json" --plot "$out/reference-methods$suffix.png"
