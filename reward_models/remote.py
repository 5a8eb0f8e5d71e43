"""A reward computed by an HTTP server (a big judge model on another machine, a VLM service, ...).

Wire format (one POST per chunk of ``batch_size`` images):

    POST <url>
    Content-Type: application/json
    {"images":   ["<base64 of a PNG>", ...],      # RGB, 8 bits, the images' own size
     "prompts":  ["a cat", ...],                   # same length and order
     "metadata": [{...}, ...]}                      # same length; must be JSON-serialisable

    200 OK
    Content-Type: application/json
    {"scores": [0.73, ...]}                         # one number per image, same order

PNG keeps the pixels exact after rounding to 8 bits (``round(255 * x)``); base64 in JSON costs a
third more bytes than multipart but keeps images, prompts and metadata in one self-describing body
that any web framework parses.

Failures: connection errors, timeouts, HTTP 5xx and 429 are retried ``retries`` times with
exponential backoff (``backoff * 2**k`` seconds, at most ``max_backoff``); other HTTP errors, a
body that is not JSON, a missing ``scores`` list, a wrong length or a non-numeric score raise at
once. Every failure is a one-line ``RewardError`` naming the URL. ``null`` scores become NaN (the
trainer counts and masks non-finite rewards). Only the standard library is used (urllib); proxies
come from the usual ``*_proxy`` environment variables.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import logging
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from diffalign.errors import RewardError
from reward_models.base import check_images, register

logger = logging.getLogger(__name__)

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})  # overloaded or restarting servers
_BODY_EXCERPT = 200  # characters of an error body quoted in messages


def encode_png(image: torch.Tensor, max_size: int | None = None) -> str:
    """``(3, H, W)`` in [0, 1] -> base64 of an 8-bit RGB PNG; with ``max_size``, an image whose longer
    side exceeds it is first shrunk (bicubic, aspect ratio kept) to that many pixels."""
    from PIL import Image

    pixels = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    picture = Image.fromarray(pixels, mode="RGB")
    if max_size is not None and max(picture.size) > max_size:
        scale = max_size / max(picture.size)
        size = (max(1, round(picture.width * scale)), max(1, round(picture.height * scale)))
        picture = picture.resize(size, Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


@dataclass(frozen=True)
class RetryPolicy:
    """How an HTTP reward client waits: ``timeout`` seconds for connecting and for each read,
    ``retries`` extra attempts after a transient failure, waits ``backoff * 2**k`` capped at ``max_backoff``."""

    timeout: float = 60.0
    retries: int = 3
    backoff: float = 1.0
    max_backoff: float = 30.0

    @classmethod
    def checked(cls, name: str, timeout: float, retries: int, backoff: float, max_backoff: float) -> "RetryPolicy":
        """The policy from a reward's keyword arguments; a RewardError naming ``name`` and the field."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise RewardError(f"{name}: timeout must be positive, got {timeout!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise RewardError(f"{name}: retries must be a non-negative integer, got {retries!r}")
        return cls(float(timeout), retries, max(0.0, float(backoff)), max(0.0, float(max_backoff)))


def check_url(name: str, field: str, url: Any) -> None:
    """A RewardError naming ``name`` and ``field`` unless ``url`` is an http(s) URL."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise RewardError(f"{name}: {field} must start with http:// or https://, got {url!r}")


def post_with_retries(url: str, body: bytes, headers: dict[str, str], policy: RetryPolicy, label: str,
                      on_retry: Callable[[], None] | None = None) -> bytes:
    """POST ``body`` to ``url``; the answer's body. Connection errors, timeouts, 5xx and 429 are retried
    as ``policy`` says (``on_retry()`` is called before each retry); other HTTP errors raise at once.
    Every failure is a one-line RewardError starting with ``label``. Safe to call from several threads."""
    attempts = policy.retries + 1
    for attempt in range(attempts):
        try:
            request = urllib.request.Request(url, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=policy.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as exc:  # the server answered with an error status
            excerpt = exc.read(_BODY_EXCERPT).decode("utf-8", "replace").replace("\n", " ").strip()
            reason = f"HTTP {exc.code} {exc.reason}" + (f": {excerpt}" if excerpt else "")
            if exc.code not in RETRY_STATUS:
                raise RewardError(f"{label}: {reason}") from None
        except TimeoutError:  # socket.timeout is TimeoutError since Python 3.10
            reason = f"timed out after {policy.timeout:g} s"
        except urllib.error.URLError as exc:  # refused, unreachable, DNS; a timeout while connecting
            timed_out = isinstance(exc.reason, TimeoutError)
            reason = f"timed out after {policy.timeout:g} s" if timed_out else f"cannot connect: {exc.reason}"
        except (http.client.HTTPException, OSError) as exc:  # connection dropped mid-answer
            reason = f"connection failed: {type(exc).__name__}: {exc}"
        if attempt < policy.retries:
            if on_retry is not None:
                on_retry()
            wait = min(policy.backoff * 2**attempt, policy.max_backoff)
            logger.warning("%s: %s; retry %d/%d in %.2gs", label, reason, attempt + 1, policy.retries, wait)
            time.sleep(wait)
    raise RewardError(f"{label}: {reason} (gave up after {attempts} attempts)")


@register("remote")
class RemoteReward:
    """Scores images by POSTing them to ``url`` (wire format in the module docstring).

    Args:
        url: the scoring endpoint (http or https).
        timeout: seconds allowed for connecting and for each read of the answer.
        retries: extra attempts after a connection error, timeout, 5xx or 429.
        backoff: seconds before the first retry; doubles each retry.
        max_backoff: cap on one wait, seconds.
        batch_size: images per request.
        headers: extra HTTP headers (e.g. an authorization header the caller supplies).
        device: accepted for the common factory signature; the work happens on the server and
            scores are returned on the CPU.
    """

    def __init__(
        self,
        url: str,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        batch_size: int = 32,
        headers: dict[str, str] | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        check_url("remote", "url", url)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise RewardError(f"remote: batch_size must be a positive integer, got {batch_size!r}")
        self.url = url
        self.policy = RetryPolicy.checked("remote", timeout, retries, backoff, max_backoff)
        self.batch_size = batch_size
        self.headers = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
        self.last_info: dict[str, float] = {}
        self.transient_retries = 0  # attempts repeated after a transient failure, since construction (metrics: reward_retries)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        check_images(images)
        batch = images.shape[0]
        if len(prompts) != batch or len(metadata) != batch:
            raise RewardError(
                f"remote: got {batch} images, {len(prompts)} prompts and {len(metadata)} metadata entries"
            )
        scores: list[float] = []
        for start in range(0, batch, self.batch_size):
            stop = min(start + self.batch_size, batch)
            body = self._encode(images[start:stop], prompts[start:stop], metadata[start:stop])
            scores.extend(self._parse(self._post(body), stop - start))
        return torch.tensor(scores, dtype=torch.float32)

    def _encode(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> bytes:
        payload = {
            "images": [encode_png(image) for image in images],
            "prompts": list(prompts),
            "metadata": list(metadata),
        }
        try:
            return json.dumps(payload, default=_json_default).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise RewardError(f"remote {self.url}: metadata cannot be sent as JSON: {exc}") from None

    def _post(self, body: bytes) -> bytes:
        """POST with retries; the answer's body, or a RewardError after the last attempt."""
        return post_with_retries(self.url, body, self.headers, self.policy, f"remote {self.url}", self._count_retry)

    def _count_retry(self) -> None:
        self.transient_retries += 1

    def _parse(self, raw: bytes, expected: int) -> list[float]:
        try:
            answer = json.loads(raw)
        except ValueError:
            excerpt = raw[:_BODY_EXCERPT].decode("utf-8", "replace").replace("\n", " ")
            raise RewardError(f"remote {self.url}: answer is not JSON: {excerpt!r}") from None
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list):
            got = f"keys {sorted(answer)}" if isinstance(answer, dict) else f"a JSON {type(answer).__name__}"
            raise RewardError(f"remote {self.url}: answer has no 'scores' list (got {got})")
        if len(scores) != expected:
            raise RewardError(f"remote {self.url}: got {len(scores)} scores for {expected} images")
        values = []
        for i, score in enumerate(scores):
            if score is None:
                values.append(math.nan)
            elif isinstance(score, (int, float)) and not isinstance(score, bool):
                values.append(float(score))
            else:
                raise RewardError(f"remote {self.url}: score {i} is not a number: {score!r}")
        return values
