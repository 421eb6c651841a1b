"""The ``vlm_judge`` reward: a vision-language model behind an OpenAI-compatible
chat-completions endpoint (vLLM, SGLang, the OpenAI API, ...) scores each output.

For each sample the reward POSTs one request to ``--vlm-url`` + ``/chat/completions``
(``--vlm-url`` is the OpenAI base URL, such as ``http://host:8000/v1``)::

    {"model": --vlm-model,
     "messages": [{"role": "user", "content": [
         {"type": "text", "text": <--vlm-prompt-template with {prompt} and {rubric} filled in>},
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}, ...]}],
     "max_tokens": --vlm-max-tokens, "temperature": --vlm-temperature}

with one image for an image output and ``--vlm-num-frames`` frames of a video, spread
evenly as the CLIP rewards pick them (:func:`miles_rewards.clip_models.frame_indices`),
in order, in the one message. Each image is an 8-bit RGB PNG of ``round(clamp(x, 0, 1) * 255)``
(:func:`miles_rewards.pixels.to_uint8_frames`; a 1-channel output is repeated to RGB).
The score is read from the answer:

- ``--vlm-score-mode number`` (default): ``x`` = the first number in
  ``choices[0].message.content`` (``7``, ``7.5``, ``Score: 7/10``, ``**8**``), and
  ``reward = (x - LO) / (HI - LO)`` with ``--vlm-score-range LO,HI`` (default ``0,10``),
  in [0, 1]; an answer without a number, or one outside [LO, HI], fails the sample;
- ``--vlm-score-mode yes_no``: the request asks for one token with its log-probabilities
  (``max_tokens: 1, logprobs: true, top_logprobs: 20``) and ``reward = P(yes) / (P(yes) +
  P(no))``, each the summed probability of the top tokens that read ``yes`` (``no``) once
  whitespace, punctuation and the tokenizers' space marks (``▁``, ``Ġ``) are stripped and
  case is ignored (``Yes``, `` yes``, ``YES``). A server that returns no log-probabilities,
  or an answer whose top tokens hold neither, fails the sample (there is no fallback to
  the answer's text: use ``number`` mode with a server without log-probabilities).

Requests go at most ``--rm-max-in-flight`` at once, each through the core's
:func:`post_with_retries`: ``--rm-timeout`` per attempt, transport errors, timeouts and
408, 429, 500, 502, 503 and 504 retried ``--rm-max-retries`` times with exponential backoff from
``--rm-retry-backoff`` (a ``Retry-After`` honoured). A sample whose request still fails,
whose request the server refuses (another 4xx: the message of the OpenAI error envelope
is quoted) or whose answer cannot be read gets an exception instance in its place, which
the core's scorer turns into a failed, masked sample with that one-line reason; the other
samples of the call keep their scores. ``pop_metrics()`` reports the requests, their
retries, the failed samples and the mean latency.

Nothing is sent when the reward is built (a judge may be billed per call): the flags are
checked there (and by the plugin's configuration check), and the first request goes with
the first scored batch. The API key is read from the environment variable
``--vlm-api-key-env`` (default ``OPENAI_API_KEY``); unset, no Authorization header is
sent. The key is never logged nor put in an error message.
"""

from __future__ import annotations

import base64
import functools
import io
import math
import os
import re
import string
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from miles_core.api import RewardError

NAME = "vlm_judge"
CHAT_PATH = "/chat/completions"
SCORE_MODES = ("number", "yes_no")
TOP_LOGPROBS = 20
"""Top tokens asked for in yes_no mode: the chat-completions API's maximum."""
PLACEHOLDERS = ("prompt", "rubric")
DEFAULT_TEMPLATE = "A generative model was given this prompt:\n{prompt}\n\n{rubric}"
QUOTE_CHARS = 80
"""An unreadable answer is quoted in the failure reason up to this many characters."""

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)")
_TOKEN_STRIP = string.whitespace + string.punctuation + "▁Ġ"


def default_rubric(mode: str, low: float, high: float, video: bool) -> str:
    """The rubric used when ``--vlm-rubric`` is unset, for the score mode and range."""
    subject = "the video (its frames are shown in order)" if video else "the image"
    if mode == "yes_no":
        return f"Does {subject} match the prompt? Answer yes or no."
    return (
        f"How well does {subject} match the prompt? Answer with one number from {low:g} to {high:g}: "
        f"{low:g} means it does not match at all, {high:g} that it matches perfectly."
    )


# ---------------------------------------------------------------------------------------
# Reading the flags (also the plugin's configuration check: nothing here sends a request)


def check_url(url: str | None) -> str:
    """``--vlm-url``: an http(s) base URL with a host, no query or fragment, not already
    ending in ``/chat/completions``."""
    if not url:
        raise RewardError(f"--vlm-url is required with the {NAME} reward (the judge's OpenAI base URL, e.g. http://host:8000/v1)")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise RewardError(f"--vlm-url {url}: not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RewardError(f"--vlm-url {url}: expected an http:// or https:// URL with a host, e.g. http://host:8000/v1")
    if parts.query or parts.fragment:
        raise RewardError(f"--vlm-url {url}: a base URL takes no query or fragment (the {NAME} reward appends {CHAT_PATH})")
    if parts.path.rstrip("/").endswith(CHAT_PATH):
        raise RewardError(
            f"--vlm-url {url}: give the base URL without {CHAT_PATH} (e.g. http://host:8000/v1); the {NAME} reward appends it"
        )
    return url


def check_model(model: str | None) -> str:
    if not model or not model.strip():
        raise RewardError(f"--vlm-model is required with the {NAME} reward (the model name the server serves)")
    return model


def read_template(path: str | None) -> str:
    """The ``--vlm-prompt-template`` file's text (unset: :data:`DEFAULT_TEMPLATE`): a
    ``str.format`` template whose only placeholders are ``{prompt}`` (required) and
    ``{rubric}``; a literal brace is written ``{{`` or ``}}``."""
    if not path:
        return DEFAULT_TEMPLATE
    flag = f"--vlm-prompt-template {path}"
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RewardError(f"{flag}: cannot read the template ({type(exc).__name__}: {exc})") from None
    try:
        fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(text) if name is not None]
    except ValueError as exc:
        raise RewardError(f"{flag}: not a template ({exc}); write a literal brace as {{{{ or }}}}") from None
    for name, spec, conversion in fields:
        if name not in PLACEHOLDERS or spec or conversion:
            written = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise RewardError(f"{flag}: placeholder {written} is not one of {{prompt}}, {{rubric}} (write a literal brace as {{{{ or }}}})")
    if "prompt" not in {name for name, _, _ in fields}:
        raise RewardError(f"{flag}: the template has no {{prompt}} placeholder (the sample's prompt goes there)")
    return text


def parse_score_range(text: str | None) -> tuple[float, float]:
    """``--vlm-score-range LO,HI``: two finite numbers, ``LO < HI``."""
    parts = str(text if text is not None else "0,10").split(",")
    try:
        low, high = (float(part) for part in parts) if len(parts) == 2 else (math.nan, math.nan)
    except ValueError:
        low = high = math.nan
    if not (math.isfinite(low) and math.isfinite(high)):
        raise RewardError(f"--vlm-score-range {text}: expected two numbers LO,HI, e.g. 0,10")
    if low >= high:
        raise RewardError(f"--vlm-score-range {text}: LO must be below HI")
    return low, high


def config_errors(config: Any) -> list[str]:
    """Every one-line error of the judge's flags (for the plugin's configuration check)."""
    checks = (
        lambda: check_url(config.get("vlm_url")),
        lambda: check_model(config.get("vlm_model")),
        lambda: read_template(config.get("vlm_prompt_template")),
        lambda: parse_score_range(config.get("vlm_score_range")),
    )
    errors = []
    for check in checks:
        try:
            check()
        except RewardError as exc:
            errors.append(str(exc))
    return errors


# ---------------------------------------------------------------------------------------
# Reading an answer


def quoted(text: str) -> str:
    """``text`` on one line, cut at :data:`QUOTE_CHARS`, as a Python literal."""
    flat = " ".join(str(text).split())
    return repr(flat if len(flat) <= QUOTE_CHARS else flat[: QUOTE_CHARS - 3] + "...")


def first_choice(body: Any) -> dict[str, Any]:
    """``choices[0]`` of a chat completion; a body without one is a one-line RewardError."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RewardError(f"the answer is not a chat completion (no choices[0]): {quoted(str(body))}")
    return choices[0]


def answer_text(choice: dict[str, Any]) -> str:
    message = choice.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        refusal = message.get("refusal") if isinstance(message, dict) else None
        why = f" (refusal: {quoted(refusal)})" if refusal else ""
        raise RewardError(f"the judge's answer has no text content{why}")
    return content


def number_score(content: str, low: float, high: float) -> float:
    """``(x - low) / (high - low)`` for ``x`` the first number in ``content``."""
    match = _NUMBER.search(content)
    if match is None:
        raise RewardError(f"the judge's answer {quoted(content)} has no number (--vlm-score-mode number)")
    value = float(match.group())
    if not low <= value <= high:
        raise RewardError(f"the judge's answer {quoted(content)} scores {value:g}, outside --vlm-score-range [{low:g}, {high:g}]")
    return (value - low) / (high - low)


def token_word(token: str) -> str:
    """A token as a word to compare: whitespace, punctuation and space marks stripped, lower-cased."""
    return token.strip(_TOKEN_STRIP).lower()


def yes_no_score(choice: dict[str, Any]) -> float:
    """``P(yes) / (P(yes) + P(no))`` from ``choices[0].logprobs.content[0].top_logprobs``."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or not content or not isinstance(content[0], dict):
        answer = choice.get("message", {}).get("content") if isinstance(choice.get("message"), dict) else None
        raise RewardError(
            f"the server returned no logprobs for the answer {quoted(str(answer))} (--vlm-score-mode yes_no needs them; "
            f"use --vlm-score-mode number for a server without log-probabilities)"
        )
    top = content[0].get("top_logprobs")
    if not isinstance(top, list):
        raise RewardError("the server returned no top_logprobs for the answer's token (--vlm-score-mode yes_no needs them)")
    mass = {"yes": 0.0, "no": 0.0}
    tokens = []
    for entry in top:
        token = entry.get("token") if isinstance(entry, dict) else None
        logprob = entry.get("logprob") if isinstance(entry, dict) else None
        if not isinstance(token, str) or isinstance(logprob, bool) or not isinstance(logprob, (int, float)):
            raise RewardError(f"malformed top_logprobs entry {quoted(str(entry))} (expected {{token: string, logprob: number}})")
        tokens.append(token)
        word = token_word(token)
        if word in mass:
            mass[word] += math.exp(min(float(logprob), 0.0))
    total = mass["yes"] + mass["no"]
    if total <= 0.0:
        shown = ", ".join(repr(token) for token in tokens[:5]) + (", ..." if len(tokens) > 5 else "")
        raise RewardError(f"neither yes nor no among the answer's top {len(tokens)} tokens ({shown})")
    return mass["yes"] / total


# ---------------------------------------------------------------------------------------
# The reward


def png_data_url(frame: np.ndarray) -> str:
    """A uint8 ``[H, W, C]`` frame (1 or 3 channels) as an RGB PNG data URL."""
    from PIL import Image

    if frame.shape[-1] == 1:
        frame = np.repeat(frame, 3, axis=-1)
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


@dataclass
class _Counters:
    requests: int = 0
    retries: int = 0
    failed: int = 0
    answered: int = 0
    latency: float = 0.0


class VlmJudge:
    """The ``vlm_judge`` reward: built with the run's configuration (nothing is sent then),
    called as ``reward(outputs, prompts, metadata) -> list[float | Exception]``, one
    request per output; a sample the judge could not score gets the exception saying why."""

    name = NAME
    needs_prompts = True

    def __init__(self, config: Any) -> None:
        from miles_core.api import RetryPolicy

        errors = config_errors(config)
        if errors:
            raise RewardError(errors[0] if NAME in errors[0] else f"{NAME}: {errors[0]}")
        self.url: str = config.get("vlm_url")
        self.model: str = config.get("vlm_model")
        self.template = read_template(config.get("vlm_prompt_template"))
        self.rubric: str | None = config.get("vlm_rubric") or None
        self.mode: str = config.get("vlm_score_mode") or "number"
        if self.mode not in SCORE_MODES:
            raise RewardError(f"--vlm-score-mode {self.mode}: expected one of {', '.join(SCORE_MODES)}")
        self.low, self.high = parse_score_range(config.get("vlm_score_range"))
        self.max_tokens = int(config.get("vlm_max_tokens") or 16)
        self.temperature = float(config.get("vlm_temperature") or 0.0)
        self.num_frames = int(config.get("vlm_num_frames") or 4)
        self.max_in_flight = int(config.get("rm_max_in_flight") or 4)
        try:
            self.policy = RetryPolicy.from_config(config)
        except ValueError as exc:
            raise RewardError(f"{NAME}: {exc}") from None
        key_env = config.get("vlm_api_key_env") or "OPENAI_API_KEY"
        key = os.environ.get(key_env)
        # The key lives only in this header dict: never logged, never in an error message.
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._lock = threading.Lock()
        self._counters = _Counters()

    # -- the request ---------------------------------------------------------------------

    def frames(self, output: Any) -> tuple[list[np.ndarray], bool]:
        """The uint8 frames sent for ``output`` and whether it is a video: an image's one
        frame, or ``--vlm-num-frames`` of a video's spread evenly."""
        from miles_rewards.clip_models import frame_indices
        from miles_rewards.pixels import to_uint8_frames

        frames = to_uint8_frames(output)
        video = len(frames) > 1
        return [frames[i] for i in frame_indices(len(frames), self.num_frames)], video

    def request_body(self, output: Any, prompt: str) -> dict[str, Any]:
        """The chat-completions request that scores ``output`` against ``prompt``."""
        frames, video = self.frames(output)
        rubric = self.rubric if self.rubric is not None else default_rubric(self.mode, self.low, self.high, video)
        text = self.template.format(prompt=prompt, rubric=rubric)
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        content.extend({"type": "image_url", "image_url": {"url": png_data_url(frame)}} for frame in frames)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        if self.mode == "yes_no":
            body.update(max_tokens=1, logprobs=True, top_logprobs=TOP_LOGPROBS)
        return body

    # -- scoring -------------------------------------------------------------------------

    def _retried(self, _line: str) -> None:
        with self._lock:
            self._counters.retries += 1

    async def _judge(self, session: Any, output: Any, prompt: str) -> float:
        import asyncio

        from miles_core.api import post_with_retries

        # PNG encoding (tens of ms per 512x512 image) off the event loop: it overlaps with other requests.
        body = await asyncio.to_thread(self.request_body, output, prompt)
        with self._lock:
            self._counters.requests += 1
        start = time.perf_counter()
        answer = await post_with_retries(
            session, [self.url], CHAT_PATH, policy=self.policy, json_body=body, headers=self._headers, on_retry=self._retried
        )
        with self._lock:
            self._counters.answered += 1
            self._counters.latency += time.perf_counter() - start
        if answer.status != 200:
            raise RewardError(f"{answer.url}: answered {answer.status}: {answer.error_message()}")
        try:
            choice = first_choice(answer.json())
            if self.mode == "yes_no":
                return yes_no_score(choice)
            return number_score(answer_text(choice), self.low, self.high)
        except RewardError as exc:
            raise RewardError(f"{answer.url}: {exc}") from None

    async def _score(self, outputs: Sequence[Any], prompts: Sequence[str]) -> list[float | Exception]:
        import aiohttp

        from miles_core.api import gather_bounded

        async with aiohttp.ClientSession() as session:
            calls = [functools.partial(self._judge, session, output, prompt) for output, prompt in zip(outputs, prompts)]
            results = await gather_bounded(calls, self.max_in_flight)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # cancelled or interrupted: not a sample's failure
        failed = sum(isinstance(result, Exception) for result in results)
        with self._lock:
            self._counters.failed += failed
        return results  # type: ignore[return-value]

    def __call__(
        self,
        outputs: Sequence[Any],
        prompts: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> list[float | Exception]:
        from miles_core.api import run_in_new_loop

        if prompts is None or len(prompts) != len(outputs):
            raise ValueError(
                f"the {NAME} reward needs one prompt per output, got {len(outputs)} outputs and {0 if prompts is None else len(prompts)} prompts"
            )
        if not outputs:
            return []
        return run_in_new_loop(self._score(outputs, prompts))

    def pop_metrics(self) -> dict[str, float]:
        """Since the previous call (which resets them): ``requests`` (one per scored sample),
        ``retries`` (further attempts of those requests), ``failed`` (samples returned as
        exceptions) and, when any request was answered, ``latency_s``: the mean seconds from
        sending a request to its last answer, retries and their waits included."""
        with self._lock:
            counters, self._counters = self._counters, _Counters()
        metrics = {"requests": float(counters.requests), "retries": float(counters.retries), "failed": float(counters.failed)}
        if counters.answered:
            metrics["latency_s"] = counters.latency / counters.answered
        return metrics
