"""The Gradio comparison app (demo/app.py): previews match the sampler, a generation through
gradio_client, the `diffalign demo` wiring and errors, and a real headless Chromium screenshot."""

import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from diffalign.cli import main
from diffalign.export import load_trained_adapter
from diffalign.sampling import sample_images
from tests.helpers.tiny_run import trained_run

from tests.helpers.tiny_run import ROOT
ARTIFACTS = ROOT / "tests" / "artifacts"  # screenshots land here (ignored by git)
CHROMIUM = "/usr/bin/chromium"
# Flags for Debian's chromium in a sandbox-less container without network (see docs/environment.md).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NEEDS_GRADIO = "the demo needs gradio: pip install gradio gradio_client"
REWARDS = ["jpeg_compressibility", "brightness"]
STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return trained_run(tmp_path_factory)


def load_app_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_app_under_test", ROOT / "demo" / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model", ["run", "tiny:shapes"])
def test_previews_come_from_the_same_rollout_as_sample_images(run, model):
    from diffalign.adapters import load_adapter

    app = load_app_module()
    adapter = load_trained_adapter(run) if model == "run" else load_adapter(model)
    gen = app.generate_with_previews(adapter, "a cat", seed=3, num_steps=STEPS, guidance_scale=4.5, resolution=32)
    assert torch.equal(gen.image, sample_images(adapter, ["a cat"], num_steps=STEPS, guidance_scale=4.5, resolution=32, seed=3)[0])
    assert gen.previews.shape == (STEPS, 3, 32, 32) and gen.times.shape == (STEPS,)
    assert 0 <= gen.previews.min() and gen.previews.max() <= 1
    assert torch.all(gen.times[:-1] > gen.times[1:])  # noise -> clean


def test_a_reward_that_cannot_score_a_prompt_does_not_hide_the_others():
    from diffalign.adapters import load_adapter

    app = load_app_module()
    images = load_adapter("tiny:shapes").decode(torch.zeros(2, 3, 32, 32))
    rewards = {name: app.reward_models.build(name, device="cpu") for name in ("shapes_eval", "brightness")}
    scores, errors = app.score(rewards, images, "a photo of a blue circle and a cyan square")
    assert set(scores) == {"shapes_eval", "brightness"} and not errors
    scores, errors = app.score(rewards, images, "a cat")  # outside the shapes grammar
    assert set(scores) == {"brightness"} and "cat" in errors["shapes_eval"]


def test_latest_run_is_the_last_finished_one(tmp_path, monkeypatch):
    app = load_app_module()
    monkeypatch.chdir(tmp_path)
    for i, name in enumerate(["b_old", "a_new", "c_unfinished"]):
        (tmp_path / "runs" / name / "checkpoints").mkdir(parents=True)
        if name != "c_unfinished":
            meta = tmp_path / "runs" / name / "final" / "diffalign.json"
            meta.parent.mkdir()
            meta.write_text("{}")
            os.utime(meta, (1000 + i, 1000 + i))
    assert app.latest_run().name == "a_new"


@pytest.fixture(scope="module")
def served_app(run):
    pytest.importorskip("gradio", reason=NEEDS_GRADIO)
    app = load_app_module().app_from_run(run, reward_names=REWARDS)
    _, url, _ = app.queue().launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    yield url
    app.close()


def test_generation_through_gradio_client(served_app):
    pytest.importorskip("gradio_client", reason="pip install gradio_client")
    from gradio_client import Client
    from PIL import Image

    assert served_app.startswith("http://127.0.0.1:")
    client = Client(served_app, verbose=False)
    pair, rewards, base_steps, aligned_steps = client.predict("a dog", 5, STEPS, 4.5, REWARDS, api_name="/generate")
    assert len(pair) == 2
    for path in pair:
        with Image.open(path) as im:
            assert im.size == (256, 256) and im.mode == "RGB"  # 32 px upscaled for display
    assert rewards["headers"] == ["reward", "tiny:sd3", "tiny_sd3_run", "change"]  # base id, run directory name
    rows = {row[0]: row[1:] for row in rewards["data"]}
    assert set(rows) == set(REWARDS)
    for base, aligned, change in rows.values():
        assert math.isfinite(base) and math.isfinite(aligned) and abs((aligned - base) - change) < 1e-3
    for strip in (base_steps, aligned_steps):
        assert len(strip) == STEPS and strip[0]["caption"].startswith("t=")
        with Image.open(strip[0]["image"]) as im:
            assert im.size == (96, 96)
    # only the selected rewards are computed
    _, rewards, _, _ = client.predict("a dog", 5, 1, 4.5, REWARDS[:1], api_name="/generate")
    assert [row[0] for row in rewards["data"]] == REWARDS[:1]


def test_a_prompt_outside_the_shapes_grammar_is_one_warning_and_pass_fail_is_labelled(monkeypatch):
    """ShapesEval and ShapesSoft refuse the prompt with the same message: one warning names both;
    ShapesEval's pass / fail row says what 0 and 1 mean."""
    gr = pytest.importorskip("gradio", reason=NEEDS_GRADIO)
    pytest.importorskip("gradio_client", reason="pip install gradio_client")
    from gradio_client import Client

    from diffalign.adapters import load_adapter

    warned = []
    monkeypatch.setattr(gr, "Warning", lambda message, *a, **k: warned.append(message))
    rewards = ["shapes_eval", "shapes_soft"]
    app = load_app_module().build_app(load_adapter("tiny:shapes"), load_adapter("tiny:shapes"), rewards, num_steps=1)
    _, url, _ = app.queue().launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        client = Client(url, verbose=False)
        _, table, _, _ = client.predict("a photo of a purple cat", 1, 1, 4.0, rewards, api_name="/generate")
        assert table["data"] == [] and len(warned) == 1, warned
        assert warned[0].startswith("shapes_eval, shapes_soft: unknown word 'cat'"), warned
        _, table, _, _ = client.predict("a photo of a red circle", 1, 1, 4.0, rewards, api_name="/generate")
        assert [row[0] for row in table["data"]] == ["shapes_eval (1 = pass, 0 = fail)", "shapes_soft"]
        assert len(warned) == 1
    finally:
        app.close()


def test_demo_command_binds_localhost_and_uses_the_run(run, monkeypatch):
    gr = pytest.importorskip("gradio", reason=NEEDS_GRADIO)
    seen = {}
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kw: seen.update(kw))
    assert main(["demo", "--aligned", str(run), "--rewards", "brightness"]) == 0
    assert seen["server_name"] == "127.0.0.1" and not seen["share"] and seen["server_port"] == 7860
    assert main(["demo", "--aligned", str(run), "--share", "--port", "7999"]) == 0
    assert seen["share"] and seen["server_port"] == 7999


def test_demo_start_up_names_the_share_flag(run, monkeypatch, capsys):
    gr = pytest.importorskip("gradio", reason=NEEDS_GRADIO)
    seen = {}
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kw: seen.update(kw))
    assert main(["demo", "--aligned", str(run), "--rewards", "brightness"]) == 0
    out = capsys.readouterr().out
    # gradio's own hint (set share=True in launch()) is silenced; the command's flag is named instead
    assert seen["quiet"] and "--share" in out and "share=True" not in out, out


@pytest.mark.parametrize("args, needle", [
    ([], "no run with final weights under runs/; train one with"),
    (["--aligned", "no/such/run"], "has no final weights"),
    (["--base", "tiny:flux", "--aligned", "RUN"], "is a flux model"),
    (["--aligned", "RUN", "--rewards", "no_such_reward"], "unknown reward"),
])
def test_demo_errors_are_one_line(run, tmp_path, monkeypatch, capsys, args, needle):
    pytest.importorskip("gradio", reason=NEEDS_GRADIO)
    monkeypatch.chdir(tmp_path)  # no runs/ here
    assert main(["demo", *[str(run) if a == "RUN" else a for a in args]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and needle in err[-1], err


def test_demo_without_gradio_is_a_one_line_error(run, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gradio", None)  # import gradio -> ImportError
    assert main(["demo", "--aligned", str(run)]) == 2
    assert capsys.readouterr().err.strip() == "error: the demo needs gradio: pip install 'diffalign[demo]'"


def test_headless_chromium_generates_and_screenshots(served_app, tmp_path):
    pytest.importorskip("playwright", reason="pip install playwright")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no {CHROMIUM}: apt-get install -y chromium")
    from PIL import Image
    from playwright.sync_api import sync_playwright

    shot = tmp_path / "demo.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(served_app, wait_until="networkidle", timeout=60_000)
            page.fill("#prompt textarea", "a red car")
            page.fill("#seed input", "11")
            page.fill("#steps input[type=number]", str(STEPS))
            page.press("#steps input[type=number]", "Enter")
            page.click("#generate")
            page.wait_for_selector("#comparison img", timeout=60_000)
            page.wait_for_function(f"document.querySelectorAll('#aligned-steps img').length >= {STEPS}", timeout=60_000)
            page.wait_for_function("document.querySelectorAll('#rewards td').length >= 4", timeout=60_000)
            assert page.locator("#comparison img").count() == 2
            assert page.locator("#base-steps img").count() == page.locator("#aligned-steps img").count() == STEPS
            assert "brightness" in page.inner_text("#rewards")
            page.wait_for_timeout(300)  # let the images paint
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    with Image.open(shot) as im:
        assert im.width >= 1000 and im.height >= 600
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "demo_screenshot.png")
    print(f"screenshot: {ARTIFACTS / 'demo_screenshot.png'}")


def test_demo_auth_is_passed_and_exposure_warned(run, monkeypatch, capsys):
    gr = pytest.importorskip("gradio", reason=NEEDS_GRADIO)
    seen = {}
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kw: seen.update(kw))
    assert main(["demo", "--aligned", str(run), "--host", "0.0.0.0", "--rewards", "brightness"]) == 0
    assert "auth" not in seen and "--auth USER:PASS" in capsys.readouterr().err  # exposed without a login: warned
    assert main(["demo", "--aligned", str(run), "--host", "0.0.0.0", "--auth", "ann:s3cret", "--rewards", "brightness"]) == 0
    assert seen["server_name"] == "0.0.0.0" and seen["auth"] == ("ann", "s3cret")
