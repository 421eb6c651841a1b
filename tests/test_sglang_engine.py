"""--rollout-engine sglang: the environment checks, the server command line, and the
launch / health / disk weight sync / shutdown cycle against a stand-in ``sglang`` package
whose serve entry point runs our own server (the real server: tests/lane_sglang); and
``--use-fault-tolerance`` / ``--miles-router-timeout`` for those servers."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from miles_core.config.availability import hardware_notes
from miles_core.config.resolve import resolve_config
from miles_core.engine.factory import create_engine
from miles_core.engine.sglang import SERVE_MODULE, SglangEngine, check_python, serve_command, server_args
from miles_core.errors import RunError, SglangEngineError
from miles_core.request import RolloutRequest
from tests.sglang_stand_in import build_stand_in_sglang, script


def config_for(tiny_sd3, *extra):
    return resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_sd3),
            "--diffusion-model-family",
            "sd3",
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--diffusion-num-steps",
            "3",
            "--diffusion-num-sde-steps",
            "2",
            "--diffusion-height",
            "32",
            "--diffusion-width",
            "32",
            "--rollout-engine",
            "sglang",
            *extra,
        ]
    )


@pytest.fixture
def fake_sglang(tmp_path):
    """A Python whose ``sglang.multimodal_gen...cli.main serve`` runs ``miles-core serve-engine``."""
    return build_stand_in_sglang(tmp_path)


# -- the command line ------------------------------------------------------------------------


@pytest.mark.exercises("--sglang-python")
def test_pass_through_args_lose_their_prefix_and_keep_their_values(tiny_sd3):
    config = config_for(
        tiny_sd3,
        "--sglang-python",
        "/opt/sg/bin/python",
        "--sglang-attention-backend",
        "torch_sdpa",
        "--sglang-num-gpus",
        "1",
        "--sglang-dit-cpu-offload=false",
        "--sglang-enable-torch-compile",
    )
    assert config.sglang_python == "/opt/sg/bin/python"
    assert config.sglang_args == [
        "--sglang-attention-backend",
        "torch_sdpa",
        "--sglang-num-gpus",
        "1",
        "--sglang-dit-cpu-offload=false",
        "--sglang-enable-torch-compile",
    ]
    command = serve_command(config.sglang_python, config.hf_checkpoint, 31234, config.sglang_args)
    assert command == [
        "/opt/sg/bin/python",
        "-m",
        SERVE_MODULE,
        "serve",
        "--model-path",
        str(tiny_sd3),
        "--host",
        "127.0.0.1",
        "--port",
        "31234",
        "--attention-backend",
        "torch_sdpa",
        "--num-gpus",
        "1",
        "--dit-cpu-offload=false",
        "--enable-torch-compile",
    ]
    # --sglang-server-concurrency is ours (the client's cap), never passed through.
    assert "--sglang-server-concurrency" not in config_for(tiny_sd3, "--sglang-server-concurrency", "4").sglang_args


@pytest.mark.parametrize("arg", ["--sglang-model-path", "--sglang-host", "--sglang-port=3000"])
def test_framework_set_server_args_are_refused(arg):
    with pytest.raises(SglangEngineError, match=r"^--sglang-(model-path|host|port): the run sets --(model-path|host|port) "):
        server_args(["--sglang-num-gpus", "1", arg, *([] if "=" in arg else ["x"])])


def test_availability_note_only_without_the_sglang_engine(tiny_sd3):
    with_sglang = config_for(tiny_sd3, "--sglang-attention-backend", "torch_sdpa")
    assert not any("--sglang-* arguments" in note for note in hardware_notes(with_sglang))
    embedded = config_for(tiny_sd3, "--sglang-attention-backend", "torch_sdpa", "--rollout-engine", "embedded")
    assert any("--sglang-* arguments" in note for note in hardware_notes(embedded))


# -- the environment checks --------------------------------------------------------------------


def test_missing_sglang_python_is_one_line(tiny_sd3):
    with pytest.raises(RunError, match=r"^--rollout-engine sglang needs --sglang-python PATH") as info:
        create_engine(config_for(tiny_sd3))
    assert "\n" not in str(info.value)


@pytest.mark.exercises("--sglang-python")
def test_nonexistent_sglang_python(tiny_sd3, tmp_path):
    missing = tmp_path / "nowhere" / "python"
    with pytest.raises(SglangEngineError, match=rf"^--sglang-python {missing}: no such file$"):
        create_engine(config_for(tiny_sd3, "--sglang-python", str(missing)))


def test_sglang_python_that_is_not_executable(tmp_path):
    plain = tmp_path / "python"
    plain.write_text("not a program")
    with pytest.raises(SglangEngineError, match=r": not an executable file$"):
        check_python(str(plain))
    with pytest.raises(SglangEngineError, match=r": not an executable file$"):
        check_python(str(tmp_path))


def test_sglang_python_that_cannot_import_sglang(tmp_path):
    broken = script(tmp_path / "python", "echo \"ModuleNotFoundError: No module named 'sglang'\" >&2; exit 1")
    with pytest.raises(SglangEngineError, match=r"cannot import sglang.multimodal_gen: ModuleNotFoundError: No module named 'sglang'$"):
        check_python(str(broken))
    real_without_sglang = sys.executable  # the project's Python has no sglang
    with pytest.raises(SglangEngineError, match=r"cannot import sglang.multimodal_gen: ModuleNotFoundError"):
        check_python(real_without_sglang)


def test_sglang_python_that_hangs_times_out(tmp_path):
    slow = script(tmp_path / "python", "sleep 30")
    with pytest.raises(SglangEngineError, match=r"'import sglang.multimodal_gen' took over 0.5 s$"):
        check_python(str(slow), timeout=0.5)


def test_server_that_dies_names_its_log(tmp_path, tiny_sd3):
    dying = script(tmp_path / "python", 'case "$2" in sglang.*) echo "boom: no GPU" ; exit 3 ;; esac; exit 0')
    with pytest.raises(SglangEngineError, match=r"server 0 exited with status 3 before it was healthy; see .*engine-0.log$") as info:
        SglangEngine.launch(str(dying), str(tiny_sd3), [], 1, tmp_path / "work", timeout=30)
    assert "boom: no GPU" in Path(str(info.value).rsplit("see ", 1)[1]).read_text()


def test_server_that_never_gets_healthy_times_out(tmp_path, tiny_sd3):
    idle = script(tmp_path / "python", "exec sleep 60")
    with pytest.raises(SglangEngineError, match=r"not healthy after 1 s; see .*engine-0.log$"):
        SglangEngine.launch(str(idle), str(tiny_sd3), [], 1, tmp_path / "work", timeout=1)


# -- launch, generate, weight sync through the disk, shutdown ------------------------------------


@pytest.mark.exercises("--rollout-num-engines", "--sglang-python")
def test_launches_servers_generates_syncs_from_disk_and_stops(tiny_sd3, tmp_path, fake_sglang):
    from miles_core.errors import WeightSyncError
    from miles_core.model_loading import load_family
    from miles_core.training.weight_sync import sync_to_engine

    python, record = fake_sglang
    out = tmp_path / "run"
    config = config_for(
        tiny_sd3,
        "--sglang-python",
        str(python),
        "--rollout-num-engines",
        "2",
        "--sglang-attention-backend",
        "torch_sdpa",
        "--output-dir",
        str(out),
    )
    engine = create_engine(config)
    try:
        assert isinstance(engine, SglangEngine) and len(set(engine.urls)) == 2
        argvs = [json.loads(p.read_text()) for p in tmp_path.glob("argv.*")]
        assert len(argvs) == 2
        for argv in argvs:
            assert argv[:3] == ["serve", "--model-path", str(tiny_sd3)]
            assert argv[-2:] == ["--attention-backend", "torch_sdpa"]
        request = RolloutRequest(prompt="a red cube", seed=7, width=32, height=32, num_inference_steps=3, num_outputs_per_prompt=2)

        async def go():
            first = await engine.generate(request)
            family = load_family(config)
            module = family.components()["transformer"]
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(0.01)
            synced = await sync_to_engine(engine, {"transformer": module}, config)
            second = await engine.generate(request)
            synced_again = await sync_to_engine(engine, {"transformer": module}, config)
            await engine.close()
            return first, second, synced, synced_again

        first, second, synced, synced_again = asyncio.run(go())
        assert len(first) == 2 and not torch.equal(first[0].generated_output, second[0].generated_output)
        assert synced.checksums == synced_again.checksums
        syncs = sorted((out / "sglang" / "weight-sync").iterdir())
        assert [p.name for p in syncs] == ["sync-00000", "sync-00001"]
        assert (syncs[0] / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
        assert (syncs[0] / "transformer" / "config.json").is_file()
        assert WeightSyncError  # the checksum check passed for both servers
        assert all(p.poll() is not None for p in engine.processes)
        assert (out / "sglang" / "logs" / "engine-1.log").is_file()
    finally:
        engine.stop_servers() if isinstance(engine, SglangEngine) else None


def test_lora_only_sync_is_refused(tmp_path):
    engine = SglangEngine(["http://127.0.0.1:1"], [], [], tmp_path)
    with pytest.raises(SglangEngineError, match="--lora-ipc-weight-sync does not apply to --rollout-engine sglang"):
        asyncio.run(engine.update_weights_from_tensors("transformer", {}, buffer_size=1, lora_only=True))
    assert os.listdir(tmp_path) == []


def test_sglang_records_are_normalised_to_ours(tmp_path, monkeypatch):
    """sglang-diffusion 0.5.23 labels every output with the request seed, sends no
    trajectory step_indices, null image_kwargs / guidance and batched conditioning."""
    from miles_core.engine.http import HttpEngine
    from miles_core.request import RolloutOutput

    def record():
        return RolloutOutput(
            request_id="r",
            prompt="p",
            seed=5,
            generated_output=torch.zeros(3, 8, 8),
            dit_trajectory={
                "latents": torch.zeros(2, 4, 1, 1),
                "timesteps": torch.tensor([602.0, 9.0]),
                "sigmas": torch.tensor([1.0, 0.602, 0.3, 0.009, 0.0]),
            },
            denoising_env={
                "image_kwargs": None,
                "guidance": None,
                "pos_cond_kwargs": {"pooled_projections": torch.ones(1, 32)},
                "neg_cond_kwargs": None,
            },
        )

    async def fake_generate(self, request):
        return [record(), record()]

    monkeypatch.setattr(HttpEngine, "generate", fake_generate)
    engine = SglangEngine(["http://127.0.0.1:1"], [], [], tmp_path)
    request = RolloutRequest(
        prompt="p",
        seed=5,
        width=32,
        height=48,
        num_inference_steps=4,
        num_outputs_per_prompt=2,
        guidance_scale=3.5,
        rollout_return_step_indices=(3, 1),
    )
    outputs = asyncio.run(engine.generate(request))
    assert [o.seed for o in outputs] == [5, 6]
    assert outputs[0].dit_trajectory["step_indices"].tolist() == [1, 3]
    # One timestep per returned latent becomes the [T] grid: steps 1 and 3 at their places.
    assert outputs[0].dit_trajectory["timesteps"].tolist() == pytest.approx([1000.0, 602.0, 300.0, 9.0])
    env = outputs[0].denoising_env
    assert env["image_kwargs"] == {"height": 48, "width": 32} and env["guidance"] == {"guidance_scale": 3.5}
    assert env["pos_cond_kwargs"]["pooled_projections"].shape == (32,)
    # The family parameters the server sampled with (Wan 2.2's second scale) reach the
    # trainer too; the flow shift is a parameter of its own.
    extras = replace(request, extra_sampling_params={"guidance_scale_2": 2.5, "flow_shift": 5.0})
    guidance = asyncio.run(engine.generate(extras))[0].denoising_env["guidance"]
    assert guidance == {"guidance_scale": 3.5, "guidance_scale_2": 2.5}
    wrong = RolloutRequest(prompt="p", seed=5, num_inference_steps=4, num_outputs_per_prompt=2)
    with pytest.raises(SglangEngineError, match="returned 2 trajectory latents without step_indices; expected 5"):
        asyncio.run(engine.generate(wrong))


def test_sglang_timesteps_become_the_loop_grid():
    """sglang-diffusion records one timestep per returned latent (steps 1, 2, 3 and the
    final 4 here); the trainer reads step k's at index k of the [T] grid. Reading the
    returned rows by step index put step 1 at step 2's timestep (the lane's drift)."""
    from miles_core.engine.sglang import timestep_grid

    sigmas = torch.tensor([1.0, 0.8577, 0.6022, 0.00893, 0.0])
    grid = sigmas[:4] * 1000
    returned = torch.tensor([857.7, 602.2, 8.93, 0.0])
    out = timestep_grid(returned, sigmas, [1, 2, 3, 4], 4)
    assert out.shape == (4,) and out[1:].tolist() == returned[:3].tolist()  # the server's values, where it sent them
    assert torch.allclose(out, grid)
    # A window that returned steps 0, 1, 2 and the final latent.
    assert torch.allclose(timestep_grid(torch.tensor([1000.0, 857.7, 602.2, 0.0]), sigmas, [0, 1, 2, 4], 4), grid)
    # Only the final latent (ode_and_return_last): the flow-matching scale fills the grid.
    assert torch.allclose(timestep_grid(torch.tensor([0.0]), sigmas, [4], 4), grid)
    # A family on the sigma scale (timestep = sigma) keeps its own scale.
    assert torch.allclose(timestep_grid(torch.tensor([0.8577, 0.0]), sigmas, [1, 4], 4), sigmas[:4])
    with pytest.raises(SglangEngineError, match="not a fixed multiple of its sigmas"):
        timestep_grid(torch.tensor([857.7, 300.0, 0.0]), sigmas, [1, 2, 4], 4)
    with pytest.raises(SglangEngineError, match="returned 3 trajectory timesteps for 4 latents"):
        timestep_grid(torch.tensor([857.7, 602.2, 0.0]), sigmas, [1, 2, 3, 4], 4)


# -- fault tolerance and the request timeout ---------------------------------------------------


def server_of(proxy: int) -> tuple[int, list[str]]:
    """The sglang server behind the authenticating proxy ``proxy`` (its one child) and the
    proxy's command line."""
    from tests.sglang_stand_in import children

    (server,) = children(proxy)
    return server, Path(f"/proc/{proxy}/cmdline").read_bytes().decode().split("\0")


def _sglang_run(tiny_sd3, prompts, python, out: Path, *, kill: bool) -> dict:
    """A 2-server fault-tolerant ``--rollout-engine sglang`` run of two rollouts (4
    microgroups each, two per server); with ``kill``, server 0 gets SIGKILL as soon as a
    microgroup of rollout 0 returns while server 0 has a request in flight (the first
    return: each server works through its two requests one at a time)."""
    import miles_core.training.weight_sync as weight_sync
    from miles_core.engine.health import HEALTHY
    from miles_core.engine.http import HttpEngine
    from tests.test_fault_tolerance import poll, recording_sync, restart_after_first_sync
    from tests.tiny_runs import run_metrics, tiny_run_args

    seen: dict = {"engines": [], "posts": [], "syncs": [], "killed_pid": None, "generates": 0}
    original_post = HttpEngine._post

    async def post(self, url, path, **kw):
        seen["posts"].append((path, url, (kw.get("json_body") or {}).get("model_path")))
        return await original_post(self, url, path, **kw)

    original_generate = SglangEngine.generate

    async def generate(self, request):
        seen["generates"] += 1
        if not seen["engines"]:
            seen["engines"].append(self)
        if kill and seen["generates"] > 4:  # rollout 1 waits for the restarted server
            await poll(lambda: self.supervisor.state[0] == HEALTHY, "sglang server 0 restarted")
            if "new_server" not in seen:  # the run's secret puts each server behind its proxy (processes[0])
                seen["new_server"] = server_of(self.processes[0].pid)
        outputs = await original_generate(self, request)
        if kill and seen["killed_pid"] is None and self.in_flight[0]:
            process = self.processes[0]
            seen.update(killed_pid=process.pid, killed_url=self.urls[0], killed_at=len(seen["posts"]), killed_server=server_of(process.pid))
            os.kill(process.pid, signal.SIGKILL)
        return outputs

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # the servers' (two of them beside the trainer)
        patch.setattr(HttpEngine, "_post", post)
        patch.setattr(SglangEngine, "generate", generate)
        # The new server comes up only after rollout 0 trained and synced, so its re-sync
        # must send the trained weights.
        patch.setattr(SglangEngine, "restart_server", restart_after_first_sync(SglangEngine.restart_server, seen, "_stopping"))
        patch.setattr(weight_sync, "sync_to_engine", recording_sync(seen))
        args = [
            *tiny_run_args(tiny_sd3, prompts, out, batch=2, n=4, steps=3, sde_steps=1),
            "--num-rollout",
            "2",
            "--lr",
            "3e-2",
            "--rollout-engine",
            "sglang",
            "--sglang-python",
            str(python),
            "--rollout-num-engines",
            "2",
            "--use-fault-tolerance",
            "--rollout-health-check-interval",
            "0.5",
            "--save-debug-rollout-data",
            str(out / "rollouts" / "{}.msgpack"),
        ]
        seen["records"] = run_metrics(args, timeout=400)
    return seen


@pytest.mark.exercises("--use-fault-tolerance")
def test_a_killed_sglang_server_is_restarted_resynced_from_disk_and_the_run_is_unchanged(tiny_sd3, prompts, tmp_path, fake_sglang):
    from tests.test_fault_tolerance import assert_the_kill_changed_nothing

    python, record = fake_sglang
    began = time.monotonic()
    disturbed = _sglang_run(tiny_sd3, prompts, python, tmp_path / "killed", kill=True)
    middle = time.monotonic()
    calm = _sglang_run(tiny_sd3, prompts, python, tmp_path / "calm", kill=False)
    print(f"disturbed run {middle - began:.1f} s, undisturbed {time.monotonic() - middle:.1f} s")

    # Killed mid-rollout: retried, restarted once, and the same samples and metrics.
    assert_the_kill_changed_nothing(disturbed["records"], calm["records"], tmp_path / "killed", tmp_path / "calm")

    # A new server process took server 0's place: same command line but the port, own log.
    engine = disturbed["engines"][0]
    new_url, new_pid = engine.urls[0], engine.processes[0].pid
    assert new_pid != disturbed["killed_pid"] and new_url != disturbed["killed_url"]
    assert engine.restarts == [1, 0]
    logs = tmp_path / "killed" / "sglang" / "logs"
    assert engine.log_paths[0] == logs / "engine-0.restart1.log"
    assert f"on {new_url}" in (logs / "engine-0.restart1.log").read_text()
    assert f"on {disturbed['killed_url']}" in (logs / "engine-0.log").read_text()  # the old log is kept
    # Each server sits behind its authenticating proxy (the process the engine holds, on the
    # URL's port); sglang itself got the same command line but for its loopback port.
    (old_server, old_proxy), (new_server, new_proxy) = disturbed["killed_server"], disturbed["new_server"]
    old_argv = json.loads(Path(f"{record}.{old_server}").read_text())
    new_argv = json.loads(Path(f"{record}.{new_server}").read_text())
    port = old_argv.index("--port") + 1
    assert new_argv[:port] + new_argv[port + 1 :] == old_argv[:port] + old_argv[port + 1 :]
    assert new_argv[port] != old_argv[port] and new_argv[new_argv.index("--host") + 1] == "127.0.0.1"
    assert new_proxy[new_proxy.index("--port") + 1] == new_url.rsplit(":", 1)[1]
    assert old_proxy[old_proxy.index("--port") + 1] == disturbed["killed_url"].rsplit(":", 1)[1]
    assert all(p.poll() is not None for p in engine.processes)  # stopped with the run

    # Before its first request it loaded the trainer's current weights from its own sync
    # folder (the third sync: initial, after rollout 0, re-sync, after rollout 1), and its
    # checksums matched.
    syncs, posts = disturbed["syncs"], disturbed["posts"]
    assert len(syncs) == 4 and syncs[2]["urls"] == [new_url] and syncs[1]["urls"] == [engine.urls[1]]
    assert syncs[2]["reported"][new_url] == syncs[2]["sent"] == syncs[1]["sent"] != syncs[0]["sent"]
    weight_sync = tmp_path / "killed" / "sglang" / "weight-sync"
    resync = weight_sync / "resync-00001" / "sync-00000"
    load = posts.index(("/update_weights_from_disk", new_url, str(resync)))
    check = posts.index(("/get_weights_checksum", new_url, None))
    first_request = posts.index(("/rollout/generate", new_url, None))
    assert load < check < syncs[2]["posts_before"] <= first_request
    assert (resync / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    # The main engine's sync folders are its own (three syncs), untouched by the re-sync.
    assert sorted(p.name for p in weight_sync.iterdir()) == ["resync-00001", "sync-00000", "sync-00001", "sync-00002"]
    # Once dead, the killed server got no weight update (syncs go to healthy servers).
    assert not [p for p in posts[disturbed["killed_at"] :] if p[1] == disturbed["killed_url"] and "weights" in p[0]]
    assert (
        all(len(s["urls"]) == 2 for s in calm["syncs"]) and not (tmp_path / "calm" / "sglang" / "logs" / "engine-0.restart1.log").exists()
    )


@pytest.mark.exercises("--miles-router-timeout")
def test_the_router_timeout_bounds_a_request_to_an_sglang_server(tiny_sd3, tmp_path, fake_sglang):
    from miles_core.errors import EngineRequestError
    from tests.test_fault_tolerance import stopped

    python, _ = fake_sglang
    config = config_for(tiny_sd3, "--sglang-python", str(python), "--miles-router-timeout", "1", "--output-dir", str(tmp_path / "run"))
    engine = create_engine(config)
    try:
        assert isinstance(engine, SglangEngine) and engine.request_timeout == 1.0 and engine.supervisor is None
        request = RolloutRequest(prompt="a red cube", seed=7, width=32, height=32, num_inference_steps=3)

        async def go():
            try:
                began = time.monotonic()
                with stopped(engine.processes[0]), pytest.raises(EngineRequestError) as info:
                    await asyncio.wait_for(engine.generate(request), 30)
                assert time.monotonic() - began < 10
                return info.value
            finally:
                await engine.close()

        error = asyncio.run(go())
        assert str(error) == f"{engine.urls[0]}/rollout/generate: no response: TimeoutError: no complete answer within 1 s"
    finally:
        engine.stop_servers() if isinstance(engine, SglangEngine) else None


def test_restarts_are_refused_once_stopping_and_a_failed_one_names_its_log(tmp_path, tiny_sd3):
    from miles_core.engine.health import FaultTolerance

    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    engine = SglangEngine(["http://127.0.0.1:1"], [process], [work / "logs" / "engine-0.log"], work, fault_tolerance=FaultTolerance())
    try:
        # Servers the engine started are restarted by it; servers it did not start are not.
        assert engine.supervisor.restart == engine._restart
        assert SglangEngine(["http://127.0.0.1:1"], [], [], work, fault_tolerance=FaultTolerance()).supervisor.restart is None
        with pytest.raises(SglangEngineError, match="not started by SglangEngine.launch"):
            engine.restart_server(0)
        dying = script(tmp_path / "python", 'case "$2" in sglang.*) echo "boom: no GPU" ; exit 3 ;; esac; exit 0')
        engine.python, engine.model_path, engine.environment = str(dying), str(tiny_sd3), dict(os.environ)
        with pytest.raises(
            SglangEngineError,
            match=r"^sglang-diffusion server 0 exited with status 3 before it was "
            r"healthy; see .*engine-0\.restart1\.log$",
        ) as info:
            engine.restart_server(0, timeout=30)
        assert "\n" not in str(info.value) and process.returncode == -signal.SIGKILL  # the old one killed first
        assert "boom: no GPU" in (work / "logs" / "engine-0.restart1.log").read_text()
        assert engine.log_paths[0] == work / "logs" / "engine-0.restart1.log" and engine.processes[0] is not process
    finally:
        engine.stop_servers()
    with pytest.raises(
        SglangEngineError,
        match=r"^sglang-diffusion server 0 \(http://127.0.0.1:1\): not restarted, "
        r"the servers are stopping$",
    ):
        engine.restart_server(0)
    assert not (work / "logs" / "engine-0.restart2.log").exists()

    # The re-sync view: one URL, no servers of its own, the model's files, its own sync folder.
    engine._owns_work_dir = True
    view = engine.view("http://127.0.0.1:2")
    assert isinstance(view, SglangEngine) and view.urls == ["http://127.0.0.1:2"] and view.processes == []
    assert view.supervisor is None and view.model_path == str(tiny_sd3) and view.request_timeout == engine.request_timeout
    assert view._next_sync_dir() == work / "weight-sync" / "resync-00001" / "sync-00000"
    assert engine.view("http://127.0.0.1:2").sync_root == work / "weight-sync" / "resync-00002"
    asyncio.run(view.close())
    assert work.is_dir()  # the engine's work folder is not the view's to remove
