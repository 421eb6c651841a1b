#!/usr/bin/env bash
# The main job: install everything, list the plugins, write a tiny offline pipeline of
# every model family under runs/tiny/, build the SD3 demo pipeline (cached after the
# first build), and train it with Flow-GRPO and LoRA on a colourfulness reward with the
# embedded engine, evaluating held-out prompts with fixed seeds before and after; the run
# writes its HTML report (report.html), whose path is the last line printed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
miles=.venv/bin/miles-core

$miles list-plugins
for family in sd3 wan2_2 ltx qwen_image cosmos3 flux; do
  dir="runs/tiny/$family"
  if [ -f "$dir/model_index.json" ]; then
    echo "runs/tiny/$family: already there, reused"
  else
    $miles make-tiny "$family" "$dir"
  fi
done
demo=runs/tiny/sd3-demo
if [ ! -f "$demo/demo_build.json" ]; then
  rm -rf "$demo"
  $miles make-tiny sd3 "$demo" --demo
fi

echo
echo "Flow-GRPO with LoRA on the SD3 demo pipeline (tiny and synthetic: for watching the machinery):"
run_dir="runs/demo-$(date +%Y%m%d-%H%M%S)"
# The training flags live in examples/demo/train.flags, which tests/test_learning.py runs
# too (the guard's diversity alarm is measured on exactly this configuration).
mapfile -t train_flags < <(sed -e 's/#.*//' examples/demo/train.flags | tr -s ' \t' '\n' | sed '/^$/d')
$miles train --hf-checkpoint "$demo" "${train_flags[@]}" --output-dir "$run_dir"
echo "run: $run_dir (metrics.jsonl, config.yaml, train.log, guard.jsonl, lora/, samples/)"
echo "report: $run_dir/report.html (open it in a browser; miles-core report RUN_DIR [RUN_DIR ...] rewrites or compares)"
