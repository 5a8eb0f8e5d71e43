"""The ocr reward: the edit-distance math on strings, and Tesseract on rendered text images.

The image tests need tesserocr and Tesseract's English model (scripts/setup.sh and .ci/run install
them); they skip where either is missing.
"""

from __future__ import annotations

import pytest
import torch

import reward_models
from diffalign.errors import RewardError
from reward_models.ocr import edit_distance, ocr_accuracy, render_text, target_text


@pytest.mark.parametrize("a, b, distance", [
    ("kitten", "sitting", 3),  # k->s, e->i, +g
    ("flaw", "lawn", 2),  # -f, +n
    ("", "abc", 3), ("abc", "", 3), ("abc", "abc", 0), ("abc", "acb", 2), ("a", "b", 1),
])
def test_edit_distance(a, b, distance):
    assert edit_distance(a, b) == distance == edit_distance(b, a)


@pytest.mark.parametrize("recognised, target, reward", [
    ("OPEN SOON", "open soon", 1.0),  # spaces and case do not count
    ("Grand OPEN SOON!", "OPEN SOON", 1.0),  # the target inside more text: distance 0
    ("OPEN S00N", "OPEN SOON", 1 - 2 / 8),  # two substitutions over 8 characters
    ("OPEN", "OPEN SOON", 1 - 4 / 8),  # four deletions
    ("", "OPEN SOON", 0.0),
    ("completely different words", "cat", 0.0),  # distance clipped to |t| = 3
])
def test_ocr_accuracy(recognised, target, reward):
    assert ocr_accuracy(recognised, target) == pytest.approx(reward)


def test_target_text():
    assert target_text('A neon sign that says "OPEN SOON" at night', {}) == "OPEN SOON"
    assert target_text("A poster reading \u201cHello\u201d", {}) == "Hello"
    assert target_text('a sign "ignored"', {"text": "Given"}) == "Given"
    for prompt in ("a sign with no quotes", 'an empty sign ""'):
        with pytest.raises(RewardError, match='ocr: prompt .* has no text in double quotes'):
            target_text(prompt, {})


def _tesseract_or_skip():
    try:
        return reward_models.build("ocr")
    except RewardError as exc:
        pytest.skip(f"Tesseract not available: {exc}")


def test_rendered_text_images():
    reward = _tesseract_or_skip()
    prompts = ['a sign that says "OPEN SOON"'] * 3 + ['a poster with "diffalign 2026"']
    images = render_text(["OPEN SOON", "", "CLOSED", "diffalign 2026"])  # exact, blank, wrong text, exact
    scores = reward(images, prompts, [{}] * 4)
    assert scores.dtype == torch.float32 and scores.shape == (4,)
    assert scores[0] >= 0.9 and scores[3] >= 0.9, reward.last_texts
    assert scores[1] == 0.0 and scores[2] < 0.5, reward.last_texts
    assert 0 < reward.last_info["ocr_exact"] <= 0.5 and reward.last_info["ocr_seconds_per_image"] > 0


def test_reader_errors_are_named():
    pytest.importorskip("tesserocr")
    with pytest.raises(RewardError, match="ocr: no eng.traineddata in tessdata='/nonexistent'"):
        reward_models.build("ocr", tessdata="/nonexistent")
    with pytest.raises(RewardError, match="ocr: no eng.traineddata and zzz.traineddata in"):
        reward_models.build("ocr", lang="eng+zzz")
    with pytest.raises(RewardError, match="page_segmentation_mode must be"):
        reward_models.build("ocr", page_segmentation_mode=20)
    assert "ocr" in reward_models.available()
