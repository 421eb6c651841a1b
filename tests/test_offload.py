"""Offload and turn-taking (``--offload``, ``--offload-train``, ``--offload-rollout``,
``--colocate``): the memory audit, storages moved off and back bit for bit, the run's
phases with the offloaded roles at zero bytes (and a control that leaves one resident),
the serve-engine's release/resume endpoints, and the configuration rules."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from miles_core.config.resolve import resolve_config
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.engine.server import create_app
from miles_core.errors import ConfigError
from miles_core.memory import OffloadedStorages, audit_memory
from miles_core.request import RolloutRequest
from miles_core.training import offload
from miles_core.training.run import train
from tests.test_server import ServerThread, assert_same_outputs, http, wait_healthy
from tests.tiny_runs import tiny_run_args

RELEASED = "engine: cannot generate while its memory is released (release_memory_occupation); resume it first (resume_memory_occupation)"


def tiny_model() -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    """A 4 -> 3 linear layer (48 + 12 bytes of fp32) after one AdamW step."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.ones(2, 4)).square().sum().backward()
    optimizer.step()
    return layer, optimizer


def frozen_module() -> torch.nn.Module:
    """2 -> 2 linear (24 bytes) and a float64 buffer of 5 (40 bytes)."""
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    module.register_buffer("table", torch.zeros(5, dtype=torch.float64))
    return module


def test_the_audit_counts_each_storage_once_under_its_first_role():
    layer, optimizer = tiny_model()
    frozen = frozen_module()
    engine = torch.nn.ModuleDict({"transformer": layer, "vae": frozen})  # shares the trained layer
    view = layer.weight[1:]  # another tensor over the weight's storage
    report = audit_memory(parameters=[*layer.parameters(), view], optimizers=[optimizer], engine_modules=[engine])
    # Hand-computed: weight 12 + bias 3 floats; AdamW keeps exp_avg and exp_avg_sq per
    # parameter plus a float32 step; the engine's own bytes are the frozen module's only.
    assert report.by_role() == {"parameters": 60, "gradients": 60, "optimizer_state": 2 * 60 + 2 * 4, "engine_weights": 24 + 40}
    assert report.as_dict() == {
        "parameters": {"cpu": 60},
        "gradients": {"cpu": 60},
        "optimizer_state": {"cpu": 128},
        "engine_weights": {"cpu": 64},
    }
    assert report.resident("gradients", "cuda:0") == 0
    with pytest.raises(ValueError, match="unknown role 'activations'; the roles are parameters, gradients"):
        report.resident("activations")


def test_offloaded_storages_come_back_bit_for_bit_with_the_same_tensors():
    layer, optimizer = tiny_model()
    control, control_optimizer = copy.deepcopy((layer, optimizer))
    frozen = frozen_module()
    # A weight read from a file mapping cannot be resized: it gets a storage of its own.
    frozen[0].weight.data = torch.frombuffer(bytearray(torch.arange(4.0).numpy().tobytes()), dtype=torch.float32).view(2, 2)
    assert not frozen[0].weight.untyped_storage().resizable()
    tensors = [*layer.parameters(), *(p.grad for p in layer.parameters()), *frozen.parameters(), *frozen.buffers()]
    tensors += [t for state in optimizer.state.values() for t in state.values()]
    before = [(t, t.detach().clone()) for t in tensors]
    moved = OffloadedStorages.offload(tensors, keep=[layer.bias])
    report = audit_memory(parameters=list(layer.parameters()), optimizers=[optimizer], engine_modules=[frozen])
    # Everything but the kept bias is released; the host holds exactly those bytes.
    assert report.by_role() == {"parameters": 12, "gradients": 0, "optimizer_state": 0, "engine_weights": 0}
    assert moved.nbytes == 48 + 60 + 128 + 64
    moved.restore()
    for tensor, copied in before:
        assert tensor.untyped_storage().nbytes() > 0
        assert torch.equal(tensor.detach().reshape(-1).view(torch.uint8), copied.reshape(-1).view(torch.uint8))
    assert all(a is b for a, b in zip(optimizer.param_groups[0]["params"], layer.parameters()))
    with pytest.raises(RuntimeError, match="already restored"):
        moved.restore()
    # The optimizer goes on exactly as one that never offloaded.
    for model, opt in ((layer, optimizer), (control, control_optimizer)):
        opt.zero_grad()
        model(torch.full((2, 4), 0.5)).square().sum().backward()
        opt.step()
    assert torch.equal(layer.weight, control.weight) and torch.equal(layer.bias, control.bias)


# -- a run taking turns ------------------------------------------------------------------

RUN = ("--num-rollout", "2", "--lr", "1e-3", "--eval-interval", "2", "--n-samples-per-eval-prompt", "1", "--skip-eval-before-train")


def short_run(tiny_sd3, prompts, out, *extra, engine_factory=None):
    """A 2-rollout full fine-tuning run with an evaluation at the end; its metrics and
    the memory audit (bytes per role) at every phase it entered."""
    args = [*tiny_run_args(tiny_sd3, prompts, out, batch=1, n=2, steps=3, sde_steps=1), *RUN]
    args += ["--eval-prompt-data", "shapes", str(prompts), "--save", str(out / "ckpt"), *extra]
    phases: list[tuple[str, dict[str, int]]] = []
    path = asyncio.run(
        train(
            resolve_config(args),
            log=lambda line: None,
            engine_factory=engine_factory,
            on_phase=lambda phase, report: phases.append((phase, report.by_role())),
        )
    )
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records], phases


def resident_offloaded_roles(phases, trainer_roles=("gradients", "optimizer_state")):
    """Each phase whose offloaded roles hold bytes: the trainer's off in generation and
    evaluation, the engine's off in training and checkpoints."""
    off = {"rollout": trainer_roles, "eval": trainer_roles, "train": ("engine_weights",), "checkpoint": ("engine_weights",)}
    return [(phase, role, held[role]) for phase, held in phases for role in off.get(phase, ()) if held[role]]


ORDER = ["sync", "rollout", "train", "sync", "rollout", "train", "sync", "eval", "checkpoint", "done"]


def final_weights(out):
    return load_file(str(out / "model" / "transformer" / "diffusion_pytorch_model.safetensors"))


@pytest.mark.exercises("--offload", "--offload-train", "--offload-rollout")
def test_an_offloaded_run_takes_turns_and_trains_bit_for_bit_as_without(tiny_sd3, prompts, tmp_path, monkeypatch):
    plain, plain_phases = short_run(tiny_sd3, prompts, tmp_path / "plain")
    records, phases = short_run(tiny_sd3, prompts, tmp_path / "offload", "--offload")
    assert [phase for phase, _ in phases] == [phase for phase, _ in plain_phases] == ORDER
    # The embedded engine samples the trainer's modules: they stay; gradients, optimizer
    # state and the engine's own modules (VAE, text encoders) take turns.
    assert resident_offloaded_roles(phases) == []
    assert all(held["parameters"] > 0 for _, held in phases)
    trained = dict(phases)["sync"]  # the last sync: everything resident, after training
    assert min(trained.values()) > 0 and trained == dict(plain_phases)["sync"]
    assert resident_offloaded_roles(plain_phases) != []  # without offload nothing moves
    # Bit for bit: metrics (but times), final weights.
    assert records == plain
    weights, plain_weights = final_weights(tmp_path / "offload"), final_weights(tmp_path / "plain")
    assert weights.keys() == plain_weights.keys()
    assert all(torch.equal(weights[k], plain_weights[k]) for k in weights)

    # Control: an offload that leaves one tensor resident and restores one optimizer value
    # doubled, and an engine that keeps its VAE: both checks fail.
    class Leaky(offload.TrainerOffload):
        def tensors(self):
            going, staying = super().tensors()
            return going[1:], staying + going[:1]

        def reload(self):
            super().reload()
            for state in self.trainer.optimizer.state.values():
                state["exp_avg"].view(-1)[0] *= 2
                break

    class KeepsItsVae(EmbeddedEngine):
        def release_memory_sync(self):
            self.keep_on_release = self.keep_on_release | {"vae"}
            return super().release_memory_sync()

    monkeypatch.setattr(offload, "trainer_offloader", lambda trainer, engine, config: Leaky(trainer, keep_parameters=True))
    _, leaky_phases = short_run(tiny_sd3, prompts, tmp_path / "leaky", "--offload", engine_factory=KeepsItsVae.from_config)
    leaks = resident_offloaded_roles(leaky_phases)
    assert {phase for phase, _, _ in leaks} == {"rollout", "eval", "train", "checkpoint"}
    leaked = final_weights(tmp_path / "leaky")
    assert not all(torch.equal(leaked[k], plain_weights[k]) for k in leaked)


@pytest.mark.exercises("--offload-train", "--offload-rollout", "--rollout-engine-urls")
def test_with_a_remote_engine_the_whole_trainer_goes_off_and_the_server_releases(tiny_sd3, prompts, tmp_path):
    server_engine = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3")
    thread = ServerThread(create_app(server_engine))
    served: list[tuple[str, int, bool]] = []
    try:
        wait_healthy(thread.url)
        args = [*tiny_run_args(tiny_sd3, prompts, tmp_path / "run", batch=1, n=2, steps=3, sde_steps=1), "--num-rollout", "2"]
        args += ["--use-lora", "--lr", "3e-2", "--rollout-engine", "http", "--rollout-engine-urls", thread.url]
        args += ["--offload-train", "--offload-rollout"]
        phases = []

        def record(phase, report):
            engine_bytes = audit_memory(engine_modules=server_engine.pipeline_modules().values()).resident("engine_weights")
            served.append((phase, engine_bytes, server_engine.memory_released))
            phases.append((phase, report.by_role()))

        asyncio.run(train(resolve_config(args), log=lambda line: None, on_phase=record))
    finally:
        thread.close()
    assert [phase for phase, _ in phases] == ["sync", "rollout", "train", "sync", "rollout", "train", "sync", "done"]
    # A remote engine: the trainer's modules go off too (LoRA base weights included).
    assert resident_offloaded_roles(phases, ("parameters", "gradients", "optimizer_state")) == []
    # The server released its whole pipeline while the trainer trained, and only then.
    assert [(phase, released) for phase, _, released in served if released] == [("train", True), ("train", True)]
    assert all((nbytes == 0) == released for _, nbytes, released in served)


# -- serve-engine endpoints ----------------------------------------------------------------


def test_serve_engine_releases_and_resumes_its_memory(tiny_sd3):
    engine = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3")
    thread = ServerThread(create_app(engine))
    request = RolloutRequest(prompt="a red cube", seed=5, num_inference_steps=2, num_outputs_per_prompt=2, request_id="r")
    from miles_core.engine.wire import unpack_outputs

    def generate():
        return http(thread.url, "/rollout/generate", request.to_json())

    try:
        wait_healthy(thread.url)
        status, body = generate()
        assert status == 200
        before = unpack_outputs(body)
        resident = audit_memory(engine_modules=engine.pipeline_modules().values()).resident("engine_weights")
        status, body = http(thread.url, "/release_memory_occupation", b"")
        assert status == 200 and json.loads(body) == {
            "success": True,
            "sleeping": True,
            "message": f"released {resident} bytes of 5 module(s)",
        }
        assert audit_memory(engine_modules=engine.pipeline_modules().values()).resident("engine_weights") == 0
        status, body = http(thread.url, "/release_memory_occupation", {})
        assert (status, json.loads(body)["message"]) == (200, "already released")
        assert (status_and_error := generate())[0] == 409 and json.loads(status_and_error[1])["error"] == RELEASED
        status, body = http(thread.url, "/get_weights_checksum", {"module_names": ["transformer"]})
        assert status == 409 and "cannot compute weight checksums while its memory is released" in json.loads(body)["error"]
        assert http(thread.url, "/resume_memory_occupation", {"stay": 1})[0] == 400
        status, body = http(thread.url, "/resume_memory_occupation", b"")
        assert status == 200 and json.loads(body) == {"success": True, "sleeping": False, "message": f"restored {resident} bytes"}
        status, body = generate()
        assert status == 200
        assert_same_outputs(before, unpack_outputs(body))
    finally:
        thread.close()


# -- configuration ------------------------------------------------------------------------

BASE = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "1"]


def offload_flags(*argv):
    config = resolve_config([*BASE, *argv])
    return config.offload_train, config.offload_rollout


@pytest.mark.exercises("--offload", "--offload-train", "--offload-rollout", "--colocate")
def test_offload_flags_resolve_and_contradictions_are_errors():
    assert offload_flags() == (False, False)
    assert offload_flags("--offload") == (True, True)
    assert offload_flags("--colocate") == (True, True)
    assert offload_flags("--colocate", "--offload-rollout") == (True, True)
    assert offload_flags("--offload-train") == (True, False)
    with pytest.raises(ConfigError) as caught:
        resolve_config([*BASE, "--colocate", "--no-offload-train"])
    assert caught.value.messages == [
        "--colocate and --no-offload-train cannot be combined: colocated trainer and engines share the devices and take turns; "
        "drop one of them"
    ]
    with pytest.raises(ConfigError) as caught:
        resolve_config([*BASE, "--offload", "--no-offload-rollout"])
    assert caught.value.messages == [
        "--offload and --no-offload-rollout cannot be combined: --offload turns on --offload-train and --offload-rollout; drop one of them"
    ]
    sft = resolve_config([*BASE, "--loss-type", "sft_loss", "--offload"])
    assert (
        "--offload: --loss-type sft_loss trains on --prompt-data rows with no rollout engine, so the trainer has no turns to take and it has no effect"
        in sft.notes
    )
    colocated = resolve_config([*BASE, "--colocate"])
    assert any(
        note.startswith("--colocate: with the hardware it needs, it places the engine servers")
        and note.endswith("so it places nothing (the turns it turns on still take effect)")
        for note in colocated.notes
    )


FROZEN_ENGINE = """
from miles_core.api import RolloutEngineSpec


def miles_register_rollout_engines():
    return [RolloutEngineSpec(name="frozen", ref="frozen_engine:FrozenEngine", description="cannot release")]
"""


def test_an_engine_that_cannot_release_is_refused_with_the_offload_flags(tmp_path, monkeypatch):
    from importlib import metadata

    from miles_core.hookspecs import ENTRY_POINT_GROUP
    from miles_core.plugin_manager import PluginHost
    from tests.fake_dists import entry_points_in, make_dist

    installed = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    make_dist(tmp_path, "acme-engine", "1.0", {"frozen": FROZEN_ENGINE})
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHost(strict=True, disabled=(), entry_points=[*installed, *entry_points_in(tmp_path)])
    with pytest.raises(ConfigError) as caught:
        resolve_config([*BASE, "--rollout-engine", "frozen", "--colocate"], host=host)
    assert caught.value.messages == [
        "--colocate and --rollout-engine frozen cannot be combined: that engine cannot release its memory while the "
        "trainer trains (its RolloutEngineSpec does not declare releases_memory)"
    ]
    assert resolve_config([*BASE, "--rollout-engine", "frozen", "--offload-train"], host=host).offload_rollout is False


def test_a_loaded_family_owns_its_storages_so_offloading_never_moves_them(tiny_sd3, prompts, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    from miles_core.memory import module_tensors, own_storages
    from miles_core.model_loading import load_family

    # The control: diffusers leaves the weights on the memory-mapped safetensors files.
    pipeline = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    modules = [m for m in pipeline.components.values() if isinstance(m, torch.nn.Module)]
    assert sum(not t.untyped_storage().resizable() for t in module_tensors(modules)) > 0
    weight = pipeline.transformer.proj_out.weight
    before = weight.detach().clone()
    assert own_storages(modules) > 0 and own_storages(modules) == 0  # once
    assert weight is pipeline.transformer.proj_out.weight and torch.equal(weight, before)
    family = load_family(resolve_config(tiny_run_args(tiny_sd3, prompts, tmp_path)))
    tensors = module_tensors(m for m in family.pipeline.components.values() if isinstance(m, torch.nn.Module))
    assert tensors and all(t.untyped_storage().resizable() for t in tensors)
