"""The wire format of ``/rollout/generate``: msgpack documents with safetensors tensor records."""

from __future__ import annotations

import base64

import msgpack
import pytest
import torch
from safetensors.torch import load, save

from miles_core.engine.wire import decode_tensor, encode_tensor, pack, pack_outputs, unpack, unpack_outputs
from miles_core.errors import WireError
from miles_core.request import RolloutOutput


def assert_same(a, b, path="$"):
    """Structural equality with torch.equal (and equal dtype) for tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b and type(a) is type(b), path


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(4, 6, generator=g)
    return {
        "f32": torch.randn(2, 3, generator=g),
        "f16": torch.randn(5, generator=g).half(),
        "bf16": torch.randn(2, 2, generator=g).bfloat16(),
        "f64": torch.randn(3, generator=g).double(),
        "i64": torch.arange(6).reshape(2, 3),
        "i32": torch.tensor([-1, 2], dtype=torch.int32),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": big.t(),  # not contiguous
        "row_of_batch": big[2],  # a view into a larger storage
    }


def test_round_trip_of_nested_structures_with_several_dtypes():
    tensors = sample_tensors()
    doc = {
        "tensors": tensors,
        "list": [tensors["f32"], {"inner": (tensors["bool"], 1, None)}, "text"],
        "scalars": {"int": 7, "float": 0.25, "none": None, "bool": True, "bytes": b"\x00\x01"},
    }
    back = unpack(pack(doc))
    expected = dict(doc)
    expected["list"] = [tensors["f32"], {"inner": [tensors["bool"], 1, None]}, "text"]
    assert_same(expected, back)
    assert back["tensors"]["transposed"].is_contiguous()


def test_tensor_record_is_plain_safetensors():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    record = encode_tensor(t)
    assert set(record) == {"__tensor__", "data", "shape", "dtype"}
    assert record["__tensor__"] is True and record["shape"] == [2, 3] and record["dtype"] == "torch.float32"
    assert isinstance(record["data"], bytes)
    assert torch.equal(load(record["data"])["t"], t)
    assert torch.equal(decode_tensor(record), t)


def test_base64_data_from_older_sglang_decodes():
    t = torch.randn(3, 2)
    record = {"__tensor__": True, "data": base64.b64encode(save({"t": t})).decode(), "shape": [3, 2], "dtype": "torch.float32"}
    assert torch.equal(decode_tensor(record), t)
    assert torch.equal(unpack(msgpack.packb({"x": record}))["x"], t)


def _outputs():
    g = torch.Generator().manual_seed(1)
    return [
        RolloutOutput(
            request_id="r1",
            prompt="a cat",
            seed=10 + i,
            generated_output=torch.rand(3, 8, 8, generator=g),
            rollout_log_probs=torch.randn(3, generator=g),
            rollout_debug_tensors={"rollout_noise_std_devs": torch.rand(3, generator=g)},
            denoising_env={
                "image_kwargs": {"height": 8, "width": 8},
                "pos_cond_kwargs": {"encoder_hidden_states": torch.randn(4, 2, generator=g)},
                "neg_cond_kwargs": None,
                "guidance": {"guidance_scale": 4.0},
            },
            dit_trajectory={"latents": torch.randn(4, 2, 2, generator=g), "sigmas": torch.tensor([1.0, 0.5, 0.0])},
            inference_time_s=0.5,
            peak_memory_mb=12.0,
        )
        for i in range(2)
    ]


def test_response_decodes_with_plain_msgpack_and_safetensors():
    outputs = _outputs()
    body = pack_outputs(outputs)

    def plain(obj):  # nothing of ours: msgpack + safetensors only
        if isinstance(obj, dict):
            if obj.get("__tensor__"):
                return load(obj["data"])["t"]
            return {k: plain(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [plain(v) for v in obj]
        return obj

    records = plain(msgpack.unpackb(body, raw=False))
    assert isinstance(records, list) and len(records) == 2
    for output, record in zip(outputs, records):
        assert_same(output.to_wire(), record)
    for output, back in zip(outputs, unpack_outputs(body)):
        assert_same(output.to_wire(), back.to_wire())


def test_sglang_nulls_for_unmeasured_metrics():
    record = _outputs()[0].to_wire()
    record.update(inference_time_s=None, peak_memory_mb=None, rollout_log_probs=None)
    (output,) = unpack_outputs(pack([record]))
    assert output.inference_time_s == 0.0 and output.peak_memory_mb == 0.0 and output.rollout_log_probs is None


@pytest.mark.parametrize(
    "record, message",
    [
        ({"__tensor__": True, "shape": [1], "dtype": "torch.float32"}, "data: must be safetensors bytes"),
        ({"__tensor__": True, "data": b"not safetensors"}, "not valid safetensors"),
        ({"__tensor__": True, "data": save({"t": torch.zeros(2)}), "shape": [3]}, "shape: [3] does not match"),
        ({"__tensor__": True, "data": save({"t": torch.zeros(2)}), "dtype": "torch.int64"}, "dtype: 'torch.int64' does not match"),
        ({"__tensor__": True, "data": save({"t": torch.zeros(2)}), "extra": 1}, "unexpected key 'extra'"),
        ({"__tensor__": 1, "data": save({"t": torch.zeros(2)})}, "__tensor__ must be true"),
        ({"__tensor__": True, "data": save({"a": torch.zeros(1), "b": torch.zeros(1)})}, "exactly one tensor named 't'"),
        ({"__tensor__": True, "data": save({"t": torch.zeros(2)}), "shape": "2"}, "shape: must be a list of integers"),
        ({"__tensor__": True, "data": "%%%"}, "base64"),
    ],
)
def test_malformed_tensor_records_are_rejected(record, message):
    with pytest.raises(WireError, match="^\\$\\.out\\.x") as info:
        unpack(msgpack.packb({"out": {"x": record}}, use_bin_type=True))
    assert message in str(info.value)


@pytest.mark.parametrize(
    "body, message",
    [
        (b"\xc1", "not a valid msgpack document"),
        (msgpack.packb(msgpack.ExtType(5, b"x")), "extension type 5"),
        (msgpack.packb({"t": msgpack.Timestamp(1, 0)}), "$.t: unexpected Timestamp"),
        (msgpack.packb([1, 2], use_bin_type=True) + b"\x00", "not a valid msgpack document"),
    ],
)
def test_malformed_documents_are_rejected(body, message):
    with pytest.raises(WireError) as info:
        unpack(body)
    assert message in str(info.value)


class _Custom:
    pass


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"a": [_Custom()]}, "$.a[0]: cannot send a"),
        ({"s": {1, 2}}, "$.s: cannot send a builtins.set"),
        ({1: "int key"}, "map keys must be strings"),
        ({"__tensor__": True}, "reserved key"),
        ({"sparse": torch.eye(2).to_sparse()}, "only dense tensors"),
    ],
)
def test_pack_refuses_anything_but_tensors_and_msgpack_types(obj, message):
    with pytest.raises(WireError) as info:
        pack(obj)
    assert message in str(info.value)


def test_unpack_outputs_checks_the_records():
    with pytest.raises(WireError, match="must be a list"):
        unpack_outputs(pack({"request_id": "x"}))
    record = _outputs()[0].to_wire()
    del record["generated_output"]
    with pytest.raises(WireError, match=r"\$\[0\]\.generated_output: missing"):
        unpack_outputs(pack([record]))
    record = _outputs()[0].to_wire()
    record["generated_output"] = [1, 2]
    with pytest.raises(WireError, match="must be a tensor record"):
        unpack_outputs(pack([record]))
