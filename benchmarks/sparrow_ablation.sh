#!/usr/bin/env bash
# Reproduces the README's Sparrow ablation on the reference model: trains the variant heads with the earlier
# head's recipe (60 short + 4 long videos, 4000 steps, seed 0; into runtime/heads/, ~5-15 min each on one
# core), measures them at ~1.5k and 25.6k visual tokens ("full" = IVSB + MTP 1, and its visual-attending
# variant), then compares that recipe with the shipped head's (10x the data, 12000 steps, MTP 3) by
# acceptance on held-out worlds (benchmarks/sparrow_heads.py).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-models/vidspec-reference}
[ -f runtime/ref-long.mp4 ] || .venv/bin/vidspec make-video --out runtime/ref-long.mp4 --duration 1700 --fps 2 --size 224x224 --seed 424242
common=(--target "$MODEL" --videos 60 --long-videos 4 --long-duration 600 --steps 4000 --minutes 40 --threads 1)
.venv/bin/vidspec train-draft "${common[@]}" --mtp-steps 1 --out runtime/heads/full
.venv/bin/vidspec train-draft "${common[@]}" --mtp-steps 1 --no-ivsb --out runtime/heads/no-ivsb
.venv/bin/vidspec train-draft "${common[@]}" --mtp-steps 3 --out runtime/heads/mtp3
.venv/bin/python benchmarks/sparrow_ablation.py --model "$MODEL" --video runtime/ref-long.mp4 --max-frames 192,3200 \
  --heads "full=runtime/heads/full,no-ivsb=runtime/heads/no-ivsb,mtp3=runtime/heads/mtp3" --json benchmarks/results/sparrow-ablation.json
# the shipped head: `vidspec train-draft --target MODEL --videos 600 --long-videos 16 --long-duration 600 --steps 12000
# --mtp-steps 3`; the same data with MTP 1 for comparison
data10=(--target "$MODEL" --videos 600 --long-videos 16 --long-duration 600 --steps 12000 --minutes 30 --threads 1)
.venv/bin/vidspec train-draft "${data10[@]}" --mtp-steps 1 --out runtime/heads/data10x
.venv/bin/python benchmarks/sparrow_heads.py --model "$MODEL" --short 10 --long 2 \
  --heads "60-videos-mtp1=runtime/heads/full,600-videos-mtp1=runtime/heads/data10x,600-videos-mtp3-shipped=$MODEL" \
  --json benchmarks/results/sparrow-heads.json
