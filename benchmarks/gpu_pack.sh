#!/usr/bin/env bash
# Packs what benchmarks/gpu_check.sh needs on a lent GPU machine that has PyTorch but not our pins and no
# network: .gpu/tf.tar.xz (transformers at our pin, model code trimmed to the families we load and what the
# auto classes import, ~1.4 MB) and the PyAV and redis wheels. .gpu/ is kept out of git (.git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/.."
tf=$(grep -o 'transformers==[0-9.]*' pyproject.toml | cut -d= -f3)
avv=$(grep -o '"av==[0-9.]*' pyproject.toml | cut -d= -f3)
rv=$(grep -o '"redis==[0-9.]*' pyproject.toml | cut -d= -f3)  # the CLI module imports it
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
rm -rf .gpu /tmp/gpu-pack && mkdir -p .gpu /tmp/gpu-pack
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d /tmp/gpu-pack "transformers==$tf" "av==$avv" "redis==$rv"
mv /tmp/gpu-pack/av-*.whl /tmp/gpu-pack/redis-*.whl .gpu/
(cd /tmp/gpu-pack && unzip -q transformers-*.whl && rm transformers-*.whl)
keep=" auto llava llava_next llava_next_video llava_onevision qwen2 qwen2_vl qwen2_5_vl qwen2_5_omni siglip llama mistral encoder_decoder bert gpt2 "
for d in /tmp/gpu-pack/transformers/models/*/; do
  n=$(basename "$d")
  [[ $keep == *" $n "* ]] || rm -rf "$d"
done
rm -f /tmp/gpu-pack/transformers-*.dist-info/RECORD
tar cJf .gpu/tf.tar.xz -C /tmp/gpu-pack .
du -sh .gpu/*
