"""Rollout + reward wall time with and without streaming scoring, side by side in one run.

One rollout of the run loop (``miles_core.training.run``'s rollout source: generation on
the embedded engine, then scoring) on the tiny SD3 pipeline, measured round-robin with
streaming (each microgroup scored as soon as it returns, while the rest generates) and
with ``--no-streaming-reward`` (the whole rollout scored after generation). Rewards:

- ``sleep``: a stand-in for a reward of realistic cost that does not compete with the
  engine for the CPU (a reward model on another device or a reward server): each call
  sleeps ``--cost-ms`` per sample in a worker thread, calls serialised by a lock as one
  reward model serves them one at a time (as ``RewardScorer`` does for a registered
  reward). It is a stand-in, not a model: the numbers show how much reward time
  streaming hides, not what a particular reward costs.
- ``jpeg``: the real ``jpeg_compressibility`` reward (miles-rewards), CPU work in a thread.

Prints per mode the median wall time of generate + score, the generation time, the wait
for scoring after generation (``perf/reward_time``) and the summed scoring time
(``perf/reward_busy_time``), and the ratio of the wall times.

Usage: python bench/reward_streaming.py [--rewards sleep,jpeg] [--cost-ms 40] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.modules.setdefault("reward_streaming", sys.modules[__name__])  # the --custom-rm-path below finds this module

COST_S = 0.04
_MODEL = threading.Lock()


async def standin_rm(args, samples):
    """The ``sleep`` stand-in: ``COST_S`` seconds per sample, one call at a time."""

    def work():
        with _MODEL:
            time.sleep(COST_S * len(samples))
        return [float(s.seed % 5) for s in samples]

    return await asyncio.to_thread(work)


def one_rollout(source, rollout_id: int) -> dict[str, float]:
    async def go():
        began = time.perf_counter()
        samples = await source.generate(rollout_id)
        generated = time.perf_counter()
        _, _, busy = await source.score(samples)
        scored = time.perf_counter()
        return {"wall": scored - began, "generation": generated - began, "wait": scored - generated, "busy": busy}

    return asyncio.run(go())


def main() -> None:
    global COST_S
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rewards", default="sleep,jpeg", help="comma list of sleep, jpeg")
    parser.add_argument("--cost-ms", type=float, default=40.0, help="the sleep stand-in's cost per sample")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4, help="prompt groups per rollout")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--microgroup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    COST_S = args.cost_ms / 1000
    torch.set_num_threads(1)

    from miles_core.config.resolve import resolve_config
    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.quiet import quiet_hub_libraries
    from miles_core.rollout.data import load_prompts
    from miles_core.rollout.hooks import build_data_source
    from miles_core.training.metrics_logging import Progress
    from miles_core.training.rollout_scoring import RolloutSource
    from miles_sd3.family import SD3Family

    quiet_hub_libraries()
    workdir = Path(tempfile.mkdtemp(prefix="bench-reward-streaming-"))
    checkpoint = SD3Family.build_tiny_pipeline(workdir / "tiny-sd3")
    prompts = workdir / "prompts.jsonl"
    prompts.write_text("".join(f'{{"input": "a red cube number {i}"}}\n' for i in range(512)))
    base = [
        "--hf-checkpoint",
        str(checkpoint),
        "--diffusion-model-family",
        "sd3",
        "--prompt-data",
        str(prompts),
        "--rollout-batch-size",
        str(args.prompts),
        "--n-samples-per-prompt",
        str(args.n),
        "--rollout-microgroup-size",
        str(args.microgroup),
        "--diffusion-num-steps",
        str(args.steps),
        "--diffusion-num-sde-steps",
        "3",
        "--diffusion-height",
        "64",
        "--diffusion-width",
        "64",
    ]
    reward_flags = {"sleep": ["--custom-rm-path", "reward_streaming.standin_rm"], "jpeg": ["--rm-type", "jpeg_compressibility"]}
    engine = None
    counter = iter(range(10**6))
    results: dict[str, dict[str, dict[str, float]]] = {}
    for reward in args.rewards.split(","):
        sources = {}
        for mode, extra in (("streaming", []), ("no streaming", ["--no-streaming-reward"])):
            config = resolve_config([*base, *reward_flags[reward], *extra])
            engine = engine or EmbeddedEngine.from_config(config)
            records = load_prompts(config.prompt_data, input_key=config.input_key, metadata_key=config.metadata_key)
            sources[mode] = RolloutSource(config, engine, build_data_source(config, records), Progress(enabled=False), 1)
        for source in sources.values():
            one_rollout(source, next(counter))  # warm-up
        times: dict[str, list[dict[str, float]]] = {mode: [] for mode in sources}
        for _ in range(args.repeats):
            for mode, source in sources.items():
                times[mode].append(one_rollout(source, next(counter)))
        results[reward] = {mode: {key: statistics.median(t[key] for t in runs) for key in runs[0]} for mode, runs in times.items()}

    samples = args.prompts * args.n
    print(
        f"tiny SD3 64x64, {args.steps} steps, {args.prompts} prompts x {args.n} samples = {samples}, microgroup "
        f"{args.microgroup} ({samples // args.microgroup} requests), embedded engine, 1 torch thread, median of "
        f"{args.repeats} (interleaved)"
    )
    for reward, modes in results.items():
        label = f"sleep stand-in, {args.cost_ms:g} ms/sample, serialised" if reward == "sleep" else "jpeg_compressibility"
        print(f"\nreward: {label}")
        print(f"{'mode':<14}{'wall s':>9}{'generation s':>14}{'wait after s':>14}{'reward busy s':>15}")
        for mode, t in modes.items():
            print(f"{mode:<14}{t['wall']:>9.3f}{t['generation']:>14.3f}{t['wait']:>14.3f}{t['busy']:>15.3f}")
        ratio = modes["no streaming"]["wall"] / modes["streaming"]["wall"]
        print(f"ratio wall no streaming / streaming: {ratio:.2f}x")


if __name__ == "__main__":
    main()
