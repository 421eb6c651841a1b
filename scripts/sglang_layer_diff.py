"""Where the opt-in sglang lane's velocity drift comes from (docs/engine.md, "The opt-in lane").

Run with the sglang environment's Python (scripts/sglang_lane.sh --build makes it):

    .sglang-venv/bin/python scripts/sglang_layer_diff.py [--tiny .sglang-venv/tiny-sd3]
        [--trainer-python .venv/bin/python] [--work DIR] [--port N]

It starts one real sglang-diffusion server on the tiny SD3 pipeline (CPU, fp32, the lane's
arguments) with a ``sitecustomize`` hook that saves every call of sglang's SD3 DiT inside
the worker process (inputs, the outputs of its submodules, the output, the weights once),
sends two rollout requests (SDE window at loop steps 0-1 and at 1-2, 4 steps, CFG 4.0,
debug tensors on), stops the server, and then reports:

1. layer by layer, diffusers' ``SD3Transformer2DModel`` (this environment's diffusers;
   with ``--trainer-python`` also the trainer environment's) run on the exact inputs of
   every server call, against the server's activations;
2. that the trajectory latents, conditioning and timesteps the server returns are what it
   fed its DiT, and that its ``rollout_model_outputs`` are ``u + g (c - u)`` of the calls;
3. the trainer's replay (one batched ``[neg; pos]`` forward, as the SD3 family predicts)
   of every SDE step with the timestep ``build_pairs`` takes (``dit_trajectory.timesteps[k]``
   for loop step ``k``) and with the timestep of the row that holds step ``k``.

Only torch, diffusers, msgpack and safetensors are used, so the comparison part also runs
under the trainer's Python (``--compare-only DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDANCE = 4.0
# (sde steps, returned latents) of the two requests: the lane's --diffusion-num-steps 4
# --diffusion-num-sde-steps 2 draws one of these two windows per seed.
WINDOWS = {"window0": ((0, 1), (0, 1, 2, 4)), "window1": ((1, 2), (1, 2, 3, 4))}
SERVER_ARGS = [
    "--model-id",
    "stable-diffusion-3-medium",
    "--backend",
    "sglang",
    "--num-gpus",
    "1",
    "--dit-cpu-offload",
    "false",
    "--text-encoder-cpu-offload",
    "false",
    "--vae-cpu-offload",
    "false",
    "--pin-cpu-memory",
    "false",
    "--dit-precision",
    "fp32",
    "--text-encoder-precisions",
    "fp32",
    "fp32",
    "fp32",
]

HOOK = r"""
import functools, importlib.abc, importlib.util, os, sys, time
DUMP = os.environ.get("SD3_LAYER_DIFF_DUMP")
TARGET = "sglang.multimodal_gen.runtime.models.dits.stablediffusion3"

def _patch(module):
    import torch
    cls = module.SD3Transformer2DModel
    original = cls.forward
    state = {"n": 0}

    @functools.wraps(original)  # sglang filters call kwargs by the forward's signature
    def forward(self, *args, **kwargs):
        acts, handles = {}, []
        for name, sub in self.named_modules():
            if name and name.count(".") <= 2:
                handles.append(sub.register_forward_hook(lambda m, i, o, name=name: acts.__setitem__(name, o)))
        try:
            out = original(self, *args, **kwargs)
        finally:
            for h in handles:
                h.remove()
        def cpu(x):
            if torch.is_tensor(x):
                return x.detach().cpu().clone()
            if isinstance(x, (tuple, list)):
                return type(x)(cpu(v) for v in x)
            return None
        record = {"kwargs": {k: cpu(v) for k, v in kwargs.items() if torch.is_tensor(v)},
                  "acts": {k: cpu(v) for k, v in acts.items()}, "out": cpu(out),
                  "autocast": torch.is_autocast_enabled("cpu"), "default_dtype": str(torch.get_default_dtype()),
                  "processors": sorted({type(m.processor).__name__ for m in self.modules() if hasattr(m, "processor")})}
        if state["n"] == 0:
            record["state_dict"] = {k: v.detach().cpu().clone() for k, v in self.state_dict().items()}
        torch.save(record, os.path.join(DUMP, f"call_{time.time_ns()}_{os.getpid()}_{state['n']:04d}.pt"))
        state["n"] += 1
        return out

    cls.forward = forward

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module
        def run(module):
            exec_module(module)
            _patch(module)
        spec.loader.exec_module = run
        return spec

if DUMP:
    sys.meta_path.insert(0, _Finder())
"""


# -- the server part (sglang's Python) ------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_body(sde: tuple[int, ...], returned: tuple[int, ...]) -> dict:
    return {
        "prompt": "a red cube",
        "negative_prompt": None,
        "seed": 11,
        "width": 32,
        "height": 32,
        "num_inference_steps": 4,
        "num_outputs_per_prompt": 2,
        "guidance_scale": GUIDANCE,
        "rollout": True,
        "rollout_sde_type": "sde",
        "rollout_noise_level": 0.7,
        "rollout_log_prob_no_const": False,
        "rollout_debug_mode": True,
        "rollout_return_denoising_env": True,
        "rollout_return_dit_trajectory": True,
        "rollout_sde_step_indices": list(sde),
        "rollout_return_step_indices": list(returned),
        "extra_sampling_params": {},
        "generator_device": "cpu",
    }


def serve_and_dump(tiny: Path, work: Path, port: int) -> None:
    (work / "hook").mkdir(parents=True, exist_ok=True)
    (work / "hook" / "sitecustomize.py").write_text(HOOK)
    dump = work / "dump"
    dump.mkdir(exist_ok=True)
    for old in dump.glob("*.pt"):
        old.unlink()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "SD3_LAYER_DIFF_DUMP": str(dump),
        "PYTHONPATH": os.pathsep.join([str(work / "hook"), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable,
        "-m",
        "sglang.multimodal_gen.runtime.entrypoints.cli.main",
        "serve",
        "--model-path",
        str(tiny),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SERVER_ARGS,
    ]
    url = f"http://127.0.0.1:{port}"
    with open(work / "server.log", "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                sys.exit(f"the server exited with status {server.returncode}; see {work / 'server.log'}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"the server was not healthy after 300 s; see {work / 'server.log'}")
            time.sleep(0.5)
        for name, (sde, returned) in WINDOWS.items():
            before = set(dump.glob("*.pt"))
            data = json.dumps(request_body(sde, returned)).encode()
            req = urllib.request.Request(url + "/rollout/generate", data=data, headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as response:
                (work / f"{name}.msgpack").write_bytes(response.read())
            calls = sorted(str(p.name) for p in set(dump.glob("*.pt")) - before)
            (work / f"{name}.calls.json").write_text(json.dumps(calls))
            print(f"{name}: sde steps {sde}, returned latents {returned}: {len(calls)} DiT calls")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


# -- the comparison part (either Python) ------------------------------------------------


def decode(obj):
    from safetensors.torch import load

    if isinstance(obj, dict):
        if obj.get("__tensor__") is True:
            return load(bytes(obj["data"]))["t"]
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj


def max_mean(a, b) -> tuple[float, float]:
    if isinstance(a, (tuple, list)):
        pairs = [max_mean(x, y) for x, y in zip(a, b) if x is not None]
        return max(p[0] for p in pairs), max(p[1] for p in pairs)
    d = (a.float() - b.float()).abs()
    return float(d.max()), float(d.mean())


def compare(tiny: Path, work: Path) -> None:
    import diffusers
    import msgpack
    import torch
    from diffusers import SD3Transformer2DModel

    torch.set_grad_enabled(False)
    model = SD3Transformer2DModel.from_pretrained(str(tiny / "transformer"), torch_dtype=torch.float32).eval()
    acts: dict = {}
    for name, sub in model.named_modules():
        if name and name.count(".") <= 2:
            sub.register_forward_hook(lambda m, i, o, name=name: acts.__setitem__(name, o))
    print(f"\n== diffusers {diffusers.__version__}, torch {torch.__version__} ({sys.executable})")

    files = {name: json.loads((work / f"{name}.calls.json").read_text()) for name in WINDOWS}
    calls = {name: [torch.load(work / "dump" / f, weights_only=False) for f in fs] for name, fs in files.items()}
    first = next(c for cs in calls.values() for c in cs)
    theirs, mine = first["state_dict"], model.state_dict()
    same = theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in mine)
    print(
        f"server DiT weights == checkpoint: {same}; server attention processors {first['processors']}, "
        f"autocast {first['autocast']}, default dtype {first['default_dtype']}"
    )

    # 1. layer by layer on the server's own inputs
    worst: dict[str, tuple[float, float]] = {}
    for c in (c for cs in calls.values() for c in cs):
        acts.clear()
        kw = {k: c["kwargs"][k] for k in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")}
        out = model(**kw, return_dict=False)[0]
        for name, value in list(c["acts"].items()) + [("OUTPUT", c["out"])]:
            ours = out if name == "OUTPUT" else acts.get(name)
            if ours is None or value is None:
                continue
            m = max_mean(value, ours)
            old = worst.get(name, (0.0, 0.0))
            worst[name] = (max(old[0], m[0]), max(old[1], m[1]))
    print("1. layer by layer, server activation vs diffusers on the same inputs (max |diff| / largest mean |diff| over calls):")
    for name, (mx, mn) in worst.items():
        print(f"   {name:48s} {mx:.3g} / {mn:.3g}")

    # 2. and 3. per request
    for name, (sde, returned) in WINDOWS.items():
        outputs = decode(msgpack.unpackb((work / f"{name}.msgpack").read_bytes(), raw=False))
        cs = calls[name]
        steps = len(cs) // 2  # one conditional and one unconditional call per loop step
        print(f"\n{name}: sde steps {sde}, returned latents {returned}")
        tr = outputs[0]["dit_trajectory"]
        print(
            f"2. dit_trajectory.timesteps {[round(x, 3) for x in tr['timesteps'].tolist()]} (one per returned latent), "
            f"sigmas x 1000 {[round(1000 * x, 3) for x in tr['sigmas'].tolist()]}; "
            f"DiT timesteps per loop step {[round(float(cs[2 * k]['kwargs']['timestep'][0]), 3) for k in range(steps)]}"
        )
        env = outputs[0]["denoising_env"]
        checks = []
        for i, o in enumerate(outputs):
            rows = {k: r for r, k in enumerate(returned)}
            for k in range(steps):
                pos, neg = cs[2 * k], cs[2 * k + 1]
                if k in rows:
                    checks.append(torch.equal(o["dit_trajectory"]["latents"][rows[k]], pos["kwargs"]["hidden_states"][i]))
                    checks.append(float(o["dit_trajectory"]["timesteps"][rows[k]]) == float(pos["kwargs"]["timestep"][i]))
                cfg = neg["out"][i] + GUIDANCE * (pos["out"][i] - neg["out"][i])
                checks.append(torch.equal(o["rollout_debug_tensors"]["rollout_model_outputs"][k], cfg))
            for key, call in (("pos_cond_kwargs", cs[0]), ("neg_cond_kwargs", cs[1])):
                checks.extend(
                    torch.equal(o["denoising_env"][key][t], call["kwargs"][t]) for t in ("encoder_hidden_states", "pooled_projections")
                )
        print(
            f"   returned latents, timesteps (at their rows), conditioning == the DiT's inputs and "
            f"rollout_model_outputs == u + {GUIDANCE:g}(c - u): {all(checks)} ({len(checks)} checks)"
        )
        print("3. trainer replay (one batched [neg; pos] forward) vs the server's rollout_model_outputs, |dv| mean / max:")
        for i, o in enumerate(outputs):
            trj, rows = o["dit_trajectory"], {k: r for r, k in enumerate(returned)}
            pos, neg = env["pos_cond_kwargs"], env["neg_cond_kwargs"]
            for k in sde:
                x = trj["latents"][rows[k]][None]
                for label, t in (("timesteps[k] (build_pairs)", trj["timesteps"][k]), ("timesteps[row of k]", trj["timesteps"][rows[k]])):
                    t2 = t.reshape(1).float().expand(2)
                    out = model(
                        hidden_states=torch.cat([x, x]),
                        timestep=t2,
                        encoder_hidden_states=torch.cat([neg["encoder_hidden_states"], pos["encoder_hidden_states"]]),
                        pooled_projections=torch.cat([neg["pooled_projections"], pos["pooled_projections"]]),
                        return_dict=False,
                    )[0]
                    u, c = out.chunk(2)
                    v = (u + GUIDANCE * (c - u))[0]
                    d = (v - o["rollout_debug_tensors"]["rollout_model_outputs"][k]).abs()
                    print(f"   output {i} step {k}: t = {label:27s} = {float(t):8.3f}: {float(d.mean()):.3g} / {float(d.max()):.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", type=Path, default=ROOT / ".sglang-venv" / "tiny-sd3")
    parser.add_argument("--work", type=Path, default=Path("/tmp/sglang-layer-diff"))
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--trainer-python", default=None, help="also compare under this Python (the trainer's diffusers)")
    parser.add_argument("--compare-only", type=Path, default=None, help="compare the dumps of an earlier run in DIR")
    args = parser.parse_args()
    if not (args.tiny / "model_index.json").is_file():
        sys.exit(f"{args.tiny}: no pipeline (write one with: .venv/bin/miles-core make-tiny sd3 {args.tiny})")
    if args.compare_only is not None:
        compare(args.tiny, args.compare_only)
        return
    serve_and_dump(args.tiny, args.work, args.port or free_port())
    compare(args.tiny, args.work)
    if args.trainer_python:
        sys.stdout.flush()
        subprocess.run([args.trainer_python, __file__, "--compare-only", str(args.work), "--tiny", str(args.tiny)], check=True)


if __name__ == "__main__":
    main()
