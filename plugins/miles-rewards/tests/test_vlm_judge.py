"""The vlm_judge reward against a local chat-completions server (tests/_chat_server.py).

No vision-language model runs here: the server follows the chat-completions schema
exactly (it refuses what the API refuses, tested below so the validator is real), decodes
the PNG data URLs it receives and answers from their pixels by a fixed rule, so every
score is checked against a number computed in the test from the float outputs (the
8-bit conversion written out here), and the decoded pixels against that conversion.
Retries, timeouts, refused requests and unreadable answers are planned on the server;
each fails only its own sample, returned as an exception, and is counted.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from miles_core.api import CallFailed, RewardError
from miles_rewards.vlm_judge import (
    DEFAULT_TEMPLATE,
    VlmJudge,
    default_rubric,
    number_score,
    token_word,
    yes_no_score,
)

from ._chat_server import ChatServer, number_answer, yes_no_top_logprobs, yes_probability
from ._clip_tiny import build_reward, config_errors, config_for

FAST = ("--rm-retry-backoff", "0", "--rm-timeout", "2")


@pytest.fixture
def server():
    with ChatServer() as running:
        yield running


def judge(server: ChatServer, *args: str) -> VlmJudge:
    """The registered reward built as the core builds it, pointed at ``server``."""
    return build_reward("vlm_judge", "--vlm-url", server.url, "--vlm-model", server.model, *FAST, *args)


def images(count: int, seed: int = 0, size: int = 12) -> list[torch.Tensor]:
    """Random images of clearly different brightness, a few values outside [0, 1]."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(3, size, size + 2, generator=generator) * (0.3 + 0.25 * i) - 0.05 for i in range(count)]


def as_uint8(output: torch.Tensor) -> np.ndarray:
    """[C, H, W] or [C, F, H, W] floats -> uint8 round(clamp(x, 0, 1) * 255), channels last."""
    array = np.clip(np.round(output.double().numpy() * 255.0), 0, 255).astype(np.uint8)
    return np.moveaxis(array, 0, -1)


def brightness(*frames: np.ndarray) -> float:
    return float(np.mean([frame.astype(np.float64).mean() for frame in frames]) / 255.0)


# ---------------------------------------------------------------------------------------
# number mode


@pytest.mark.exercises("--vlm-url", "--vlm-model", "--vlm-max-tokens", "--vlm-temperature")
def test_number_mode_scores_each_image_exactly_and_sends_the_schema_request(server):
    outputs = images(3)
    prompts = ["a red cube", "two {braced} cats", "snow"]
    reward = judge(server, "--vlm-max-tokens", "7", "--vlm-temperature", "0.5")
    assert server.attempts == 0  # building the reward sends nothing
    scores = reward(outputs, prompts)
    expected_frames = [as_uint8(x) for x in outputs]
    expected = [float(number_answer(brightness(f))) / 10 for f in expected_frames]
    assert scores == expected  # exact: the same float from the same text
    assert len(set(expected)) == 3
    by_prompt = {r.text.split("\n")[1]: r for r in server.received}
    for output, prompt, frame in zip(outputs, prompts, expected_frames):
        received = by_prompt[prompt]
        (image,) = received.images
        assert np.array_equal(image, frame)  # the pixels went over the wire exactly
        # Control: truncating instead of rounding gives other pixels.
        assert not np.array_equal(image, np.clip(output.numpy() * 255, 0, 255).astype(np.uint8).transpose(1, 2, 0))
        body = received.body
        assert set(body) == {"model", "messages", "max_tokens", "temperature"}
        assert (body["model"], body["max_tokens"], body["temperature"]) == (server.model, 7, 0.5)
        (message,) = body["messages"]
        assert message["role"] == "user" and [part["type"] for part in message["content"]] == ["text", "image_url"]
        assert message["content"][0]["text"] == DEFAULT_TEMPLATE.format(prompt=prompt, rubric=default_rubric("number", 0, 10, False))
        assert message["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")


@pytest.mark.exercises("--vlm-score-range")
@pytest.mark.parametrize(
    "answer_format, score_range, low, high",
    [("Score: {score}/10", "-10,10", -10.0, 10.0), ("**{score}**", "0,20", 0.0, 20.0), ("{score}.", "0.5,10.5", 0.5, 10.5)],
)
def test_score_range_maps_the_answer_to_0_1(server, answer_format, score_range, low, high):
    server.answer_format = answer_format
    outputs = images(3, seed=1)
    scores = judge(server, f"--vlm-score-range={score_range}")(outputs, ["p"] * 3)  # '=': -10,10 is no flag
    answers = [float(number_answer(brightness(as_uint8(x)))) for x in outputs]
    assert scores == pytest.approx([(x - low) / (high - low) for x in answers], abs=1e-15)
    # The default rubric names the range.
    assert f"from {low:g} to {high:g}" in server.received[0].text


@pytest.mark.parametrize(
    "content, expected",
    [("7", 0.7), ("7.5", 0.75), ("Score: 7/10", 0.7), ("**8**", 0.8), (" 10 \n", 1.0), ("0", 0.0), ("I'd say 3, maybe 4", 0.3)],
)
def test_the_first_number_of_the_answer(content, expected):
    assert number_score(content, 0.0, 10.0) == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize(
    "content, reason",
    [
        ("I cannot judge this image.", "the judge's answer 'I cannot judge this image.' has no number"),
        ("11/10", "the judge's answer '11/10' scores 11, outside --vlm-score-range [0, 10]"),
        ("-1", "scores -1, outside"),
        ("x" * 200, "'" + "x" * 77 + "...' has no number"),
    ],
)
def test_an_unreadable_answer_is_a_one_line_reason_quoting_it(content, reason):
    with pytest.raises(RewardError) as info:
        number_score(content, 0.0, 10.0)
    assert reason in str(info.value) and "\n" not in str(info.value)


def test_a_bad_answer_fails_only_its_own_sample(server):
    server.plan("answer", content="Sorry,\nI cannot rate   this.")
    outputs = images(3, seed=2)
    reward = judge(server, "--rm-max-in-flight", "1")  # one at a time: the planned answer is the first sample's
    scores = reward(outputs, ["a", "b", "c"])
    assert isinstance(scores[0], RewardError)
    assert (
        str(scores[0])
        == f"{server.url}/chat/completions: the judge's answer 'Sorry, I cannot rate this.' has no number (--vlm-score-mode number)"
    )
    assert scores[1:] == [float(number_answer(brightness(as_uint8(x)))) / 10 for x in outputs[1:]]
    metrics = reward.pop_metrics()
    assert (metrics["requests"], metrics["retries"], metrics["failed"]) == (3, 0, 1)
    assert metrics["latency_s"] > 0
    assert reward.pop_metrics() == {"requests": 0.0, "retries": 0.0, "failed": 0.0}  # popped: reset


# ---------------------------------------------------------------------------------------
# yes_no mode


@pytest.mark.exercises("--vlm-score-mode")
def test_yes_no_is_p_yes_over_p_yes_plus_p_no_from_the_logprobs(server):
    outputs = images(3, seed=3)
    scores = judge(server, "--vlm-score-mode", "yes_no")(outputs, ["x", "y", "z"])
    for output, score in zip(outputs, scores):
        (received,) = [r for r in server.received if np.array_equal(r.images[0], as_uint8(output))]
        assert {k: received.body[k] for k in ("max_tokens", "logprobs", "top_logprobs")} == {
            "max_tokens": 1,
            "logprobs": True,
            "top_logprobs": 20,
        }
        assert default_rubric("yes_no", 0, 10, False) in received.text
        # The formula over the list the server returned: every spelling of yes / no summed.
        top = received.response["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        p_yes = sum(math.exp(t["logprob"]) for t in top if t["token"].strip().lower() == "yes")
        p_no = sum(math.exp(t["logprob"]) for t in top if t["token"].strip().lower() == "no")
        assert {t["token"] for t in top} == {"Yes", " yes", "No", "NO", "Maybe"}
        assert score == pytest.approx(p_yes / (p_yes + p_no), rel=1e-12)
        assert score == pytest.approx(yes_probability(brightness(as_uint8(output))), rel=1e-12)
    assert len({round(s, 6) for s in scores}) == 3  # control: the images score differently


@pytest.mark.parametrize("token", ["Yes", " yes", "YES", "yes.", "▁Yes", "ĠYes", "\nyes!"])
def test_yes_tokens_are_matched_case_and_space_insensitively(token):
    assert token_word(token) == "yes"
    choice = {
        "logprobs": {
            "content": [
                {
                    "token": token,
                    "logprob": -0.1,
                    "top_logprobs": [{"token": token, "logprob": math.log(0.75)}, {"token": "No", "logprob": math.log(0.25)}],
                }
            ]
        }
    }
    assert yes_no_score(choice) == pytest.approx(0.75, rel=1e-12)
    assert token_word("Yesterday") != "yes"


def test_yes_no_without_logprobs_or_without_yes_and_no_fails_the_sample(server):
    server.plan("answer", content="Yes", omit_logprobs=True)
    server.plan("answer", content="Maybe", top_logprobs=[("Maybe", -0.2), ("Perhaps", -1.9)])
    scores = judge(server, "--vlm-score-mode", "yes_no", "--rm-max-in-flight", "1")(images(3, seed=4), ["a", "b", "c"])
    assert "the server returned no logprobs for the answer 'Yes'" in str(scores[0])
    assert "use --vlm-score-mode number for a server without log-probabilities" in str(scores[0])
    assert "neither yes nor no among the answer's top 2 tokens ('Maybe', 'Perhaps')" in str(scores[1])
    assert isinstance(scores[2], float) and 0 < scores[2] < 1


def test_the_top_logprobs_the_server_sends_are_the_ones_asked_for():
    # The server's list is sorted and cut at top_logprobs: with 2, only the two likeliest come back.
    top = yes_no_top_logprobs(0.9)
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert math.fsum(math.exp(lp) for _, lp in top) == pytest.approx(1.0, abs=1e-12)


# ---------------------------------------------------------------------------------------
# retries, timeouts, refusals


@pytest.mark.exercises("--rm-max-retries", "--rm-retry-backoff")
def test_429_then_success_is_retried_and_counted(server):
    server.plan("429", 2, retry_after="0")
    outputs = images(1, seed=5)
    reward = judge(server, "--rm-max-retries", "2")
    assert reward(outputs, ["p"]) == [float(number_answer(brightness(as_uint8(outputs[0])))) / 10]
    assert server.attempts == 3
    metrics = reward.pop_metrics()
    assert (metrics["requests"], metrics["retries"], metrics["failed"]) == (1, 2, 0)


def test_500_on_every_attempt_fails_the_sample(server):
    server.plan("500", 10)
    reward = judge(server, "--rm-max-retries", "2")
    (value,) = reward(images(1), ["p"])
    assert isinstance(value, CallFailed)
    assert str(value) == (
        f"{server.url}/chat/completions: answered 500: The server had an error while processing your request. (after 3 attempts)"
    )
    assert server.attempts == 3
    assert reward.pop_metrics() == {"requests": 1.0, "retries": 2.0, "failed": 1.0}


@pytest.mark.exercises("--rm-timeout")
def test_a_hanging_server_times_out_and_is_retried(server):
    server.plan("hang", 1)
    outputs = images(2, seed=6)
    reward = judge(server, "--rm-timeout", "0.3", "--rm-max-retries", "1", "--rm-max-in-flight", "1")
    start = time.perf_counter()
    scores = reward(outputs, ["a", "b"])
    assert 0.3 <= time.perf_counter() - start < 3.0  # one 0.3 s timeout, then answers
    assert scores == [float(number_answer(brightness(as_uint8(x)))) / 10 for x in outputs]
    assert reward.pop_metrics()["retries"] == 1
    server.plan("hang", 2)
    (value,) = reward(outputs[:1], ["a"])
    assert str(value) == f"{server.url}/chat/completions: no answer within 0.3 s (--rm-timeout) (after 2 attempts)"


def test_a_refused_request_is_not_retried_and_quotes_the_error_message(server):
    reward = build_reward("vlm_judge", "--vlm-url", server.url + "/", "--vlm-model", "gpt-unknown", *FAST)
    (value,) = reward(images(1), ["p"])
    assert isinstance(value, RewardError)
    assert (
        str(value)
        == f"{server.url}/chat/completions: answered 404: The model `gpt-unknown` does not exist or you do not have access to it."
    )
    assert server.attempts == 1
    assert reward.pop_metrics()["failed"] == 1


@pytest.mark.exercises("--rm-max-in-flight")
def test_at_most_rm_max_in_flight_requests_at_once(server):
    server.delay = 0.15
    outputs = images(8, seed=7)
    scores = judge(server, "--rm-max-in-flight", "3")(outputs, [f"p{i}" for i in range(8)])
    assert server.max_concurrent == 3  # bounded, and the bound is reached
    assert scores == [float(number_answer(brightness(as_uint8(x)))) / 10 for x in outputs]
    server.max_concurrent = 0
    judge(server, "--rm-max-in-flight", "1")(outputs[:3], ["a", "b", "c"])
    assert server.max_concurrent == 1


# ---------------------------------------------------------------------------------------
# the API key


@pytest.mark.exercises("--vlm-api-key-env")
def test_the_api_key_comes_from_the_named_environment_variable(server, monkeypatch):
    server.api_key = "sk-test-123"
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test-123")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-default")
    outputs = images(1)
    assert isinstance(judge(server, "--vlm-api-key-env", "MY_JUDGE_KEY")(outputs, ["p"])[0], float)
    assert server.authorizations == ["Bearer sk-test-123"]
    # The default variable is OPENAI_API_KEY: a wrong key is the server's 401, not retried, key not quoted.
    (value,) = judge(server)(outputs, ["p"])
    assert server.authorizations[-1] == "Bearer sk-default"
    assert str(value) == f"{server.url}/chat/completions: answered 401: Incorrect API key provided."
    assert "sk-default" not in str(value)
    # An unset variable sends no Authorization header.
    monkeypatch.delenv("OPENAI_API_KEY")
    server.api_key = None
    assert isinstance(judge(server)(outputs, ["p"])[0], float)
    assert server.authorizations[-1] is None


# ---------------------------------------------------------------------------------------
# template, rubric, start-up checks


@pytest.mark.exercises("--vlm-prompt-template", "--vlm-rubric")
def test_a_template_file_and_a_rubric_make_the_request_text(server, tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text("Rubric: {rubric}\nPrompt: {prompt}\nAnswer in {{braces}}.", encoding="utf-8")
    judge(server, "--vlm-prompt-template", str(template), "--vlm-rubric", "Rate it 0-10.")(images(1), ["a {x} cat"])
    assert server.received[0].text == "Rubric: Rate it 0-10.\nPrompt: a {x} cat\nAnswer in {braces}."


@pytest.mark.parametrize(
    "text, reason",
    [
        ("{prompt} {style}", "placeholder {style} is not one of {prompt}, {rubric}"),
        ("{prompt} {}", "placeholder {} is not one of {prompt}, {rubric}"),
        ("{prompt!r}", "placeholder {prompt!r} is not one of"),
        ("{rubric} only", "the template has no {prompt} placeholder"),
        ("{prompt", "not a template (expected '}' before end of string)"),
    ],
)
def test_template_errors_are_one_line_naming_the_flag(server, tmp_path, text, reason):
    template = tmp_path / "t.txt"
    template.write_text(text, encoding="utf-8")
    args = ("--rm-type", "vlm_judge", "--vlm-url", server.url, "--vlm-model", "m", "--vlm-prompt-template", str(template))
    (line,) = config_errors(*args)
    assert line.startswith(f"--vlm-prompt-template {template}: ") and reason in line and "\n" not in line
    with pytest.raises(RewardError, match="^vlm_judge: --vlm-prompt-template "):
        VlmJudge(_Config(vlm_url=server.url, vlm_model="m", vlm_prompt_template=str(template)))


def test_missing_or_malformed_flags_are_one_line_errors_and_nothing_is_sent(server, tmp_path):
    assert config_errors("--rm-type", "vlm_judge") == [
        "--vlm-url is required with the vlm_judge reward (the judge's OpenAI base URL, e.g. http://host:8000/v1)",
        "--vlm-model is required with the vlm_judge reward (the model name the server serves)",
    ]
    # Also where the reward is only part of a mixture.
    assert len(config_errors("--reward-weights", '{"vlm_judge": 1.0, "brightness": 1.0}')) == 2
    assert config_errors("--rm-type", "brightness") == []  # not in use: not checked
    cases = {
        "localhost:8000/v1": "expected an http:// or https:// URL with a host",
        "http://:8000/v1": "expected an http:// or https:// URL with a host",
        "http://host:port/v1": "not a URL (Port could not be cast to integer value",
        "http://host:8000/v1?key=1": "a base URL takes no query or fragment",
        "http://host:8000/v1/chat/completions": "give the base URL without /chat/completions",
    }
    for url, reason in cases.items():
        (line,) = config_errors("--rm-type", "vlm_judge", "--vlm-url", url, "--vlm-model", "m")
        assert line.startswith(f"--vlm-url {url}: {reason}"), line
    for value in ("10", "a,b", "5,5", "10,0", "0,inf"):
        (line,) = config_errors("--rm-type", "vlm_judge", "--vlm-url", server.url, "--vlm-model", "m", "--vlm-score-range", value)
        assert line.startswith(f"--vlm-score-range {value}: "), line
    with pytest.raises(RewardError, match=r"^--vlm-model is required with the vlm_judge reward"):
        VlmJudge(_Config(vlm_url=server.url))
    with pytest.raises(RewardError, match=r"^vlm_judge: --vlm-url ftp://h/v1: expected an http"):
        VlmJudge(_Config(vlm_url="ftp://h/v1", vlm_model="m"))
    missing = tmp_path / "missing.txt"
    with pytest.raises(RewardError, match=rf"^vlm_judge: --vlm-prompt-template {missing}: cannot read the template \(FileNotFoundError"):
        VlmJudge(_Config(vlm_url=server.url, vlm_model="m", vlm_prompt_template=str(missing)))
    assert server.attempts == 0


class _Config(dict):
    """A configuration for building the reward directly, as a per-sample ``metadata.rm_type``
    builds it when the configuration's check did not see it: ``get`` like the core's."""

    def get(self, key, default=None):
        return super().get(key, default)


# ---------------------------------------------------------------------------------------
# videos and channels


@pytest.mark.exercises("--vlm-num-frames")
def test_a_video_sends_num_frames_frames_spread_evenly_in_one_message(server):
    video = torch.stack([torch.full((3, 6, 8), i / 10) + 0.01 * torch.rand(3, 6, 8) for i in range(9)], dim=1)  # [C, F, H, W]
    gray = torch.rand(1, 6, 8, generator=torch.Generator().manual_seed(8))
    scores = judge(server, "--vlm-num-frames", "3", "--rm-max-in-flight", "1")([video, gray], ["a clip", "gray"])
    frames = as_uint8(video)  # [F, H, W, C]
    sent = server.received[0]
    assert len(sent.images) == 3 and all(np.array_equal(a, frames[i]) for a, i in zip(sent.images, (0, 4, 8)))
    assert [p["type"] for p in sent.body["messages"][0]["content"]] == ["text"] + ["image_url"] * 3
    assert default_rubric("number", 0, 10, True) in sent.text and "frames are shown in order" in sent.text
    assert scores[0] == float(number_answer(brightness(frames[0], frames[4], frames[8]))) / 10
    # A one-channel image goes as RGB, its channel repeated.
    (rgb,) = server.received[1].images
    assert np.array_equal(rgb, np.repeat(as_uint8(gray), 3, axis=-1))
    assert scores[1] == float(number_answer(brightness(as_uint8(gray)))) / 10


# ---------------------------------------------------------------------------------------
# the test server refuses what the API refuses


def _post(server: ChatServer, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.url + "/chat/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _with(body: dict, path: tuple, value) -> dict:
    body = json.loads(json.dumps(body))
    target = body
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return body


_DELETE = object()


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("seed_x",), 1, "Unrecognized request argument supplied: seed_x"),
        (("stream",), True, "'stream' is a chat-completions parameter this test server does not implement."),
        (("model",), _DELETE, "Missing required parameter: 'model'."),
        (("model",), 3, "Invalid type for 'model'"),
        (("max_tokens",), 0, "Invalid 'max_tokens': integer below minimum value"),
        (("max_tokens",), 1.5, "Invalid type for 'max_tokens'"),
        (("temperature",), 2.5, "Invalid 'temperature': expected a value in [0, 2]"),
        (("temperature",), True, "Invalid type for 'temperature'"),
        (("top_logprobs",), 5, "'logprobs' must be set to true when 'top_logprobs' is used"),
        (("logprobs",), "yes", "Invalid type for 'logprobs'"),
        (("messages",), [], "Invalid 'messages': empty array"),
        (("messages", 0, "role"), "tool", "Invalid value for 'messages[0].role'"),
        (("messages", 0, "role"), "system", "image_url parts are only allowed in user messages"),
        (("messages", 0, "content", 0, "kind"), "x", "a text part is"),
        (("messages", 0, "content", 1, "type"), "image", "Invalid value for 'messages[0].content[1].type'"),
        (("messages", 0, "content", 1, "image_url", "detail"), "ultra", "image_url.detail"),
        (("messages", 0, "content", 1, "image_url", "url"), "https://example.com/a.png", "takes base64 data URLs only"),
        (("messages", 0, "content", 1, "image_url", "url"), "data:image/png;base64,bm90IGEgcG5n", "the image could not be decoded"),
        (("messages", 0, "content", 1, "image_url", "url"), "data:image/jpeg;base64,", "the image could not be decoded"),
    ],
)
def test_the_server_refuses_a_request_outside_the_schema(server, path, value, message):
    body = judge(server).request_body(images(1)[0], "p")
    status, answer = _post(server, body)  # control: the reward's own request is accepted
    assert status == 200 and answer["object"] == "chat.completion"
    if path == ("top_logprobs",):
        body["logprobs"] = False
    status, answer = _post(server, _with(body, path, value))
    assert status == 400
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert message in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"


def test_the_server_answers_a_well_formed_chat_completion(server):
    body = judge(server, "--vlm-score-mode", "yes_no").request_body(images(1)[0], "p")
    body["top_logprobs"] = 3
    status, answer = _post(server, body)
    assert status == 200
    assert set(answer) == {"id", "object", "created", "model", "choices", "usage", "system_fingerprint"}
    (choice,) = answer["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == choice["logprobs"]["content"][0]["token"]
    assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 3
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    status, answer = _post(server, b"{not json")
    assert status == 400 and answer["error"]["message"] == "We could not parse the JSON body of your request."


# ---------------------------------------------------------------------------------------
# through the core's scorer


def test_the_scorer_masks_and_counts_a_sample_the_judge_failed(server):
    from miles_core.training.rewards import RewardScorer

    server.plan("500", 2)  # the first sample's two attempts (one request at a time)
    config = config_for(
        "--rm-type",
        "vlm_judge",
        "--vlm-url",
        server.url,
        "--vlm-model",
        server.model,
        *FAST,
        "--rm-max-retries",
        "1",
        "--rm-max-in-flight",
        "1",
    )
    outputs = images(3, seed=9)
    samples = [SimpleNamespace(pixels=x, prompt=f"p{i}", metadata={}, reward=None) for i, x in enumerate(outputs)]
    scorer = RewardScorer(config)
    rewards = asyncio.run(scorer.score(samples)).tolist()
    assert math.isnan(rewards[0]) and samples[0].reward_failed and samples[0].remove_sample
    assert rewards[1:] == pytest.approx([float(number_answer(brightness(as_uint8(x)))) / 10 for x in outputs[1:]], abs=1e-6)
    metrics = scorer.finish(samples)
    assert metrics["rollout/reward/vlm_judge_failed"] == 1
    assert metrics["rollout/reward/vlm_judge/requests"] == 3 and metrics["rollout/reward/vlm_judge/retries"] == 1
