"""The remote reward client against small HTTP servers on 127.0.0.1 (ephemeral ports, in threads).

Retry waits are a few milliseconds and timeouts a fraction of a second, so the file runs in about
a second; every server stops at the end of its test.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

import reward_models
from diffalign.errors import RewardError

QUICK_RETRIES = dict(backoff=0.001, max_backoff=0.01)  # retry waits in tests: milliseconds


def _decode_png(text: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(text))))  # (H, W, 3) uint8


@contextmanager
def serve(respond):
    """Run ``respond(request_json, call_index) -> (status, body)`` behind POST on 127.0.0.1:<free port>.

    ``body`` is bytes, or any other value sent as JSON. Yields ``(url, requests)``, where
    ``requests`` collects the decoded JSON bodies received.
    """
    received: list = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                received.append(payload)
                index = len(received) - 1
            status, body = respond(payload, index)
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up (timeout test): nothing to answer
                pass

        def log_message(self, *args):  # keep pytest's output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _images(batch: int = 3, seed: int = 0) -> torch.Tensor:
    pixels = torch.randint(0, 256, (batch, 3, 8, 6), generator=torch.Generator().manual_seed(seed))
    return pixels.float() / 255


def _mean_pixel_plus_prompt_length(payload, index):
    """A judge whose score depends on every field: mean pixel / 255 + len(prompt) + metadata["bonus"]."""
    scores = [
        float(_decode_png(image).mean()) / 255 + len(prompt) + meta.get("bonus", 0)
        for image, prompt, meta in zip(payload["images"], payload["prompts"], payload["metadata"])
    ]
    return 200, {"scores": scores}


def test_round_trip_in_chunks():
    images, prompts = _images(3), ["a", "bb", "ccc"]
    metadata = [{"bonus": 10}, {}, {"bonus": torch.tensor(20)}]  # tensors in metadata are sent as numbers
    with serve(_mean_pixel_plus_prompt_length) as (url, received):
        reward = reward_models.build("remote", url=url, batch_size=2, timeout=5, **QUICK_RETRIES)
        scores = reward(images, prompts, metadata)
    assert [len(r["images"]) for r in received] == [2, 1]  # batch_size images per request
    assert _decode_png(received[0]["images"][1]).shape == (8, 6, 3)  # PNG at the images' own size
    expected = images.mean(dim=(1, 2, 3)) + torch.tensor([1.0 + 10, 2.0, 3.0 + 20])
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-5)  # 8-bit images: PNG is lossless


def test_retries_connection_errors_and_5xx_then_succeeds():
    def flaky(payload, index):
        if index < 2:
            return 503, {"error": "warming up"}
        return 200, {"scores": [1.5] * len(payload["images"])}

    with serve(flaky) as (url, received):
        scores = reward_models.build("remote", url=url, retries=2, timeout=5, **QUICK_RETRIES)(_images(2), ["a", "b"], [{}, {}])
    assert len(received) == 3
    assert scores.tolist() == [1.5, 1.5]


def test_always_500_gives_up_naming_the_url():
    with serve(lambda payload, index: (500, b"model crashed")) as (url, received):
        reward = reward_models.build("remote", url=url, retries=2, timeout=5, **QUICK_RETRIES)
        with pytest.raises(RewardError, match=f"{url}: HTTP 500.*model crashed.*after 3 attempts") as info:
            reward(_images(1), ["a"], [{}])
    assert len(received) == 3 and "\n" not in str(info.value)


def test_client_errors_are_not_retried():
    with serve(lambda payload, index: (400, {"error": "bad prompt"})) as (url, received):
        with pytest.raises(RewardError, match="HTTP 400.*bad prompt"):
            reward_models.build("remote", url=url, retries=3, **QUICK_RETRIES)(_images(1), ["a"], [{}])
    assert len(received) == 1


def test_slow_server_times_out():
    def slow(payload, index):
        time.sleep(0.5)
        return 200, {"scores": [0.0]}

    with serve(slow) as (url, received):
        reward = reward_models.build("remote", url=url, timeout=0.1, retries=1, **QUICK_RETRIES)
        start = time.perf_counter()
        with pytest.raises(RewardError, match=f"{url}: timed out after 0.1 s.*after 2 attempts"):
            reward(_images(1), ["a"], [{}])
    assert time.perf_counter() - start < 0.9  # waiting for both answers would take >= 1 s


def test_connection_refused_is_retried_then_named():
    with serve(lambda payload, index: (200, {"scores": []})) as (url, _):
        pass  # the server is stopped: its port now refuses connections
    reward = reward_models.build("remote", url=url, retries=1, timeout=1, **QUICK_RETRIES)
    with pytest.raises(RewardError, match=f"{url}: cannot connect.*after 2 attempts"):
        reward(_images(1), ["a"], [{}])


@pytest.mark.parametrize(
    "body, message",
    [
        ({"scores": [1.0, 2.0]}, "got 2 scores for 3 images"),
        ({"scores": [1.0, "high", 2.0]}, "score 1 is not a number: 'high'"),
        ({"scores": [1.0, True, 2.0]}, "score 1 is not a number: True"),
        ({"score": [1.0, 2.0, 3.0]}, "no 'scores' list \\(got keys \\['score'\\]\\)"),
        (b"<html>oops</html>", "answer is not JSON"),
    ],
)
def test_malformed_answers(body, message):
    with serve(lambda payload, index: (200, body)) as (url, received):
        with pytest.raises(RewardError, match=message):
            reward_models.build("remote", url=url, **QUICK_RETRIES)(_images(3), ["a", "b", "c"], [{}, {}, {}])
    assert len(received) == 1  # a server bug is not retried


def test_null_scores_become_nan():
    with serve(lambda payload, index: (200, {"scores": [None, 2]})) as (url, _):
        scores = reward_models.build("remote", url=url, **QUICK_RETRIES)(_images(2), ["a", "b"], [{}, {}])
    assert torch.isnan(scores[0]) and scores[1] == 2.0


def test_bad_arguments_and_inputs():
    with pytest.raises(RewardError, match="url must start with http"):
        reward_models.build("remote", url="127.0.0.1:8000")
    with pytest.raises(RewardError, match="retries must be"):
        reward_models.build("remote", url="http://127.0.0.1:9/", retries=-1)
    reward = reward_models.build("remote", url="http://127.0.0.1:9/")  # never contacted below
    with pytest.raises(RewardError, match="2 images, 1 prompts"):
        reward(_images(2), ["a"], [{}, {}])
    with pytest.raises(RewardError, match="metadata cannot be sent as JSON"):
        reward(_images(1), ["a"], [{"obj": object()}])


# ---- a training run against a failing server --------------------------------------------------
def _train_args(out, url, *extra):
    from tests.helpers.tiny_run import FAST

    return ["train", "configs/tiny/flow_grpo_sd3.yaml", f"output_dir={out}", "max_iterations=2", *FAST,
            "sampling.num_steps=3", "rollout.group_size=2", "reward.name=remote", f"reward.kwargs.url={url}",
            "reward.kwargs.timeout=0.3", "reward.kwargs.retries=1", "reward.kwargs.backoff=0.001", *extra]


def _good(payload, index):
    return 200, {"scores": [float(_decode_png(image).mean()) / 255 for image in payload["images"]]}


def _slow(payload, index):
    time.sleep(0.6)  # longer than the client's timeout (0.3 s)
    return _good(payload, index)


SERVER_FAULTS = {
    "timeout": _slow,
    "http_500": lambda payload, index: (500, b"internal error"),
    "garbage_json": lambda payload, index: (200, b"{scores: [1, 2"),
    "wrong_count": lambda payload, index: (200, {"scores": [0.5]}),
}


@pytest.mark.parametrize("fault", list(SERVER_FAULTS))
def test_failing_server_stops_training_with_a_checkpoint(fault, tmp_path, capsys):
    from diffalign import runs
    from tests.helpers.tiny_run import run_cli

    out = tmp_path / "run"
    with serve(SERVER_FAULTS[fault]) as (url, received):
        code = run_cli(*_train_args(out, url, "reward.max_failures=1"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: stopped: remote " + url) and "reward.max_failures=1" in err[-1]
    assert "Traceback" not in "\n".join(err)
    retried = fault in ("timeout", "http_500")  # transient: the client tried twice per call
    assert len(received) == (4 if retried else 2)  # 2 failed calls (max_failures=1 tolerates one)
    state = runs.load_checkpoint(runs.latest_checkpoint(out))
    assert state["iteration"] == 0 and state["stats"]["reward_failures"] == 2
    assert state["stats"].get("reward_retries", 0) == (2 if retried else 0)


def test_resume_after_the_server_is_back_equals_an_uninterrupted_run(tmp_path):
    from safetensors.torch import load_file

    from diffalign import runs
    from tests.helpers.tiny_run import run_cli

    ref, out = tmp_path / "ref", tmp_path / "run"
    with serve(_good) as (url, _):
        assert run_cli(*_train_args(ref, url)) == 0
    with serve(SERVER_FAULTS["garbage_json"]) as (url, _):
        assert run_cli(*_train_args(out, url, "reward.max_failures=0")) == 2
    with serve(_good) as (url, _):  # the server is back, on another port
        assert run_cli("resume", str(out), f"reward.kwargs.url={url}") == 0
    a, b = (load_file(str(d / "final" / "pytorch_lora_weights.safetensors")) for d in (ref, out))
    assert all(torch.equal(a[k], b[k]) for k in a)
    skip = ("seconds", "time/", "reward_failures")
    ra, rb = ([{k: v for k, v in r.items() if not any(s in k for s in skip)} for r in runs.read_jsonl(d / "metrics.jsonl")]
              for d in (ref, out))
    assert ra == rb
    assert [r["reward_failures"] for r in runs.read_jsonl(out / "metrics.jsonl") if not r.get("eval")] == [1, 1]


def test_transient_error_is_retried_and_counted(tmp_path):
    from diffalign import runs
    from tests.helpers.tiny_run import run_cli

    out = tmp_path / "run"
    with serve(lambda payload, index: (503, b"busy") if index == 0 else _good(payload, index)) as (url, _):
        assert run_cli(*_train_args(out, url, "max_iterations=1")) == 0
    record = [r for r in runs.read_jsonl(out / "metrics.jsonl") if not r.get("eval")][0]
    assert record["reward_retries"] == 1 and "reward_failures" not in record


def test_nan_scores_are_counted_and_skipped(tmp_path):
    from diffalign import runs
    from tests.helpers.tiny_run import run_cli

    out = tmp_path / "run"

    def some_null(payload, index):
        status, body = _good(payload, index)
        body["scores"][0] = None  # the wire's NaN
        return status, body

    with serve(some_null) as (url, _):
        assert run_cli(*_train_args(out, url, "max_iterations=1", "reward.nonfinite=skip")) == 0
    record = [r for r in runs.read_jsonl(out / "metrics.jsonl") if not r.get("eval")][0]
    assert record["nonfinite_rewards"] >= 1
