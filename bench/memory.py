"""Memory per process and per phase of a training run: the bytes its tensors hold by role
(the memory audit, :func:`miles_core.memory.audit_memory`: parameters, gradients,
optimizer state, engine weights) and its resident and peak RSS, for several set-ups side
by side at the bench size (``miles-core make-tiny sd3 DIR --scale bench``).

Each configuration is a real run of ``miles-core train`` (:func:`miles_core.training.run.train`;
full fine-tuning, Flow-GRPO, the embedded engine, jpeg_compressibility, a checkpoint after
every rollout) of two rollouts, each in a process of its own. The run loop calls back at each phase boundary (rollout,
train, sync, checkpoint) with this process's audit; at that moment the benchmark also
reads the process's RSS and, under ``--use-ray``, asks every training rank for its own
audit and RSS. Reported: the phases of the second rollout (the optimizer state exists
from the first step on). Tensors and RSS are read as the phase starts; peak RSS
(``ru_maxrss``, the process's high-water mark so far) as it ends, so a phase that raises
it (a checkpoint that gathers) shows it.

Configurations (``--configs``): ``one`` (one process), ``ranks`` (2 training ranks under
``--use-ray``: the driver and each rank), ``offload`` (one process, ``--offload``),
``fsdp-cpu-offload`` (2 ranks, ``--fsdp-cpu-offload``). One that this tree cannot run
reports ``not available: <message>`` (an error or a note saying a flag has no effect
while the configuration is resolved); one whose run breaks reports ``failed: ...`` and
the benchmark exits with status 1.

Usage: python bench/memory.py [--configs one,ranks,offload,fsdp-cpu-offload] [--smoke] [--json PATH]
(``--smoke``: the tiny pipeline, one process and ``--offload`` only, both in this process
so their RSS is not apart: seconds.)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

CONFIGS: dict[str, tuple[str, ...]] = {
    "one": (),
    "ranks": ("--use-ray", "--actor-num-gpus-per-node", "2"),
    "offload": ("--offload",),
    "fsdp-cpu-offload": ("--use-ray", "--actor-num-gpus-per-node", "2", "--fsdp-cpu-offload"),
}
RUN_FLAGS = (
    "--rollout-batch-size",
    "1",
    "--n-samples-per-prompt",
    "2",
    "--rollout-microgroup-size",
    "2",
    "--diffusion-num-steps",
    "2",
    "--diffusion-num-sde-steps",
    "1",
    "--rm-type",
    "jpeg_compressibility",
    "--num-rollout",
    "2",
    "--save-interval",
    "1",
)
PHASES = ("rollout", "train", "sync", "checkpoint")
ROLES = ("parameters", "gradients", "optimizer_state", "engine_weights")


def rss() -> int:
    """This process's resident set, in bytes (Linux)."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_rss() -> int:
    """This process's peak resident set so far, in bytes: ``ru_maxrss`` (KiB on Linux), or
    the resident set now where the kernel has not caught up with it yet."""
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss())


def by_role(tensors: dict[str, dict[str, int]]) -> dict[str, int]:
    """``{role: {device: bytes}}`` summed over devices."""
    return {role: sum(tensors.get(role, {}).values()) for role in ROLES}


class PhaseLog:
    """What the run's phase callback sees, per process: the driver's audit and RSS, and
    each rank's (``cluster.trainer.rank_memory_reports()``) under ``--use-ray``."""

    def __init__(self, cluster: Any = None) -> None:
        self.cluster = cluster
        self.entries: list[dict[str, Any]] = []

    def __call__(self, phase: str, report: Any) -> None:
        self.close()
        processes = {"driver": {"tensors": by_role(report.as_dict()), "rss": rss()}}
        trainer = getattr(self.cluster, "trainer", None)
        if trainer is not None:
            for rank, answer in enumerate(trainer.rank_memory_reports()):
                processes[f"rank {rank}"] = {"tensors": by_role(answer["tensors"]), "rss": answer["rss"], "peak_rss": answer["peak_rss"]}
        self.entries.append({"phase": phase, "processes": processes})

    def close(self) -> None:
        """The phase in progress ends: the driver's peak RSS so far (the ranks' is read at
        the next boundary, with their audit)."""
        if self.entries:
            self.entries[-1]["processes"]["driver"]["peak_rss"] = peak_rss()

    def last_rollout(self) -> dict[str, dict[str, Any]]:
        """The last rollout's phases by name; a rank's peak RSS of a phase is the one it
        reported at the next boundary."""
        starts = [i for i, entry in enumerate(self.entries) if entry["phase"] == "rollout"]
        if not starts:
            return {}
        phases: dict[str, dict[str, Any]] = {}
        for index in range(starts[-1], len(self.entries)):
            entry = self.entries[index]
            if entry["phase"] not in PHASES or entry["phase"] in phases:
                continue
            following = self.entries[index + 1]["processes"] if index + 1 < len(self.entries) else {}
            for name, process in entry["processes"].items():
                if name != "driver" and name in following:
                    process["peak_rss"] = following[name]["peak_rss"]
            phases[entry["phase"]] = entry["processes"]
        return phases


def _one_line(exc: BaseException) -> str:
    from miles_core.errors import MilesError

    text = str(exc) if isinstance(exc, MilesError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


async def measure(name: str, checkpoint: Path, prompts: Path, workdir: Path) -> dict[str, Any]:
    """One configuration's run; its last rollout's phases, or why it could not run."""
    from miles_core.config.resolve import resolve_config
    from miles_core.training.run import train

    flags = CONFIGS[name]
    args = [
        "--hf-checkpoint",
        str(checkpoint),
        "--diffusion-model-family",
        "sd3",
        "--prompt-data",
        str(prompts),
        *RUN_FLAGS,
        *flags,
        "--save",
        str(workdir / f"ckpt-{name}"),
        "--output-dir",
        str(workdir / f"run-{name}"),
    ]
    result: dict[str, Any] = {"config": name, "flags": list(flags)}
    try:
        config = resolve_config(args)
    except Exception as exc:
        return {**result, "status": f"not available: {_one_line(exc)}"}
    inert = [note for note in config.notes if "has no effect" in note and any(note.startswith(f"{flag}:") for flag in flags)]
    if inert:
        return {**result, "status": f"not available: {inert[0]}"}
    cluster = None
    began = time.perf_counter()
    try:
        if config.get("use_ray"):
            from miles_core.launch import start_session

            cluster = start_session(config, log=lambda line: None)
        log = PhaseLog(cluster)
        await train(config, log=lambda line: None, cluster=cluster, on_phase=log)
        log.close()
    except Exception as exc:  # the run itself broke: not a refusal of the set-up
        return {**result, "status": f"failed: {_one_line(exc)}"}
    finally:
        if cluster is not None:
            cluster.close()
    return {**result, "status": "ok", "seconds": round(time.perf_counter() - began, 1), "phases": log.last_rollout()}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def report(results: list[dict[str, Any]], trainable_fp32: int) -> None:
    print(f"\nfp32 trainable state (the transformer's parameters, full fine-tuning): {_mib(trainable_fp32)} MiB")
    print("MiB per process and phase (tensors and RSS as the phase starts, peak RSS as it ends):")
    header = f"{'config':<18}{'process':<9}{'phase':<12}{'params':>9}{'grads':>9}{'optim':>9}{'engine':>9}{'tensors':>9}{'RSS':>9}{'peak RSS':>10}"
    print(header)
    for result in results:
        if result["status"] != "ok":
            print(f"{result['config']:<18}{result['status']}")
            continue
        for phase, processes in result["phases"].items():
            for process, seen in processes.items():
                tensors = seen["tensors"]
                print(
                    f"{result['config']:<18}{process:<9}{phase:<12}"
                    + "".join(f"{_mib(tensors[role]):>9}" for role in ROLES)
                    + f"{_mib(sum(tensors.values())):>9}{_mib(seen['rss']):>9}{_mib(seen.get('peak_rss')):>10}"
                )
    ok = {result["config"]: result for result in results if result["status"] == "ok"}

    def tensors(config: str, phase: str, process: str = "driver") -> int | None:
        seen = ok.get(config, {}).get("phases", {}).get(phase, {}).get(process)
        return None if seen is None else sum(seen["tensors"].values())

    print()
    one_train, one_rollout = tensors("one", "train"), tensors("one", "rollout")
    if one_train and tensors("ranks", "train") is not None:
        driver = tensors("ranks", "train")
        print(
            f"driver tensors in the train phase, 2 ranks / one process: {driver / one_train:.3f}x "
            f"({_mib(driver)} vs {_mib(one_train)} MiB; one process - driver = {_mib(one_train - driver)} MiB, "
            f"the fp32 trainable state is {_mib(trainable_fp32)} MiB)"
        )
    if one_rollout and tensors("offload", "rollout") is not None:
        offloaded = tensors("offload", "rollout")
        print(
            f"tensors in the rollout phase, --offload / one process: {offloaded / one_rollout:.3f}x ({_mib(offloaded)} vs {_mib(one_rollout)} MiB)"
        )
    if one_train and tensors("offload", "train") is not None:
        offloaded = tensors("offload", "train")
        print(
            f"tensors in the train phase, --offload / one process: {offloaded / one_train:.3f}x ({_mib(offloaded)} vs {_mib(one_train)} MiB)"
        )
    if tensors("ranks", "train", "rank 0") and tensors("fsdp-cpu-offload", "train", "rank 0") is not None:
        base, offloaded = tensors("ranks", "train", "rank 0"), tensors("fsdp-cpu-offload", "train", "rank 0")
        print(f"rank 0 tensors in the train phase, --fsdp-cpu-offload / 2 ranks: {offloaded / base:.3f}x (every device counted)")


def run_config(name: str, checkpoint: Path, prompts: Path, workdir: Path) -> dict[str, Any]:
    """``name`` in a process of its own (its RSS and peak RSS are its own); its output
    goes to a log file, whose end is kept when it breaks."""
    result_path = workdir / f"{name}.json"
    log_path = workdir / f"{name}.log"
    command = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--checkpoint",
        str(checkpoint),
        "--prompts",
        str(prompts),
        "--workdir",
        str(workdir),
    ]
    with open(log_path, "w", encoding="utf-8") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode
    if not result_path.exists():
        tail = " | ".join(log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:])
        return {"config": name, "flags": list(CONFIGS[name]), "status": f"failed: exit status {code}: {tail}"}
    return json.loads(result_path.read_text(encoding="utf-8"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=None, help=f"comma-separated, of {', '.join(CONFIGS)} (default: all; --smoke: one,offload)")
    parser.add_argument("--smoke", action="store_true", help="the tiny pipeline, in seconds, in this process (the test suite's run)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results there")
    parser.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)  # one configuration, in its own process
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from miles_core.quiet import quiet_hub_libraries

    quiet_hub_libraries()
    if args.child:
        result = asyncio.run(measure(args.child, args.checkpoint, args.prompts, args.workdir))
        (args.workdir / f"{args.child}.json").write_text(json.dumps(result), encoding="utf-8")
        return
    names = (args.configs or ("one,offload" if args.smoke else ",".join(CONFIGS))).split(",")
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    from miles_sd3.family import SD3Family

    scale = "tiny" if args.smoke else "bench"
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        workdir = Path(tmp)
        checkpoint = SD3Family.build_tiny_pipeline(workdir / scale, scale=scale)
        trainable_fp32 = 4 * sum(
            int(torch.Size(shape).numel())
            for shape in _safetensors_shapes(checkpoint / "transformer" / "diffusion_pytorch_model.safetensors").values()
        )
        prompts = workdir / "prompts.jsonl"
        prompts.write_text("".join(f'{{"input": "a photo of thing {i}"}}\n' for i in range(8)), encoding="utf-8")
        print(
            f"memory per phase, {scale} SD3 pipeline: full fine-tuning, 1 prompt x 2 samples, 2 steps (1 SDE), "
            "2 rollouts (the second reported), a checkpoint after each; 1 thread; "
            + ("all in this process (RSS not apart)" if args.smoke else "each configuration in its own process")
        )
        results = []
        for name in names:
            if args.smoke:  # seconds matter more than separate RSS at the tiny size
                result = asyncio.run(measure(name, checkpoint, prompts, workdir))
            else:
                result = run_config(name, checkpoint, prompts, workdir)
            print(f"{name}: {result['status']}", flush=True)
            results.append(result)
    report(results, trainable_fp32)
    if args.json is not None:
        args.json.write_text(
            json.dumps({"scale": scale, "trainable_fp32_bytes": trainable_fp32, "results": results}, indent=2) + "\n", encoding="utf-8"
        )
    print(f"\nbenchmark took {time.perf_counter() - began:.0f} s")
    if any(result["status"].startswith("failed") for result in results):
        raise SystemExit(1)


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors file's header (nothing loaded)."""
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    return {name: entry["shape"] for name, entry in header.items() if name != "__metadata__"}


if __name__ == "__main__":
    main()
