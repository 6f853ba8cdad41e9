#!/usr/bin/env bash
# The issue-5 methods table over a SAMPLE of videos instead of the one bench video: N held-out worlds drawn
# like it (28 minutes, 2 fps, 224x224; seeds from 1_000_200_000, never trained on, the same worlds as
# `benchmarks/sparrow_heads.py --worlds`), every method answering the four caption requests on every world
# in each repeat, at the main run's six lengths. One video's four answers are a small sample (Sparrow's
# accepted length at 1.5k varies 3.1-8.4 between such worlds); the rows here pool N of them.
# The router is the shipped one (calibrated on the bench video); nothing is written to the model.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-models/vidspec-reference}
out=${OUT:-benchmarks/results}
n=${WORLDS:-8}
threads=${THREADS:-1}
name=${NAME:-reference-methods-worlds}
mkdir -p runtime/bench-worlds "$out"
videos=()
for i in $(seq 0 $((n - 1))); do
  seed=$((1000200000 + i))
  v=runtime/bench-worlds/world-$seed-1700s.mp4
  [ -f "$v" ] || .venv/bin/vidspec make-video --out "$v" --duration 1700 --fps 2 --size 224x224 --seed "$seed"
  videos+=(--video "$v")
done
qs=(--question "describe the video ." --question "what happens in the video ?" \
    --question "describe what happens ." --question "caption the video .")
.venv/bin/vidspec bench --model "$MODEL" "${videos[@]}" --fps 2 --max-frames "${FRAMES:-64,128,192,512,2048,3200}" \
  $(for m in ${METHODS:-vanilla std sparrow auto hf-prompt-lookup}; do echo --method "$m"; done) \
  "${qs[@]}" --repeats 2 --min-decode-s 8 --max-repeats 20 --max-new-tokens 96 --threads "$threads" \
  --json "$out/$name.json" --plot "$out/$name.png"
