"""Weight sync through a torch.distributed group (``--weight-sync-path distributed``), over
gloo between this process (rank 0) and real ``serve-engine`` processes: the engines end
up with the trainer's weights, bit for bit those an HTTP sync gives, bucket by bucket; a
bucket altered on the way fails the checksum comparison; a run through the group has the
HTTP run's metrics; bad requests, impossible choices and an unreachable trainer are
one-line errors.

The tests share one fleet of two engines; the LoRA-only test adds an adapter to the
engines' transformer, so it comes last."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

import miles_core.engine.group_sender as group_sender_module
import miles_core.training.weight_sync as weight_sync
from miles_core.config.resolve import resolve_config
from miles_core.config.sync_path import choose_sync_path, ranks_sync_path
from miles_core.engine.fleet import EngineFleet
from miles_core.engine.http import HttpEngine
from miles_core.errors import ConfigError, EngineRequestError, WeightGroupError, WeightSyncError
from miles_core.training.weight_sync import close_weight_groups, engine_weights, expected_checksum, sync_to_engine
from miles_core.weights import iter_buckets
from tests.test_server import error_of, http
from tests.test_weight_sync import adapted, checksum_of, transformer
from tests.tiny_runs import run_metrics, tiny_run_args

BUFFER = 64 * 1024  # several buckets of the tiny transformer (96 KiB)


@pytest.fixture(scope="module")
def fleet(tiny_sd3, tmp_path_factory):
    engines = EngineFleet.start(
        tiny_sd3, 2, tmp_path_factory.mktemp("group-engines"), "--diffusion-model-family", "sd3", "--device", "cpu", threads=1
    )
    try:
        yield engines.urls
    finally:
        asyncio.run(close_weight_groups())
        engines.stop()


def sync_config(path: str, *, lora_only: bool = False) -> SimpleNamespace:
    return SimpleNamespace(lora_ipc_weight_sync=lora_only, update_weight_buffer_size=BUFFER, weight_sync_path=path)


def sync(urls, modules, config):
    async def main():
        async with HttpEngine(urls) as engine:
            return await sync_to_engine(engine, modules, config)

    return asyncio.run(main())


def nudged(module: torch.nn.Module) -> torch.nn.Module:
    """A copy with one weight changed by one step (the control)."""
    import copy

    module = copy.deepcopy(module)
    with torch.no_grad():
        parameter = next(module.parameters())
        parameter.view(-1)[0] = torch.nextafter(parameter.view(-1)[0], torch.tensor(float("inf")))
    return module


@pytest.mark.exercises("--weight-sync-path", "--update-weight-buffer-size")
def test_a_group_sync_gives_the_engines_the_weights_an_http_sync_gives(fleet, tiny_sd3, monkeypatch):
    trained = adapted(transformer(tiny_sd3))  # a LoRA merged into the full weights, as a LoRA run's full sync sends
    other = nudged(trained)
    want, other_want = expected_checksum(trained, lora_only=False), expected_checksum(other, lora_only=False)
    assert want != other_want

    sync(fleet, {"transformer": other}, sync_config("http"))
    assert [checksum_of(url) for url in fleet] == [other_want] * 2
    broadcasts: list[int] = []
    pack = group_sender_module.pack_bucket

    def counting(tensors, device, **kwargs):
        broadcasts.append(sum(t.numel() * t.element_size() for t in tensors))
        return pack(tensors, device, **kwargs)

    monkeypatch.setattr(group_sender_module, "pack_bucket", counting)
    result = sync(fleet, {"transformer": trained}, sync_config("distributed"))
    # Every engine holds what the trainer sent (sync_to_engine compared the checksums too).
    assert result.path == "distributed" and result.checksums == {"transformer": want}
    through_group = [checksum_of(url) for url in fleet]
    assert through_group == [want] * 2
    # Bucket by bucket, cut at --update-weight-buffer-size: one broadcast per bucket.
    buckets = list(iter_buckets(engine_weights(trained), BUFFER))
    assert broadcasts == [sum(t.numel() * t.element_size() for t in b.values()) for b in buckets] and len(buckets) > 1
    assert result.bytes == sum(broadcasts)
    # Bit-identical to an HTTP sync of the same weights (the checksum hashes every byte);
    # the nudged weights give another one.
    sync(fleet, {"transformer": trained}, sync_config("http"))
    assert [checksum_of(url) for url in fleet] == through_group
    assert other_want not in through_group

    # Control: one bucket altered after the trainer hashed it fails the comparison.
    def corrupting(tensors, device, **kwargs):
        if not broadcasts:
            tensors = [tensors[0] + 1, *tensors[1:]]
        broadcasts.append(0)
        return pack(tensors, device, **kwargs)

    broadcasts.clear()
    monkeypatch.setattr(group_sender_module, "pack_bucket", corrupting)
    with pytest.raises(WeightSyncError, match=rf"^{fleet[0]}: module 'transformer' reports checksum [0-9a-f]+ after a full weight sync"):
        sync(fleet, {"transformer": trained}, sync_config("distributed"))


def test_a_training_rank_broadcasts_through_the_group(fleet, tiny_sd3):
    """Under --use-ray rank 0 is the group's source (send_from_rank): same weights, same checks."""
    from miles_core.training.weight_sync import check_checksums, send_from_rank

    module = nudged(adapted(transformer(tiny_sd3), seed=2))
    dtypes = {"transformer": {name: p.dtype for name, p in module.named_parameters()}}
    answer = send_from_rank({"transformer": module}, dtypes, fleet, sync_config("distributed"), lora_only=False, sends=True)
    assert answer["error"] is None and answer["failure"] is None
    assert answer["checksums"] == {"transformer": expected_checksum(module, lora_only=False)}

    async def check():
        async with HttpEngine(fleet) as engine:
            await check_checksums(engine, answer["checksums"], lora_only=False)

    asyncio.run(check())


def test_impossible_weight_sync_paths_are_refused_in_one_line(tiny_sd3, prompts, tmp_path):
    def choice(path, engine_kind, *, colocated=False, cuda=False, **flags):
        config = SimpleNamespace(rollout_engine=flags.pop("rollout_engine", "http"), get={"weight_sync_path": path, **flags}.get)
        return choose_sync_path(config, engine_kind=engine_kind, colocated=colocated, cuda=cuda)

    # auto: CUDA-IPC on the trainer's GPU, a group for engines on GPUs of their own, else HTTP or disk.
    assert choice("auto", "embedded") == "none"
    assert choice("auto", "serve-engine", colocated=True, cuda=True) == "cuda-ipc"
    assert choice("auto", "sglang", colocated=True, cuda=True) == "cuda-ipc"
    assert choice("auto", "serve-engine", colocated=True, cuda=True, use_ray=True) == "http"  # ranks have no IPC sender
    assert choice("auto", "serve-engine", colocated=True, cuda=True, rollout_engine_urls="http://10.0.0.5:30000") == "http"
    with pytest.raises(ConfigError, match=r"^--weight-sync-path cuda-ipc with --rollout-engine-urls: only the servers a run"):
        choice("cuda-ipc", "serve-engine", colocated=True, cuda=True, rollout_engine_urls="http://10.0.0.5:30000")
    assert choice("auto", "serve-engine", cuda=True, use_ray=True) == "distributed"
    assert choice("auto", "serve-engine", cuda=True) == "http"  # one machine's fleet may share the trainer's GPU
    assert choice("auto", "serve-engine", use_ray=True) == "http"  # CPU: HTTP stays the default
    assert choice("auto", "sglang", cuda=True, use_ray=True) == "disk"
    assert choice("distributed", "serve-engine") == "distributed"  # gloo on CPU, when asked for
    # Under Ray the driver decides for every rank from the placement's devices, not its own.
    ray_config = SimpleNamespace(rollout_engine="http", get={"weight_sync_path": "auto", "use_ray": True}.get)
    assert ranks_sync_path(ray_config, gpus=True) == "distributed" and ranks_sync_path(ray_config, gpus=False) == "http"
    refusals = {
        ("distributed", "embedded", False, False): "--weight-sync-path distributed: the in-process embedded engine samples the "
        "trainer's own modules, so there is no weight sync (leave it auto, or use --use-ray or --rollout-engine http/sglang)",
        ("cuda-ipc", "serve-engine", False, True): "--weight-sync-path cuda-ipc requires --colocate: CUDA-IPC handles open only "
        "on the GPU of the process that made them",
        ("cuda-ipc", "serve-engine", True, False): "--weight-sync-path cuda-ipc needs CUDA, and this machine has no GPU; use "
        "http or distributed (gloo)",
        ("cuda-ipc", "serve-engine", True, True, True): "--weight-sync-path cuda-ipc with --use-ray: the training ranks send "
        "weights as http buckets or over a distributed group; CUDA-IPC handles come only from a one-process run's trainer in "
        "this version",
        ("distributed", "sglang", False, False): "--weight-sync-path distributed: sglang-diffusion servers have no distributed "
        "weight-update endpoints; use disk (or cuda-ipc with --colocate)",
        ("distributed", "serve-engine", True, True): "--weight-sync-path distributed with --colocate on GPUs: nccl cannot put "
        "two ranks on one device; use cuda-ipc",
        ("http", "sglang", False, False): "--weight-sync-path http: sglang-diffusion servers do not take safetensors buckets; "
        "use disk (or cuda-ipc with --colocate)",
        ("disk", "serve-engine", False, False): "--weight-sync-path disk applies to --rollout-engine sglang only (its servers "
        "load weights from disk); use http or distributed",
    }
    for (path, kind, colocated, cuda, *ray), message in refusals.items():
        with pytest.raises(ConfigError) as info:
            choice(path, kind, colocated=colocated, cuda=cuda, use_ray=bool(ray))
        assert str(info.value) == message
    # From the command line: a configuration error (exit status 2) before anything loads.
    with pytest.raises(ConfigError) as info:
        resolve_config([*tiny_run_args(tiny_sd3, prompts, tmp_path), "--weight-sync-path", "disk"])
    assert info.value.exit_code == 2 and info.value.messages == [
        "--weight-sync-path disk: the in-process embedded engine samples the trainer's own modules, so there is no weight "
        "sync (leave it auto, or use --use-ray or --rollout-engine http/sglang)"
    ]


def test_the_group_endpoints_refuse_bad_requests_naming_the_field(fleet):
    url = fleet[0]
    join = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2, "group_name": "g"}
    update = {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "nope", "target_module": "transformer"}
    cases = [
        ("/init_weights_update_group", {**join, "master_port": 0}, 400, "master_port: must be an integer from 1 to 65535, got 0"),
        ("/init_weights_update_group", {**join, "rank_offset": 2}, 400, "rank_offset: must be an integer from 1 to 1, got 2"),
        ("/init_weights_update_group", {**join, "world_size": 1}, 400, "world_size: must be an integer of at least 2, got 1"),
        ("/init_weights_update_group", {**join, "backend": "mpi"}, 400, "backend: must be one of gloo, nccl, got 'mpi'"),
        ("/init_weights_update_group", {**join, "backend": "nccl"}, 400, "backend: nccl needs CUDA, and this server has none"),
        ("/init_weights_update_group", {**join, "group_name": ""}, 400, "group_name: must be a non-empty string"),
        ("/init_weights_update_group", {**join, "port": 1}, 400, "port: unknown field"),
        ("/update_weights_from_distributed", update, 400, "group_name: this server is in no weight-update group 'nope'"),
        ("/destroy_weights_update_group", {"group_name": "nope"}, 400, "group_name: this server is in no weight-update group"),
    ]
    for path, body, status, prefix in cases:
        got_status, message = error_of(http(url, path, body))
        assert got_status == status and message.startswith(prefix), (path, got_status, message)


def test_metadata_that_does_not_fit_is_refused_before_the_broadcast(fleet, tiny_sd3):
    """Open a group, then post bad bucket metadata: refused naming the field, without
    taking part in a broadcast (the request returns at once)."""
    from miles_core.engine.group_sender import GroupSender

    sender = GroupSender(fleet[:1], join_timeout=20)
    asyncio.run(sender.open())
    try:
        base = {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "group_name": sender.name, "target_module": "transformer"}
        cases = [
            ({**base, "names": []}, 400, "names: must be a non-empty list of tensor names"),
            ({**base, "dtypes": ["float33"]}, 400, "dtypes: unknown dtype 'float33'"),
            ({**base, "shapes": [[2, -1]]}, 400, "shapes: each shape must be a list of non-negative integers"),
            ({**base, "shapes": [[2], [3]]}, 400, "shapes: must be a list with one shape per name (1)"),
            ({**base, "target_module": "vae2"}, 400, "target_module: unknown module 'vae2'"),
            ({**base, "lora_only": True}, 400, "names: lora_only update holds 'a', which is not a lora_A/lora_B tensor"),
            ({**base, "shapes": [[1 << 40]]}, 413, "shapes: the bucket holds 4398046511104 bytes, over this server's"),
        ]
        for body, status, prefix in cases:
            got_status, message = error_of(http(fleet[0], "/update_weights_from_distributed", body))
            assert got_status == status and message.startswith(prefix), (got_status, message)
        # Through the sender: the refusal names the server and the field at once (the
        # servers leave the group, which ends the broadcast waiting for them), and the
        # group is given up; the next sync makes a new one.
        began = time.monotonic()
        with pytest.raises(EngineRequestError, match=rf"^{fleet[0]}/update_weights_from_distributed: HTTP 400: target_module: unknown"):
            asyncio.run(sender.send("vae2", {"a": torch.ones(2)}, buffer_size=BUFFER))
        assert sender.group is None and sender.broken and time.monotonic() - began < 5
    finally:
        asyncio.run(sender.close())
    assert sync(fleet[:1], {"transformer": transformer(tiny_sd3)}, sync_config("distributed")).path == "distributed"


def test_an_engine_that_cannot_reach_the_trainer_is_one_line_naming_it_and_the_address(fleet, tiny_sd3, monkeypatch):
    module = transformer(tiny_sd3)
    unreachable = "198.51.100.1"  # TEST-NET-2: routed nowhere
    monkeypatch.setenv(weight_sync.ADDRESS_ENV, unreachable)
    monkeypatch.setenv(weight_sync.JOIN_TIMEOUT_ENV, "1")
    asyncio.run(close_weight_groups())  # nothing synced yet: this is the run's start-up
    began = time.monotonic()
    with pytest.raises(WeightGroupError) as info:
        sync(fleet, {"transformer": module}, sync_config("distributed"))
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 2, message
    joining = "could not join the weight-update group at"
    assert message.startswith(tuple(f"{url}: {joining} {unreachable}:" for url in fleet)), message
    assert time.monotonic() - began < 15
    # Mid-run (a sync went through before): exit status 1.
    monkeypatch.delenv(weight_sync.ADDRESS_ENV)
    sync(fleet, {"transformer": module}, sync_config("distributed"))
    monkeypatch.setenv(weight_sync.ADDRESS_ENV, unreachable)
    with pytest.raises(WeightGroupError) as info:
        sync(fleet[:1], {"transformer": module}, sync_config("distributed"))  # another set of servers: a new group
    assert info.value.exit_code == 1 and str(info.value).startswith(f"{fleet[0]}: could not join the weight-update group at ")
    asyncio.run(close_weight_groups())


def test_a_run_synced_through_the_group_has_the_metrics_of_the_http_run(fleet, tiny_sd3, prompts, tmp_path, monkeypatch):
    opened: list[tuple[str, ...]] = []
    original = weight_sync.group_sender

    async def recording(urls, config, **kw):
        opened.append(tuple(urls))
        return await original(urls, config, **kw)

    monkeypatch.setattr(weight_sync, "group_sender", recording)

    def run(path: str) -> list[dict]:
        args = [
            *tiny_run_args(tiny_sd3, prompts, tmp_path / path, batch=2, n=2, steps=3, sde_steps=1),
            "--num-rollout",
            "2",
            "--lr",
            "3e-2",
            "--rollout-engine",
            "http",
            "--rollout-engine-urls",
            ",".join(fleet),
            "--update-weight-buffer-size",
            str(BUFFER),
            "--weight-sync-path",
            path,
        ]
        return [
            {k: v for k, v in r.items() if not k.startswith("perf/") and not k.endswith("_time")} for r in run_metrics(args, timeout=300)
        ]

    through_group = run("distributed")
    assert opened and set(opened) == {tuple(fleet)}  # one sync before the first rollout, one after each (same group)
    assert len(opened) == 3
    opened.clear()
    over_http = run("http")
    assert not opened
    assert "train/loss" in through_group[1] and through_group == over_http


def test_a_lora_only_group_sync_matches_http(fleet, tiny_sd3):
    """Last: the engines' transformer gets the adapter (the first LoRA-only sync adds it)."""
    trained = adapted(transformer(tiny_sd3))
    other = adapted(transformer(tiny_sd3), seed=1)
    want = expected_checksum(trained, lora_only=True)
    assert want != expected_checksum(other, lora_only=True)
    sync(fleet, {"transformer": transformer(tiny_sd3)}, sync_config("http"))  # the base weights the adapters go on
    result = sync(fleet, {"transformer": trained}, sync_config("distributed", lora_only=True))
    assert result.checksums == {"transformer": want} and [checksum_of(url) for url in fleet] == [want] * 2
    sync(fleet, {"transformer": other}, sync_config("http", lora_only=True))
    assert [checksum_of(url) for url in fleet] != [want] * 2  # control: another adapter
    sync(fleet, {"transformer": trained}, sync_config("http", lora_only=True))
    assert [checksum_of(url) for url in fleet] == [want] * 2
    asyncio.run(close_weight_groups())
