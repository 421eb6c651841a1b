#!/usr/bin/env bash
# The main job: install everything, list the plugins, and write a tiny offline pipeline
# for every model family under runs/tiny/ (kept and reused on later runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
miles=.venv/bin/miles-core

$miles list-plugins
for family in sd3 wan2_2 ltx qwen_image cosmos3; do
  dir="runs/tiny/$family"
  if [ -f "$dir/model_index.json" ]; then
    echo "runs/tiny/$family: already there, reused"
  else
    $miles make-tiny "$family" "$dir"
  fi
done
echo
echo "Resolved configuration of a GRPO run on the tiny SD3 pipeline:"
$miles config --hf-checkpoint runs/tiny/sd3 --diffusion-model-family sd3 \
  --rollout-batch-size 2 --n-samples-per-prompt 8 --num-steps-per-rollout 2 \
  --use-lora --rm-type jpeg_compressibility | sed -n '/^resolved:/,$p'
