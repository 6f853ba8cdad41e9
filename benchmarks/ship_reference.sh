#!/usr/bin/env bash
# Ships an exported reference-model candidate as models/vidspec-reference, after its `vidspec eval`:
#  1. copies the model files of the export (not its training-only aux head),
#  2. trains its Sparrow draft head (the card's recipe; DRAFT_MINUTES caps the optimisation),
#  3. measures its attention sparsity and the head's draft lengths (side by side, one thread each),
#  4. calibrates the router on one thread (the bench video, four caption requests),
#  5. rebuilds the model card from the eval, the sparsity and the notes (and, where it exists,
#     benchmarks/results/reference-NAME-eval-pooled.json: every block of held-out videos, `vidspec eval --pool`).
#
#   benchmarks/ship_reference.sh runtime/v12-export v12    # needs benchmarks/results/reference-v12-eval.json
#
# The previous model is copied to runtime/shipped-before-NAME first (outside git), to restore it if a step fails.
# FROM_STEP=N (default 1) starts at step N, e.g. after a later step failed: the steps before it are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
export_dir=${1:?usage: ship_reference.sh EXPORT_DIR NAME}
name=${2:?usage: ship_reference.sh EXPORT_DIR NAME}
model=models/vidspec-reference
results=benchmarks/results
eval_json=$results/reference-$name-eval.json
draft_minutes=${DRAFT_MINUTES:-30}
from_step=${FROM_STEP:-1}
[ -f "$eval_json" ] || { echo "no $eval_json: run vidspec eval on the export first" >&2; exit 2; }
[ -f "$export_dir/model.safetensors" ] || { echo "$export_dir holds no exported model" >&2; exit 2; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_SDPA_FORCE_GQA=1
LD_PRELOAD="$(.venv/bin/python -m infra.cpu preload)"
export LD_PRELOAD
py=.venv/bin/python
mkdir -p runtime
stamp() { echo "[$(date +%H:%M:%S)] $*"; }

if [ "$from_step" -le 1 ]; then
stamp "1/5 model files from $export_dir"
rm -rf "runtime/shipped-before-$name"
cp -r "$model" "runtime/shipped-before-$name"
find "$model" -mindepth 1 -delete
for f in config.json generation_config.json model.safetensors preprocessor_config.json tokenizer.json \
  tokenizer_config.json chat_template.jinja training_info.json; do
  cp "$export_dir/$f" "$model/$f"
done
fi

if [ "$from_step" -le 2 ]; then
stamp "2/5 Sparrow head ($draft_minutes min of optimisation at most)"
.venv/bin/vidspec train-draft --target "$model" --videos 600 --long-videos 16 --long-duration 600 --steps 14000 \
  --minutes "$draft_minutes" --mtp-steps 3 --argmax-weight 1 --threads 2 \
  >"$results/sparrow-head-training-$name.log" 2>&1
fi

if [ "$from_step" -le 3 ]; then
stamp "3/5 sparsity and draft lengths"
$py -m decoders.train.sparsity --model "$model" --lengths short,long --n-videos 3 --threads 1 \
  --json "$results/reference-$name-sparsity.json" >"runtime/sparsity-$name.log" 2>&1 &
sparsity_pid=$!
$py benchmarks/sparrow_heads.py --heads "$name=$model" --short 10 --long 6 \
  --json "$results/sparrow-heads-$name.json" >"runtime/sparrow-heads-$name.log" 2>&1 &
heads_pid=$!
wait "$sparsity_pid"
wait "$heads_pid"
fi

if [ "$from_step" -le 4 ]; then
stamp "4/5 router (one thread)"
[ -f runtime/ref-long.mp4 ] || .venv/bin/vidspec make-video --out runtime/ref-long.mp4 --duration 1700 --fps 2 \
  --size 224x224 --seed 424242
.venv/bin/vidspec bench --model "$model" --video runtime/ref-long.mp4 --fps 2 --max-frames 64,128,192,512,2048,3200 \
  --method std --method sparrow --question "describe the video ." --question "what happens in the video ?" \
  --question "describe what happens ." --question "caption the video ." --repeats 3 --min-decode-s 4 \
  --max-repeats 30 --max-new-tokens 96 --threads 1 --write-router \
  --json "$results/reference-router-calibration-$name.json" >"runtime/router-$name.log" 2>&1
fi

stamp "5/5 model card"
pooled=$results/reference-$name-eval-pooled.json  # every block of held-out videos measured (vidspec eval --pool)
$py -m decoders.train.card --model "$model" --eval "$eval_json" --sparsity "$results/reference-$name-sparsity.json" \
  --notes "$results/reference-card-notes.md" --draft "$results/reference-card-draft.md" \
  $([ -f "$pooled" ] && echo --pooled "$pooled")
du -sh "$model"
stamp "shipped $name (the card's draft-head section, $results/reference-card-draft.md, is written by hand)"
