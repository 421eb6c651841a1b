"""The VAE decode in chunks against a whole-batch decode (docs/benchmarks.md, "VAE decode in
chunks").

Measured here, on tiny pipelines with real weights (an image family and a video family):
a rollout's final latents decoded as one batch (the engine before ``--vae-decode-batch-size``)
and one output at a time (:func:`miles_core.engine.sampler.decode_outputs`), the largest
pixel difference between the two, a control (the first output's latents nudged by 1e-3,
which must move the pixels far more), and the bytes each decode holds at its peak (counted by the planner's
:class:`~miles_core.planning.tensor_bytes.LiveBytes`), with their ratio.

Planned at real size (the meta device; no weights): one VAE decode call of Wan 2.2 TI2V-5B at
its recipe's 704x1280, 121 frames, for 1 and 8 videos at once and with the VAE's tiling.

Usage: python bench/decode_chunks.py [--smoke] [--outputs N]
(``--smoke``: the tiny pipelines only, seconds.)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = (("sd3", 64, None), ("wan2_2_ti2v", 64, 9))
"""(family, size, frames) of the tiny pipelines decoded."""
TI2V = ROOT / "plugins/miles-wan22/tests/data/real_checkpoints/Wan2.2-TI2V-5B-Diffusers"


def _tiny_case(family_name: str, size: int, frames: int | None, outputs: int, scratch: Path) -> dict:
    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.engine.sampler import decode_outputs, output_generators
    from miles_core.planning.tensor_bytes import LiveBytes
    from miles_core.request import RolloutRequest

    tiny = scratch / family_name
    subprocess.run([sys.executable, "-m", "miles_core.cli.main", "make-tiny", family_name, str(tiny)], check=True, capture_output=True)
    family = EmbeddedEngine.from_checkpoint(tiny, family_name).family
    request = RolloutRequest(prompt="a red cube", seed=7, height=size, width=size, num_frames=frames, num_inference_steps=2)
    params = family.resolve_params(request)
    with torch.no_grad():
        latents = family.initial_latents(params, output_generators(7, outputs, "cpu"))
        cond = family.encode("a red cube", None, params).expand(outputs)
        final = family.final_latents(latents, cond, params)

        def decoded(batch_size: int, lat: dict) -> tuple[list[torch.Tensor], int]:
            with LiveBytes() as live:
                pixels, _ = decode_outputs(family, lat, params, batch_size)
            return pixels, live.peak

        whole, whole_peak = decoded(outputs, final)
        chunked, chunked_peak = decoded(1, final)
        nudged = {name: value.clone() for name, value in final.items()}
        first = next(iter(nudged))
        nudged[first][0] += 1e-3
        control, _ = decoded(outputs, nudged)
    return {
        "case": f"tiny {family_name}",
        "diff": max((a - b).abs().max().item() for a, b in zip(whole, chunked)),
        "control": max((a - b).abs().max().item() for a, b in zip(whole, control)),
        "whole_peak": whole_peak,
        "chunked_peak": chunked_peak,
    }


def _planned_ti2v(outputs: int) -> dict:
    from miles_core.config.resolve import resolve_config
    from miles_core.planning.measure import measure_run

    args = ["--hf-checkpoint", str(TI2V), "--rollout-batch-size", "1", "--custom-config-path", str(ROOT / "recipes/wan22_ti2v.yaml")]
    config = resolve_config([*args, "--rollout-microgroup-size", str(outputs), "--vae-decode-batch-size", str(outputs)])
    measured = measure_run(config, dtype=torch.bfloat16, checkpointing=())
    return {tiled: measured.decode[tiled] for tiled in (False, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the tiny pipelines only")
    parser.add_argument("--outputs", type=int, default=4, help="outputs decoded (tiny pipelines)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from miles_core.quiet import quiet_hub_libraries

    quiet_hub_libraries()
    with tempfile.TemporaryDirectory() as scratch:
        rows = [_tiny_case(name, size, frames, args.outputs, Path(scratch)) for name, size, frames in TINY]
    print(f"{args.outputs} outputs: whole batch vs one at a time")
    print(f"{'case':<18} {'max |diff|':>11} {'control':>9} {'peak whole KiB':>15} {'one at a time':>14} {'ratio':>6}")
    for row in rows:
        ratio = row["whole_peak"] / row["chunked_peak"]
        print(
            f"{row['case']:<18} {row['diff']:>11.2e} {row['control']:>9.2e} {row['whole_peak'] / 1024:>15.1f}"
            f" {row['chunked_peak'] / 1024:>14.1f} {ratio:>5.2f}x"
        )
    print("ratio = whole-batch peak / one-at-a-time peak; control: the first output's latents nudged by 1e-3")
    if args.smoke:
        return
    decode = _planned_ti2v(8)
    gib = 2**30
    print("\nplanned, Wan 2.2 TI2V-5B VAE decode at 704x1280, 121 frames, bf16 (GiB at the call's peak, pixels included)")
    print(f"{'videos at once':>14} {'untiled':>9} {'tiled':>9} {'ratio':>6}")
    for count in (1, 8):
        untiled, tiled = decode[False].at(count) / gib, decode[True].at(count) / gib
        print(f"{count:>14} {untiled:>9.2f} {tiled:>9.2f} {untiled / tiled:>5.2f}x")
    print(f"8 at once / 1 at a time, untiled: {decode[False].at(8) / decode[False].at(1):.2f}x (ratio)")


if __name__ == "__main__":
    main()
