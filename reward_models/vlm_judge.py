"""A vision-language model as judge, over an OpenAI-compatible chat endpoint (vLLM, SGLang, or
``scripts/serve_vlm_judge.py`` for local tests).

One request per image, ``concurrency`` of them in flight::

    POST {base_url}/v1/chat/completions
    {"model": "<model>", "temperature": 0, "max_tokens": 8,
     "logprobs": true, "top_logprobs": 20,                       # mode "yes_no" only
     "messages": [{"role": "system", "content": "<system_prompt>"},          # when given
                  {"role": "user", "content": [
                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
                      {"type": "text", "text": "<prompt_template with {prompt} filled in>"}]}],
     ...request_kwargs}                                           # seed, top_p, a server's own fields

Scores, in ``[0, 1]``:

- ``mode: yes_no``: ``P(Yes)`` at the first answer token that holds a letter, the sum of ``exp(logprob)`` over the
  ``top_logprobs`` entries that read "yes" in any case and spacing (a "yes" outside the top k counts
  as 0, as in VQAScore's ``P("Yes" | image, question)``). A server that returns no logprobs gets
  the answer text read instead: 1 if its first word is "yes", 0 if "no".
- ``mode: score``: the first match of ``score_pattern`` (one group holding a number, by default the
  N of "Score: N") mapped from ``score_range = [low, high]`` to ``[0, 1]`` and clipped there.

An answer that cannot be read is a one-line RewardError quoting its first 100 characters. HTTP
failures are retried as the ``remote`` reward retries them (:func:`reward_models.remote.post_with_retries`).
The API key, when the server needs one, is read from the environment variable named by
``api_key_env``; a config never holds the key itself.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from diffalign.errors import RewardError
from reward_models.base import check_images, register
from reward_models.remote import RetryPolicy, check_url, encode_png, post_with_retries

MODES = ("yes_no", "score")
DEFAULT_TEMPLATES = {
    "yes_no": 'Does this image show "{prompt}"? Answer Yes or No.',
    "score": 'How well does this image show "{prompt}"? Rate it from 0 to 10 and answer as "Score: N/10".',
}
DEFAULT_MAX_TOKENS = {"yes_no": 8, "score": 64}  # "Yes" is one token; a score may follow a sentence
DEFAULT_SCORE_PATTERN = r"[Ss]core\s*[:=]?\s*(-?\d+(?:\.\d+)?)"
MAX_TOP_LOGPROBS = 20  # the OpenAI API's limit, and vLLM's default maximum
ANSWER_EXCERPT = 100  # characters of an unreadable answer quoted in the error


@register("vlm_judge")
class VlmJudge:
    """Scores each image with a VLM's answer about its prompt (formats in the module docstring).

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted).
        model: the served model name the server expects.
        mode: ``yes_no`` (P(Yes), or the answer's yes / no) or ``score`` (a number parsed from the answer).
        prompt_template: the question; ``{prompt}`` is replaced by the image's prompt.
        system_prompt: an optional system message.
        score_pattern: ``score`` mode: a regex with one group that captures the number.
        score_range: ``score`` mode: ``[low, high]`` of the judge's scale, mapped to ``[0, 1]``.
        max_tokens: answer length limit (default 8 for yes_no, 64 for score).
        temperature: 0 asks for greedy answers (the same image gets the same score).
        top_logprobs: ``yes_no`` mode: alternatives per token the server reports (0 asks for no logprobs).
        api_key_env: name of an environment variable holding the API key (sent as a Bearer token).
        timeout, retries, backoff, max_backoff: as for the ``remote`` reward (per request).
        concurrency: requests in flight at once (threads).
        max_image_size: longer image sides above this many pixels are shrunk before sending; null keeps them.
        request_kwargs: more fields of the request body (``seed``, ``top_p``, a server's own options).
        device: accepted for the common factory signature; scores are returned on the CPU.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        mode: str = "yes_no",
        prompt_template: str | None = None,
        system_prompt: str | None = None,
        score_pattern: str = DEFAULT_SCORE_PATTERN,
        score_range: Sequence[float] = (0.0, 10.0),
        max_tokens: int | None = None,
        temperature: float = 0.0,
        top_logprobs: int = MAX_TOP_LOGPROBS,
        api_key_env: str | None = None,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        concurrency: int = 8,
        max_image_size: int | None = 1024,
        request_kwargs: dict[str, Any] | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        name = "vlm_judge"
        check_url(name, "base_url", base_url)
        if not isinstance(model, str) or not model:
            raise RewardError(f"{name}: model must be the served model's name, got {model!r}")
        if mode not in MODES:
            raise RewardError(f"{name}: mode must be one of {', '.join(MODES)}, got {mode!r}")
        template = DEFAULT_TEMPLATES[mode] if prompt_template is None else prompt_template
        if not isinstance(template, str) or "{prompt}" not in template:
            raise RewardError(f"{name}: prompt_template must contain {{prompt}}, got {template!r}")
        try:
            pattern = re.compile(score_pattern)
        except (re.error, TypeError) as exc:
            raise RewardError(f"{name}: score_pattern is not a regular expression: {exc}") from None
        if pattern.groups != 1:
            raise RewardError(f"{name}: score_pattern must have exactly one group (the number), got {score_pattern!r}")
        if not (isinstance(score_range, (list, tuple)) and len(score_range) == 2
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in score_range)
                and score_range[0] < score_range[1]):
            raise RewardError(f"{name}: score_range must be [low, high] with low < high, got {score_range!r}")
        max_tokens = DEFAULT_MAX_TOKENS[mode] if max_tokens is None else max_tokens
        for field, value, low in (("max_tokens", max_tokens, 1), ("concurrency", concurrency, 1),
                                  ("top_logprobs", top_logprobs, 0), ("max_image_size", max_image_size, 1)):
            if value is None and field == "max_image_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RewardError(f"{name}: {field} must be an integer >= {low}, got {value!r}")
        if top_logprobs > MAX_TOP_LOGPROBS:
            raise RewardError(f"{name}: top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {top_logprobs!r}")
        if request_kwargs is not None and not isinstance(request_kwargs, dict):
            raise RewardError(f"{name}: request_kwargs must be a mapping, got {request_kwargs!r}")
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key_env is not None:
            key = os.environ.get(str(api_key_env))
            if not key:
                raise RewardError(f"{name}: api_key_env names the environment variable {api_key_env!r}, which is not set")
            self.headers["Authorization"] = f"Bearer {key}"
        root = base_url.rstrip("/")
        self.url = (root if root.endswith("/v1") else root + "/v1") + "/chat/completions"
        self.model, self.mode, self.template, self.system_prompt = model, mode, template, system_prompt
        self.pattern, self.score_range = pattern, (float(score_range[0]), float(score_range[1]))
        self.max_tokens, self.temperature, self.top_logprobs = max_tokens, float(temperature), top_logprobs
        self.policy = RetryPolicy.checked(name, timeout, retries, backoff, max_backoff)
        self.concurrency, self.max_image_size = concurrency, max_image_size
        self.request_kwargs = dict(request_kwargs or {})
        self.label = f"{name} {self.url}"
        self.last_info: dict[str, float] = {}
        self.transient_retries = 0  # attempts repeated after a transient failure, since construction (metrics: reward_retries)
        self._lock = threading.Lock()

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        check_images(images)
        batch = images.shape[0]
        if len(prompts) != batch:
            raise RewardError(f"vlm_judge: got {batch} images and {len(prompts)} prompts")
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, batch))) as pool:
            scores = list(pool.map(self._score_one, range(batch), images.detach().cpu(), prompts))
        if batch:
            self.last_info = {"judge_seconds_per_image": (time.perf_counter() - start) / batch}
        return torch.tensor(scores, dtype=torch.float32)

    def request_body(self, image: torch.Tensor, prompt: str) -> dict[str, Any]:
        """The JSON body sent for one ``(3, H, W)`` image and its prompt."""
        url = "data:image/png;base64," + encode_png(image, self.max_image_size)
        user = [{"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": self.template.replace("{prompt}", prompt)}]
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        body: dict[str, Any] = {"model": self.model, "messages": [*messages, {"role": "user", "content": user}],
                                "max_tokens": self.max_tokens, "temperature": self.temperature}
        if self.mode == "yes_no" and self.top_logprobs > 0:
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        return {**body, **self.request_kwargs}

    def _score_one(self, index: int, image: torch.Tensor, prompt: str) -> float:
        data = json.dumps(self.request_body(image, prompt)).encode("utf-8")
        raw = post_with_retries(self.url, data, self.headers, self.policy, self.label, self._count_retry)
        answer, logprobs = self._read_choice(raw)
        if self.mode == "score":
            return self._numeric_score(answer, index)
        if logprobs:
            return yes_probability(answer_token(logprobs))
        return self._yes_no_from_text(answer, index)

    def _count_retry(self) -> None:
        with self._lock:  # retries happen in several threads at once
            self.transient_retries += 1

    def _read_choice(self, raw: bytes) -> tuple[str, list[dict]]:
        """(answer text, per-token logprob entries or []) of the first choice."""
        try:
            answer = json.loads(raw)
            choice = answer["choices"][0]
            text = choice["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError):
            excerpt = raw[:ANSWER_EXCERPT].decode("utf-8", "replace").replace("\n", " ")
            raise RewardError(f"{self.label}: not a chat completion: {excerpt!r}") from None
        content = (choice.get("logprobs") or {}).get("content") or []
        return str(text), content if isinstance(content, list) else []

    def _numeric_score(self, answer: str, index: int) -> float:
        match = self.pattern.search(answer)
        if match is None:
            raise RewardError(f"vlm_judge: answer {index} has no score matching {self.pattern.pattern!r}: "
                              f"{_excerpt(answer)!r}")
        low, high = self.score_range
        return min(max((float(match.group(1)) - low) / (high - low), 0.0), 1.0)

    def _yes_no_from_text(self, answer: str, index: int) -> float:
        words = re.findall(r"[A-Za-z]+", answer)
        first = words[0].lower() if words else ""
        if first in ("yes", "no"):
            return 1.0 if first == "yes" else 0.0
        raise RewardError(f"vlm_judge: answer {index} is neither yes nor no: {_excerpt(answer)!r}")


def answer_token(content: list[dict]) -> dict:
    """The logprob entry of the first answer token holding a letter: "Yes" in "**Yes**" or " Yes"
    (the first token when none does)."""
    for entry in content:
        if isinstance(entry, dict) and re.search(r"[A-Za-z]", str(entry.get("token", ""))):
            return entry
    return content[0]


def yes_probability(entry: dict) -> float:
    """P(yes) at one answer token from its logprob entry ``{"token", "logprob", "top_logprobs": [...]}``:
    the summed probability of the alternatives that read "yes" (0 when none of the top k does). A
    NaN logprob gives NaN, which the trainer counts as a non-finite reward."""
    candidates = entry.get("top_logprobs") or [entry]
    total = 0.0
    for candidate in candidates:
        if str(candidate.get("token", "")).strip().lower() == "yes":
            total += math.exp(float(candidate["logprob"]))
    return min(total, 1.0) if not math.isnan(total) else total


def _excerpt(answer: str) -> str:
    return answer[:ANSWER_EXCERPT].replace("\n", " ")
