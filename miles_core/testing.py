"""Checks that every plugin's test suite needs, in one place.

Plugin authors call these from their own tests (the packages under ``plugins/`` do):
the plugin loads strictly through its real entry-point metadata, its registration
imports stay light, its LoRA targets exist, and its tiny pipeline builds
deterministically; :func:`tiny_pipeline_fixtures` gives every suite the same built and
loaded tiny pipeline. Torch, PEFT, safetensors and pytest are imported inside the
functions that need them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_core.hookspecs import ENTRY_POINT_GROUP
from miles_core.plugin_manager import PluginHost

if TYPE_CHECKING:
    import torch

HEAVY_MODULES = ("torch", "diffusers", "transformers")


def load_plugin(name: str, distribution: str) -> PluginHost:
    """Load only the entry point ``name`` of ``miles.plugins``, strictly, and check
    that ``distribution`` declares it and that it loaded without error."""
    found = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    assert len(found) == 1, f"entry point {name!r} of {ENTRY_POINT_GROUP}: found {len(found)}"
    (ep,) = found
    assert ep.dist is not None and ep.dist.metadata["Name"] == distribution, (
        f"entry point {name!r} belongs to {ep.dist and ep.dist.metadata['Name']!r}, expected {distribution!r}"
    )
    host = PluginHost(strict=True, disabled=(), entry_points=found)
    record = host.record(name)
    assert record.status == "ok", record.error
    return host


def _heavy_modules_after(code: str, heavy: Sequence[str]) -> list[str]:
    """Which of ``heavy`` a fresh interpreter has loaded after running ``code``."""
    code += f"import json as _json, sys as _sys\nprint(_json.dumps(sorted(m for m in {list(heavy)!r} if m in _sys.modules)))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode != 0:
        raise AssertionError(f"running\n{code}failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def heavy_modules_after_import(modules: Iterable[str], heavy: Sequence[str] = HEAVY_MODULES) -> list[str]:
    """Which of ``heavy`` a fresh interpreter has loaded after importing ``modules``."""
    code = f"import importlib\nfor name in {list(modules)!r}:\n    importlib.import_module(name)\n"
    return _heavy_modules_after(code, heavy)


def assert_import_is_light(*modules: str, heavy: Sequence[str] = HEAVY_MODULES) -> None:
    """Importing ``modules`` in a fresh interpreter loads none of ``heavy``."""
    loaded = heavy_modules_after_import(modules, heavy)
    assert loaded == [], f"importing {', '.join(modules)} loads {', '.join(loaded)}"


def assert_plugin_is_light(
    name: str,
    distribution: str,
    *,
    checkpoint: str = "no/such-checkpoint",
    heavy: Sequence[str] = HEAVY_MODULES,
) -> None:
    """What the core does before any model is needed loads none of ``heavy``: in a fresh
    interpreter, load the plugin ``name`` as :func:`load_plugin` does (which imports its
    entry-point module and calls its registration hooks), resolve the class of every model
    family it registers and call its ``native_size(checkpoint)`` (as config resolution
    does)."""
    code = (
        "from miles_core.testing import load_plugin\n"
        f"host = load_plugin({name!r}, {distribution!r})\n"
        f"for family_name in host.record({name!r}).registers.get('model_family', []):\n"
        f"    host.registries.model_family.get(family_name).load().native_size({checkpoint!r})\n"
    )
    loaded = _heavy_modules_after(code, heavy)
    assert loaded == [], f"loading plugin {name!r} and resolving its families loads {', '.join(loaded)}"


def assert_lora_targets(model: torch.nn.Module, targets: Sequence[str]) -> list[str]:
    """Every target suffix names at least one module of ``model`` (PEFT's rule: the whole
    module name or a dot-separated suffix of it), every module it names is an
    ``nn.Linear`` (PEFT would also wrap a convolution or an embedding), and PEFT wraps
    each. Returns the names of the wrapped modules; ``model`` itself is left untouched."""
    import copy

    import torch
    from peft import LoraConfig, inject_adapter_in_model

    modules = dict(model.named_modules())
    linears = {name for name, module in modules.items() if isinstance(module, torch.nn.Linear)}
    for target in targets:
        matched = [name for name in modules if name == target or name.endswith("." + target)]
        assert any(name in linears for name in matched), f"LoRA target {target!r} matches no nn.Linear of {type(model).__name__}"
        others = [f"{name} ({type(modules[name]).__name__})" for name in matched if name not in linears]
        assert not others, f"LoRA target {target!r} also matches modules that are not nn.Linear: {others}"
    wrapped_model = inject_adapter_in_model(LoraConfig(r=2, target_modules=list(targets)), copy.deepcopy(model))
    wrapped = [name for name, module in wrapped_model.named_modules() if hasattr(module, "lora_A")]
    for target in targets:
        assert any(name == target or name.endswith("." + target) for name in wrapped), target
    return wrapped


def saved_tensors(directory: str | Path) -> dict[str, Any]:
    """Every tensor of every ``*.safetensors`` file under ``directory``, keyed by
    ``relative/path.safetensors:tensor_name``."""
    from safetensors.torch import load_file

    root = Path(directory)
    tensors: dict[str, Any] = {}
    for path in sorted(root.rglob("*.safetensors")):
        for key, value in load_file(path).items():
            tensors[f"{path.relative_to(root)}:{key}"] = value
    return tensors


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_build_is_deterministic(family: Any, workdir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``family.build_tiny_pipeline`` writes the same files, byte for byte (weights,
    configs, tokenizers), for the same seed, and for another seed the same files with
    different tensors in every ``*.safetensors`` file (the control that makes the first
    check mean something: no component may ignore the seed). Returns the
    :func:`saved_tensors` of the seed-0 and seed-1 builds."""
    import torch

    workdir = Path(workdir)
    first_dir = family.build_tiny_pipeline(workdir / "seed0-a", seed=0)
    again_dir = family.build_tiny_pipeline(workdir / "seed0-b", seed=0)
    other_dir = family.build_tiny_pipeline(workdir / "seed1", seed=1)
    first_files, again_files = _files(Path(first_dir)), _files(Path(again_dir))
    assert first_files.keys() == again_files.keys(), "same seed, different files"
    changed = [path for path in first_files if first_files[path] != again_files[path]]
    assert not changed, f"same seed, different contents: {', '.join(changed)}"
    first, other = saved_tensors(first_dir), saved_tensors(other_dir)
    assert first and first.keys() == other.keys()
    for weights in sorted({key.split(":", 1)[0] for key in first}):
        keys = [key for key in first if key.split(":", 1)[0] == weights]
        assert not all(torch.equal(first[k], other[k]) for k in keys), f"seed 1 built the same weights as seed 0 in {weights}"
    return first, other


def install_into(package_dir: str | Path, target: str | Path) -> Path:
    """``pip install`` a plugin package (no dependencies, no index) into ``target``, a
    folder to put on ``PYTHONPATH``: how a test installs an example plugin for real,
    entry points included, without touching the environment."""
    import subprocess
    import sys

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(package_dir),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(target)


def directory_size(directory: str | Path) -> int:
    """Total bytes of the files under ``directory``."""
    return sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())


def load_tiny_pipeline(family: Any, directory: str | Path) -> Any:
    """``family.load_pipeline(directory)``, checked to be exactly the class the family
    resolves for ``directory`` (its ``pipeline_class``), with its progress bar off."""
    from miles_core.family import pipeline_class_for

    pipe = family.load_pipeline(directory)
    expected = pipeline_class_for(family, directory)
    assert type(pipe) is expected, f"{family.__name__}.load_pipeline gave a {type(pipe).__name__}, expected {expected.__name__}"
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_pipeline_fixtures(family: Any, *, seed: int = 0, variant: str | None = None) -> tuple[Any, Any]:
    """Module-scoped pytest fixtures ``(tiny_dir, pipe)``: ``family``'s tiny pipeline built
    once with ``seed`` (and ``variant``, for a family with ``tiny_variants``) into a
    temporary directory, and that directory loaded with :func:`load_tiny_pipeline`. Assign
    them to those names in a test module::

        tiny_dir, pipe = testing.tiny_pipeline_fixtures(SD3Family)
    """
    import pytest

    options: dict[str, Any] = {"seed": seed} if variant is None else {"seed": seed, "variant": variant}

    @pytest.fixture(scope="module")
    def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return Path(family.build_tiny_pipeline(tmp_path_factory.mktemp(family.__name__) / "tiny", **options))

    @pytest.fixture(scope="module")
    def pipe(tiny_dir: Path) -> Any:
        return load_tiny_pipeline(family, tiny_dir)

    return tiny_dir, pipe


@contextmanager
def serve_engine_process(checkpoint: str | Path, *args: str, log_path: str | Path, timeout: float = 90.0) -> Iterator[Any]:
    """Start ``miles-core serve-engine --hf-checkpoint CHECKPOINT --port 0 ARGS`` with one
    torch thread (:func:`miles_core.engine.fleet.start_engine`), wait (at most ``timeout``
    seconds) until it listens, yield its :class:`~miles_core.engine.fleet.ServedEngine`,
    and always stop it. Its stderr goes to ``log_path``, quoted when it dies early."""
    from miles_core.engine.fleet import start_engine
    from miles_core.errors import FleetError

    try:
        served = start_engine(checkpoint, *args, log_path=log_path, timeout=timeout)
    except FleetError as exc:
        raise AssertionError(f"serve-engine did not start listening: {exc}\n{Path(log_path).read_text()}") from None
    try:
        yield served
    finally:
        served.stop()


@contextmanager
def serve_engine_in_thread(engine: Any, timeout: float = 30.0) -> Iterator[str]:
    """Serve ``engine`` (an :class:`~miles_core.engine.embedded.EmbeddedEngine`) with
    serve-engine's application from an event loop of its own in a background thread;
    yield its base URL once ``GET /health`` answers 200, and always stop it. A run then
    reaches the engine over HTTP (weight sync included) while the test holds the
    engine's own objects."""
    import asyncio
    import threading

    from miles_core.engine.http import HttpEngine
    from miles_core.engine.server import create_app, start_server

    async def healthy(url: str) -> None:
        async with HttpEngine(url) as client:
            await client.wait_until_healthy(timeout=timeout, interval=0.05)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="engine-server", daemon=True)
    thread.start()
    try:
        server = asyncio.run_coroutine_threadsafe(start_server(create_app(engine)), loop).result(timeout)
        try:
            asyncio.run(healthy(server.url))
            yield server.url
        finally:
            asyncio.run_coroutine_threadsafe(server.close(), loop).result(timeout)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if not thread.is_alive():  # a loop still running cannot be closed; the daemon thread ends with the process
            loop.close()


def scoring_samples(outputs: Sequence[Any], prompts: Sequence[str] | None = None) -> list[Any]:
    """Rollout samples holding ``outputs`` (images ``[C, H, W]`` or videos ``[C, F, H, W]``),
    one prompt group each, as a reward scorer (``RewardScorer.score``) receives them;
    ``prompts`` default to ``prompt 0``, ``prompt 1``, ..."""
    from miles_core.request import RolloutOutput
    from miles_core.rollout.sample import Sample

    prompts = list(prompts) if prompts is not None else [f"prompt {i}" for i in range(len(outputs))]
    return [
        Sample(
            prompt=prompt,
            metadata={},
            rollout_id=0,
            group_index=i,
            index_in_group=0,
            seed=i,
            sde_step_indices=(),
            output=RolloutOutput(request_id=f"r{i}", prompt=prompt, seed=i, generated_output=output),
        )
        for i, (output, prompt) in enumerate(zip(outputs, prompts, strict=True))
    ]


@contextmanager
def serve_reward_in_thread(config: Any, *, api_key: str | None = None, timeout: float = 60.0, **options: Any) -> Iterator[str]:
    """Serve ``config``'s reward with serve-reward's application from an event loop of its
    own in a background thread; yield its base URL once ``GET /health`` answers 200 (an
    AssertionError with the server's reason when the reward fails to build), and always
    stop it. ``--rm-type remote`` then scores through it over loopback HTTP. ``options``:
    :func:`~miles_core.reward_service.server.create_reward_app`'s limits (``max_samples``,
    ``max_body_bytes``) and ``worker`` (a run's reward worker)."""
    import asyncio
    import threading
    import time
    import urllib.error
    import urllib.request

    from miles_core.reward_service.run_worker import create_worker_app
    from miles_core.reward_service.server import create_reward_app, start_reward_server

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="reward-server", daemon=True)
    thread.start()
    try:
        create = create_worker_app if options.pop("worker", False) else create_reward_app
        app = create(config, api_key=api_key, **options)
        server = asyncio.run_coroutine_threadsafe(start_reward_server(app), loop).result(timeout)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    with urllib.request.urlopen(server.url + "/health", timeout=timeout) as answer:
                        if answer.status == 200:
                            break
                except urllib.error.HTTPError as exc:
                    body = json.loads(exc.read() or b"{}")
                    if body.get("status") == "failed" or time.monotonic() > deadline:
                        raise AssertionError(f"the reward server did not become healthy: {body}") from None
                time.sleep(0.02)
            yield server.url
        finally:
            asyncio.run_coroutine_threadsafe(server.close(), loop).result(timeout)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if not thread.is_alive():
            loop.close()


@contextmanager
def serve_reward_process(
    *args: str, log_path: str | Path, env: dict[str, str] | None = None, timeout: float = 90.0
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start ``miles-core serve-reward ARGS`` (a free loopback port, one torch thread) in a
    process of its own; wait (at most ``timeout`` seconds) until it says it serves, yield
    ``(base URL, process)`` and always stop it (SIGKILL when SIGTERM does not). Its stderr
    goes to ``log_path``, quoted when it dies early."""
    import os
    import time

    log = Path(log_path)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "miles_core.cli.main", "serve-reward", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=environment,
        )
    try:
        deadline = time.monotonic() + timeout
        url = None
        while url is None:
            for line in log.read_text().splitlines():
                if line.startswith("serving reward ") and " on http" in line:
                    url = line.rsplit(" on ", 1)[1].strip()
            if url is None:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"serve-reward did not start serving:\n{log.read_text()}")
                time.sleep(0.05)
        yield url, process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def assert_matched_by_content(tiny_dir: str | Path, family_name: str, workdir: str | Path) -> Path:
    """A copy of ``tiny_dir`` named ``workdir/my-finetune`` is matched to ``family_name``
    among every installed family by what it is (``model_index.json`` and the component
    configs), while no family's name patterns match its path: the control that shows the
    content, not the name, decided. Returns the copy."""
    import shutil

    from miles_core.family_match import match_family, names_matching
    from miles_core.plugin_manager import get_host

    registry = get_host().registries.model_family
    copy = Path(workdir) / "my-finetune"
    shutil.copytree(tiny_dir, copy)
    by_name = [reg.name for reg in names_matching(str(copy), registry)]
    assert by_name == [], f"{copy}: its path matches the name patterns of {by_name}; use a neutral workdir"
    matched = match_family(copy, registry).name
    assert matched == family_name, f"{copy}: matched to {matched}, expected {family_name}"
    return copy


CHROMIUM_MISSING = (
    "Debian's chromium is not on PATH: the browser tests drive it through Playwright; install it "
    "(as root: apt-get install -y chromium, which scripts/test.sh does) and Playwright's Python package "
    "(.venv/bin/python -m pip install -c constraints.txt playwright)"
)


def artifact_dir() -> Path:
    """Where tests keep what a person may want to look at afterwards (screenshots):
    ``$MILES_TEST_ARTIFACTS`` when set, else ``test-artifacts/`` in the repository."""
    import os

    configured = os.environ.get("MILES_TEST_ARTIFACTS")
    directory = Path(configured) if configured else Path(__file__).resolve().parents[1] / "test-artifacts"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


# The page's own checks, run in the browser: every chart drawn, every image decoded, every
# video playable (canPlayType of its source's type) and playing (currentTime advances).
_PAGE_CHECKS = """async () => {
  const charts = [...document.querySelectorAll('svg.chart')].map((svg, i) => {
    const box = svg.getBoundingClientRect();
    return {i, width: box.width, height: box.height, lines: svg.querySelectorAll('path, polyline').length};
  });
  const images = [...document.images].map(img => ({src: img.currentSrc.slice(0, 80), width: img.naturalWidth, complete: img.complete}));
  const videos = [];
  for (const video of document.querySelectorAll('video')) {
    const source = video.querySelector('source');
    const type = source ? source.type : '';
    const entry = {type, canPlay: type ? video.canPlayType(type) : '', start: video.currentTime, end: null, error: null};
    try {
      video.muted = true;
      await video.play();
      const until = performance.now() + 5000;
      while (video.currentTime <= entry.start && performance.now() < until) await new Promise(r => setTimeout(r, 50));
      entry.end = video.currentTime;
      video.pause();
    } catch (e) { entry.error = String(e); }
    videos.push(entry);
  }
  return {charts, images, videos};
}"""


def check_report_in_browser(
    report: str | Path, screenshot: str | Path, *, min_charts: int = 1, min_images: int = 0, min_videos: int = 0
) -> dict[str, Any]:
    """Open ``report`` (an HTML file) in Debian's Chromium through Playwright (no browser
    download) and assert that it loads with no console error, no page error and no request
    beyond the file itself and data: URIs (besides files next to it); that at least
    ``min_charts`` SVG charts are drawn (each with a non-empty box and a line), every image
    decodes (natural width > 0; at least ``min_images``), and every video (at least
    ``min_videos``) can play its source's type and advances when played. Saves a full-page
    screenshot to ``screenshot``; returns what the page reported."""
    import shutil

    import pytest

    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail(CHROMIUM_MISSING, pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(CHROMIUM_MISSING, pytrace=False)
    report = Path(report).resolve()
    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, args=["--no-sandbox", "--autoplay-policy=no-user-gesture-required"]
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on(
                "console", lambda message: problems.append(f"console {message.type}: {message.text}") if message.type == "error" else None
            )
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))

            def request(req: Any) -> None:
                if not req.url.startswith(("file://", "data:")):
                    problems.append(f"request beyond the file: {req.url}")

            page.on("request", request)
            page.goto(report.as_uri(), wait_until="load")
            found = page.evaluate(_PAGE_CHECKS)
            Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    charts, images, videos = found["charts"], found["images"], found["videos"]
    problems += [f"chart {c['i']} not drawn: {c}" for c in charts if not (c["width"] > 0 and c["height"] > 0 and c["lines"] > 0)]
    problems += [f"image not loaded: {i}" for i in images if not (i["complete"] and i["width"] > 0)]
    problems += [f"video cannot play: {v}" for v in videos if not v["canPlay"] or v["error"] or not (v["end"] or 0) > v["start"]]
    for what, count, least in (
        ("charts", len(charts), min_charts),
        ("images", len(images), min_images),
        ("videos", len(videos), min_videos),
    ):
        if count < least:
            problems.append(f"{count} {what}, expected at least {least}")
    assert not problems, f"{report}:\n" + "\n".join(problems)
    return found


def check_run_report(run_dir: str | Path, screenshot_name: str, **least: int) -> dict[str, Any]:
    """Write ``run_dir``'s report (``RUN_DIR/report.html``, as ``miles-core report`` does) and
    check it in the browser (:func:`check_report_in_browser`, ``least``: its ``min_*``
    counts), keeping the screenshot as ``screenshot_name`` under :func:`artifact_dir`."""
    from miles_core.report import write_report

    out = write_report([Path(run_dir)], Path(run_dir) / "report.html")
    return check_report_in_browser(out, artifact_dir() / screenshot_name, **least)
