"""Prompt encoding over a run, with and without ``--precompute-prompt-embeddings``, side
by side in one process on the tiny SD3 pipeline (``miles-core make-tiny sd3``; T5 length
256, the family's default).

A run of ``--rollouts`` rollouts draws ``--batch`` prompts per rollout, cycling through
``--prompts`` distinct ones; each prompt group of ``--n`` samples is ``n / --microgroup``
requests, and each request asks the engine for its conditioning once, through the
engine's own :class:`~miles_core.engine.sampler.ConditioningCache` (what the sampler does
per request). Denoising is left out: only encoding differs between the set-ups.

Set-ups:

- ``embedded``: today's per-engine cache (64 entries), never cleared (the embedded engine
  shares the trainer's weights and receives no weight update);
- ``remote``: the same cache cleared after every rollout (a serve-engine clears it on each
  weight update);
- ``store cold``: the run's store built at start-up (every distinct prompt encoded once
  and written to the disk cache), then every request answered from it;
- ``store warm``: the same with the disk cache already filled (a rerun): entries loaded
  and checked, nothing encoded.

Reported: seconds spent encoding (the store's build included) over the run, and the tensor
bytes held for conditioning: "resident" while the run goes on (without the flag the text
encoders' weights plus the most the cache held at a rollout's end; with it the stored
encodings: each store set-up runs on its own load of the pipeline and frees its encoders,
as a run does) and "peak", the most held at once (with the flag: the encoders and the
whole store at the end of the build, before freeing). Ratios are without / with.

Usage: python bench/prompt_embeddings.py [--rollouts 20] [--prompts 16] [--batch 2] [--n 8]
[--microgroup 8] [--scale tiny] [--smoke]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import tempfile
import time
from pathlib import Path

import torch


def requests_of_run(args: argparse.Namespace) -> list[list]:
    """The requests of each rollout, in order (seeds and steps do not enter an encoding)."""
    from miles_core.request import RolloutRequest

    prompts = [f"prompt number {i}: a {['red', 'blue', 'green', 'white'][i % 4]} object on a table" for i in range(args.prompts)]
    per_group = max(1, args.n // args.microgroup)
    rollouts = []
    for r in range(args.rollouts):
        batch = [prompts[(r * args.batch + j) % len(prompts)] for j in range(args.batch)]
        rollouts.append(
            [
                RolloutRequest(prompt=p, num_inference_steps=args.steps, num_outputs_per_prompt=args.microgroup, guidance_scale=1.0)
                for p in batch
                for _ in range(per_group)
            ]
        )
    return rollouts


def per_engine(family, rollouts: list[list], *, clear_each_rollout: bool) -> dict:
    from miles_core.engine.prompt_store import tensor_bytes, text_encoders
    from miles_core.engine.sampler import ConditioningCache

    cache = ConditioningCache()
    spent = 0.0
    entries = 0  # the most the cache held at the end of a rollout (before a clear)
    for requests in rollouts:
        for request in requests:
            params = family.resolve_params(request)
            began = time.perf_counter()
            with torch.no_grad():
                cache.encode(family, request.prompt, request.negative_prompt, params)
            spent += time.perf_counter() - began
        entries = max(entries, cache.nbytes)
        if clear_each_rollout:
            cache.clear()
    held = tensor_bytes(text_encoders(family).values()) + entries
    return {"encode_s": spent, "in_encode_s": spent, "encodes": cache.misses, "bytes": held, "peak": held}


def with_store(family, rollouts: list[list], folder: Path) -> dict:
    """The run's store on ``family`` (a fresh load: freeing cannot be undone), built, its
    encoders freed as a run frees them, then every request answered from it."""
    from miles_core.engine.prompt_store import PromptStore, package_owners, tensor_bytes, text_encoders
    from miles_core.engine.sampler import ConditioningCache

    package_owners.cache_clear()  # each set-up pays the fingerprint's scan, as each run does
    distinct = {}
    for requests in rollouts:
        for request in requests:
            distinct.setdefault(request.prompt, request)
    encoders = tensor_bytes(text_encoders(family).values())
    store = PromptStore.build(family, list(distinct.values()), folder, log=print)
    peak = encoders + store.nbytes  # at the end of the build, before freeing
    store.free_encoders()
    left = tensor_bytes(text_encoders(family).values())  # 0: nothing of the encoders stays
    cache = ConditioningCache(store=store)
    spent = 0.0
    for requests in rollouts:
        for request in requests:
            params = family.resolve_params(request)
            began = time.perf_counter()
            cache.encode(family, request.prompt, request.negative_prompt, params)
            spent += time.perf_counter() - began
    return {
        "encode_s": store.stats.total_s + spent,
        "in_encode_s": store.stats.encode_s,
        "encodes": store.stats.encoded,
        "loaded": store.stats.loaded,
        "bytes": store.nbytes + left,
        "peak": peak,
        "freed": store.freed_bytes,
    }


def warm_up(family, request) -> None:
    """One encode of a prompt outside the run, so no set-up pays the first call's set-up."""
    with torch.no_grad():
        family.encode("warm-up", None, family.resolve_params(request))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts in the data")
    parser.add_argument("--batch", type=int, default=2, help="prompts per rollout")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--microgroup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--scale", choices=("tiny", "bench"), default="tiny")
    parser.add_argument("--smoke", action="store_true", help="3 rollouts of 4 prompts: seconds")
    args = parser.parse_args()
    if args.smoke:
        args.rollouts, args.prompts = 3, 4
    torch.set_num_threads(1)

    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.quiet import quiet_hub_libraries
    from miles_sd3.family import SD3Family

    quiet_hub_libraries()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = SD3Family.build_tiny_pipeline(
            Path(tmp) / "stable-diffusion-3-tiny", **({"scale": "bench"} if args.scale == "bench" else {})
        )
        rollouts = requests_of_run(args)
        results = {}
        family = EmbeddedEngine.from_checkpoint(checkpoint, "sd3").family
        warm_up(family, rollouts[0][0])
        results["embedded"] = per_engine(family, rollouts, clear_each_rollout=False)
        results["remote"] = per_engine(family, rollouts, clear_each_rollout=True)
        # Each store set-up on its own load of the pipeline (loading is not timed), freeing
        # the encoders as a run does: the cold run fills the disk cache, the warm one reruns.
        for name in ("store cold", "store warm"):
            fresh = EmbeddedEngine.from_checkpoint(checkpoint, "sd3").family
            warm_up(fresh, rollouts[0][0])
            results[name] = with_store(fresh, rollouts, Path(tmp) / "cache")

    requests = sum(len(r) for r in rollouts)
    print(
        f"{args.rollouts} rollouts x {args.batch} prompts x {args.n} samples (microgroup {args.microgroup}, {requests} requests), "
        f"{args.prompts} distinct prompts, T5 length {SD3Family.max_sequence_length}, one torch thread"
    )
    # encode s: all the run spends on conditioning; in encoders: the family's encode calls
    # alone (the rest is the store's fingerprint, reads, checks, writes and look-ups).
    # resident: what conditioning holds while the run goes on; peak: the most it held at once.
    print(f"{'set-up':<12}{'encodes':>9}{'encode s':>11}{'in encoders':>13}{'resident MiB':>14}{'peak MiB':>10}")
    for name, r in results.items():
        print(
            f"{name:<12}{r['encodes']:>9}{r['encode_s']:>11.3f}{r['in_encode_s']:>13.3f}{r['bytes'] / 2**20:>14.2f}{r['peak'] / 2**20:>10.2f}"
        )
    cold, warm = results["store cold"], results["store warm"]
    print(f"text encoders freed: {warm['freed'] / 2**20:.2f} MiB; stored encodings: {warm['bytes'] / 2**20:.3f} MiB")
    for base in ("embedded", "remote"):
        b = results[base]
        print(
            f"ratio {base} / store cold: encode time {b['encode_s'] / cold['encode_s']:.2f}x, "
            f"resident bytes {b['bytes'] / cold['bytes']:.1f}x; {base} / store warm: encode time {b['encode_s'] / warm['encode_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
