"""``miles-core``: the entry point, dispatching to one module per command.

Each command module is imported only when its command runs, so ``list-plugins`` stays
free of torch, diffusers and transformers. Errors are handled here, once for every
command: a :class:`~miles_core.errors.MilesError` is printed as ``PROG: error: MESSAGE``
(one line per message) and the exit status is the error's ``exit_code`` (2: bad input or
configuration, 1: a failure while running, 3: a run the reward-hacking guard stopped). The traceback is printed too with
``--debug`` (before the command) or ``MILES_DEBUG=1``.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from miles_core.errors import MilesError

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("miles_core.cli.train", "Run training: rollout, reward, optimizer steps, metrics"),
    "list-plugins": ("miles_core.cli.list_plugins", "List installed plugins and what they register"),
    "config": ("miles_core.cli.config_command", "Resolve and validate training flags; print the configuration as YAML"),
    "plan": ("miles_core.cli.plan", "Plan a training run's memory per rank and engine from configuration files alone"),
    "make-tiny": ("miles_core.cli.make_tiny", "Write a tiny, randomly initialised pipeline of a model family"),
    "score": ("miles_core.cli.score", "Score image files with a reward (--rm-type ...), as a training run would"),
    "generate": ("miles_core.cli.generate", "Sample a checkpoint (optionally with a LoRA) to image or video files"),
    "serve-engine": ("miles_core.cli.serve_engine", "Serve a model over HTTP as a rollout engine (POST /rollout/generate)"),
    "serve-reward": ("miles_core.cli.serve_reward", "Serve a reward over HTTP (POST /score), for --rm-type remote"),
    "router": ("miles_core.cli.router", "Route POST /rollout/generate over engine servers (the miles router)"),
    "report": ("miles_core.cli.report", "Write a run's HTML report (curves, samples, configuration, alarms); several runs overlaid"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [
        "usage: miles-core [--version] [--debug] COMMAND [ARGS...]",
        "",
        "RL post-training (Flow-GRPO, DiffusionNFT, SFT) for flow-matching diffusion models.",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += [
        "",
        "Run 'miles-core COMMAND --help' for a command's options. --debug (or MILES_DEBUG=1)",
        "prints the traceback behind an error.",
    ]
    return "\n".join(lines)


def debug_from_env() -> bool:
    return os.environ.get("MILES_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = debug_from_env()
    while args and args[0] == "--debug":
        debug = True
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    if args[0] == "--version":
        from miles_core import __version__

        print(f"miles-core {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"miles-core: error: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    prog = f"miles-core {command}"
    try:
        module = importlib.import_module(COMMANDS[command][0])
        return int(module.run(rest, prog=prog) or 0)
    except MilesError as exc:
        if debug:
            traceback.print_exc()
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"{prog}: error: {line}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
