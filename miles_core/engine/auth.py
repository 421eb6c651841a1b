"""The secret that engine servers and the router require of every request
but ``GET /health`` (``Authorization: Bearer <key>``, as sglang and OpenAI-style servers
take it), and the client side that sends it. docs/engine.md, "Authentication", has the
threat model.

A run that starts servers makes a fresh secret (:func:`new_secret`) and hands it to them
in their environment (:data:`API_KEY_ENV`), never on a command line (``ps`` shows those)
and never in a log, a metrics record, ``config.yaml`` or a checkpoint. For servers started
by hand both sides take the key from ``--api-key``, ``--api-key-file`` (a file readable
only by its owner; a looser one is used with a warning) or :data:`API_KEY_ENV`, in that
order (:func:`resolve_api_key`).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import stat
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from aiohttp import web

from miles_core.errors import ApiKeyError

API_KEY_ENV = "MILES_API_KEY"
"""The environment variable a server (and a run, for servers it did not start) reads its
key from."""

OPEN_PATHS = frozenset({("GET", "/health"), ("HEAD", "/health")})
"""Requests a server answers without the key: liveness only, nothing that generates,
changes or reveals weights."""


def new_secret() -> str:
    """A fresh random key for one run (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def auth_headers(key: str | None) -> dict[str, str]:
    """The header a client sends (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def read_key_file(path: str | Path, *, flag: str = "--api-key-file", warn: Callable[[str], None] | None = None) -> str:
    """The key in ``path`` (surrounding whitespace stripped). A file that group or others
    can read is used, with a one-line warning through ``warn``; a missing, unreadable or
    empty one raises :class:`ApiKeyError` naming it."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        key = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ApiKeyError(f"{flag} {path}: cannot read the key ({type(exc).__name__}: {exc})") from None
    if not key:
        raise ApiKeyError(f"{flag} {path}: the file is empty; it must hold the key")
    if any(ch.isspace() for ch in key):
        raise ApiKeyError(f"{flag} {path}: the key holds whitespace; it must be one token")
    if mode & (stat.S_IRWXG | stat.S_IRWXO) and warn is not None:
        warn(f"warning: {flag} {path} is readable by group or others (mode {stat.S_IMODE(mode):04o}); chmod 600 it")
    return key


def resolve_api_key(
    value: str | None,
    key_file: str | Path | None,
    *,
    environ: Mapping[str, str] | None = None,
    warn: Callable[[str], None] | None = None,
) -> str | None:
    """The key from ``--api-key`` (``value``), else ``--api-key-file``, else
    :data:`API_KEY_ENV`; None when none is set. An empty or whitespace-holding key raises
    :class:`ApiKeyError` naming where it came from."""
    if value is not None:
        return _checked(value, "--api-key")
    if key_file is not None:
        return read_key_file(key_file, warn=warn)
    env = os.environ if environ is None else environ
    if API_KEY_ENV in env:
        return _checked(env[API_KEY_ENV], API_KEY_ENV)
    return None


def _checked(key: str, source: str) -> str:
    if not key.strip():
        raise ApiKeyError(f"{source}: the key is empty")
    if any(ch.isspace() for ch in key):
        raise ApiKeyError(f"{source}: the key holds whitespace; it must be one token")
    return key


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def open_server_warning(command: str, host: str, key: str | None) -> str | None:
    """The one-line warning for a server listening beyond loopback without a key, or None."""
    if key is not None or is_loopback(host):
        return None
    return (
        f"warning: {command} listens on {host} without an API key: anyone who can reach it can generate "
        f"and replace its weights; set {API_KEY_ENV} or --api-key-file"
    )


def refusal(request_header: str | None, key: str) -> str | None:
    """Why a request with this ``Authorization`` header is refused, or None when it
    carries ``key``."""
    if request_header is None:
        return "missing Authorization header: this server requires 'Authorization: Bearer <key>'"
    scheme, _, token = request_header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        return "malformed Authorization header: expected 'Bearer <key>'"
    try:
        given = token.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes in the header: no key of ours
        return "malformed Authorization header: expected 'Bearer <key>'"
    if not hmac.compare_digest(given, key.encode("utf-8")):
        return "wrong API key"
    return None


def bearer_middleware(key: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    """An aiohttp middleware that answers 401 (``{"error": ...}``) to every request but
    :data:`OPEN_PATHS` that does not carry ``key``, before its handler runs or its body is
    read, so a refused request changes nothing."""

    @web.middleware
    async def require_key(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if (request.method, request.path) not in OPEN_PATHS:
            why = refusal(request.headers.get("Authorization"), key)
            if why is not None:
                return web.json_response({"error": why}, status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return require_key


__all__ = [
    "API_KEY_ENV",
    "OPEN_PATHS",
    "auth_headers",
    "bearer_middleware",
    "is_loopback",
    "new_secret",
    "open_server_warning",
    "read_key_file",
    "refusal",
    "resolve_api_key",
]
