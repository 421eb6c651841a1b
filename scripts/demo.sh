#!/usr/bin/env bash
# The main job: install everything, list the plugins, write a tiny offline pipeline for
# every model family under runs/tiny/ (kept and reused on later runs), and run a short
# Flow-GRPO training on the tiny SD3 pipeline with the embedded engine.
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
echo "A short Flow-GRPO run with LoRA on the tiny SD3 pipeline (embedded engine, CPU):"
run_dir="runs/demo-$(date +%Y%m%d-%H%M%S)"
$miles train --hf-checkpoint runs/tiny/sd3 --diffusion-model-family sd3 \
  --prompt-data examples/prompts/shapes.jsonl --rollout-batch-size 2 --n-samples-per-prompt 8 \
  --num-steps-per-rollout 2 --diffusion-num-steps 8 --diffusion-num-sde-steps 3 \
  --diffusion-guidance-scale 1.0 --use-lora --lora-rank 16 --lora-alpha 32 --lr 3e-3 \
  --diffusion-clip-range 0.2 --rm-type jpeg_compressibility --num-rollout 6 --output-dir "$run_dir"
echo "metrics: $run_dir/metrics.jsonl, configuration: $run_dir/config.yaml"
