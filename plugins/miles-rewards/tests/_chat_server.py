"""A local OpenAI-compatible chat-completions server for the ``vlm_judge`` tests.

No vision-language model runs in this repository's tests, so the judge's other side is
this aiohttp server on ``127.0.0.1``: it checks each request against the chat-completions
request schema (the fields the judge may send, exactly typed; anything else is the API's
400 with its error envelope ``{"error": {"message", "type", "param", "code"}}``), decodes
the PNG data URLs it receives, and answers a well-formed ``chat.completion`` object whose
answer is a deterministic function of the decoded pixels, so a test can compute the
exact score it must get:

- ``b`` = the mean over the message's images of each decoded 8-bit RGB image's mean value,
  / 255 (a video's frames all have one size, so that is the mean over all its pixels);
- without ``logprobs``: the content is :func:`number_answer` ``(b)``, the score
  ``round(10 * b, 3)`` written in :attr:`ChatServer.answer_format`;
- with ``logprobs: true`` (the judge's yes/no mode): ``p = 0.05 + 0.9 * b`` shared over
  the tokens of :func:`yes_no_top_logprobs` (``Yes``, `` yes``, ``No``, ``NO`` and a
  constant ``Maybe``), the most likely one the content; the reward the judge must compute
  from the returned list is ``p``.

Planned answers replace the rule for the next requests, in order
(:meth:`ChatServer.plan`): ``429`` (with ``Retry-After``), ``500``, ``hang`` (no answer
until the client gives up or the server stops), or a given content and top-logprob list.
The server records every valid request (:attr:`ChatServer.received`), the Authorization
header of every request, and the most requests it served at once.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import itertools
import json
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web
from PIL import Image

# The request fields of the chat-completions API: those the judge sends are checked exactly;
# the API's others are real but not implemented here (a 400 saying so); any other name is
# the API's "Unrecognized request argument" 400.
CHECKED_FIELDS = frozenset({"model", "messages", "max_tokens", "temperature", "logprobs", "top_logprobs"})
OTHER_API_FIELDS = frozenset(
    {
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "max_completion_tokens",
        "metadata",
        "modalities",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "reasoning_effort",
        "response_format",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "tool_choice",
        "tools",
        "top_p",
        "user",
        "web_search_options",
    }
)
ROLES = ("system", "user", "assistant")
IMAGE_DETAILS = ("auto", "low", "high")
MAX_TOP_LOGPROBS = 20
IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")


class BadRequest(Exception):
    """A request the API refuses: status, message, type, param and code of its error envelope."""

    def __init__(
        self, message: str, *, param: str | None = None, status: int = 400, kind: str = "invalid_request_error", code: str | None = None
    ):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def response(self) -> web.Response:
        return error_response(self.status, str(self), kind=self.kind, param=self.param, code=self.code)


def error_response(
    status: int, message: str, *, kind: str, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status, headers=headers)


def number_answer(brightness: float, answer_format: str = "{score}") -> str:
    """The content the server answers in number mode for images of mean brightness ``b``."""
    return answer_format.format(score=f"{round(10.0 * brightness, 3):g}")


def yes_probability(brightness: float) -> float:
    """The server's P(yes) / (P(yes) + P(no)) for images of mean brightness ``b``."""
    return 0.05 + 0.9 * brightness


def yes_no_top_logprobs(brightness: float) -> list[tuple[str, float]]:
    """The server's top tokens and log-probabilities, most likely first: 0.9 of the mass
    split between yes and no in proportion ``p : 1 - p``, each spelled two ways in unequal
    shares (so only the sum over spellings gives ``p``); 0.1 on ``Maybe``."""
    p = yes_probability(brightness)
    mass = [("Yes", 0.7 * 0.9 * p), (" yes", 0.3 * 0.9 * p), ("No", 0.5 * 0.9 * (1 - p)), ("NO", 0.5 * 0.9 * (1 - p)), ("Maybe", 0.1)]
    return sorted(((token, math.log(share)) for token, share in mass), key=lambda item: -item[1])


@dataclass
class Planned:
    """One planned answer: ``kind`` is ``429``, ``500``, ``hang`` or ``answer``."""

    kind: str
    retry_after: str | None = "0"
    content: str | None = None
    top_logprobs: list[tuple[str, float]] | None = None
    omit_logprobs: bool = False


@dataclass
class Received:
    """A valid request: its body, its images (uint8 ``[H, W, 3]``) and its text."""

    body: dict[str, Any]
    images: list[np.ndarray]
    text: str
    response: dict[str, Any] | None = None


@dataclass
class ChatServer:
    """The server; ``with ChatServer(...) as server:`` runs it on a thread of its own and
    :attr:`url` is its OpenAI base URL (``http://127.0.0.1:PORT/v1``).

    Attributes:
        model: the one model it serves (another name is the API's 404 ``model_not_found``).
        api_key: when set, requests need ``Authorization: Bearer <api_key>`` (else 401).
        delay: seconds each answer takes (so concurrent requests overlap).
        answer_format: how the number-mode score is written (``{score}`` in it).
    """

    model: str = "judge-1"
    api_key: str | None = None
    delay: float = 0.0
    answer_format: str = "{score}"
    received: list[Received] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    attempts: int = 0
    max_concurrent: int = 0
    _planned: deque[Planned] = field(default_factory=deque)
    _active: int = 0
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- running ---------------------------------------------------------------------

    def __enter__(self) -> ChatServer:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chat-server", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: Any) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self) -> None:
        self._closing = asyncio.Event()
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_post("/v1/chat/completions", self._handle)
        # handler_cancellation: a handler whose client went away (a timed-out attempt) stops.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/v1"

    async def _stop(self) -> None:
        self._closing.set()
        await self._runner.cleanup()

    def plan(self, kind: str, count: int = 1, **options: Any) -> None:
        """Answer the next ``count`` requests with ``kind`` (``429``, ``500``, ``hang``,
        ``answer``) instead of the rule; ``options`` are :class:`Planned`'s."""
        with self._lock:
            self._planned.extend(Planned(kind, **options) for _ in range(count))

    # -- serving -----------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.attempts += 1
            self.authorizations.append(request.headers.get("Authorization"))
            self._active += 1
            self.max_concurrent = max(self.max_concurrent, self._active)
        try:
            if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return error_response(401, "Incorrect API key provided.", kind="invalid_request_error", code="invalid_api_key")
            with self._lock:
                planned = self._planned.popleft() if self._planned else None
            if planned is not None and planned.kind == "hang":
                await self._closing.wait()
                return error_response(503, "server stopping", kind="server_error")
            if planned is not None and planned.kind == "429":
                headers = {"Retry-After": planned.retry_after} if planned.retry_after is not None else None
                return error_response(429, "Rate limit reached for requests.", kind="requests", code="rate_limit_exceeded", headers=headers)
            if planned is not None and planned.kind == "500":
                return error_response(500, "The server had an error while processing your request.", kind="server_error")
            try:
                raw = await request.read()
                try:
                    body = json.loads(raw)
                except ValueError:
                    raise BadRequest("We could not parse the JSON body of your request.") from None
                received = self._validate(body)
            except BadRequest as exc:
                return exc.response()
            if self.delay:
                await asyncio.sleep(self.delay)
            received.response = self._completion(received, planned)
            with self._lock:
                self.received.append(received)
            return web.json_response(received.response)
        finally:
            with self._lock:
                self._active -= 1

    # -- the request schema ---------------------------------------------------------------

    def _validate(self, body: Any) -> Received:
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        for name in body:
            if name in OTHER_API_FIELDS:
                raise BadRequest(f"'{name}' is a chat-completions parameter this test server does not implement.", param=name)
            if name not in CHECKED_FIELDS:
                raise BadRequest(f"Unrecognized request argument supplied: {name}", param=name)
        for name in ("model", "messages"):
            if name not in body:
                raise BadRequest(f"Missing required parameter: '{name}'.", param=name)
        model = body["model"]
        if not isinstance(model, str) or not model:
            raise BadRequest(f"Invalid type for 'model': expected a non-empty string, but got {_kind(model)}.", param="model")
        if model != self.model:
            raise BadRequest(
                f"The model `{model}` does not exist or you do not have access to it.", status=404, param=None, code="model_not_found"
            )
        if "max_tokens" in body:
            value = body["max_tokens"]
            if not _is_int(value):
                raise BadRequest(f"Invalid type for 'max_tokens': expected an integer, but got {_kind(value)}.", param="max_tokens")
            if value < 1:
                raise BadRequest(
                    f"Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got {value}.", param="max_tokens"
                )
        if "temperature" in body:
            value = body["temperature"]
            if not _is_number(value):
                raise BadRequest(f"Invalid type for 'temperature': expected a decimal, but got {_kind(value)}.", param="temperature")
            if not 0 <= value <= 2:
                raise BadRequest(f"Invalid 'temperature': expected a value in [0, 2], but got {value}.", param="temperature")
        if "logprobs" in body and not isinstance(body["logprobs"], bool):
            raise BadRequest(f"Invalid type for 'logprobs': expected a boolean, but got {_kind(body['logprobs'])}.", param="logprobs")
        if "top_logprobs" in body:
            value = body["top_logprobs"]
            if not _is_int(value):
                raise BadRequest(f"Invalid type for 'top_logprobs': expected an integer, but got {_kind(value)}.", param="top_logprobs")
            if not 0 <= value <= MAX_TOP_LOGPROBS:
                raise BadRequest(
                    f"Invalid 'top_logprobs': expected a value in [0, {MAX_TOP_LOGPROBS}], but got {value}.", param="top_logprobs"
                )
            if body.get("logprobs") is not True:
                raise BadRequest(
                    "Invalid value for 'top_logprobs': 'logprobs' must be set to true when 'top_logprobs' is used.", param="top_logprobs"
                )
        images, texts = self._messages(body["messages"])
        return Received(body, images, "\n".join(texts))

    def _messages(self, messages: Any) -> tuple[list[np.ndarray], list[str]]:
        if not isinstance(messages, list):
            raise BadRequest(f"Invalid type for 'messages': expected an array, but got {_kind(messages)}.", param="messages")
        if not messages:
            raise BadRequest("Invalid 'messages': empty array. Expected an array with minimum length 1.", param="messages")
        images: list[np.ndarray] = []
        texts: list[str] = []
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(message, dict):
                raise BadRequest(f"Invalid type for '{where}': expected an object, but got {_kind(message)}.", param=where)
            extra = set(message) - {"role", "content", "name"}
            if extra:
                raise BadRequest(f"Unrecognized request argument supplied: {where}.{sorted(extra)[0]}", param=where)
            role = message.get("role")
            if role not in ROLES:
                raise BadRequest(
                    f"Invalid value for '{where}.role': expected one of {', '.join(ROLES)}, but got {role!r}.", param=f"{where}.role"
                )
            if "name" in message and not isinstance(message["name"], str):
                raise BadRequest(f"Invalid type for '{where}.name': expected a string.", param=f"{where}.name")
            if "content" not in message:
                raise BadRequest(f"Missing required parameter: '{where}.content'.", param=f"{where}.content")
            content = message["content"]
            if isinstance(content, str):
                texts.append(content)
                continue
            if not isinstance(content, list) or not content:
                raise BadRequest(
                    f"Invalid type for '{where}.content': expected a string or a non-empty array of parts, but got {_kind(content)}.",
                    param=f"{where}.content",
                )
            for j, part in enumerate(content):
                image = self._part(part, f"{where}.content[{j}]", role, texts)
                if image is not None:
                    images.append(image)
        return images, texts

    def _part(self, part: Any, where: str, role: str, texts: list[str]) -> np.ndarray | None:
        if not isinstance(part, dict):
            raise BadRequest(f"Invalid type for '{where}': expected an object, but got {_kind(part)}.", param=where)
        kind = part.get("type")
        if kind == "text":
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise BadRequest(f'Invalid \'{where}\': a text part is {{"type": "text", "text": string}}.', param=where)
            texts.append(part["text"])
            return None
        if kind == "image_url":
            if role != "user":
                raise BadRequest(f"Invalid '{where}': image_url parts are only allowed in user messages.", param=where)
            if set(part) != {"type", "image_url"} or not isinstance(part["image_url"], dict):
                raise BadRequest(
                    f'Invalid \'{where}\': an image part is {{"type": "image_url", "image_url": {{"url": ...}}}}.', param=where
                )
            image_url = part["image_url"]
            extra = set(image_url) - {"url", "detail"}
            if extra:
                raise BadRequest(f"Unrecognized request argument supplied: {where}.image_url.{sorted(extra)[0]}", param=where)
            if "detail" in image_url and image_url["detail"] not in IMAGE_DETAILS:
                raise BadRequest(f"Invalid value for '{where}.image_url.detail': expected one of {', '.join(IMAGE_DETAILS)}.", param=where)
            if not isinstance(image_url.get("url"), str):
                raise BadRequest(f"Missing required parameter: '{where}.image_url.url'.", param=where)
            return decode_data_url(image_url["url"], where)
        raise BadRequest(f"Invalid value for '{where}.type': expected one of text, image_url, but got {kind!r}.", param=where)

    # -- the answer ------------------------------------------------------------------------

    def _completion(self, received: Received, planned: Planned | None) -> dict[str, Any]:
        body = received.body
        brightness = float(np.mean([image.astype(np.float64).mean() for image in received.images]) / 255.0) if received.images else 0.0
        want_logprobs = body.get("logprobs") is True
        top: list[tuple[str, float]] = []
        if planned is not None and planned.kind == "answer":
            content = planned.content or ""
            top = planned.top_logprobs if planned.top_logprobs is not None else [(content, 0.0)]
        elif want_logprobs:
            top = yes_no_top_logprobs(brightness)
            content = top[0][0]
        else:
            content = number_answer(brightness, self.answer_format)
        # Words stand for tokens: an answer longer than max_tokens is cut there.
        words = content.split(" ")
        max_tokens = body.get("max_tokens")
        finish = "stop"
        if max_tokens is not None and len(words) > max_tokens:
            content, finish = " ".join(words[:max_tokens]), "length"
        logprobs = None
        if want_logprobs and not (planned is not None and planned.omit_logprobs):
            shown = top[: body.get("top_logprobs", 0)]
            chosen = dict(top).get(content, top[0][1] if top else 0.0)
            logprobs = {
                "content": [
                    {
                        "token": content,
                        "logprob": chosen,
                        "bytes": list(content.encode()),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in shown],
                    }
                ],
                "refusal": None,
            }
        completion_tokens = len(content.split())
        prompt_tokens = len(received.text.split()) + 85 * len(received.images)
        return {
            "id": f"chatcmpl-test{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content, "refusal": None},
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "system_fingerprint": None,
        }


def decode_data_url(url: str, where: str) -> np.ndarray:
    """A ``data:image/...;base64,...`` URL -> its image as uint8 ``[H, W, 3]``; anything else
    is a 400 (this server cannot fetch URLs)."""
    head, comma, data = url.partition(",")
    if not url.startswith("data:") or not comma or not head.endswith(";base64"):
        raise BadRequest(f"Invalid '{where}.image_url.url': this test server takes base64 data URLs only.", param=where)
    media_type = head[len("data:") : -len(";base64")]
    if media_type not in IMAGE_MEDIA_TYPES:
        raise BadRequest(
            f"Invalid '{where}.image_url.url': unsupported image type {media_type!r}.", param=where, code="invalid_image_format"
        )
    try:
        raw = base64.b64decode(data, validate=True)
        with Image.open(io.BytesIO(raw)) as image:
            if image.format != media_type.split("/")[1].upper().replace("JPG", "JPEG"):
                raise ValueError(f"the data is {image.format}, the URL says {media_type}")
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (binascii.Error, ValueError, OSError) as exc:
        raise BadRequest(
            f"Invalid '{where}.image_url.url': the image could not be decoded ({exc}).", param=where, code="invalid_image"
        ) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _kind(value: Any) -> str:
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a decimal",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)
