"""The CUDA-IPC weight sync's request format (sglang-diffusion's ``/update_weights_from_tensor``
JSON), the serve-engine's refusals and field checks, and on this CPU machine the load path
itself with CPU tensors passed as torch ``file_system`` shared memory to a real
``serve-engine --accept-ipc-weights`` process (the CUDA handles run in the GPU lane)."""

import asyncio
import base64
import ipaddress
import json
import pickle
import re
from types import SimpleNamespace

import psutil
import pytest
import torch
import torch.multiprocessing

from miles_core.engine.embedded import EmbeddedEngine
from miles_core.engine.fleet import start_engine
from miles_core.engine.http import HttpEngine
from miles_core.engine.ipc_wire import (
    decode_base64,
    is_loopback_peer,
    load_payload,
    select_payload,
    serialize_named_tensors,
)
from miles_core.engine.server import create_app, start_server
from miles_core.errors import EngineRequestError, IpcFormatError, WeightSyncError
from miles_core.training.ipc_sync import ipc_requests, module_weights, sync_through_ipc
from miles_core.training.weight_sync import check_checksums, engine_weights
from miles_core.weights import module_checksum, named_tensors_checksum


@pytest.fixture
def shared_files():
    """CPU tensors pickle as shared-memory file names (what an unrelated process can open)."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    yield
    torch.multiprocessing.set_sharing_strategy(before)


def small_module(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def decoded(body: dict) -> list[tuple[str, torch.Tensor]]:
    (payload,) = body["serialized_named_tensors"]
    return load_payload(decode_base64(payload))


# -- the format -------------------------------------------------------------------------------


@pytest.mark.exercises("--update-weight-buffer-size")
def test_requests_carry_buckets_in_sglangs_format_and_decode_back_to_the_same_tensors(shared_files):
    module = small_module()
    (weights,) = module_weights({"transformer": module}, lora_only=False)
    budget = 16 * 8 * 4 + 16 * 4  # the first layer's weight and bias fill one bucket
    requests = list(ipc_requests(weights, budget))
    assert len(requests) == 2
    received = []
    for body, bucket in requests:
        assert set(body) == {
            "serialized_named_tensors",
            "payload_gpu_uuids",
            "load_format",
            "target_modules",
            "weight_update_mode",
            "lora_alpha",
            "lora_rank",
        }
        assert body["payload_gpu_uuids"] is None  # CPU tensors: no GPU to name
        assert (body["load_format"], body["target_modules"], body["weight_update_mode"]) == (None, ["transformer"], None)
        assert sum(t.numel() * t.element_size() for _, t in bucket) <= budget
        json.dumps(body)  # plain JSON
        pairs = decoded(body)
        assert [name for name, _ in pairs] == [name for name, _ in bucket]
        received += pairs
    sent = dict(module.named_parameters())
    assert [name for name, _ in received] == sorted(sent)
    for name, tensor in received:
        assert tensor.dtype == sent[name].dtype and torch.equal(tensor, sent[name].detach())


@pytest.mark.exercises("--lora-ipc-weight-sync")
def test_lora_only_requests_are_lora_merge_updates_with_the_adapters_rank_and_alpha(shared_files):
    from peft import LoraConfig, inject_adapter_in_model

    module = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["0", "1"]), small_module())
    module.peft_config = {"default": LoraConfig(r=2, lora_alpha=4, target_modules=["0", "1"])}
    (weights,) = module_weights({"transformer": module}, lora_only=True)
    ((body, bucket),) = list(ipc_requests(weights, 1 << 20))
    assert (body["weight_update_mode"], body["lora_rank"], body["lora_alpha"]) == ("lora_merge", 2, 4)
    names = [name for name, _ in decoded(body)]
    assert names == sorted(name for name, _ in module.named_parameters() if ".lora_" in name) and len(names) == 4


def test_the_sender_refuses_cpu_tensors_in_one_line():
    config = SimpleNamespace(lora_ipc_weight_sync=False, update_weight_buffer_size=1 << 20)

    async def attempt():
        async with HttpEngine("http://127.0.0.1:9") as engine:  # nothing is posted
            await sync_through_ipc(engine, {"transformer": small_module()}, config)

    with pytest.raises(WeightSyncError) as caught:
        asyncio.run(attempt())
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("the CUDA-IPC weight sync sends CUDA tensors; transformer.0.bias is on cpu")


def test_the_unpickler_runs_no_other_global_and_payloads_must_be_tensor_pairs():
    class Runs:  # (eval: print is replaced by Ray's safe_print once Ray is imported)
        def __reduce__(self):
            return (eval, ("print('ran')",))

    with pytest.raises(IpcFormatError, match=r"global builtins\.eval is not allowed"):
        load_payload(pickle.dumps([("x", Runs())]))
    # Names next to the allowed ones stay out: a torch name that is not a dtype, a shell,
    # torch's plain (non-multiprocessing) tensor rebuild.
    for module, name in (("torch", "load"), ("os", "system"), ("torch._utils", "_rebuild_tensor_v2")):
        forged = b"\x80\x04c" + f"{module}\n{name}\n".encode() + b"."  # PROTO 4, GLOBAL module name, STOP
        with pytest.raises(IpcFormatError, match=rf"global {re.escape(module)}\.{name} is not allowed"):
            load_payload(forged)
    with pytest.raises(IpcFormatError, match=r"\(name, tensor\) pairs"):
        load_payload(pickle.dumps([("x", 1)]))
    with pytest.raises(IpcFormatError, match="not valid base64"):
        decode_base64("not base64!")


def test_loopback_peers_and_payload_selection():
    assert all(is_loopback_peer(a) for a in ("127.0.0.1", "127.8.9.1", "::1", "::ffff:127.0.0.1"))
    assert not any(is_loopback_peer(a) for a in ("192.0.2.2", "fd00::2", "::ffff:10.0.0.1", "", None, "unix"))
    assert select_payload(["a"], None, None) == "a"
    assert select_payload(["a", "b"], ["GPU-AB", "GPU-CD"], "cd") == "b"  # NVML's prefix and case do not matter
    with pytest.raises(IpcFormatError, match="no payload was exported from this server's GPU ef"):
        select_payload(["a", "b"], ["ab", "cd"], "ef")
    with pytest.raises(IpcFormatError, match="payload_gpu_uuids: this server runs on the CPU"):
        select_payload(["a"], ["ab"], None)


# -- the serve-engine -------------------------------------------------------------------------


@pytest.mark.exercises("--colocate", "--weight-sync-path")
def test_only_a_run_syncing_through_cuda_ipc_starts_its_serve_engines_accepting_the_format(tiny_sd3):
    from miles_core.config.resolve import resolve_config
    from miles_core.engine.fleet import accepts_ipc_weights, serve_arguments

    base = ["--hf-checkpoint", str(tiny_sd3), "--rollout-engine", "http", "--rollout-num-engines", "1", "--rollout-batch-size", "1"]
    colocated = resolve_config([*base, "--colocate"])
    assert accepts_ipc_weights(colocated, cuda=True)  # auto: the engine is on the trainer's GPU
    assert not accepts_ipc_weights(colocated, cuda=False)
    assert not accepts_ipc_weights(resolve_config(base), cuda=True)  # its own GPU: not colocated
    assert not accepts_ipc_weights(resolve_config([*base, "--colocate", "--weight-sync-path", "http"]), cuda=True)
    assert "--accept-ipc-weights" not in serve_arguments(colocated)  # this machine has no GPU


def non_loopback_ipv4() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family.name == "AF_INET" and not ipaddress.ip_address(address.address).is_loopback:
                return address.address
    return None


async def post(url: str, body: dict) -> tuple[int, str]:
    async with HttpEngine(url) as client:
        try:
            await client.update_weights_from_ipc(body)
        except EngineRequestError as exc:
            return exc.status, exc.message
    return 200, ""


def test_the_format_is_refused_unless_colocated_and_from_a_loopback_peer(tiny_sd3, shared_files):
    engine = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3")
    body = {"serialized_named_tensors": [serialize_named_tensors([("x", torch.zeros(1))])]}
    host = non_loopback_ipv4()

    async def run():
        results = []
        for accept, address in [(False, "127.0.0.1"), (True, host)]:
            if address is None:
                continue
            server = await start_server(create_app(engine, accept_ipc_weights=accept), address)
            try:
                results.append(await post(server.url, body))
            finally:
                await server.close()
        return results

    results = asyncio.run(run())
    assert results[0] == (
        403,
        "serialized_named_tensors: refused: this format is unpickled (code execution for its sender), so this server "
        "takes it only when started colocated with its trainer (serve-engine --accept-ipc-weights); send msgpack "
        "safetensors buckets",
    )
    if host is not None:  # the peer check by itself: test_loopback_peers_and_payload_selection
        assert results[1] == (
            403,
            "serialized_named_tensors: refused: this format is unpickled (code execution for its sender) and taken "
            f"from loopback peers only, not {host}",
        )


@pytest.fixture(scope="module")
def colocated(tiny_sd3, tmp_path_factory):
    """A real ``serve-engine --accept-ipc-weights`` process on loopback."""
    log = tmp_path_factory.mktemp("ipc") / "engine.log"
    served = start_engine(tiny_sd3, "--device", "cpu", "--accept-ipc-weights", log_path=log, healthy=True)
    yield served
    served.stop()


def test_malformed_fields_answer_400_naming_the_field(colocated, shared_files):
    good = serialize_named_tensors([("proj_out.bias", torch.zeros(1))])
    cases = [
        ({}, "serialized_named_tensors: must be a non-empty list of base64 payloads, got None"),
        ({"serialized_named_tensors": []}, "serialized_named_tensors: must be a non-empty list of base64 payloads, got []"),
        ({"serialized_named_tensors": ["@@"]}, "serialized_named_tensors: not valid base64"),
        ({"serialized_named_tensors": [good], "load_format": "flattened_bucket"}, "load_format: 'flattened_bucket' is not supported"),
        ({"serialized_named_tensors": [good], "target_modules": ["vae2"]}, "target_modules: unknown module 'vae2'"),
        ({"serialized_named_tensors": [good], "target_modules": ["a", "b"]}, "target_modules: must name exactly one module"),
        ({"serialized_named_tensors": [good], "payload_gpu_uuids": ["GPU-1"]}, "payload_gpu_uuids: this server runs on the CPU"),
        ({"serialized_named_tensors": [good, good]}, "payload_gpu_uuids: required when serialized_named_tensors holds 2"),
        ({"serialized_named_tensors": [good], "payload_gpu_uuids": ["a", "b"]}, "payload_gpu_uuids: needs one entry per payload"),
        ({"serialized_named_tensors": [good], "weight_update_mode": "merge"}, "weight_update_mode: must be null"),
        ({"serialized_named_tensors": [good], "lora_rank": 4}, "lora_rank: goes with weight_update_mode 'lora_merge' only"),
        ({"serialized_named_tensors": [good], "weight_update_mode": "lora_merge"}, "serialized_named_tensors: a lora_merge update holds"),
        ({"serialized_named_tensors": [good], "extra": 1}, "extra: unknown field"),
        (
            {"serialized_named_tensors": [base64.b64encode(pickle.dumps([("x", print)])).decode()]},
            "serialized_named_tensors: cannot be unpickled",
        ),
        (
            {"serialized_named_tensors": [serialize_named_tensors([("nope", torch.zeros(1))])]},
            "serialized_named_tensors: transformer has no parameter 'nope'",
        ),
    ]

    async def run():
        return [await post(colocated.url, body) for body, _ in cases]

    for (status, message), (body, prefix) in zip(asyncio.run(run()), cases):
        assert status == 400 and message.startswith(prefix), (body, status, message)


def test_cpu_shared_memory_loads_into_a_real_serve_engine_with_equal_checksums(colocated, tiny_sd3, shared_files):
    trainer = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3").component("transformer")
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter in trainer.parameters():
            parameter.add_(torch.randn_like(parameter) * 1e-3)
    (weights,) = module_weights({"transformer": trainer}, lora_only=False)
    expected = named_tensors_checksum(engine_weights(trainer))

    async def run():
        async with HttpEngine(colocated.url) as client:
            before = (await client.weights_checksum(["transformer"]))["transformer"]
            for body, _bucket in ipc_requests(weights, 64 * 1024):
                await client.update_weights_from_ipc(body)
            await check_checksums(client, {"transformer": expected}, lora_only=False)
            with torch.no_grad():  # the control: one weight nudged on the trainer's side
                next(trainer.parameters()).view(-1)[0] += 1e-2
            with pytest.raises(WeightSyncError, match="reports checksum"):
                await check_checksums(client, {"transformer": module_checksum(trainer)}, lora_only=False)
            return before

    before = asyncio.run(run())
    assert before != expected


@pytest.mark.exercises("--lora-ipc-weight-sync")
def test_a_lora_merge_update_gives_an_adapterless_serve_engine_the_adapter_and_equal_checksums(colocated, tiny_sd3, shared_files):
    from peft import LoraConfig

    trainer = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3").component("transformer")
    trainer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"], init_lora_weights="gaussian"))
    (full,) = module_weights({"transformer": trainer}, lora_only=False)
    (lora,) = module_weights({"transformer": trainer}, lora_only=True)

    async def run():
        async with HttpEngine(colocated.url) as client:
            for body, _bucket in ipc_requests(full, 1 << 20):  # the base weights the adapter sits on
                await client.update_weights_from_ipc(body)
            for body, _bucket in ipc_requests(lora, 4096):
                assert body["weight_update_mode"] == "lora_merge"
                await client.update_weights_from_ipc(body)
            await check_checksums(client, {"transformer": lora.checksum}, lora_only=True)
            with torch.no_grad():  # the control: one lora_B nudged on the trainer's side
                next(p for n, p in trainer.named_parameters() if ".lora_B." in n).view(-1)[0] += 1e-2
            with pytest.raises(WeightSyncError, match="LoRA-only weight sync"):
                await check_checksums(client, {"transformer": module_checksum(trainer)}, lora_only=True)

    asyncio.run(run())


# -- sglang-diffusion servers ---------------------------------------------------------------


def test_sglangs_whole_module_checksum_after_an_ipc_sync_counts_the_checkpoints_other_tensors(tiny_sd3, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from miles_core.engine.sglang import SglangEngine

    trainer = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3").component("transformer")
    sent = {name: tensor.clone() for name, tensor in engine_weights(trainer)}
    (stored,) = (tiny_sd3 / "transformer").glob("*.safetensors")
    others = {name: tensor for name, tensor in load_file(str(stored)).items() if name not in sent}
    assert list(others) == ["pos_embed.pos_embed"]  # a buffer in diffusers, a parameter in sglang
    held = named_tensors_checksum([*sent.items(), *others.items()])  # what an sglang server hashes
    engine = SglangEngine(["http://127.0.0.1:1", "http://127.0.0.1:2"], [], [], tmp_path)
    engine.model_path = str(tiny_sd3)
    engine.expect_ipc_module("transformer", sent)

    async def reported(self, module_names=None):
        return {"http://127.0.0.1:1": {"transformer": held}, "http://127.0.0.1:2": {"transformer": "something else"}}

    monkeypatch.setattr(HttpEngine, "weights_checksums", reported)
    trainers = named_tensors_checksum(sent.items())
    assert asyncio.run(engine.weights_checksums(["transformer"])) == {
        "http://127.0.0.1:1": {"transformer": trainers},
        "http://127.0.0.1:2": {"transformer": "something else"},  # the control: any other answer fails the check
    }
    with pytest.raises(WeightSyncError, match=r"^http://127.0.0.1:2: module 'transformer' reports checksum something else"):
        asyncio.run(check_checksums(engine, {"transformer": trainers}, lora_only=False))


@pytest.mark.exercises("--lora-ipc-weight-sync")
def test_a_lora_only_ipc_sync_to_sglang_is_refused_in_one_line(tmp_path):
    from miles_core.engine.sglang import SglangEngine

    engine = SglangEngine(["http://127.0.0.1:1"], [], [], tmp_path)
    config = SimpleNamespace(lora_ipc_weight_sync=True, update_weight_buffer_size=1 << 20)
    with pytest.raises(WeightSyncError) as caught:
        asyncio.run(sync_through_ipc(engine, {"transformer": small_module()}, config))
    assert str(caught.value) == (
        "--lora-ipc-weight-sync through CUDA IPC to SglangEngine: its servers' checksums do not cover a LoRA adapter, "
        "so the sync could not be checked (leave --lora-ipc-weight-sync off: full weights, merged)"
    )
