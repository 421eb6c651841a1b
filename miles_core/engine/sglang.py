"""The ``sglang`` engine: real sglang-diffusion servers the run starts itself.

sglang pins its own torch, diffusers and transformers, so the servers run from a separate
Python environment (``--sglang-python PATH``). The run starts ``--rollout-num-engines``
servers, each on a free loopback port, as

    PATH -m sglang.multimodal_gen.runtime.entrypoints.cli.main serve
         --model-path CKPT --host 127.0.0.1 --port P [--sglang-* args, prefix stripped]

(``--sglang-attention-backend X`` becomes ``--attention-backend X``, the reference's rule;
``--model-path``, ``--host`` and ``--port`` are the framework's and an error when passed),
waits for ``GET /health`` and talks to them through :class:`HttpEngine` (the same
``/rollout/generate`` wire). Weight sync writes the trainer's weights as safetensors, one
directory per sync (``<module>/diffusion_pytorch_model.safetensors``), and asks every server
to load it with ``/update_weights_from_disk``. sglang's own ``/update_weights_from_tensor``
passes CUDA-IPC handles in pickles, so it serves only colocated GPU runs: there
:mod:`miles_core.training.ipc_sync` sends it and tells :meth:`SglangEngine.expect_ipc_module`
what it sent, so that the checksum check works as after a disk sync.

Every request carries ``generator_device`` (``--diffusion-generator-device``: ``cpu``
unless the run asks for ``cuda``), so sglang-diffusion, whose own default is ``cuda``,
draws each output's noise where our engine does: with ``cpu``, the same latents.

``--miles-router-timeout`` bounds each request as for the ``http`` engine. With
``--use-fault-tolerance`` the servers are health-checked like an ``http`` fleet's; a dead or
hung one is relaunched (:meth:`SglangEngine.restart_server`: same command and environment,
a new port, log ``engine-<i>.restart<k>.log``) and re-synced through the disk by
:meth:`SglangEngine.view` before it serves again.

sglang-diffusion 0.5.23 takes no API key. With the run's key (``api_key``) each server
listens on 127.0.0.1 on a private port behind an authenticating proxy
(:mod:`miles_core.engine.auth_proxy`, the parent process of the server) that holds the
clients' address, requires the key and lets ``/update_weights_from_disk`` load only from
under the sync folder ``sync_root`` (the re-syncs' ``resync-*`` lie under it) and
``allowed_weight_roots``; a restarted server gets the same. The key reaches the proxy in
its environment only.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from miles_core.engine.health import FaultTolerance
from miles_core.engine.http import HttpEngine
from miles_core.errors import SglangEngineError
from miles_core.request import FLOW_SHIFT, RolloutOutput, RolloutRequest
from miles_core.weights import named_tensors_checksum

SERVE_MODULE = "sglang.multimodal_gen.runtime.entrypoints.cli.main"
FRAMEWORK_ARGS = ("--model-path", "--host", "--port")
"""Server arguments the framework sets itself; passing them as ``--sglang-*`` is an error."""
PREFIX = "--sglang-"
IMPORT_CHECK_TIMEOUT = 120.0


def server_args(sglang_args: Sequence[str]) -> list[str]:
    """The ``--sglang-*`` pass-through arguments as the server's own: prefix stripped,
    values verbatim. ``--sglang-model-path``, ``--sglang-host`` and ``--sglang-port`` raise."""
    out: list[str] = []
    for token in sglang_args:
        if token.startswith(PREFIX):
            name = "--" + token[len(PREFIX) :]
            if name.split("=", 1)[0] in FRAMEWORK_ARGS:
                raise SglangEngineError(
                    f"{token.split('=', 1)[0]}: the run sets {name.split('=', 1)[0]} of the sglang-diffusion servers itself"
                )
            out.append(name)
        else:
            out.append(token)
    return out


def serve_command(python: str, model_path: str, port: int, sglang_args: Sequence[str], host: str = "127.0.0.1") -> list[str]:
    """The command line of one sglang-diffusion server."""
    return [
        str(python),
        "-m",
        SERVE_MODULE,
        "serve",
        "--model-path",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        *server_args(sglang_args),
    ]


def check_python(python: str | None, timeout: float = IMPORT_CHECK_TIMEOUT) -> str:
    """``python`` as an absolute path, once it runs ``import sglang.multimodal_gen``;
    :class:`SglangEngineError` (one line) when missing, not executable or broken."""
    if not python:
        raise SglangEngineError(
            "--rollout-engine sglang needs --sglang-python PATH: the Python of a separate "
            "sglang-diffusion environment (see docs/engine.md; scripts/sglang_lane.sh builds one)"
        )
    path = Path(python).expanduser()
    if not path.exists():
        raise SglangEngineError(f"--sglang-python {python}: no such file")
    if path.is_dir() or not os.access(path, os.X_OK):
        raise SglangEngineError(f"--sglang-python {python}: not an executable file")
    try:
        result = subprocess.run([str(path), "-c", "import sglang.multimodal_gen"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SglangEngineError(f"--sglang-python {python}: 'import sglang.multimodal_gen' took over {timeout:g} s") from None
    except OSError as exc:
        raise SglangEngineError(f"--sglang-python {python}: cannot run it: {exc}") from None
    if result.returncode != 0:
        lines = [line for line in (result.stderr or result.stdout).strip().splitlines() if line.strip()]
        last = lines[-1].strip() if lines else f"exit status {result.returncode}"
        raise SglangEngineError(f"--sglang-python {python}: cannot import sglang.multimodal_gen: {last}")
    return str(path.absolute())


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class SglangEngine(HttpEngine):
    """Starts sglang-diffusion servers, then behaves as an :class:`HttpEngine` over them."""

    def __init__(
        self,
        urls: Sequence[str],
        processes: Sequence[subprocess.Popen],
        log_paths: Sequence[Path],
        work_dir: Path,
        *,
        owns_work_dir: bool = False,
        sync_root: Path | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("fault_tolerance") is not None and processes and kwargs.get("restart") is None:
            kwargs["restart"] = self._restart  # the run started these servers: it restarts them
        super().__init__(list(urls), **kwargs)
        self.processes = list(processes)
        self.log_paths = list(log_paths)
        self.work_dir = Path(work_dir)
        self._owns_work_dir = owns_work_dir
        self.sync_root = Path(sync_root) if sync_root is not None else self.work_dir / "weight-sync"
        """Where the weight syncs' directories go (``sync-<n>``)."""
        self._syncs = 0
        self._sync_dir: Path | None = None
        self._expected: dict[str, tuple[str, str]] = {}  # module -> (checksum of the file, of the trainer's tensors)
        self._views = 0
        self.model_path: str | None = None
        # How launch() started the servers, so that restart_server() can start one again.
        self.python: str | None = None
        self.sglang_args: list[str] = []
        self.environment: dict[str, str] | None = None
        self.allowed_weight_roots: tuple[str, ...] = ()
        """Where launch() let the servers load weights from (with a key: behind the proxy)."""
        self.launch_timeout = 600.0
        self.restarts = [0] * len(self.processes)
        self._lock = threading.Lock()
        self._stopping = False

    @classmethod
    def from_config(cls, config: Any, api_key: str | None = None) -> SglangEngine:
        """The run's servers; with ``api_key`` (the run's secret) behind authenticating
        proxies that let them load weights only from the sync folder (and from the
        configuration's ``allowed_weight_roots``, when it has any)."""
        python = check_python(config.get("sglang_python"))
        args = list(config.sglang_args)
        server_args(args)  # framework-set arguments fail before anything starts
        count = int(config.get("rollout_num_engines") or 1)
        if count < 1:
            raise SglangEngineError(f"--rollout-num-engines must be at least 1, got {count}")
        options = cls.client_options(config)
        if config.get("output_dir"):
            work_dir, owned = Path(config.output_dir) / "sglang", False
            work_dir.mkdir(parents=True, exist_ok=True)
        else:
            work_dir, owned = Path(tempfile.mkdtemp(prefix="miles-sglang-")), True
        engine = cls.launch(
            python,
            config.hf_checkpoint,
            args,
            count,
            work_dir,
            timeout=600.0,
            api_key=api_key,
            allowed_weight_roots=config.get("allowed_weight_roots") or (),
            **options,
        )
        engine._owns_work_dir = owned
        return engine

    @staticmethod
    def client_options(config: Any) -> dict[str, Any]:
        """The run's client settings of its servers (concurrency, timeouts, fault tolerance)."""
        request_timeout = config.get("miles_router_timeout")
        if request_timeout is not None and not request_timeout > 0:
            raise SglangEngineError(f"--miles-router-timeout must be positive, got {request_timeout}")
        try:
            fault_tolerance = FaultTolerance.from_config(config)
        except ValueError as exc:
            raise SglangEngineError(str(exc)) from None
        return {
            "max_concurrency": config.sglang_server_concurrency,
            "decode_workers": config.get("rollout_parser_num_workers") or 1,
            "request_timeout": request_timeout,
            "fault_tolerance": fault_tolerance,
        }

    @classmethod
    def launch(
        cls,
        python: str,
        model_path: str,
        sglang_args: Sequence[str],
        count: int,
        work_dir: Path,
        *,
        timeout: float = 600.0,
        env: Mapping[str, str] | None = None,
        allowed_weight_roots: Sequence[str | Path] = (),
        **kwargs: Any,
    ) -> SglangEngine:
        """Start ``count`` servers and wait until every one answers ``/health`` with 200.
        With ``api_key`` in ``kwargs`` each is behind an authenticating proxy that lets it
        load weights from the sync folder and ``allowed_weight_roots`` only."""
        work_dir = Path(work_dir)
        (work_dir / "logs").mkdir(parents=True, exist_ok=True)
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        api_key = kwargs.get("api_key")
        roots: tuple[str, ...] = ()
        if api_key is not None:
            sync_root = Path(kwargs["sync_root"]) if kwargs.get("sync_root") is not None else work_dir / "weight-sync"
            sync_root.mkdir(parents=True, exist_ok=True)  # a root must exist when the proxy resolves it
            roots = (str(sync_root.absolute()), *map(str, allowed_weight_roots))
        processes, logs, urls = [], [], []
        try:
            for index in range(count):
                port = free_port()
                log_path = work_dir / "logs" / f"engine-{index}.log"
                processes.append(
                    spawn_server(python, model_path, port, sglang_args, environment, log_path, api_key=api_key, allowed_weight_roots=roots)
                )
                logs.append(log_path)
                urls.append(f"http://127.0.0.1:{port}")
            engine = cls(urls, processes, logs, work_dir, **kwargs)
        except BaseException:
            kill_servers(processes)
            raise
        engine.model_path = str(model_path)
        engine.python, engine.sglang_args, engine.environment = str(python), list(sglang_args), environment
        engine.allowed_weight_roots = roots
        engine.launch_timeout = timeout
        try:
            engine._wait_healthy(timeout)
        except BaseException:
            engine.stop_servers()
            raise
        return engine

    def _wait_healthy(self, timeout: float, servers: Mapping[int, str] | None = None) -> None:
        """Wait until the servers (``{index: url}``, default: all) answer ``/health`` with
        200; :class:`SglangEngineError` naming the first one's log when it exits or times out."""
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self.urls) if servers is None else servers)
        while pending:
            for index, url in list(pending.items()):
                code = self.processes[index].poll()
                if code is not None:
                    raise SglangEngineError(
                        f"sglang-diffusion server {index} exited with status {code} before it was healthy; see {self.log_paths[index]}"
                    )
                try:
                    with urllib.request.urlopen(url + "/health", timeout=5) as response:
                        if response.status == 200:
                            del pending[index]
                except (urllib.error.URLError, OSError):
                    pass
            if not pending:
                return
            if time.monotonic() >= deadline:
                index = next(iter(pending))
                raise SglangEngineError(
                    f"sglang-diffusion server {index} ({pending[index]}) not healthy after {timeout:g} s; see {self.log_paths[index]}"
                )
            time.sleep(0.25)

    # -- fault tolerance ----------------------------------------------------------------------

    async def _restart(self, index: int) -> str:
        """The supervisor's ``restart`` callback (``--use-fault-tolerance``)."""
        return await asyncio.to_thread(self.restart_server, index)

    def restart_server(self, index: int, timeout: float | None = None) -> str:
        """Replace server ``index``: SIGKILL its process group (it is dead or hung), start
        it again with the same command line and environment on a new free port (log
        ``logs/engine-<index>.restart<k>.log``, so the old log keeps what went wrong), wait
        until it is healthy (``timeout``: launch's by default) and return its URL. Blocking;
        :class:`SglangEngineError` naming the new log when it does not come up, or when
        :meth:`stop_servers` has begun."""
        if self.python is None or self.model_path is None or self.environment is None:
            raise SglangEngineError("these sglang-diffusion servers were not started by SglangEngine.launch: cannot restart one")
        old = self.processes[index]
        kill_servers([old])
        with self._lock:  # stop_servers() must not miss a server started while it runs
            if self._stopping:
                raise SglangEngineError(f"sglang-diffusion server {index} ({self.urls[index]}): not restarted, the servers are stopping")
            self.restarts[index] += 1
            port = free_port()
            log_path = self.work_dir / "logs" / f"engine-{index}.restart{self.restarts[index]}.log"
            self.processes[index] = spawn_server(
                self.python,
                self.model_path,
                port,
                self.sglang_args,
                self.environment,
                log_path,
                api_key=self.api_key,
                allowed_weight_roots=self.allowed_weight_roots,
            )
            self.log_paths[index] = log_path
        url = f"http://127.0.0.1:{port}"  # the supervisor puts it in the slot
        try:
            self._wait_healthy(self.launch_timeout if timeout is None else timeout, {index: url})
        except BaseException:
            kill_servers([self.processes[index]])
            raise
        return url

    def view(self, url: str) -> SglangEngine:
        """An engine over ``url`` alone that syncs weights through the disk like this one
        (the re-sync of a restarted server), in its own directory
        ``weight-sync/resync-<n>`` so that it never overwrites this engine's syncs. It
        starts and stops no server and leaves the work directory alone."""
        self._views += 1
        view = SglangEngine(
            [url],
            [],
            [],
            self.work_dir,
            sync_root=self.sync_root / f"resync-{self._views:05d}",
            max_concurrency=self.max_concurrency,
            request_timeout=self.request_timeout,
            connect_timeout=self.connect_timeout,
            api_key=self.api_key,
        )
        view.model_path = self.model_path
        return view

    async def generate(self, request: RolloutRequest) -> list[RolloutOutput]:
        """As :meth:`HttpEngine.generate`. sglang-diffusion 0.5.23 draws output *i* from
        ``seed + i`` (the lane checks the first latents) but labels every record with the
        request's ``seed``; such records get their own seed back. Its ``dit_trajectory``
        holds the requested steps' latents without ``step_indices`` (they are added) and
        one timestep per returned latent (rebuilt as our ``[T]`` loop grid, see
        :func:`timestep_grid`)."""
        outputs = await super().generate(request)
        if len(outputs) > 1 and all(output.seed == request.seed for output in outputs):
            for index, output in enumerate(outputs):
                output.seed = request.seed + index
        for output in outputs:
            _normalize_env(output.denoising_env, request)
            trajectory = output.dit_trajectory
            # Its trajectory carries no step_indices: the latents are those of the requested
            # rollout_return_step_indices, in step order, or of every step 0..T.
            if trajectory and "latents" in trajectory and "step_indices" not in trajectory:
                rows = trajectory["latents"].shape[0]
                wanted = request.rollout_return_step_indices
                steps = sorted(set(wanted)) if wanted is not None else list(range(request.num_inference_steps + 1))
                if rows != len(steps):
                    raise SglangEngineError(
                        f"sglang-diffusion returned {rows} trajectory latents without step_indices; expected {len(steps)} (steps {steps})"
                    )
                trajectory["step_indices"] = torch.tensor(steps)
                if "timesteps" in trajectory and "sigmas" in trajectory:
                    trajectory["timesteps"] = timestep_grid(
                        trajectory["timesteps"], trajectory["sigmas"], steps, request.num_inference_steps
                    )
        return outputs

    # -- weight sync through the disk ---------------------------------------------------

    async def update_weights_from_tensors(
        self,
        module_name: str,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        buffer_size: int,
        lora_only: bool = False,
        lora_config: Mapping[str, Any] | None = None,
    ) -> int:
        """Write the module's full weights as safetensors in this sync's directory and have
        every server load them (``/update_weights_from_disk``). ``buffer_size`` does not
        apply (one file per module); LoRA-only updates are refused."""
        if lora_only:
            raise SglangEngineError(
                "--lora-ipc-weight-sync does not apply to --rollout-engine sglang: its servers "
                "load full weights from disk (leave the flag off)"
            )
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in items}
        folder = self._next_sync_dir() / module_name
        written = await asyncio.to_thread(self._write_module, folder, module_name, tensors)
        await self.update_weights_from_disk(str(folder.parent), target_modules=[module_name])
        self._expected[module_name] = (named_tensors_checksum(written.items()), named_tensors_checksum(tensors.items()))
        return len(tensors)

    def _next_sync_dir(self) -> Path:
        if self._sync_dir is None:
            self._sync_dir = self.sync_root / f"sync-{self._syncs:05d}"
            self._syncs += 1
        return self._sync_dir

    async def weights_checksums(self, module_names: Sequence[str] | None = None) -> dict[str, dict[str, str]]:
        # The trainer asks for checksums once per sync, after every module: the next
        # update starts a new directory.
        self._sync_dir = None
        answers = await super().weights_checksums(module_names)
        # sglang hashes every parameter of its module, which can hold tensors the trainer
        # does not send (SD3's fixed pos_embed table, a buffer in diffusers); the sync file
        # holds those too, copied from the checkpoint. A server reporting exactly the file
        # the trainer's tensors were written to holds exactly those tensors: report it as
        # the trainer's checksum. Any other answer goes through unchanged (and fails the check).
        for answer in answers.values():
            for name, value in answer.items():
                if name in self._expected and value == self._expected[name][0]:
                    answer[name] = self._expected[name][1]
        return answers

    def _write_module(self, folder: Path, module_name: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Write the module's file; tensors of the checkpoint's files the trainer does not
        send (buffers) are copied from the checkpoint. Returns what was written."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        if self.model_path and (Path(self.model_path) / module_name / "config.json").is_file():
            shutil.copyfile(Path(self.model_path) / module_name / "config.json", folder / "config.json")
        written = self._with_checkpoint_tensors(module_name, tensors)
        save_file(written, str(folder / "diffusion_pytorch_model.safetensors"))
        return written

    def _with_checkpoint_tensors(self, module_name: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` and the checkpoint's tensors of the module that the trainer does not
        send (buffers in diffusers, parameters in sglang: SD3's ``pos_embed`` table)."""
        from safetensors import safe_open

        held = dict(tensors)
        if self.model_path:
            for path in sorted((Path(self.model_path) / module_name).glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as handle:
                    for name in handle.keys():
                        if name not in held:
                            held[name] = handle.get_tensor(name)
        return held

    def expect_ipc_module(self, module_name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """After a full CUDA-IPC sync of ``module_name`` (``tensors``: what was sent, on the
        host): the servers hold those tensors and, for what the trainer does not send, the
        checkpoint's, which they loaded at start; a server reporting the checksum of that
        union is reported as holding the trainer's weights, as after a disk sync."""
        held = self._with_checkpoint_tensors(module_name, tensors)
        self._expected[module_name] = (named_tensors_checksum(held.items()), named_tensors_checksum(tensors.items()))

    # -- shutdown ---------------------------------------------------------------------------

    def stop_servers(self, grace: float = 20.0) -> None:
        with self._lock:  # a restart from now on is refused
            self._stopping = True
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()

    async def close(self) -> None:
        await super().close()
        await asyncio.to_thread(self.stop_servers)
        if self._owns_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)


def spawn_server(
    python: str,
    model_path: str,
    port: int,
    sglang_args: Sequence[str],
    environment: Mapping[str, str],
    log_path: Path,
    host: str = "127.0.0.1",
    *,
    api_key: str | None = None,
    allowed_weight_roots: Sequence[str | Path] = (),
) -> subprocess.Popen:
    """Start one server (its own process group, output to ``log_path``); does not wait.

    With ``api_key`` the clients' address ``host:port`` is an authenticating proxy's
    (:mod:`miles_core.engine.auth_proxy`: the key required, disk loads only from under
    ``allowed_weight_roots``), and sglang-diffusion, which takes no key, listens on
    127.0.0.1 on a private port behind it; the returned process is the proxy's, the
    server its child in its process group. The key goes in the proxy's environment only.
    A root that is not a directory raises :class:`~miles_core.errors.ConfigError` before
    anything starts."""
    command = serve_command(python, model_path, port, sglang_args, host)
    env = dict(environment)
    if api_key is not None:
        from miles_core.engine.auth import API_KEY_ENV
        from miles_core.engine.weight_roots import ROOTS_FLAG, resolve_roots

        roots = resolve_roots(allowed_weight_roots)
        private = free_port("127.0.0.1")
        command = [
            sys.executable,
            "-m",
            "miles_core.engine.auth_proxy",
            "--host",
            host,
            "--port",
            str(port),
            "--upstream-port",
            str(private),
            ROOTS_FLAG,
            *map(str, roots),
            "--",
            *serve_command(python, model_path, private, sglang_args, "127.0.0.1"),
        ]
        env[API_KEY_ENV] = api_key
    with log_path.open("wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def kill_servers(processes: Sequence[subprocess.Popen]) -> None:
    """SIGKILL each server's process group (its workers too) and reap it. A process
    already reaped is left alone: its group id may have been reused."""
    for process in processes:
        if process.returncode is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def wait_server(index: int, process: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    """Wait until one server answers ``/health`` with 200; :class:`SglangEngineError` naming
    its log when it exits or times out (it is then killed)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    try:
        while True:
            code = process.poll()
            if code is not None:
                raise SglangEngineError(f"sglang-diffusion server {index} exited with status {code} before it was healthy; see {log_path}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() >= deadline:
                raise SglangEngineError(f"sglang-diffusion server {index} ({url}) not healthy after {timeout:g} s; see {log_path}")
            time.sleep(0.25)
    except BaseException:
        kill_servers([process])
        raise


def engine_device_args(sglang_args: Sequence[str], devices: int) -> list[str]:
    """The pass-through arguments of an engine given ``devices`` devices
    (``--rollout-num-gpus-per-engine``): ``--sglang-num-gpus N`` is added, and sglang-diffusion
    splits its N GPUs itself (sequence parallelism over what tensor, data and CFG
    parallelism leave, Ulysses by default). A ``--sglang-num-gpus`` the user passed wins, and
    so do ``--sglang-tp-size``, ``--sglang-sp-degree``, ``--sglang-ulysses-degree`` and the
    like, which sglang-diffusion checks against the number of GPUs."""
    args = list(sglang_args)
    if devices > 1 and not any(token.split("=", 1)[0] == PREFIX + "num-gpus" for token in args):
        args += [PREFIX + "num-gpus", str(devices)]
    return args


FLOW_MATCH_TRAIN_TIMESTEPS = 1000.0
"""diffusers' flow-matching schedulers: ``timestep = sigma x num_train_timesteps``."""


def timestep_grid(returned: torch.Tensor, sigmas: torch.Tensor, steps: Sequence[int], total: int) -> torch.Tensor:
    """Our ``dit_trajectory.timesteps`` (the ``[T]`` loop grid, the trainer reads step
    ``k``'s at index ``k``) from sglang-diffusion's: it records one timestep per *returned*
    latent (row ``j`` is step ``steps[j]``'s; the final latent's, step T, is dropped).
    Steps it did not return get ``sigma_k x scale``, the scale read off the returned rows
    (1000 for SD3's scheduler; diffusers' flow-matching default when no row tells)."""
    returned = returned.reshape(-1)
    if returned.shape[0] != len(steps):
        raise SglangEngineError(
            f"sglang-diffusion returned {returned.shape[0]} trajectory timesteps for {len(steps)} latents (steps {list(steps)})"
        )
    sigmas = sigmas.reshape(-1).to(torch.float64)
    known = {step: returned[row] for row, step in enumerate(steps) if step < total}
    ratios = [float(value) / float(sigmas[step]) for step, value in known.items() if float(sigmas[step]) > 0]
    scale = ratios[0] if ratios else FLOW_MATCH_TRAIN_TIMESTEPS
    if any(abs(ratio - scale) > 1e-4 * abs(scale) for ratio in ratios):
        raise SglangEngineError(
            f"sglang-diffusion's trajectory timesteps are not a fixed multiple of its sigmas "
            f"(timestep / sigma = {', '.join(f'{r:g}' for r in ratios)})"
        )
    grid = (sigmas[:total] * scale).to(returned.dtype)
    for step, value in known.items():
        grid[step] = value  # the server's own value, bit for bit
    return grid


def _normalize_env(env: dict[str, Any] | None, request: RolloutRequest) -> None:
    """sglang-diffusion's ``denoising_env`` as ours: it sends ``image_kwargs`` and
    ``guidance`` as null (filled from the request, its family parameters such as Wan
    2.2's ``guidance_scale_2`` included, as our engine records them) and the conditioning
    with a leading batch dimension of 1 (dropped: ours is per output)."""
    if not env:
        return
    if env.get("image_kwargs") is None:
        image = {"height": request.height, "width": request.width}
        if request.num_frames is not None:
            image.update(num_frames=request.num_frames, fps=request.fps)
        env["image_kwargs"] = image
    if env.get("guidance") is None:
        guidance: dict[str, Any] = {"guidance_scale": request.guidance_scale}
        if request.true_cfg_scale is not None:
            guidance["true_cfg_scale"] = request.true_cfg_scale
        guidance.update((k, v) for k, v in request.extra_sampling_params.items() if k != FLOW_SHIFT)  # (a field of its own)
        env["guidance"] = guidance
    for key in ("pos_cond_kwargs", "neg_cond_kwargs"):
        cond = env.get(key)
        if isinstance(cond, dict):
            for name, tensor in list(cond.items()):
                if isinstance(tensor, torch.Tensor) and tensor.dim() > 1 and tensor.shape[0] == 1:
                    cond[name] = tensor[0]


__all__ = [
    "FRAMEWORK_ARGS",
    "SglangEngine",
    "SglangEngineError",
    "check_python",
    "engine_device_args",
    "kill_servers",
    "serve_command",
    "server_args",
    "spawn_server",
    "wait_server",
]
