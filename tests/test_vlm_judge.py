"""The vlm_judge reward against a real server process: scripts/serve_vlm_judge.py serving a tiny random
LLaVA (built in code, saved, loaded with from_pretrained, answers from generate()) on 127.0.0.1.

The model is random, so the tests check the pipeline, not the judgement: the request's form, the image
reaching the model (different images, different P(Yes)), answers read from logprobs and from text,
scores in [0, 1], greedy answers repeatable, order kept under concurrency, retries and errors. One
server serves the whole file (its start, importing torch and transformers, is most of the time).
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

import reward_models
from diffalign.errors import RewardError
from reward_models.vlm_judge import answer_token, yes_probability

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from serve_vlm_judge import TINY_VOCAB  # noqa: E402  (the script is not a package)

MODEL = "tiny-vlm"
QUICK = dict(backoff=0.01, max_backoff=0.01, timeout=10)
STARTUP_SECONDS = 90  # the server's start on a busy 2-core machine, with margin


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _images(batch: int, seed: int = 0, size: int = 24) -> torch.Tensor:
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _judge(url: str, **kwargs):
    return reward_models.build("vlm_judge", base_url=url, model=MODEL, **{**QUICK, **kwargs})


def _force(word: str) -> dict:
    """request_kwargs making the tiny model answer ``word`` at every step (OpenAI's logit_bias)."""
    return {"logit_bias": {str(TINY_VOCAB.index(word)): 100}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server process on a free port. Its first request is sent while the server is still
    starting: refused connections are retried until it answers."""
    folder = tmp_path_factory.mktemp("vlm")
    port = _free_port()
    log = open(folder / "server.log", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "serve_vlm_judge.py"), "--tiny",
                                str(folder / "model"), "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    judge = _judge(url, retries=STARTUP_SECONDS * 10, backoff=0.1, max_backoff=0.1)
    try:
        first = judge(_images(1), ["a red square"], [{}])
        yield {"url": url, "first": first, "first_retries": judge.transient_retries, "process": process}
    except RewardError:
        pytest.fail("the server did not start: " + (folder / "server.log").read_text()[-2000:])
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()


def test_first_request_is_retried_until_the_server_is_up(server):
    assert server["first_retries"] > 0  # the server cannot be listening before torch is imported
    assert 0 <= server["first"].item() <= 1 and server["process"].poll() is None


def test_yes_probability_from_logprobs_matches_the_servers_answer(server):
    images = _images(4)
    judge = _judge(server["url"], concurrency=4)
    scores = judge(images, ["a cat"] * 4, [{}] * 4)
    assert scores.dtype == torch.float32 and scores.shape == (4,)
    assert torch.isfinite(scores).all() and (scores >= 0).all() and (scores <= 1).all()
    assert len(set(scores.tolist())) == 4  # each image reached the model: different images, different P(Yes)
    # the same request by hand: P(Yes) over the whole 20-word vocabulary (top_logprobs lists all of it)
    body = json.dumps(judge.request_body(images[2], "a cat")).encode()
    request = urllib.request.Request(judge.url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        answer = json.loads(response.read())
    first = answer_token(answer["choices"][0]["logprobs"]["content"])["top_logprobs"]
    assert len(first) == len(TINY_VOCAB) and abs(sum(math.exp(t["logprob"]) for t in first) - 1) < 1e-4
    expected = sum(math.exp(t["logprob"]) for t in first if t["token"] == "Yes")
    assert scores[2].item() == pytest.approx(expected, rel=1e-5)


def test_greedy_answers_repeat_and_concurrency_keeps_the_order(server):
    images = _images(3, seed=1)
    batch = torch.cat([images, images.flip(0), images])  # 9 images, 3 distinct
    scores = _judge(server["url"], concurrency=5)(batch, ["a dog"] * 9, [{}] * 9)
    one_by_one = _judge(server["url"], concurrency=1)(images, ["a dog"] * 3, [{}] * 3)
    torch.testing.assert_close(scores, torch.cat([one_by_one, one_by_one.flip(0), one_by_one]), rtol=0, atol=0)


def test_answers_read_from_text_without_logprobs(server):
    images = _images(2)
    yes = _judge(server["url"], top_logprobs=0, request_kwargs=_force("Yes"))(images, ["a", "b"], [{}, {}])
    no = _judge(server["url"], top_logprobs=0, request_kwargs=_force("No"))(images, ["a", "b"], [{}, {}])
    assert yes.tolist() == [1.0, 1.0] and no.tolist() == [0.0, 0.0]


def test_numeric_scores_are_parsed_and_normalised(server):
    sevens = dict(mode="score", score_pattern=r"(\d+)", request_kwargs=_force("7"))
    assert _judge(server["url"], **sevens)(_images(2), ["a", "b"], [{}, {}]).tolist() == pytest.approx([0.7, 0.7])
    clipped = _judge(server["url"], score_range=[0, 5], **sevens)(_images(1), ["a"], [{}])
    assert clipped.tolist() == [1.0]  # 7 on a 0..5 scale


def test_unreadable_answers_name_the_reward_and_quote_100_characters(server):
    judge = _judge(server["url"], mode="score", max_tokens=80, request_kwargs=_force("Score"))  # "Score Score ..." has no number
    with pytest.raises(RewardError) as info:
        judge(_images(1), ["a"], [{}])
    message = str(info.value)
    assert message.startswith("vlm_judge: answer 0 has no score matching")
    assert "'" + "Score " * 16 + "Scor'" in message  # the first 100 characters of the answer
    judge = _judge(server["url"], top_logprobs=0, request_kwargs=_force("Score"))
    with pytest.raises(RewardError, match="vlm_judge: answer 0 is neither yes nor no: 'Score Score"):
        judge(_images(1), ["a"], [{}])


def test_wrong_model_name_is_not_retried(server):
    judge = reward_models.build("vlm_judge", base_url=server["url"] + "/v1/", model="other", retries=3, **QUICK)
    with pytest.raises(RewardError, match="HTTP 404.*The model `other` does not exist"):
        judge(_images(1), ["a"], [{}])
    assert judge.transient_retries == 0


def test_no_server_is_retried_then_named():
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    judge = _judge(url, retries=2)
    with pytest.raises(RewardError, match=f"vlm_judge {url}/v1/chat/completions: cannot connect.*after 3 attempts"):
        judge(_images(2), ["a", "b"], [{}, {}])
    assert judge.transient_retries == 4  # 2 images x 2 retries, counted across threads


def test_request_body_and_image_size():
    judge = reward_models.build("vlm_judge", base_url="http://127.0.0.1:9", model="m", max_image_size=10,
                                system_prompt="Be strict.", request_kwargs={"seed": 3})
    body = judge.request_body(torch.rand(3, 20, 40), "a red cat")
    from PIL import Image

    system, user = body["messages"]
    assert system == {"role": "system", "content": "Be strict."} and user["role"] == "user"
    image_part, text_part = user["content"]
    header, data = image_part["image_url"]["url"].split(",")
    assert header == "data:image/png;base64"
    assert Image.open(io.BytesIO(base64.b64decode(data))).size == (10, 5)  # longer side shrunk to 10, aspect kept
    assert text_part == {"type": "text", "text": 'Does this image show "a red cat"? Answer Yes or No.'}
    assert body["logprobs"] is True and body["top_logprobs"] == 20 and body["temperature"] == 0 and body["seed"] == 3
    assert judge.url == "http://127.0.0.1:9/v1/chat/completions"


def test_yes_probability_sums_yes_spellings_and_keeps_nan():
    entry = {"token": "Yes", "logprob": math.log(0.5), "top_logprobs": [
        {"token": "Yes", "logprob": math.log(0.5)}, {"token": " yes", "logprob": math.log(0.2)},
        {"token": "No", "logprob": math.log(0.3)}]}
    assert yes_probability(entry) == pytest.approx(0.7)
    assert yes_probability({"token": "No", "logprob": -0.1, "top_logprobs": []}) == 0.0
    assert math.isnan(yes_probability({"token": "Yes", "logprob": float("nan")}))  # counted by the trainer
    markup = {"token": "**", "logprob": -0.1}
    assert answer_token([markup, entry, markup]) is entry  # "**Yes**": the word, not the markup
    assert answer_token([markup]) is markup


def test_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    with pytest.raises(RewardError, match="api_key_env names the environment variable 'JUDGE_KEY', which is not set"):
        reward_models.build("vlm_judge", base_url="http://127.0.0.1:9", model="m", api_key_env="JUDGE_KEY")
    monkeypatch.setenv("JUDGE_KEY", "secret")
    judge = reward_models.build("vlm_judge", base_url="http://127.0.0.1:9", model="m", api_key_env="JUDGE_KEY")
    assert judge.headers["Authorization"] == "Bearer secret"
    with pytest.raises(RewardError, match="bad arguments.*api_key"):
        reward_models.build("vlm_judge", base_url="http://127.0.0.1:9", model="m", api_key="secret")


@pytest.mark.parametrize("kwargs, message", [
    (dict(base_url="127.0.0.1:8000"), "base_url must start with http"),
    (dict(model=""), "model must be"),
    (dict(mode="rank"), "mode must be one of yes_no, score"),
    (dict(prompt_template="Is it good?"), "prompt_template must contain {prompt}"),
    (dict(score_pattern=r"\d+"), "score_pattern must have exactly one group"),
    (dict(score_pattern="("), "score_pattern is not a regular expression"),
    (dict(score_range=[10, 0]), "score_range must be"),
    (dict(concurrency=0), "concurrency must be an integer >= 1"),
    (dict(top_logprobs=50), "top_logprobs must be at most 20"),
    (dict(timeout=0), "timeout must be positive"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(RewardError, match=f"vlm_judge: {message}"):
        reward_models.build("vlm_judge", **{"base_url": "http://127.0.0.1:9", "model": "m", **kwargs})
    assert "vlm_judge" in reward_models.available()
