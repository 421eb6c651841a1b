"""The ``train`` / ``config`` command line, built from flag records.

Every option is added with ``default=SUPPRESS`` so the parsed namespace holds exactly
what the user typed; defaults are filled in afterwards, which is how the configuration
knows, for every value, whether the user set it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from miles_core.config.flag import GROUPS, Flag
from miles_core.config.model import FlagEntry
from miles_core.config.reference_flags import FLAGS
from miles_core.errors import ConfigError
from miles_core.registry import PluginInfo, Registries

SGLANG_PREFIX = "--sglang-"


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``prog: error: ...``), exit 2.

    Command modules pass their docstring as the description; its reStructuredText
    literals are shown as plain text in ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("description"):
            kwargs["description"] = kwargs["description"].replace("``", "")
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def core_plugin_info() -> PluginInfo:
    from miles_core import __version__

    return PluginInfo("core", "miles-core", __version__)


def flag_entries(plugin_flags: Sequence[Any] = ()) -> dict[str, FlagEntry]:
    """The core's flags then each plugin's (``OwnedFlag`` records), keyed by dest."""
    core = core_plugin_info()
    entries: dict[str, FlagEntry] = {flag.dest: FlagEntry(flag, core) for flag in FLAGS}
    for owned in plugin_flags:
        existing = entries.get(owned.flag.dest)
        if existing is not None:
            raise ConfigError(
                f"{owned.flag.name} is defined by both {existing.owner} and {owned.owner}; disable one of them (MILES_DISABLED_PLUGINS)"
            )
        entries[owned.flag.dest] = FlagEntry(owned.flag, owned.owner)
    by_name = {entry.flag.name: entry.flag for entry in entries.values()}
    for entry in entries.values():
        alias, target = entry.flag, by_name.get(entry.flag.alias_of or "")
        if alias.alias_of is None:
            continue
        if target is None or target.alias_of is not None or target.type != alias.type or target.nargs != alias.nargs:
            if target is None or target.alias_of is not None:
                why = "no such flag" if target is None else "itself an alias"
            else:
                why = f"it takes {target.type}{' ' + target.nargs if target.nargs else ''}, not {alias.type}{' ' + alias.nargs if alias.nargs else ''}"
            raise ConfigError(f"{alias.name} ({entry.owner}) is declared an alias of {alias.alias_of}: {why}")
    return entries


def default_text(flag: Flag) -> str:
    """How a default reads in ``--help`` and the docs."""
    if flag.auto:
        return "auto"
    if flag.type == "bool":
        return "off"
    if flag.type == "tristate":
        return "unset" if flag.default is None else ("on" if flag.default else "off")
    if flag.default is None:
        return "unset"
    if isinstance(flag.default, (list, tuple)):
        return ",".join(str(v) for v in flag.default)
    if isinstance(flag.default, dict):
        return "{}" if not flag.default else str(flag.default)
    return str(flag.default)


def group_title(entry: FlagEntry) -> str:
    title = GROUPS.get(entry.group, entry.group.replace("_", " ").capitalize())
    if entry.owner.name != "core":
        title += f" (plugin {entry.owner.distribution})"
    return title


def _converter(flag: Flag) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return flag._convert_one(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def build_parser(entries: dict[str, FlagEntry], registries: Registries, prog: str) -> OneLineParser:
    parser = OneLineParser(
        prog=prog,
        description="Flags of a training run (the miles-diffusion CLI reference, plus plugin flags). "
        f"Unknown {SGLANG_PREFIX}* flags are passed verbatim to sglang-diffusion servers.",
        argument_default=argparse.SUPPRESS,
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for entry in entries.values():
        flag = entry.flag
        title = group_title(entry)
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        kwargs: dict[str, Any] = {"dest": flag.dest, "help": f"{flag.help} (default: {default_text(flag)})"}
        if flag.type == "bool":
            kwargs["action"] = "store_true"
        elif flag.type == "tristate":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _converter(flag)
            if flag.nargs:
                kwargs["nargs"] = flag.nargs
            if flag.choices:
                kwargs["choices"] = flag.choices
            if flag.registry:
                kwargs["metavar"] = "{" + ",".join(registries[flag.registry].names()) + "}"
            elif flag.metavar:
                kwargs["metavar"] = flag.metavar
        group.add_argument(flag.name, *flag.aliases, **kwargs)
    return parser


def split_sglang_args(unknown: list[str]) -> tuple[list[str], list[str]]:
    """Split ``parse_known_args`` leftovers into ``--sglang-*`` pass-through arguments
    (each with the values that follow it) and anything else."""
    passthrough: list[str] = []
    rest: list[str] = []
    taking_values = False
    for token in unknown:
        if token.startswith("--"):
            taking_values = token.startswith(SGLANG_PREFIX) and "=" not in token
            (passthrough if token.startswith(SGLANG_PREFIX) else rest).append(token)
        elif taking_values:
            passthrough.append(token)
        else:
            rest.append(token)
    return passthrough, rest


def parse_command_line(
    argv: Sequence[str],
    entries: dict[str, FlagEntry],
    registries: Registries,
    prog: str,
    extend: Callable[[OneLineParser], Sequence[str]] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Return ``(values the user typed, keyed by dest; --sglang-* pass-through args)``.

    ``extend`` adds a command's own arguments to the training flags (``miles-core score``)
    and returns their dests; their values come back under the key ``"__command__"``.
    Exits with status 2 and a one-line message on a malformed command line.
    """
    parser = build_parser(entries, registries, prog)
    own = list(extend(parser)) if extend else []
    namespace, unknown = parser.parse_known_args(list(argv))
    passthrough, rest = split_sglang_args(unknown)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    typed = vars(namespace)
    if extend:
        typed["__command__"] = {dest: typed.pop(dest, None) for dest in own}
    return typed, passthrough
