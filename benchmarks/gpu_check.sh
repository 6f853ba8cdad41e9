#!/usr/bin/env bash
# The GPU checks in one run, sized for a 15-minute lease of one H200 (device tool): run
#   benchmarks/gpu_pack.sh here, then on the GPU machine `OUT=... benchmarks/gpu_check.sh` carrying .gpu.
# 0. the tests marked `gpu` (lossless on every family in fp32 on CUDA; bf16 Sparrow acceptance against fp32;
#    Sparrow's CUDA-graph draft chain captured and drafting as its eager form), collected from the files that
#    hold them (the service tests need Ray, which that machine lacks);
# 1. the attention's value product at 0.5k-25.6k keys, plain against split over the keys (gpu_attn_layout.py:
#    session 26's profile found it 90% of a 25.6k step's GPU time; off the CPU it is now split);
# 2. Sparrow's CUDA-graph draft chain against the same step eagerly and the per-step path, same drafts, on one
#    world at 0.5k and 1.5k (gpu_sparrow_chain.py; the chain was written without a GPU in session 26);
# 3. issue 5's table on a GPU over a sample of videos: the reference model in float32 (its own dtype), every
#    method of the issue at the issue's ~0.5k, 1.5k, 4k, 16k and 25.6k visual tokens on the first 5 held-out
#    worlds of benchmarks/reference_methods_worlds.sh (WORLDS, FRAMESW, REPEATSW; `auto` with router.json's
#    cuda entry), measured in the order 0.5k, 1.5k, 25.6k, 4k, 16k (the targets' lengths first: a time limit
#    costs the others; the JSON is written after every length).
#    Session 27's lease ran exactly this in 378 s (benchmarks/results/h200-s27/).
#    Session 26's lease ran 4 worlds with 4 methods (hf-prompt-lookup at 25.6k did not fit then: the videos
#    were read one at a time and every warm-up answered every prompt); bench now reads 8 videos at once and
#    warms up on one prompt per video, which this step's sizing assumes;
# 4. (BF16=1) the bench video in bfloat16 at three lengths (are the answers still identical, and do Sparrow's
#    drafts hold up since the head's attention was rerouted?); its 60 s did not suffice in session 26;
# 5. (PROFILE=1) a per-op profile of vanilla steps at 0.5k and 25.6k (benchmarks/gpu_profile.py; session 26's
#    is in benchmarks/results/h200-s26/gpu-profile.json);
# Session 24 ran these on the bench video; BENCHVIDEO=1 repeats them (router calibration, written to router.json's
# by_device entry, and the methods table); Q7B=1 adds StD vs vanilla on a random-weight Qwen2-VL with
# Qwen2-VL-7B's language model at ~16k visual tokens in float32 (identity; random weights accept almost
# nothing: it checks the path, not the speedup).
# Each step has its own time limit, so a failure or overrun of one leaves the others' results (the worlds
# JSON is written after every length); the default steps take at most ~540 s of the device tool's 600 s a
# command (installs and world videos take ~35 s): run it with timeout_s ~595 (a call killed at its limit
# still returns what is under $OUT).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runtime/gpu}
mkdir -p "$OUT" runtime
OUT=$(cd "$OUT" && pwd)  # absolute: some steps run from benchmarks/
PY=${PY:-python3}
DEV=${DEV:-cuda}  # DEV=cpu FRAMES=64 FRAMESW=64 FRAMES16=64 WORLD_S=60 REPEATS=1 SIZE7=test FRAMES7=16: dry run
export PYTHONUNBUFFERED=1 VIDSPEC_ATTN_KERNEL=0 HF_HUB_OFFLINE=1
if [ -d .gpu ]; then
  mkdir -p /tmp/site && tar xJf .gpu/tf.tar.xz -C /tmp/site
  "$PY" -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi -L || true
"$PY" -c "import torch, transformers, av; print('torch', torch.__version__, 'transformers', transformers.__version__, 'av', av.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
[ "${BF16:-0}${BENCHVIDEO:-0}${PROFILE:-0}" = 000 ] || [ -f runtime/ref-long.mp4 ] || timeout 60 "$PY" -m pipeline.cli make-video --out runtime/ref-long.mp4 \
  --duration 1700 --fps 2 --size 224x224 --seed 424242
worlds=()  # held-out worlds of reference_methods_worlds.sh, written in parallel (one core each)
seeds=$(seq 1000200000 $((1000200000 + ${WORLDS:-5} - 1)))
for s in $seeds; do
  v=runtime/bench-worlds/world-$s-${WORLD_S:-1700}s.mp4
  [ -f "${v%.mp4}.json" ] || timeout 120 "$PY" -m pipeline.cli make-video --out "$v" --duration "${WORLD_S:-1700}" \
    --fps 2 --size 224x224 --seed "$s" >>"$OUT/gpu.log" 2>&1 &
done
wait
for s in $seeds; do  # the event log is written after the video: a world is complete
  v=runtime/bench-worlds/world-$s-${WORLD_S:-1700}s.mp4
  if [ -f "${v%.mp4}.json" ]; then worlds+=(--video "$v"); else echo "world $v incomplete: left out"; fi
done
# TESTS=0, LAYOUT=0, CHAIN=0 skip steps 0-2 (a second, shorter call of one lease: the worlds step alone)
if [ "${TESTS:-1}" = 1 ]; then
  echo "== gpu tests"  # the checks that need a GPU (pytest -m gpu; skipped everywhere else)
  timeout "${TESTS_S:-70}" "$PY" -m pytest -q -m gpu -p no:cacheprovider $(grep -l "mark.gpu" tests/test_*.py) \
    >"$OUT/gpu-tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -5 "$OUT/gpu-tests.log"
fi
if [ "${LAYOUT:-1}" = 1 ]; then
  echo "== attention layout"  # the value product at long lengths, plain against split over the keys
  PYTHONPATH="${PYTHONPATH:-}:$PWD" timeout "${LAYOUT_S:-25}" "$PY" benchmarks/gpu_attn_layout.py --device "$DEV" \
    --json "$OUT/gpu-attn-layout.json" 2>>"$OUT/gpu.log"
fi
echo "== sparrow chain"  # CUDA-graph draft chain against the same step eagerly and step by step
[ "${CHAIN:-1}" = 1 ] && [ ${#worlds[@]} -gt 0 ] && (cd benchmarks && PYTHONPATH="${PYTHONPATH:-}:$(dirname "$PWD")" timeout "${CHAIN_S:-45}" \
  "$PY" gpu_sparrow_chain.py --device "$DEV" --model ../models/vidspec-reference --video "../${worlds[1]}" \
  --max-frames 64,192 --repeats "${REPEATSC:-5}" --json "$OUT/gpu-sparrow-chain.json" 2>>"$OUT/gpu.log")
frames=${FRAMES:-64,128,192,512,2048,3200}
qs=(--question "describe the video ." --question "what happens in the video ?" \
    --question "describe what happens ." --question "caption the video .")
common=(--device "$DEV" --fps 2 "${qs[@]}" --max-new-tokens 96 --warmup 1)
step() {  # name, limit (s), command...: run it with a limit; print its table and the end of its log
  local name=$1 limit=$2 t0
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@" >"/tmp/$name.md" 2>>"$OUT/gpu.log"
  echo "== $name: rc=$? in $(($(date +%s) - t0)) s"
  cat "/tmp/$name.md"
}
# sized from session 26's H200 logs (per repeat and 4 worlds: ~10 s at 0.5k and 1.5k for all five methods,
# ~17 s at 25.6k without hf-prompt-lookup, which re-encodes and re-prefills every video for each of its
# answers, ~2 s an answer estimated; 8-16 s to read one video at 25.6k): ~370 s expected for 5 worlds at the
# issue's five lengths, 2 repeats after a warm-up, more (up to 6) for our methods until each has 5 s
# of decoding (a repeat at 1.5k lasts ~1 s on the GPU: two could not resolve 5% in session 26)
step worlds "${WORLDS_S:-400}" "$PY" -m pipeline.cli bench "${common[@]}" "${worlds[@]}" --read-workers 8 \
  --dtype float32 --max-frames "${FRAMESW:-64,192,3200,512,2048}" \
  $(for m in ${METHODSW:-vanilla std sparrow auto hf-prompt-lookup}; do echo --method "$m"; done) \
  --repeats "${REPEATSW:-2}" --min-decode-s "${MIN_DECODE_S:-5}" --max-repeats "${MAX_REPEATS:-6}" --json "$OUT/reference-methods-worlds-h200.json" --plot "$OUT/reference-methods-worlds-h200.png"
if [ "${BENCHVIDEO:-0}" = 1 ]; then
  step router "${ROUTER_S:-70}" "$PY" -m pipeline.cli bench "${common[@]}" --video runtime/ref-long.mp4 --dtype float32 \
    --max-frames "$frames" --method std --method sparrow --repeats 3 --write-router \
    --json "$OUT/reference-router-h200.json"
  cp models/vidspec-reference/sparrow/router.json "$OUT/router.json"
  step methods "${REF_S:-240}" "$PY" -m pipeline.cli bench "${common[@]}" --video runtime/ref-long.mp4 --dtype float32 \
    --max-frames "$frames" --method vanilla --method std --method sparrow --method auto --method hf \
    --method hf-prompt-lookup --repeats "${REPEATS:-3}" --json "$OUT/reference-methods-h200.json" \
    --plot "$OUT/reference-methods-h200.png"
fi
[ "${BF16:-0}" = 1 ] && step bf16 "${BF16_S:-90}" "$PY" -m pipeline.cli bench "${common[@]}" --video runtime/ref-long.mp4 --dtype bfloat16 --max-frames "${FRAMES16:-64,192,3200}" \
  --method vanilla --method std --method sparrow --method auto --repeats 3 --json "$OUT/reference-bf16-h200.json"
if [ "${PROFILE:-0}" = 1 ]; then  # where a vanilla step's time goes at 0.5k and 25.6k (5.4 / 7.7 ms in s26)
  echo "== profile"
  PYTHONPATH="${PYTHONPATH:-}:$PWD" timeout "${PROF_S:-60}" "$PY" benchmarks/gpu_profile.py --device "$DEV" --max-frames 64,3200 --steps 32 \
    --json "$OUT/gpu-profile.json" 2>>"$OUT/gpu.log" | grep -v "^USDT"
fi
if [ "${Q7B:-0}" = 1 ]; then
  t0=$(date +%s)
  timeout 120 "$PY" -m pipeline.cli make-tiny-model --size "${SIZE7:-7b}" --init-std 0.02 --dtype bfloat16 \
    --device "$DEV" --out runtime/q7b >>"$OUT/gpu.log" 2>&1
  [ -f runtime/gpu-video.mp4 ] || timeout 60 "$PY" -m pipeline.cli make-video --out runtime/gpu-video.mp4 \
    --duration 300 --fps 2 --size 224x224 --seed 7
  echo "7b checkpoint in $(($(date +%s) - t0)) s"
  step q7b "${Q7B_S:-150}" "$PY" -m pipeline.cli bench --model runtime/q7b --device "$DEV" --dtype float32 --video runtime/gpu-video.mp4 \
    --fps 2 --max-frames "${FRAMES7:-228}" --method vanilla --method std --repeats 2 --max-new-tokens 64 \
    --ignore-eos --json "$OUT/gpu-std-7b-fp32.json"
fi
tail -4 "$OUT/gpu.log"
