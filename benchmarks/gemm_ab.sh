#!/usr/bin/env bash
# A/B of the native forward's projection product between a git revision's kernel source (A) and the working
# tree's (B): benchmarks/gemm_ab.cpp, compiled as the kernels are (-O3 -march=native). Shapes: the reference
# model's (K = 128 / 512) and the language model of Qwen2-VL-7B's (hidden 3584, MLP 18944), 1-16 rows.
# Usage: benchmarks/gemm_ab.sh REV [out.jsonl]
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: benchmarks/gemm_ab.sh REV [out.jsonl]}
out=${2:-benchmarks/results/gemm-ab.jsonl}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the extern "C" entry points would clash when both copies are in one program: drop the linkage spec
git show "$rev:decoders/kernels/attn.cpp" | sed 's/^extern "C" //' >"$tmp/a.cpp"
sed 's/^extern "C" //' decoders/kernels/attn.cpp >"$tmp/b.cpp"
g++ -O3 -march=native -fopenmp -std=c++17 -DA_SRC="\"$tmp/a.cpp\"" -DB_SRC="\"$tmp/b.cpp\"" \
  -o "$tmp/gemm_ab" benchmarks/gemm_ab.cpp
: >"$out"
for shape in "128 384" "128 1024" "512 128" "3584 4608" "3584 37888" "18944 3584"; do
  for n in 1 6 12 16; do
    # shellcheck disable=SC2086
    "$tmp/gemm_ab" $shape "$n" 5 | tee -a "$out"
  done
done
echo "wrote $out"
