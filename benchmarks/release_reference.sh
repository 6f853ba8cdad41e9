#!/usr/bin/env bash
# Everything that follows a training run of the reference model, in order:
#  1. export the EMA weights of $WORK_DIR/state.pt (default runtime/train-reference) to models/vidspec-reference,
#  2. `vidspec eval` on held-out worlds (short and long) and the attention-sparsity measurement,
#  3. the model card (every figure from those JSON files; notes and the draft head's section from
#     benchmarks/results/reference-card-{notes,draft}.md: update the draft section after step 4),
#  4. the Sparrow draft head (`vidspec train-draft`, saved under models/vidspec-reference/sparrow/).
# Then run benchmarks/reference_methods.sh (router calibration + the methods table) and
# benchmarks/lvspec_sweep.py. Knobs: MODEL, WORK_DIR, N_SHORT, N_LONG, THREADS, DRAFT_MINUTES.
# The draft head is trained with IVSB and one-step prediction (--mtp-steps 1): the best variant of the
# ablation (benchmarks/sparrow_ablation.py, README).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-models/vidspec-reference}
N_SHORT=${N_SHORT:-32}
N_LONG=${N_LONG:-8}
THREADS=${THREADS:-2}
DRAFT_MINUTES=${DRAFT_MINUTES:-10}
out=runtime/eval
mkdir -p "$out"
# the saved state's own training config is recorded in training_info.json
.venv/bin/vidspec train-reference --export-only --work-dir "${WORK_DIR:-runtime/train-reference}" --out "$MODEL"
.venv/bin/vidspec eval --model "$MODEL" --lengths short,long --n-short "$N_SHORT" --n-long "$N_LONG" \
  --threads "$THREADS" --json "$out/eval.json" | tail -3
.venv/bin/python -m decoders.train.sparsity --model "$MODEL" --lengths short,long --n-videos 3 \
  --threads "$THREADS" --json "$out/sparsity.json" | tail -3
.venv/bin/python -m decoders.train.card --model "$MODEL" --eval "$out/eval.json" \
  --sparsity "$out/sparsity.json" --notes benchmarks/results/reference-card-notes.md \
  --draft benchmarks/results/reference-card-draft.md
.venv/bin/vidspec train-draft --target "$MODEL" --mtp-steps 1 --videos 40 --long-videos 4 --long-duration 600 \
  --steps 3000 --minutes "$DRAFT_MINUTES" --threads "$THREADS"
