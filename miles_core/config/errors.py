"""Configuration errors: one line per violation, naming the flags and the rule."""

from __future__ import annotations

from typing import Iterable


class ConfigError(ValueError):
    """One or more configuration violations; the CLI prints one line each, exit 2."""

    def __init__(self, messages: str | Iterable[str]) -> None:
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))
