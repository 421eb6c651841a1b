"""--precompute-prompt-embeddings on the tiny SD3 pipeline: the store builds, loads from
its cache and rebuilds a corrupt entry, keeps an entry it cannot write in memory; the text
encoders are freed, after which the family refuses another store; the fingerprint covers
every frozen module an encode runs (LTX-2's connectors), the family's defaults and code;
a run gives the same records with and without it (a forged cache entry, the control,
changes them); the runs it cannot serve (a plugin's engine included) say so in one line;
serve-engine preloads the run's manifest."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest
import torch

from miles_core.cli import serve_engine
from miles_core.config.resolve import resolve_config
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.engine.prompt_store import (
    PromptStore,
    conditioning_key,
    encoder_fingerprint,
    entry_path,
    frozen_modules,
    text_encoders,
    write_entry,
    write_manifest,
)
from miles_core.engine.wire import unpack_outputs
from miles_core.errors import ConfigError, PromptNotStoredError, RunError
from miles_core.request import RolloutRequest
from miles_core.training.prompt_embeddings import precompute_prompt_embeddings, server_arguments
from miles_core.training.run import train
from tests.test_server import ServerThread, assert_same, error_of, http, wait_healthy
from tests.tiny_runs import tiny_run_args

HOOKS = "tests.custom_hooks_example"


def request(prompt: str, negative: str | None = None) -> RolloutRequest:
    return RolloutRequest(prompt=prompt, negative_prompt=negative, num_inference_steps=2, height=32, width=32, rollout=False)


def assert_conditioning_equal(a, b) -> None:
    for x, y in ((a.positive, b.positive), (a.negative or {}, b.negative or {})):
        assert x.keys() == y.keys()
        for name in x:
            assert x[name].dtype == y[name].dtype and torch.equal(x[name], y[name]), name


def data_offset(path: Path) -> int:
    """Where the tensor bytes of a safetensors file begin."""
    (size,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + size


@pytest.mark.exercises("--precompute-prompt-embeddings")
def test_the_store_builds_loads_rebuilds_a_corrupt_entry_and_frees_the_encoders(tiny_sd3, tmp_path):
    family = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3").family
    requests = [request("a red cube"), request("a blue ball"), request("a red cube")]  # one repeated
    lines: list[str] = []
    first = PromptStore.build(family, requests, tmp_path, log=lines.append)
    assert (first.stats.encoded, first.stats.loaded, len(first.entries)) == (2, 0, 2) and lines == []
    for r in requests:  # the stored encoding is the tensor a fresh encode gives (same call, batch 1)
        params = family.resolve_params(r)
        assert_conditioning_equal(first.get(r.prompt, None, params), family.encode(r.prompt, None, params))

    again = PromptStore.build(family, requests, tmp_path, log=lines.append)
    assert (again.stats.encoded, again.stats.loaded) == (0, 2) and lines == []
    for key, cond in first.entries.items():
        assert_conditioning_equal(again.entries[key], cond)

    # One flipped byte in an entry's tensors: detected by its checksum, rebuilt with one notice.
    fingerprint = encoder_fingerprint(family)
    cube = conditioning_key("a red cube", None, family.resolve_params(requests[0]))
    path = entry_path(tmp_path, fingerprint, cube)
    data = bytearray(path.read_bytes())
    data[data_offset(path) + 5] ^= 0x01
    path.write_bytes(bytes(data))
    rebuilt = PromptStore.build(family, requests, tmp_path, log=lines.append)
    assert lines == [f"--precompute-prompt-embeddings: cache entry {path} for prompt 'a red cube' is corrupt (checksum mismatch); rebuilt"]
    assert (rebuilt.stats.encoded, rebuilt.stats.loaded, rebuilt.stats.rebuilt) == (1, 1, 1)
    assert_conditioning_equal(rebuilt.entries[cube], first.entries[cube])
    path.write_bytes(b"\x00" * 7)  # not even a header
    lines.clear()
    PromptStore.build(family, requests, tmp_path, log=lines.append)
    assert lines == [
        f"--precompute-prompt-embeddings: cache entry {path} for prompt 'a red cube' is corrupt (not a readable safetensors file); rebuilt"
    ]

    # Controls: another negative prompt is another key (encoded, not loaded, and another
    # tensor); one encoder weight nudged changes the fingerprint and forces a re-encode.
    negative = PromptStore.build(family, [request("a red cube", "blurry")], tmp_path, log=lines.append)
    assert (negative.stats.encoded, negative.stats.loaded) == (1, 0)
    other = next(iter(negative.entries.values()))
    assert not torch.equal(other.negative["encoder_hidden_states"], first.entries[cube].negative["encoder_hidden_states"])
    with torch.no_grad():
        next(text_encoders(family)["text_encoder"].parameters()).view(-1)[0] += 1e-3
    nudged = PromptStore.build(family, requests, tmp_path, log=lines.append)
    assert (nudged.stats.encoded, nudged.stats.loaded) == (2, 0) and encoder_fingerprint(family) != fingerprint

    # Freeing: every encoder's weights go to the meta device; encode answers from the store.
    encoders = text_encoders(family)
    resident = sum(t.numel() * t.element_size() for m in encoders.values() for t in (*m.parameters(), *m.buffers()))
    assert set(encoders) == {"text_encoder", "text_encoder_2", "text_encoder_3"}
    assert nudged.free_encoders() == resident > nudged.nbytes > 0
    assert all(t.is_meta for m in encoders.values() for t in m.parameters())
    params = family.resolve_params(requests[0])
    assert family.encode("a red cube", None, params) is nudged.entries[cube]
    with pytest.raises(PromptNotStoredError) as caught:
        family.encode("a yellow duck", None, params)
    assert str(caught.value) == (
        "prompt: 'a yellow duck' (with these sampling parameters) is not among the prompt embeddings computed at "
        "start-up under --precompute-prompt-embeddings, and the text encoders were freed"
    )
    # Freeing cannot be undone: the family refuses to build another store (not a checksum of meta tensors).
    with pytest.raises(RunError) as refused:
        PromptStore.build(family, requests, tmp_path, log=lines.append)
    assert str(refused.value) == (
        "--precompute-prompt-embeddings: the text encoders of this SD3Family were freed by an earlier prompt store, "
        "so it cannot encode again; load the pipeline again"
    )


@pytest.mark.exercises("--precompute-prompt-embeddings", "--prompt-embeddings-cache")
def test_an_entry_that_cannot_be_written_is_kept_in_memory_with_one_notice(tiny_sd3, tmp_path):
    family = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3").family
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder should be")
    requests = [request("a red cube"), request("a blue ball")]
    lines: list[str] = []
    store = PromptStore.build(family, requests, blocked, log=lines.append)
    first = entry_path(blocked, encoder_fingerprint(family), conditioning_key("a red cube", None, family.resolve_params(requests[0])))
    assert lines == [
        f"--precompute-prompt-embeddings: cannot write cache entry {first} (Not a directory); encodings not written are kept in memory only"
    ]
    assert (store.stats.encoded, store.stats.unwritten, len(store.entries)) == (2, 2, 2)
    params = family.resolve_params(requests[1])
    assert_conditioning_equal(store.get("a blue ball", None, params), family.encode("a blue ball", None, params))


def test_the_fingerprint_covers_every_frozen_module_the_settings_and_the_code(tmp_path, monkeypatch):
    """LTX-2's encode runs its ``connectors`` after the text encoder: a nudged connector
    weight, another default negative prompt or an edit of the family's source gives another
    fingerprint; the controls (the trainable transformer, the VAE) leave it as it is."""
    from miles_ltx.family import LtxFamily

    family = EmbeddedEngine.from_checkpoint(LtxFamily.build_tiny_pipeline(tmp_path / "ltx"), "ltx").family
    assert set(frozen_modules(family)) == {"text_encoder", "connectors", "vocoder"}
    base = encoder_fingerprint(family)

    def nudged(module: torch.nn.Module) -> str:
        with torch.no_grad():
            first = next(module.parameters()).view(-1)
            first[0] += 1e-3
            try:
                return encoder_fingerprint(family)
            finally:
                first[0] -= 1e-3

    assert nudged(family.pipeline.transformer) == base and nudged(family.pipeline.vae) == base  # controls
    assert nudged(family.pipeline.connectors) != base
    assert encoder_fingerprint(family) == base
    family.default_negative_prompt = "blurry"  # a default resolve_params does not write into the params
    assert encoder_fingerprint(family) != base
    del family.default_negative_prompt
    assert encoder_fingerprint(family) == base

    # Code: a subclass in its own module; one comment added to its source changes the fingerprint.
    source = tmp_path / "acme_ltx_family.py"
    source.write_text("from miles_ltx.family import LtxFamily\n\n\nclass AcmeLtx(LtxFamily):\n    pass\n")
    spec = importlib.util.spec_from_file_location("acme_ltx_family", source)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "acme_ltx_family", module)  # as an installed plugin's module is
    spec.loader.exec_module(module)
    acme = module.AcmeLtx(family.pipeline)
    before = encoder_fingerprint(acme)
    assert encoder_fingerprint(acme) == before
    source.write_text(source.read_text() + "# a comment\n")
    assert encoder_fingerprint(acme) != before


def run_records(tiny_sd3, prompts, out, *extra, log=lambda line: None):
    args = [*tiny_run_args(tiny_sd3, prompts, out, n=2, steps=2, sde_steps=1), "--num-rollout", "1", "--use-lora", "--lora-rank", "4"]
    path = asyncio.run(train(resolve_config([*args, "--lr", "1e-2", *extra]), log=log))
    return [
        {k: v for k, v in json.loads(line).items() if k.startswith(("train/", "rollout/"))}
        for line in (path / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.exercises("--precompute-prompt-embeddings", "--prompt-embeddings-cache")
def test_a_run_gives_the_same_records_with_the_flag_and_a_forged_entry_changes_them(tiny_sd3, prompts, tmp_path):
    without = run_records(tiny_sd3, prompts, tmp_path / "without")
    lines: list[str] = []
    cache = tmp_path / "cache"
    with_store = run_records(
        tiny_sd3, prompts, tmp_path / "with", "--precompute-prompt-embeddings", "--prompt-embeddings-cache", str(cache), log=lines.append
    )
    assert with_store == without  # exactly: the same encoder call per prompt
    (line,) = [line for line in lines if line.startswith("--precompute-prompt-embeddings")]
    assert line.startswith(f"--precompute-prompt-embeddings: 3 prompt encodings (0 from {cache}, 3 encoded, 0 rebuilt) in ")

    # The control: every cache entry rewritten (with a valid checksum) to hold the
    # encoding of the next prompt; the run loads them and its records change.
    from miles_core.rollout.generate import RolloutSettings
    from miles_core.rollout.seeds import Microgroup

    family = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3").family
    fingerprint = encoder_fingerprint(family)
    settings = RolloutSettings.from_config(resolve_config(tiny_run_args(tiny_sd3, prompts, tmp_path / "x", n=2, steps=2, sde_steps=1)))
    names = [json.loads(line)["input"] for line in prompts.read_text().splitlines()]
    requests = [settings.request(p, Microgroup(0, 0, 1, 0), (), ()) for p in names]
    stored = PromptStore.build(family, requests, cache, log=lines.append)
    assert stored.stats.loaded == 3
    keys = list(stored.entries)
    for key, other in zip(keys, keys[1:] + keys[:1]):
        cond = stored.entries[other]
        tensors = {f"positive.{k}": v for k, v in cond.positive.items()} | {f"negative.{k}": v for k, v in cond.negative.items()}
        write_entry(entry_path(cache, fingerprint, key), fingerprint, key, tensors)
    forged = run_records(tiny_sd3, prompts, tmp_path / "forged", "--precompute-prompt-embeddings", "--prompt-embeddings-cache", str(cache))
    assert forged != without


OWN_ENGINE = """
from miles_core.api import RolloutEngineSpec


def miles_register_rollout_engines():
    return [RolloutEngineSpec(name="own", ref="own_engine:OwnEngine", description="encodes for itself")]
"""


@pytest.mark.exercises("--precompute-prompt-embeddings", "--prompt-embeddings-cache")
def test_runs_it_cannot_serve_say_so_in_one_line_and_bad_flags_are_refused(tiny_sd3, prompts, tmp_path, monkeypatch):
    base = tiny_run_args(tiny_sd3, prompts, tmp_path / "run")
    cases = [
        (["--rollout-engine", "sglang"], "sglang-diffusion servers encode prompts themselves"),
        (
            ["--disable-rollout-global-dataset", "--data-source-path", f"{HOOKS}.CursorSource", "--num-rollout", "1"],
            "--data-source-path: its prompts are unknown at start",
        ),
        (["--rollout-function-path", f"{HOOKS}.own_prompts_rollout"], "--rollout-function-path: a custom rollout supplies its own prompts"),
    ]
    for extra, why in cases:
        lines: list[str] = []
        config = resolve_config([*base, "--precompute-prompt-embeddings", *extra])
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        store = precompute_prompt_embeddings(config, [], engine=None, trainer=None, out=out, supervised=False, log=lines.append)
        assert store is None
        assert lines == [f"--precompute-prompt-embeddings: does not apply ({why}); prompts are encoded per engine as without it"]
        assert server_arguments(config, out) == []
    # An engine a plugin registers encodes for itself: the store does not apply to it.
    from importlib import metadata

    from miles_core.hookspecs import ENTRY_POINT_GROUP
    from miles_core.plugin_manager import PluginHost
    from tests.fake_dists import entry_points_in, make_dist

    installed = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    make_dist(tmp_path / "dists", "acme-engine", "1.0", {"own": OWN_ENGINE})
    monkeypatch.syspath_prepend(str(tmp_path / "dists"))
    host = PluginHost(strict=True, disabled=(), entry_points=[*installed, *entry_points_in(tmp_path / "dists")])
    config = resolve_config([*base, "--precompute-prompt-embeddings", "--rollout-engine", "own"], host=host)
    lines = []
    assert precompute_prompt_embeddings(config, [], engine=None, trainer=None, out=out, supervised=False, log=lines.append) is None
    assert lines == [
        "--precompute-prompt-embeddings: does not apply (--rollout-engine own encodes prompts itself); "
        "prompts are encoded per engine as without it"
    ]
    with pytest.raises(ConfigError) as caught:
        resolve_config([*base, "--prompt-embeddings-cache", str(tmp_path)])
    assert str(caught.value) == "--prompt-embeddings-cache requires --precompute-prompt-embeddings (the cache it keeps)"


@pytest.mark.exercises("--precompute-prompt-embeddings")
def test_serve_engine_preloads_the_manifest_and_refuses_other_prompts(tiny_sd3, tmp_path, capsys):
    stored = request("a red cube")
    manifest = write_manifest(tmp_path / "prompt_embeddings.json", tmp_path / "cache", [stored])
    config = resolve_config([*tiny_run_args(tiny_sd3, tmp_path, tmp_path), "--rollout-engine", "http", "--rollout-num-engines", "1"])
    assert server_arguments(config, tmp_path) == []  # the flag is off
    config = resolve_config(
        [*tiny_run_args(tiny_sd3, tmp_path, tmp_path), "--precompute-prompt-embeddings", "--rollout-engine", "http"]
        + ["--rollout-num-engines", "1"]
    )
    assert server_arguments(config, tmp_path) == ["--prompt-embeddings", str(manifest.absolute())]

    args, family = serve_engine.parse_args(["--hf-checkpoint", str(tiny_sd3), "--device", "cpu", "--prompt-embeddings", str(manifest)])
    server = ServerThread(serve_engine.build_app(args, family))
    try:
        wait_healthy(server.url)
        status, body = http(server.url, "/rollout/generate", stored.to_json())
        assert status == 200
        reference = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3")
        expected = asyncio.run(reference.generate(stored))
        for got, want in zip(unpack_outputs(body), expected, strict=True):
            assert_same(got.generated_output, want.generated_output)
        status, message = error_of(http(server.url, "/rollout/generate", request("a yellow duck").to_json()))
        assert status == 400 and message.startswith("prompt: 'a yellow duck' (with these sampling parameters) is not among")
    finally:
        server.close()
    err = capsys.readouterr().err
    assert "--precompute-prompt-embeddings: 1 prompt encodings (0 from" in err and "1 encoded); text encoders freed (" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 1, "cache": str(tmp_path), "requests": [{"prompt": "x", "colour": 1}]}))
    with pytest.raises(SystemExit) as caught:
        serve_engine.parse_args(["--hf-checkpoint", str(tiny_sd3), "--prompt-embeddings", str(bad)])
    assert caught.value.code == 2
    assert capsys.readouterr().err == f"miles-core serve-engine: error: --prompt-embeddings {bad}: colour: unknown field\n"


def sft_args(tiny_sd3, data, out) -> list[str]:
    args = ["--hf-checkpoint", str(tiny_sd3), "--diffusion-model-family", "sd3", "--prompt-data", str(data), "--loss-type", "sft_loss"]
    args += ["--rollout-batch-size", "4", "--micro-batch-size", "4", "--diffusion-num-steps", "4", "--diffusion-height", "32"]
    return [*args, "--diffusion-width", "32", "--lr", "3e-3", "--num-rollout", "2", "--output-dir", str(out)]


def sft_records(tiny_sd3, data, out, *extra, log=lambda line: None):
    path = asyncio.run(train(resolve_config([*sft_args(tiny_sd3, data, out), *extra]), log=log))
    return [
        {k: v for k, v in json.loads(line).items() if k.startswith("train/")} for line in (path / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.exercises("--precompute-prompt-embeddings", "--prompt-embeddings-cache")
def test_sft_trains_on_the_stored_encodings(tiny_sd3, tmp_path):
    from PIL import Image

    (tmp_path / "images").mkdir()
    rows = []
    for i, (name, colour) in enumerate([("a red square", (220, 30, 30)), ("a blue square", (30, 30, 220))] * 2):
        Image.new("RGB", (40, 40), colour).save(tmp_path / "images" / f"{i}.png")
        rows.append(json.dumps({"input": f"{name} {i}", "image": f"images/{i}.png"}))
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(rows) + "\n")
    without = sft_records(tiny_sd3, data, tmp_path / "without")
    lines: list[str] = []
    cache = tmp_path / "cache"
    flags = ("--precompute-prompt-embeddings", "--prompt-embeddings-cache", str(cache))
    assert sft_records(tiny_sd3, data, tmp_path / "with", *flags, log=lines.append) == without
    assert [line for line in lines if line.startswith("--precompute")][0].startswith(
        f"--precompute-prompt-embeddings: 4 prompt encodings (0 from {cache}, 4 encoded, 0 rebuilt) in "
    )
    # The control: every entry swapped with the next prompt's (valid checksums) changes the losses.
    family = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3").family
    fingerprint = encoder_fingerprint(family)
    from miles_core.training.prompt_embeddings import run_requests
    from miles_core.training.sft import load_sft_rows

    config = resolve_config(sft_args(tiny_sd3, data, tmp_path / "x"))
    rows = load_sft_rows(data, input_key="input", image_key="image")
    stored = PromptStore.build(family, run_requests(config, rows, supervised=True), cache, log=lines.append)
    assert stored.stats.loaded == 4
    keys = list(stored.entries)
    for key, other in zip(keys, keys[1:] + keys[:1]):
        tensors = {f"positive.{k}": v for k, v in stored.entries[other].positive.items()}
        write_entry(entry_path(cache, fingerprint, key), fingerprint, key, tensors)
    forged = sft_records(tiny_sd3, data, tmp_path / "forged", *flags)
    assert [r["train/loss"] for r in forged] != [r["train/loss"] for r in without]
