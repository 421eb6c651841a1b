"""Weight sync to remote engines: the merged weights an engine without LoRA layers must
hold, LoRA-only sync with the engine adding the adapter, checksums on both sides, and
training runs against an HTTP engine (in process, and a ``miles-core serve-engine``
subprocess for the alignment probe)."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import torch

from miles_core import testing
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.engine.http import HttpEngine
from miles_core.engine.server import create_app
from miles_core.errors import WeightSyncError
from miles_core.training.weight_sync import (
    check_checksums,
    engine_weights,
    expected_checksum,
    lora_config,
    lora_tensors,
    send_from_rank,
    sync_to_engine,
)
from miles_core.weights import (
    bucket_to_bytes,
    iter_buckets,
    load_named_tensors,
    module_checksum,
    named_tensors_checksum,
)
from tests.test_server import ServerThread, error_of, http, wait_healthy
from tests.tiny_runs import run_metrics, tiny_run_args

PROMPTS = ['{"input": "a red cube"}', '{"input": "a blue ball"}']
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"], "init_lora_weights": "gaussian"}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture
def server(tiny_sd3):
    """A fresh in-process server of the tiny checkpoint: (url, its engine)."""
    engine = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3")
    thread = ServerThread(create_app(engine))
    try:
        wait_healthy(thread.url)
        yield thread.url, engine
    finally:
        thread.close()


def transformer(tiny_sd3):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.from_pretrained(str(tiny_sd3 / "transformer"))


def adapted(module, config=LORA, seed=0):
    """A copy of ``module`` with a LoRA whose B is not zero (a trained adapter)."""
    from peft import LoraConfig

    module = copy.deepcopy(module)
    module.add_adapter(LoraConfig(**config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in lora_tensors(module):
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return module


def checksum_of(url: str, module: str = "transformer") -> str:
    status, body = http(url, "/get_weights_checksum", {"module_names": [module]})
    assert status == 200, body
    return json.loads(body)[module]


def run_training(tiny_sd3, prompts, out, *extra):
    return run_metrics([*tiny_run_args(tiny_sd3, prompts, out, batch=1, n=2, steps=3, sde_steps=1), *extra], timeout=120)


def trained_transformer(tiny_sd3, checkpoint_dir: Path):
    """The trainer's transformer at the end of a LoRA run, rebuilt from its checkpoint."""
    from peft import LoraConfig

    from miles_core.training.checkpoint import load_checkpoint

    module = transformer(tiny_sd3)
    module.add_adapter(LoraConfig(**LORA))
    load_named_tensors(module, load_checkpoint(checkpoint_dir).model_state["transformer"], module_name="transformer")
    return module


LORA_RUN = (
    "--use-lora",
    "--lora-rank",
    "4",
    "--lora-alpha",
    "8",
    "--lora-target-modules",
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "--lr",
    "3e-2",
    "--num-rollout",
    "2",
)


# -- (a) the merged weights ---------------------------------------------------------------


def test_engine_weights_are_the_merged_lora(tiny_sd3):
    from peft.tuners.lora import LoraModel

    plain = transformer(tiny_sd3)
    lora = adapted(plain)
    merged = dict(engine_weights(lora))
    assert list(merged) == sorted(name for name, _ in plain.named_parameters())
    assert not any("lora_" in name or "base_layer" in name for name in merged)

    # A fresh plain copy loaded with them computes what the adapted module computes.
    fresh = copy.deepcopy(plain)
    load_named_tensors(fresh, merged, module_name="transformer")
    cfg = plain.config
    generator = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(2, cfg.in_channels, 8, 8, generator=generator),
        "encoder_hidden_states": torch.randn(2, 5, cfg.joint_attention_dim, generator=generator),
        "pooled_projections": torch.randn(2, cfg.pooled_projection_dim, generator=generator),
        "timestep": torch.tensor([250.0, 750.0]),
    }
    with torch.no_grad():
        want, got, base = (m(**inputs).sample for m in (lora, fresh, plain))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - base).abs().max() > 1e-2  # control: the adapter matters

    # PEFT's own merge_and_unload, on a copy of the base with the same adapter tensors.
    from peft import LoraConfig

    peft_model = LoraModel(copy.deepcopy(plain), LoraConfig(**LORA), "default")
    missing, unexpected = peft_model.model.load_state_dict(dict(lora_tensors(lora)), strict=False)
    assert not unexpected and all("lora_" not in name for name in missing)
    unloaded = peft_model.merge_and_unload()
    assert {n for n, _ in unloaded.named_parameters()} == set(merged)
    for name, parameter in unloaded.named_parameters():
        assert torch.equal(parameter, merged[name]), name

    # Checksums: the trainer's sum of what it sends is what a plain engine module reports.
    assert named_tensors_checksum(merged.items()) == module_checksum(unloaded) == module_checksum(fresh)
    assert expected_checksum(lora, lora_only=False) == module_checksum(fresh)
    assert expected_checksum(lora, lora_only=True) == module_checksum(lora) != module_checksum(fresh)
    # A plain module's engine weights are its parameters.
    assert expected_checksum(plain, lora_only=False) == module_checksum(plain)
    # Adapters switched off: the base weights.
    lora.disable_adapters()
    assert expected_checksum(lora, lora_only=False) == module_checksum(plain)


def test_lora_tensors_and_config_fit_an_engine_side_adapter(tiny_sd3):
    lora = adapted(transformer(tiny_sd3))
    config = lora_config(lora)
    assert config == {**LORA, "target_modules": sorted(LORA["target_modules"])}
    names = [name for name, _ in lora_tensors(lora)]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    engine_side = transformer(tiny_sd3)
    assert EmbeddedEngine._ensure_lora_adapter("transformer", engine_side, config) is True
    assert {n for n, _ in engine_side.named_parameters()} == {n for n, _ in lora.named_parameters()}
    load_named_tensors(engine_side, dict(lora_tensors(lora)), module_name="transformer")
    assert module_checksum(engine_side) == expected_checksum(lora, lora_only=True)


# -- the server's lora_config -----------------------------------------------------------------


def test_server_adds_the_adapter_once_and_refuses_another(server, tiny_sd3):
    url, engine = server
    lora = adapted(transformer(tiny_sd3))
    tensors = dict(lora_tensors(lora))
    bucket = bucket_to_bytes(tensors)

    def send(body) -> tuple[int, bytes]:
        return http(url, "/update_weights_from_tensor", msgpack.packb(body), content_type="application/msgpack")

    base = {"target_module": "transformer", "bucket": bucket, "lora_only": True}
    cases = [
        (base, 400, "lora_config: transformer has no LoRA adapter"),
        ({**base, "lora_only": False, "lora_config": LORA}, 400, "lora_config: goes with lora_only"),
        ({**base, "lora_config": {**LORA, "r": 0}}, 400, "lora_config.r: must be a positive integer"),
        ({**base, "lora_config": {**LORA, "dropout": 0.1}}, 400, "lora_config.dropout: unknown field"),
        ({**base, "lora_config": {**LORA, "target_modules": []}}, 400, "lora_config.target_modules: "),
        (
            {**base, "lora_config": {**LORA, "target_modules": ["no_such_layer"]}},
            400,
            "lora_config: transformer: cannot add the LoRA adapter",
        ),
    ]
    before = checksum_of(url)
    for body, status, prefix in cases:
        got_status, message = error_of(send(body))
        assert got_status == status and message.startswith(prefix), (got_status, message)
    assert not getattr(engine.component("transformer"), "peft_config", None)
    assert checksum_of(url) == before

    status, body = send({**base, "lora_config": LORA})
    assert status == 200 and json.loads(body)["num_tensors"] == len(tensors)
    assert checksum_of(url) == expected_checksum(lora, lora_only=True)
    # The same adapter again is fine; another one is a conflict, and nothing changes.
    assert send({**base, "lora_config": LORA})[0] == 200
    status, message = error_of(send({**base, "lora_config": {**LORA, "r": 8}}))
    assert status == 409 and message.startswith("lora_config: transformer already has LoRA adapter(s)")
    assert checksum_of(url) == expected_checksum(lora, lora_only=True)


def test_a_sync_the_engine_did_not_apply_names_the_url_and_module(server, tiny_sd3):
    url, engine = server
    engine.update_weights_from_tensors = lambda name, tensors, **kwargs: len(tensors)  # drops every update
    config = SimpleNamespace(lora_ipc_weight_sync=False, update_weight_buffer_size=1 << 20)

    async def main():
        async with HttpEngine(url) as client:
            await sync_to_engine(client, {"transformer": adapted(transformer(tiny_sd3))}, config)

    with pytest.raises(WeightSyncError, match=rf"^{url}: module 'transformer' reports checksum [0-9a-f]+ after a full"):
        asyncio.run(main())


# -- from a training rank: gathered and posted bucket by bucket, checksums compared -------------


@pytest.mark.parametrize("lora_only", [False, True], ids=["merged", "lora-only"])
def test_a_rank_sends_its_weights_in_buckets_and_a_corrupted_bucket_fails_the_checksum(server, tiny_sd3, monkeypatch, lora_only):
    import miles_core.engine.http as http_module

    url, engine = server
    module = adapted(transformer(tiny_sd3))
    dtypes = {"transformer": {name: p.dtype for name, p in module.named_parameters()}}
    size = 1024 if lora_only else 64 * 1024  # several buckets either way (the adapter is 6 KiB)
    config = SimpleNamespace(update_weight_buffer_size=size)
    sent_buckets: list[int] = []
    encode = http_module.bucket_to_bytes

    def recording(bucket):
        sent_buckets.append(sum(t.numel() * t.element_size() for t in bucket.values()))
        return encode(bucket)

    monkeypatch.setattr(http_module, "bucket_to_bytes", recording)

    def send_and_check() -> dict:
        answer = send_from_rank({"transformer": module}, dtypes, [url], config, lora_only=lora_only, sends=True)
        assert answer["error"] is None

        async def check():
            async with HttpEngine(url) as client:
                await check_checksums(client, answer["checksums"], lora_only=lora_only)

        asyncio.run(check())
        return answer

    answer = send_and_check()
    assert answer["checksums"] == {"transformer": expected_checksum(module, lora_only=lora_only)}
    assert checksum_of(url) == expected_checksum(module, lora_only=lora_only)
    # Bucket by bucket: what the sync sends, cut at --update-weight-buffer-size (never all at once).
    sent = lora_tensors(module) if lora_only else engine_weights(module)
    items = sorted(sent, key=lambda item: item[0]) if lora_only else list(sent)
    assert sent_buckets == [sum(t.numel() * t.element_size() for t in b.values()) for b in iter_buckets(items, size)]
    assert len(sent_buckets) > 1 and answer["bytes"] == sum(sent_buckets)

    # Control: one bucket altered on its way (after the rank hashed it) fails the comparison.
    def corrupting(bucket):
        if not sent_buckets:
            name = next(iter(bucket))
            bucket = {**bucket, name: bucket[name] + 1}
        return recording(bucket)

    sent_buckets.clear()
    monkeypatch.setattr(http_module, "bucket_to_bytes", corrupting)
    with pytest.raises(WeightSyncError, match=rf"^{url}: module 'transformer' reports checksum [0-9a-f]+ after a "):
        send_and_check()


def test_a_rank_that_cannot_reach_an_engine_still_gathers_to_the_end(tiny_sd3):
    module = adapted(transformer(tiny_sd3))
    dtypes = {"transformer": {name: p.dtype for name, p in module.named_parameters()}}
    config = SimpleNamespace(update_weight_buffer_size=64 * 1024)
    answer = send_from_rank({"transformer": module}, dtypes, ["http://127.0.0.1:9"], config, lora_only=False, sends=True)
    url, status, _ = answer["error"]
    assert url.startswith("http://127.0.0.1:9/update_weights_from_tensor") and status is None
    assert answer["checksums"] == {} and answer["bytes"] == 0


def test_a_streamed_component_loads_as_save_pretrained_wrote_it(tiny_sd3, tmp_path):
    from diffusers import SD3Transformer2DModel

    from miles_core.training.final_weights import INDEX_NAME, stream_component

    module = transformer(tiny_sd3)
    dtypes = {name: torch.float64 for name, _ in module.named_parameters()}  # another dtype for an engine: cast on the way
    stream_component(module, tmp_path / "streamed", dtypes, writes=True, max_shard_bytes=16 * 1024)
    files = sorted(p.name for p in (tmp_path / "streamed").glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "streamed" / INDEX_NAME).is_file()
    loaded = SD3Transformer2DModel.from_pretrained(str(tmp_path / "streamed"), torch_dtype=torch.float64)
    state = module.state_dict()
    assert loaded.state_dict().keys() == state.keys()
    assert all(torch.equal(loaded.state_dict()[k], v.to(torch.float64)) for k, v in state.items())
    # A rank that does not write gathers the same tensors and writes nothing.
    stream_component(module, tmp_path / "silent", dtypes, writes=False)
    assert not (tmp_path / "silent").exists()


# -- (b, d) a LoRA run against an HTTP engine, full merged weights in small buckets -------------


@pytest.mark.exercises("--update-weight-buffer-size", "--rollout-engine", "--rollout-engine-urls")
@pytest.mark.exercises("--lora-rank", "--lora-alpha", "--lora-target-modules")
def test_lora_run_syncs_merged_weights_in_buckets(server, tiny_sd3, prompts, tmp_path):
    url, engine = server
    before = checksum_of(url)
    calls = []
    update = engine.update_weights_from_tensors
    engine.update_weights_from_tensors = lambda name, tensors, **kw: calls.append(len(tensors)) or update(name, tensors, **kw)
    buffer_size = 32 * 1024
    records = run_training(
        tiny_sd3,
        prompts,
        tmp_path / "run",
        *LORA_RUN,
        "--rollout-engine",
        "http",
        "--rollout-engine-urls",
        url,
        "--update-weight-buffer-size",
        str(buffer_size),
        "--save",
        str(tmp_path / "ckpt"),
    )
    assert [r["rollout_id"] for r in records] == [0, 1]
    trained = trained_transformer(tiny_sd3, tmp_path / "ckpt")
    after = checksum_of(url)
    assert after == expected_checksum(trained, lora_only=False)
    assert after != before  # control: training moved the engine's weights
    assert not getattr(engine.component("transformer"), "peft_config", None)  # the engine stays plain
    # One sync before the first rollout and one after each rollout, each in several buckets.
    per_sync = [len(b) for b in iter_buckets(engine_weights(trained), buffer_size)]
    assert len(per_sync) >= 3 and calls == per_sync * 3
    total = sum(t.numel() * t.element_size() for _, t in engine_weights(trained))
    assert records[0]["perf/weight_sync_bytes"] == 2 * total and records[1]["perf/weight_sync_bytes"] == total
    assert all(r["perf/weight_sync_time"] > 0 for r in records)


# -- (c) LoRA-only ----------------------------------------------------------------------------


@pytest.mark.exercises("--lora-ipc-weight-sync")
def test_lora_only_run_creates_the_engine_adapter(server, tiny_sd3, prompts, tmp_path):
    url, engine = server
    before = checksum_of(url)
    records = run_training(
        tiny_sd3,
        prompts,
        tmp_path / "run",
        *LORA_RUN,
        "--rollout-engine",
        "http",
        "--rollout-engine-urls",
        url,
        "--lora-ipc-weight-sync",
        "--save",
        str(tmp_path / "ckpt"),
    )
    module = engine.component("transformer")
    assert set(module.peft_config) == {"default"} and module.peft_config["default"].r == 4
    trained = trained_transformer(tiny_sd3, tmp_path / "ckpt")
    after = checksum_of(url)
    assert after == expected_checksum(trained, lora_only=True) == module_checksum(module)
    assert after != expected_checksum(transformer(tiny_sd3), lora_only=False) and after != before
    # Control: the engine's merged view is the trainer's merged weights.
    assert expected_checksum(module, lora_only=False) == expected_checksum(trained, lora_only=False)
    lora_bytes = sum(t.numel() * t.element_size() for _, t in lora_tensors(trained))
    assert records[1]["perf/weight_sync_bytes"] == lora_bytes


# -- (e) the alignment probe against a serve-engine subprocess -------------------------------


def test_alignment_probe_is_exactly_zero_against_a_serve_engine_process(tiny_sd3, prompts, tmp_path):
    with testing.serve_engine_process(
        tiny_sd3, "--diffusion-model-family", "sd3", "--device", "cpu", log_path=tmp_path / "serve.log"
    ) as served:
        url = served.url
        wait_healthy(url, timeout=60)
        # Nudge one engine weight: only the run's initial sync makes the probe exact again.
        name, weight = next(iter(transformer(tiny_sd3).named_parameters()))
        body = {"target_module": "transformer", "bucket": bucket_to_bytes({name: weight.detach() + 0.1})}
        assert http(url, "/update_weights_from_tensor", msgpack.packb(body), content_type="application/msgpack")[0] == 200
        assert checksum_of(url) != module_checksum(transformer(tiny_sd3))
        (record,) = run_training(
            tiny_sd3,
            prompts,
            tmp_path / "probe",
            "--num-rollout",
            "1",
            "--debug-skip-optimizer-step",
            "--diffusion-debug-mode",
            "--micro-batch-size-sample",
            "2",
            "--micro-batch-size-tstep",
            "1",
            "--diffusion-guidance-scale",
            "4.5",
            "--rollout-engine",
            "http",
            "--rollout-engine-urls",
            url,
        )
        assert record["train/num_pairs"] == 2
        assert record["train/log_prob_max_abs_diff"] == 0.0 and record["train/log_prob_mean_abs_diff"] == 0.0
        assert record["train/model_output_max_abs_diff"] == 0.0
        assert record["train/ratio_mean"] == 1.0 and record["train/clipfrac"] == 0.0
        # The initial sync happened (full weights, checked), and none after the skipped step.
        assert record["perf/weight_sync_bytes"] > 0
        assert checksum_of(url) == module_checksum(transformer(tiny_sd3))
