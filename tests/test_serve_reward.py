"""``miles-core serve-reward`` (``miles_core.reward_service.server``): a reward served over
the wire scores exactly as the same reward in-process, with per-sample failures, the
weights' checksum, keys, roots, limits and one-line refusals; and the real command in a
process of its own."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import signal
from importlib import metadata
from pathlib import Path

import aiohttp
import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.engine.weight_roots import resolve_roots
from miles_core.errors import ConfigError, RewardError, UsageError
from miles_core.plugin_manager import get_host
from miles_core.reward_service import wire
from miles_core.reward_service.server import (
    check_servable,
    create_reward_app,
    reward_records,
    start_reward_server,
    weights_sha256,
)
from miles_core.rollout.sample import Sample
from miles_core.testing import scoring_samples, serve_reward_process
from miles_core.training.rewards import RewardScorer
from tests.ray_nodes import wait_gone

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = "tests.reward_examples"
KEY = "test-key-0123"


def resolve(*argv: str):
    return resolve_config(list(argv), prog="miles-core serve-reward", scope="reward")


def grid_pixels(n: int, seed: int = 0, shape=(3, 6, 5)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, shape, generator=generator).float().div(255.0) for _ in range(n)]


def in_process(config, pixels, prompts) -> list[Sample]:
    """The same samples scored by a RewardScorer in this process (each its own group)."""
    samples = scoring_samples(pixels, prompts)
    asyncio.run(RewardScorer(config).score(samples))
    return samples


@contextlib.asynccontextmanager
async def serving(config, *, key: str | None = None, **options):
    """The reward server on a free loopback port, in this event loop, and a client session;
    waits until ``/health`` answers (200, or 503 'failed')."""
    from miles_core.reward_service.run_worker import create_worker_app

    app = (create_worker_app if options.pop("worker", False) else create_reward_app)(config, api_key=key, **options)
    server = await start_reward_server(app, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(600):
                async with session.get(server.url + "/health") as answer:
                    body = await answer.json()
                if answer.status == 200 or body.get("status") == "failed":
                    break
                await asyncio.sleep(0.02)
            yield server.url, session
    finally:
        await server.close()


def headers(key: str | None = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def post(session, url: str, body, key: str | None = None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    async with session.post(url + "/score", data=data, headers={"Content-Type": "application/json", **headers(key)}) as answer:
        return answer.status, await answer.json()


def body_of(pixels, prompts, encoding="png", reward=None, groups=None) -> dict:
    return wire.encode_request(pixels, prompts, [{} for _ in prompts], encoding=encoding, reward=reward, groups=groups)


# -- scores ----------------------------------------------------------------------------------


def test_a_served_reward_scores_exactly_as_in_process():
    config = resolve("--rm-type", "brightness")
    pixels, prompts = grid_pixels(4), ["a", "b", "c", "d"]
    expected = [s.reward for s in in_process(config, pixels, prompts)]
    # float32 carries any values exactly: off-grid pixels, some outside [0, 1].
    floats = [torch.rand(3, 5, 4, generator=torch.Generator().manual_seed(i)) * 1.2 - 0.1 for i in range(3)]
    expected_floats = [s.reward for s in in_process(config, floats, prompts[:3])]

    async def main():
        async with serving(config) as (url, session):
            png = await post(session, url, body_of(pixels, prompts, reward="brightness"))
            f32 = await post(session, url, body_of(floats, prompts[:3], encoding="float32"))
            # The control: off-grid pixels through png are quantised, so they score otherwise.
            quantised = await post(session, url, body_of(floats, prompts[:3], encoding="png"))
            return png, f32, quantised

    png, f32, quantised = asyncio.run(main())
    assert png == (200, {"rewards": expected, "components": [{}] * 4, "errors": [None] * 4})
    assert f32[1]["rewards"] == expected_floats
    # Independently: brightness is the mean of the [0, 1]-clamped pixels.
    assert expected_floats == pytest.approx([float(x.clamp(0, 1).double().mean()) for x in floats], abs=1e-6)
    assert quantised[0] == 200 and quantised[1]["rewards"] != expected_floats
    assert quantised[1]["rewards"] == pytest.approx(expected_floats, abs=1 / 255)


def test_a_mixture_serves_its_components_and_concurrent_requests():
    weights = {"brightness": 0.5, "colorfulness": 2.0}
    config = resolve("--reward-weights", json.dumps(weights))
    pixels = grid_pixels(5, seed=3)
    video = grid_pixels(1, seed=4, shape=(3, 3, 6, 5))
    prompts = [f"p{i}" for i in range(5)]
    local = in_process(config, pixels + video, prompts + ["video"])

    async def main():
        async with serving(config) as (url, session):
            return await asyncio.gather(
                post(session, url, body_of(pixels[:3], prompts[:3], reward="0.5*brightness + 2*colorfulness")),
                post(session, url, body_of(pixels[3:] + video, prompts[3:] + ["video"])),
            )

    (s1, first), (s2, second) = asyncio.run(main())
    assert (s1, s2) == (200, 200)
    got = list(zip(first["rewards"] + second["rewards"], first["components"] + second["components"]))
    assert got == [(s.reward, s.reward_components) for s in local]
    for reward, components in got:
        assert set(components) == set(weights)
        assert reward == pytest.approx(sum(w * components[n] for n, w in weights.items()), rel=1e-12)
    frame = pixels[0].double().numpy()
    rg, yb = frame[0] - frame[1], 0.5 * (frame[0] + frame[1]) - frame[2]
    colorfulness = math.hypot(rg.std(), yb.std()) + 0.3 * math.hypot(rg.mean(), yb.mean())  # Hasler-Suesstrunk on [0, 1]
    assert got[0][1] == {"brightness": pytest.approx(frame.mean(), abs=1e-6), "colorfulness": pytest.approx(colorfulness, abs=1e-6)}


def test_a_sample_the_reward_fails_on_gets_null_and_its_reason_only():
    config = resolve("--custom-rm-path", f"{EXAMPLES}.flaky")
    prompts = ["ok", "a nan here", "a text one", "fine"]

    async def main():
        async with serving(config) as (url, session):
            return await post(session, url, body_of(grid_pixels(4), prompts))

    status, body = asyncio.run(main())
    assert status == 200
    assert body["rewards"] == [2.0, None, None, 4.0]
    assert body["errors"] == [
        None,
        f"--custom-rm-path {EXAMPLES}.flaky: returned nan",
        f"--custom-rm-path {EXAMPLES}.flaky: returned 'high' (str), not a number",
        None,
    ]


def test_group_rewards_need_groups():
    config = resolve("--custom-rm-path", f"{EXAMPLES}.rank_in_group", "--group-rm")
    pixels = [torch.full((3, 2, 2), v) for v in (0.9, 0.1, 0.5, 0.2, 0.8)]

    async def main():
        async with serving(config) as (url, session):
            missing = await post(session, url, body_of(pixels, ["a"] * 5))
            grouped = await post(session, url, body_of(pixels, ["a"] * 5, groups=[0, 0, 0, 1, 1]))
            async with session.get(url + "/info") as answer:
                info = await answer.json()
            return missing, grouped, info

    missing, grouped, info = asyncio.run(main())
    assert missing == (
        400,
        {"error": "samples[0].group: missing; this server's reward scores whole groups (--group-rm): give every sample its group"},
    )
    assert grouped[1]["rewards"] == [2.0, 0.0, 1.0, 0.0, 1.0]  # ranks within each group, not across the request
    assert info["group_rm"] is True
    assert info["rewards"] == [
        {"name": f"--custom-rm-path {EXAMPLES}.rank_in_group", "distribution": None, "version": None, "weights_sha256": None}
    ]


def test_a_reward_that_cannot_be_used_answers_422_in_one_line():
    config = resolve("--custom-rm-path", f"{EXAMPLES}.length_parts")  # dicts, and no --reward-key

    async def main():
        async with serving(config) as (url, session):
            return await post(session, url, body_of(grid_pixels(2), ["a b", "c"]))

    status, body = asyncio.run(main())
    assert status == 422  # not retried: every attempt would get it
    assert body["error"] == (
        f"--custom-rm-path {EXAMPLES}.length_parts returns a dict per sample (keys: length, note, words); choose the trained one with --reward-key"
    )


# -- the server's answers --------------------------------------------------------------------


def test_info_keys_refusals_and_limits():
    config = resolve("--rm-type", "colorfulness")
    pixels = grid_pixels(3)

    async def main():
        async with serving(config, key=KEY, max_samples=2, max_body_bytes=4000) as (url, session):
            results = {}
            async with session.get(url + "/health") as answer:  # no key needed
                results["health"] = answer.status, await answer.json()
            async with session.head(url + "/health") as answer:
                results["head"] = answer.status
            # A row's metadata.rm_type names no other reward here: the server's reward scores it.
            routed = body_of(pixels[:1], ["a"])
            routed["samples"][0]["metadata"] = {"rm_type": "brightness"}
            results["routed"] = await post(session, url, routed, key=KEY)
            async with session.get(url + "/info") as answer:
                results["info_no_key"] = answer.status, await answer.json()
            async with session.get(url + "/info", headers=headers()) as answer:
                results["info"] = answer.status, await answer.json()
            results["no_key"] = await post(session, url, body_of(pixels[:1], ["a"]))
            results["wrong_key"] = await post(session, url, body_of(pixels[:1], ["a"]), key="other")
            results["empty"] = await post(session, url, {"wire_version": 1, "samples": []}, key=KEY)
            results["ok"] = await post(session, url, body_of(pixels[:2], ["a", "b"], reward="colorfulness"), key=KEY)
            results["mismatch"] = await post(session, url, body_of(pixels[:1], ["a"], reward="pickscore"), key=KEY)
            results["too_many"] = await post(session, url, body_of(pixels, ["a", "b", "c"]), key=KEY)
            results["too_big"] = await post(session, url, None, key=KEY, raw=b" " * 5000)
            results["not_json"] = await post(session, url, None, key=KEY, raw=b"{oops")
            bad = body_of(pixels[:2], ["a", "b"])
            bad["samples"][1]["pixels"]["shape"] = [3, 6]
            results["bad_shape"] = await post(session, url, bad, key=KEY)
            async with session.get(url + "/nothing", headers=headers()) as answer:
                results["404"] = answer.status, await answer.json()
            return results

    r = asyncio.run(main())
    assert r["health"] == (200, {"status": "ok"}) and r["head"] == 200
    colorfulness = in_process(config, pixels[:1], ["a"])[0].reward
    assert r["routed"] == (200, {"rewards": [colorfulness], "components": [{}], "errors": [None]})
    assert colorfulness != float(pixels[0].mean())  # the control: brightness would differ
    assert r["info_no_key"] == (401, {"error": "missing Authorization header: this server requires 'Authorization: Bearer <key>'"})
    assert r["info"] == (
        200,
        {
            "wire_version": 1,
            "reward": "colorfulness",
            "rewards": [
                {
                    "name": "colorfulness",
                    "distribution": "miles-rewards",
                    "version": metadata.version("miles-rewards"),
                    "weights_sha256": None,
                }
            ],
            "pixel_encodings": ["png", "float32"],
            "max_samples": 2,
            "max_values": 2**30,
            "max_body_bytes": 4000,
            "group_rm": False,
            "run_worker": False,
        },
    )
    assert r["no_key"][0] == 401 and r["wrong_key"] == (401, {"error": "wrong API key"})
    assert r["empty"] == (200, {"rewards": [], "components": [], "errors": []})
    assert r["ok"][0] == 200 and len(r["ok"][1]["rewards"]) == 2
    assert r["mismatch"] == (409, {"error": "reward: the request expects 'pickscore'; this server serves 'colorfulness'"})
    assert r["too_many"] == (
        413,
        {
            "error": "samples: 3 samples, over this server's limit of 2 per request (--max-samples raises it; a client sends smaller batches)"
        },
    )
    assert r["too_big"][0] == 413 and r["too_big"][1]["error"].endswith(
        "over this server's limit of 4000 bytes (--max-body-bytes raises it)"
    )
    assert r["not_json"][0] == 400 and r["not_json"][1]["error"].startswith("body: not valid JSON (")
    assert r["bad_shape"] == (
        400,
        {"error": "samples[1].pixels.shape: expected [C, H, W] (an image) or [C, F, H, W] (a video), got [3, 6]"},
    )
    assert r["404"] == (404, {"error": "GET /nothing: Not Found"})


@pytest.fixture
def register(monkeypatch):
    """``register(name, cls)``: ``tests.reward_examples.<cls>`` as reward ``name`` for one test."""
    from miles_core.registry import PluginInfo, Registration
    from miles_core.specs import RewardSpec

    registry = get_host().registries.reward

    def add(name: str, cls: str) -> None:
        spec = RewardSpec(name=name, ref=f"{EXAMPLES}:{cls}", description=f"test reward {cls}")
        monkeypatch.setitem(registry._entries, name, Registration(spec, PluginInfo(name, "tests", "0")))

    return add


def test_a_reward_that_cannot_be_built_answers_503_and_says_why(register):
    register("unbuildable", "Unbuildable")
    config = resolve("--rm-type", "unbuildable")
    failures = []

    async def main():
        async with serving(config, on_build_error=failures.append) as (url, session):
            async with session.get(url + "/health") as answer:
                health = answer.status, await answer.json()
            return health, await post(session, url, body_of(grid_pixels(1), ["a"]))

    health, score = asyncio.run(main())
    why = "reward: failed to build: reward unbuildable: cannot be built: OSError: no weights at /nowhere/model.safetensors"
    assert health == (503, {"status": "failed", "error": why})
    assert score == (503, {"error": why})
    assert [str(exc) for exc in failures] == ["reward unbuildable: cannot be built: OSError: no weights at /nowhere/model.safetensors"]


# -- weights: checksum and roots ---------------------------------------------------------------


def write_model(directory: Path, payload: bytes = b"weights") -> Path:
    (directory / "sub").mkdir(parents=True)
    (directory / "config.json").write_text('{"a": 1}')
    (directory / "sub" / "model.bin").write_bytes(payload)
    return directory


def expected_sha(entries: list[tuple[str, list[tuple[str, bytes]]]]) -> str:
    """The documented rule, written out: per flag its name and NUL, then per file its
    relative path, NUL, size (8 bytes little-endian) and bytes."""
    digest = hashlib.sha256()
    for flag, files in entries:
        digest.update(flag.encode() + b"\0")
        for relative, data in files:
            digest.update(relative.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def test_weights_sha256_follows_the_documented_rule(tmp_path):
    model = write_model(tmp_path / "model")
    processor = tmp_path / "processor"
    processor.mkdir()
    (processor / "tokenizer.json").write_text("tok")
    (model / ".cache").mkdir()
    (model / ".cache" / "download.lock").write_text("differs per machine")  # skipped
    config = resolve("--rm-type", "pickscore", "--pickscore-model-path", str(model), "--pickscore-processor-path", str(processor))
    (record,) = reward_records(config)  # nothing built: the hash alone
    assert (record["name"], record["distribution"]) == ("pickscore", "miles-rewards")
    expected = expected_sha(
        [
            ("--pickscore-model-path", [("config.json", b'{"a": 1}'), ("sub/model.bin", b"weights")]),
            ("--pickscore-processor-path", [("tokenizer.json", b"tok")]),
        ]
    )
    assert record["weights_sha256"] == expected
    # Controls: one byte of a weight file, or a file's name, changes it.
    (model / "sub" / "model.bin").write_bytes(b"weightz")
    assert reward_records(config)[0]["weights_sha256"] != expected
    (model / "sub" / "model.bin").write_bytes(b"weights")
    assert reward_records(config)[0]["weights_sha256"] == expected
    (processor / "tokenizer.json").rename(processor / "vocab.json")
    assert reward_records(config)[0]["weights_sha256"] != expected
    # A single file hashes with an empty relative path; a hub id is not hashed.
    single = tmp_path / "head.safetensors"
    single.write_bytes(b"head")
    assert weights_sha256([("--x-path", str(single)), ("--y-path", "org/not-here")]) == expected_sha([("--x-path", [("", b"head")])])
    assert weights_sha256([("--y-path", "org/not-here")]) is None


def test_allowed_weight_roots_refuse_a_path_flag_outside_them_before_anything_is_built(tmp_path, capsys, monkeypatch):
    root, outside = tmp_path / "root", tmp_path / "outside"
    inside_model, inside_processor = write_model(root / "model"), write_model(root / "processor")
    outside_model = write_model(outside / "model")
    link = root / "escape"
    link.symlink_to(outside_model)
    roots = resolve_roots([root])
    args = ["--rm-type", "pickscore", "--pickscore-processor-path", str(inside_processor), "--pickscore-model-path"]
    check_servable(resolve(*args, str(inside_model)), roots)  # under the root: accepted (nothing is built)
    for path in (outside_model, link):
        with pytest.raises(ConfigError) as info:
            create_reward_app(resolve(*args, str(path)), allowed_weight_roots=roots)
        assert str(info.value).startswith(f"--pickscore-model-path {str(path)!r}")
        assert f"is outside the allowed weight roots ({root.resolve()})" in str(info.value)
    check_servable(resolve(*args, str(outside_model)), None)  # no roots: no check
    # A hub id is not a local path under the roots, even where it reads as one.
    monkeypatch.chdir(root)
    with pytest.raises(ConfigError) as info:
        check_servable(resolve(*args, "org/name"), roots)
    assert str(info.value) == (
        "--pickscore-model-path 'org/name': no such file or directory; with --allowed-weight-roots a reward's weights "
        "are local files under the roots (a hub id is downloaded, not read from them)"
    )
    # The command: exit 2, one line, before the port is taken or the model loaded.
    from miles_core.cli.main import main

    code = main(["serve-reward", *args, str(outside_model), "--allowed-weight-roots", str(root)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(
        f"miles-core serve-reward: error: --pickscore-model-path {str(outside_model)!r} is outside the allowed weight roots"
    )
    assert err.count("\n") == 1


def test_refused_configurations():
    url = ("--rm-url", "http://127.0.0.1:9")
    with pytest.raises(UsageError) as info:
        check_servable(resolve("--rm-type", "remote", *url), None)
    assert str(info.value) == "--rm-type remote: a reward server scores itself; serve the reward its clients should get (--rm-type NAME)"
    with pytest.raises(UsageError) as info:
        check_servable(resolve("--reward-weights", '{"brightness": 1, "remote": 1}', *url), None)
    assert str(info.value).startswith("--reward-weights names remote: a reward server scores itself")
    with pytest.raises(UsageError) as info:
        check_servable(resolve(), None)
    assert str(info.value) == "no reward to serve: give --rm-type NAME, --reward-weights (a mixture) or --custom-rm-path"
    from miles_core.cli.serve_reward import open_warning

    assert open_warning("miles-core serve-reward", "0.0.0.0", None) == (
        "warning: miles-core serve-reward listens on 0.0.0.0 without an API key: anyone who can reach it can use its "
        "reward (and its GPU time); set MILES_API_KEY or --api-key-file"
    )
    assert open_warning("miles-core serve-reward", "0.0.0.0", KEY) is None
    assert open_warning("miles-core serve-reward", "127.0.0.1", None) is None


# -- the command -------------------------------------------------------------------------------


def test_the_command_serves_until_sigterm(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    log = tmp_path / "serve-reward.log"
    with serve_reward_process("--rm-type", "brightness", "--api-key-file", str(key_file), log_path=log) as (url, process):
        lines = log.read_text().splitlines()
        assert lines[-2].startswith("listening on http://127.0.0.1:"), lines
        assert lines[-1] == f"serving reward brightness on {url}" and url.startswith("http://127.0.0.1:")
        pixels = grid_pixels(2)

        async def main():
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/health") as answer:
                    assert answer.status == 200
                return await post(session, url, body_of(pixels, ["a", "b"], reward="brightness"), key=KEY)

        status, body = asyncio.run(main())
        assert status == 200
        assert body["rewards"] == [s.reward for s in in_process(resolve("--rm-type", "brightness"), pixels, ["a", "b"])]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


# -- a run's reward worker (--run-worker) ----------------------------------------------------


async def post_to(session, url: str, path: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    async with session.post(url + path, data=data, headers={"Content-Type": "application/json"}) as answer:
        return answer.status, json.loads(await answer.read())


def test_a_run_worker_scores_as_the_run_and_its_evaluation_do():
    """``--run-worker``: each sample routed by its metadata.rm_type as in the run, the
    evaluation reward on request, every outcome the run's metrics need; the public
    ``POST /score`` is not served there, nor the worker's routes on a public server."""
    from miles_core.reward_service.run_worker import encode_outcome

    config = resolve("--rm-type", "brightness", "--eval-rm-type", "redness")
    pixels = grid_pixels(3)
    rows = [{}, {"rm_type": "colorfulness"}, {}]

    def in_run(evaluation: bool) -> list[dict]:
        samples = scoring_samples(pixels, ["a", "b", "c"])
        for sample, row in zip(samples, rows):
            sample.metadata = dict(row)
        scorer = RewardScorer(config, evaluation=evaluation)
        asyncio.run(scorer.score(samples))
        return [encode_outcome(s, scorer.take_outcome(s)) for s in samples]

    def body(evaluation, metadata=rows) -> dict:
        samples = [
            wire.encode_sample(x, p, m, encoding="float32", group=i, seed=i, index_in_group=0)
            for i, (x, p, m) in enumerate(zip(pixels, ["a", "b", "c"], metadata))
        ]
        return {"wire_version": 1, "evaluation": evaluation, "samples": samples}

    async def main():
        results = {}
        async with serving(config, worker=True) as (url, session):
            results["describe"] = await post_to(session, url, "/worker/describe", {"evaluation": True})
            results["train"] = await post_to(session, url, "/worker/score", body(False))
            results["eval"] = await post_to(session, url, "/worker/score", body(True))
            results["unknown"] = await post_to(session, url, "/worker/score", body(False, [{"rm_type": "nope"}, {}, {}]))
            results["bad_flag"] = await post_to(session, url, "/worker/score", {**body(False), "evaluation": "yes"})
            results["bad_rewards"] = await post_to(session, url, "/worker/counters", {"rewards": "brightness"})
            results["score"] = await post_to(session, url, "/score", body_of(pixels, ["a", "b", "c"]))
            # No limits: more samples than a public server takes (256), and a NaN one warned about.
            many = [torch.full((3, 2, 2), 0.5)] * 299 + [torch.full((3, 2, 2), math.nan)]
            big = [wire.encode_sample(x, "p", {}, encoding="float32", group=i) for i, x in enumerate(many)]
            results["many"] = await post_to(session, url, "/worker/score", {"wire_version": 1, "samples": big})
        async with serving(config) as (url, session):
            results["public"] = await post_to(session, url, "/worker/score", body(False))
        return results

    r = asyncio.run(main())
    # torch's setting is per process: the server in this thread reports this process's.
    deterministic = torch.are_deterministic_algorithms_enabled()
    assert r["describe"] == (200, {"reward": "redness", "group_rm": False, "deterministic_algorithms": deterministic})
    assert r["train"] == (200, {"outcomes": in_run(False), "warnings": []})
    assert r["eval"] == (200, {"outcomes": in_run(True), "warnings": []})
    # The control: the rows' own reward counts in training, not in evaluation.
    assert r["train"][1]["outcomes"][1]["scored_by"] == {"colorfulness": None} != r["eval"][1]["outcomes"][1]["scored_by"]
    with pytest.raises(RewardError) as unknown:
        samples = scoring_samples(pixels[:1], ["a"])
        samples[0].metadata = {"rm_type": "nope"}
        asyncio.run(RewardScorer(config).score(samples))
    assert r["unknown"] == (422, {"error": str(unknown.value)})
    assert r["bad_flag"] == (400, {"error": "evaluation: expected true or false, got 'yes'"})
    assert r["bad_rewards"] == (400, {"error": "rewards: expected a list of reward names"})
    assert r["score"][0] == 404 and r["public"][0] == 404
    status, answer = r["many"]
    assert status == 200 and [o["failed"] for o in answer["outcomes"]] == [False] * 299 + [True]
    assert len(answer["warnings"]) == 1 and "returned nan" in answer["warnings"][0]


def test_a_run_worker_needs_its_runs_secret_in_the_environment(monkeypatch):
    from miles_core.cli.serve_reward import run

    monkeypatch.delenv("MILES_API_KEY", raising=False)
    with pytest.raises(UsageError) as info:
        run(["--run-worker", "--rm-type", "brightness"])
    assert str(info.value) == "--run-worker: MILES_API_KEY must hold the secret of the run that starts this worker"
    assert info.value.exit_code == 2


WORKER_PARENT = """
import subprocess, sys, time
log = open(sys.argv[1], "w")
child = subprocess.Popen(
    [sys.executable, "-m", "miles_core.cli.main", "serve-reward", "--run-worker", "--rm-type", "brightness"],
    stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
)
print(child.pid, flush=True)
while "serving reward" not in open(sys.argv[1]).read():
    time.sleep(0.05)
if sys.argv[2] == "stay":
    time.sleep(3600)
"""


def test_a_run_worker_stops_when_the_process_that_started_it_is_gone(tmp_path):
    """A host actor killed cannot stop its server: the server sees its parent go and stops
    with one line, exit status 1; while the parent lives (the control, started beside it)
    it keeps serving."""
    import os
    import subprocess
    import sys
    import time

    import psutil

    env = {**os.environ, "MILES_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
    logs = {parent: tmp_path / f"{parent}.log" for parent in ("exit", "stay")}
    starters = {
        parent: subprocess.Popen([sys.executable, "-c", WORKER_PARENT, str(log), parent], stdout=subprocess.PIPE, text=True, env=env)
        for parent, log in logs.items()
    }
    pids: dict[str, int] = {}
    try:
        children = {}
        for parent, starter in starters.items():
            pids[parent] = int(starter.stdout.readline())
            children[parent] = psutil.Process(pids[parent])
        starters["exit"].wait(timeout=120)

        # The server looks every second; one that exits leaves a zombie, which counts as gone.
        assert wait_gone([children["exit"]], 2.5) == [], logs["exit"].read_text()
        assert (
            logs["exit"]
            .read_text()
            .splitlines()[-1]
            .startswith("miles-core serve-reward: error: the process that started this worker (pid ")
        )
        deadline = time.monotonic() + 60
        while "serving reward" not in logs["stay"].read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert wait_gone([children["stay"]], 1.5) == [children["stay"]], logs["stay"].read_text()  # past its next look
    finally:
        for starter in starters.values():
            starter.kill()
        for pid in pids.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
