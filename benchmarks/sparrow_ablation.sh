#!/usr/bin/env bash
# Reproduces the README's Sparrow ablation on the shipped reference model: trains the variant heads with the
# shipped head's data, steps and seed (into runtime/heads/, ~5-15 min each on one core), then measures them
# beside the shipped head ("full") and its visual-attending variant at ~1.5k and 25.6k visual tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-models/vidspec-reference}
[ -f runtime/ref-long.mp4 ] || .venv/bin/vidspec make-video --out runtime/ref-long.mp4 --duration 1700 --fps 2 --size 224x224 --seed 424242
common=(--target "$MODEL" --videos 60 --long-videos 4 --long-duration 600 --steps 4000 --minutes 40 --threads 1)
.venv/bin/vidspec train-draft "${common[@]}" --mtp-steps 1 --no-ivsb --out runtime/heads/no-ivsb
.venv/bin/vidspec train-draft "${common[@]}" --mtp-steps 3 --out runtime/heads/mtp3
.venv/bin/python benchmarks/sparrow_ablation.py --model "$MODEL" --video runtime/ref-long.mp4 --max-frames 192,3200 \
  --heads "full=$MODEL,no-ivsb=runtime/heads/no-ivsb,mtp3=runtime/heads/mtp3" --json benchmarks/results/sparrow-ablation.json
