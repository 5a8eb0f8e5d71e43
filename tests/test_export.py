"""``diffalign export``: LoRA and merged folders reproduce the trained model, the model card,
the Hub upload operations, safe output folders, and one-line errors for pushes that cannot happen."""

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest
import torch

from diffalign.adapters import load_adapter
from diffalign.cli import main
from diffalign.export import load_trained_adapter, merged_adapter
from diffalign.hub import upload_operations
from diffalign.sampling import sample_images
from tests.helpers.tiny_run import ROOT, trained_run

PROMPTS = ["a cat", "a red car"]
SAMPLE = dict(num_steps=4, guidance_scale=4.5, resolution=32, seed=7)
CARD_FILES = {"README.md", "diffalign.json", "images/widget.png", "images/before.png", "images/after.png",
              "images/before_after.png"}
FUSED_TOL = 1e-5  # fused W + s*B@A vs unfused W x + s*B(A x): fp32 rounding only


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return trained_run(tmp_path_factory)


@pytest.fixture(scope="module")
def trained_images(run):
    return sample_images(load_trained_adapter(run), PROMPTS, **SAMPLE)


@pytest.fixture(scope="module")
def lora_dir(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "lora"
    assert main(["export", str(run), "--format", "lora", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def merged_dir(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "merged"
    assert main(["export", str(run), "--format", "merged", "--out", str(out)]) == 0
    return out


def test_lora_export_reproduces_trained_images_exactly(lora_dir, trained_images):
    base = load_adapter("tiny:sd3")
    base_images = sample_images(base, PROMPTS, **SAMPLE)
    # the LoRA matters: without it the images differ by far more than any rounding
    assert (base_images - trained_images).abs().max() > 100 * FUSED_TOL
    base.pipeline.load_lora_weights(str(lora_dir))  # the one line a diffusers user writes
    assert torch.equal(sample_images(base, PROMPTS, **SAMPLE), trained_images)


def test_merged_export_is_a_plain_pipeline_with_the_trained_weights(run, merged_dir, trained_images):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(merged_dir))  # the one line for merged exports
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    assert not any("lora" in k for k in pipe.transformer.state_dict())
    exported = sample_images(load_adapter(str(merged_dir)), PROMPTS, **SAMPLE)
    # bit-exact against the same fusion in memory: saving and loading lose nothing ...
    assert torch.equal(exported, sample_images(merged_adapter(run), PROMPTS, **SAMPLE))
    # ... and within fp32 rounding of the unfused trained model (fusing changes the order of
    # the sums, so bit-exactness with the LoRA layers is not possible)
    torch.testing.assert_close(exported, trained_images, rtol=0, atol=FUSED_TOL)


def test_model_card_parses_and_says_what_was_trained(lora_dir):
    from huggingface_hub import ModelCard

    card = ModelCard.load(lora_dir / "README.md")
    data = card.data.to_dict()
    assert {"diffalign", "flow_grpo", "sd3", "lora"} <= set(data["tags"])
    # a LoRA on a tiny base built in code: diffusers alone cannot load it, so the card does not say it does
    assert data["license"] == "apache-2.0" and "library_name" not in data and "diffusers" not in data["tags"]
    assert data["pipeline_tag"] == "text-to-image"
    assert "base_model" not in data  # tiny:sd3 has no Hub page; a hub id would be linked
    text = card.text
    assert 'pipe.load_lora_weights(".")' in text
    assert "tiny:sd3" in text and "jpeg_compressibility" in text
    assert "| reward_mean |" in text and "before (base)" in text  # eval before / after from metrics.jsonl
    assert "`optim.lr` | `0.01`" in text and "`algorithm.beta`" in text and "`lora.rank` | `8`" in text
    assert "![before](images/before.png)" in text and "![after](images/after.png)" in text
    assert data["widget"] == [{"text": "a cat", "output": {"url": "images/widget.png"}}]  # the first eval prompt
    for image in ("widget", "before", "after", "before_after"):
        assert (lora_dir / "images" / f"{image}.png").stat().st_size > 0
    meta = json.loads((lora_dir / "diffalign.json").read_text())
    assert meta["format"] == "lora" and meta["algorithm"] == "flow_grpo" and "export" in meta


def test_exported_files_name_no_local_path(run, lora_dir, merged_dir):
    """Every file, text or binary (safetensors headers too), of both exports and of final/."""
    roots = {str(run.resolve().parents[1]), str(lora_dir.resolve().parents[1]), str(ROOT), "site-packages"}
    for folder in (lora_dir, merged_dir, run / "final"):
        files = [f for f in folder.rglob("*") if f.is_file()]
        assert files
        for f in files:
            data = f.read_bytes()
            assert not [r for r in roots if r.encode() in data], f


def test_widget_is_one_prompt_drawn_by_base_and_trained_model_from_the_same_noise(run, lora_dir):
    """images/widget.png: the widget prompt by the base (left) and the trained model (right) with
    the run's evaluation sampler and seed, each tile the 32 px image enlarged 8x (nearest)."""
    import numpy as np
    import yaml
    from PIL import Image

    from diffalign.export import WIDGET_TILE_PX

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    settings = dict(num_steps=cfg["sampling"]["eval_num_steps"], guidance_scale=cfg["sampling"]["guidance_scale"],
                    resolution=32, seed=cfg["eval"]["seed"], batch_size=1)
    expected = [sample_images(load_adapter("tiny:sd3"), ["a cat"], **settings),
                sample_images(load_trained_adapter(run), ["a cat"], **settings)]
    assert not torch.equal(*expected)
    pixels = np.asarray(Image.open(lora_dir / "images" / "widget.png").convert("RGB"))
    step = WIDGET_TILE_PX // 32
    for i, images in enumerate(expected):
        x0 = 2 + i * (WIDGET_TILE_PX + 2)  # labelled_grid: a 2 px border around each tile
        tile = pixels[2 + step // 2: 2 + WIDGET_TILE_PX: step, x0 + step // 2: x0 + WIDGET_TILE_PX: step]
        want = (images[0].clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        assert np.array_equal(tile, want), i
    text = (lora_dir / "README.md").read_text()
    assert "*a cat*" in text and f"seed {cfg['eval']['seed']}" in text


def test_card_change_column_has_paired_intervals(run, lora_dir):
    from diffalign import stats

    saved = [json.loads((run / "eval_records" / f"iter-{i:06d}.json").read_text())["rewards"] for i in (0, 1)]
    # the per-image rewards as one-family stats records, the reward as the partial score
    a, b = ([{"prompt": p, "family": "all", "passed": False, "score": v} for p, v in zip(r["prompts"], r["values"])] for r in saved)
    d = stats.paired_difference(a, b)["partial"]
    row = next(line for line in (lora_dir / "README.md").read_text().splitlines() if line.startswith("| reward_mean |"))
    assert row.endswith(f"| {d.value:+.4f} [{d.lo:+.4f}, {d.hi:+.4f}] |"), row


def test_symlinks_are_refused_in_uploads(lora_dir, tmp_path):
    import shutil

    from diffalign.errors import DiffalignError

    folder = tmp_path / "upload"
    shutil.copytree(lora_dir, folder)
    (folder / "secret").symlink_to("/etc/hostname")
    with pytest.raises(DiffalignError, match="symbolic link"):
        upload_operations(folder)


def test_loading_snippet_runs(lora_dir, monkeypatch):
    monkeypatch.chdir(lora_dir)  # a local export's snippet loads "." (the folder names no local path)
    text = (lora_dir / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0].replace("num_inference_steps=2", "num_inference_steps=1")
    scope = {}
    exec(compile(code, "card-snippet", "exec"), scope)
    assert scope["image"].size == (32, 32)


def test_upload_operations_list_every_file(lora_dir, merged_dir):
    paths = [op.path_in_repo for op in upload_operations(lora_dir)]
    assert paths == sorted(paths)
    assert set(paths) == CARD_FILES | {"pytorch_lora_weights.safetensors"}
    merged = {op.path_in_repo for op in upload_operations(merged_dir)}
    assert CARD_FILES | {"model_index.json", "transformer/diffusion_pytorch_model.safetensors",
                         "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"} <= merged
    assert not any(p.startswith(".") or "/." in p for p in merged)


def test_export_replaces_only_earlier_exports(run, tmp_path, capsys):
    out = tmp_path / "lora"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert main(["export", str(run), "--out", str(out)]) == 0  # an earlier export: replaced
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folders left
    capsys.readouterr()

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for target in (mine, run, run / "final"):
        assert main(["export", str(run), "--out", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
    assert (mine / "notes.txt").read_text() == "keep me" and sorted(os.listdir(mine)) == ["notes.txt"]
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.parametrize("case", ["no final", "full weights as lora", "not a run"])
def test_bad_runs_are_one_line_errors(tmp_path, capsys, case):
    run = tmp_path / "run"
    if case != "not a run":
        (run / "final").mkdir(parents=True)
        (run / "config.yaml").write_text("seed: 0\n")
    if case == "full weights as lora":
        (run / "final" / "diffalign.json").write_text(json.dumps({"format": "full", "base_model": "tiny:sd3"}))
    assert main(["export", str(run), "--format", "lora"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


@pytest.fixture
def online_without_token(monkeypatch, tmp_path):
    import huggingface_hub

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


@pytest.mark.parametrize("repo_id, offline, needle", [
    ("not a repo id!", "0", "invalid repo id"),
    ("a/b/c", "0", "invalid repo id"),
    ("just-a-name", "0", "expected USER/REPO"),
    ("user/model", "1", "HF_HUB_OFFLINE"),
    ("user/model", "0", "needs a Hugging Face token"),
])
def test_push_that_cannot_happen_fails_first_with_one_line(run, tmp_path, capsys, monkeypatch, online_without_token,
                                                            repo_id, offline, needle):
    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    out = tmp_path / "never-written"
    assert main(["export", str(run), "--out", str(out), "--push-to-hub", repo_id]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    assert not out.exists()


def test_private_without_push_is_an_error(run, capsys):
    assert main(["export", str(run), "--private"]) == 2
    assert "--push-to-hub" in capsys.readouterr().err


@pytest.mark.skipif(not os.environ.get("HF_TOKEN"), reason="live Hub push: set HF_TOKEN (and network) to run it")
def test_live_push_to_a_private_repo(run, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import HfApi

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    api = HfApi(token=os.environ["HF_TOKEN"])
    repo_id = f"{api.whoami()['name']}/diffalign-export-test-{uuid.uuid4().hex[:8]}"
    try:
        assert main(["export", str(run), "--out", str(tmp_path / "lora"), "--push-to-hub", repo_id, "--private"]) == 0
        assert set(api.list_repo_files(repo_id)) >= {"README.md", "pytorch_lora_weights.safetensors", "images/after.png"}
        assert api.model_info(repo_id).private
    finally:
        api.delete_repo(repo_id, missing_ok=True)


def test_one_iteration_with_ema_on_changes_the_weights(tmp_path):
    """The recipe's defaults (EMA on, decay 0.9 every 8 steps): one iteration must not leave final/
    equal to the base, as an EMA first updated at step 8 would."""
    from safetensors.torch import load_file

    from diffalign.export import LORA_WEIGHTS_FILE, unchanged_weights
    from tests.helpers.tiny_run import CONFIG, run_cli

    out = tmp_path / "ema_run"
    assert run_cli("train", CONFIG, f"output_dir={out}", "max_iterations=1", "log.progress_bar=false",
                   "log.report=false", "eval.at_start=false", "sampling.eval_num_steps=2") == 0
    meta = json.loads((out / "final" / "diffalign.json").read_text())
    assert meta["weights"] == "ema" and meta["ema_updates"] == 1
    lora_b = [v for k, v in load_file(str(out / "final" / LORA_WEIGHTS_FILE)).items() if "lora_B" in k]
    assert lora_b and any(v.any() for v in lora_b)
    assert unchanged_weights(out) is None
    export = tmp_path / "ema_export"
    assert main(["export", str(out), "--out", str(export)]) == 0
    assert any(v.any() for k, v in load_file(str(export / LORA_WEIGHTS_FILE)).items() if "lora_B" in k)


def test_export_warns_when_the_weights_equal_the_base(run, tmp_path, capsys):
    """final/ with every lora_B at its zero init (what an EMA that never averaged exported; optim.lr
    must be > 0, so no run config gives it): the export says so in one line."""
    import shutil

    from safetensors.torch import load_file, save_file

    from diffalign.export import LORA_WEIGHTS_FILE

    copy = tmp_path / "zeroed"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("export", "checkpoints"))
    weights = copy / "final" / LORA_WEIGHTS_FILE
    tensors = load_file(str(weights))
    save_file({k: torch.zeros_like(v) if "lora_B" in k else v for k, v in tensors.items()}, str(weights))
    capsys.readouterr()
    assert main(["export", str(copy), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if line.startswith("warning: the exported weights equal the base model's")]
    assert len(warnings) == 1
    assert main(["export", str(run), "--out", str(tmp_path / "trained")]) == 0
    assert "warning: the exported weights" not in capsys.readouterr().err


def test_saved_pipelines_name_no_local_path(tmp_path):
    """A fully fine-tuned final/ of the shipped model (loaded from inside the package) records the
    model id, not the folder it was loaded from."""
    from diffalign.export import save_trained_weights, unchanged_weights

    adapter = load_adapter("shapes")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model:\n  id: shapes\n")
    save_trained_weights(adapter, run / "final", lora=False, metadata={"base_model": "shapes", "family": "shapes"})
    for f in (run / "final").rglob("*.json"):
        text = f.read_text()
        assert "/" + "site-packages" not in text and str(tmp_path) not in text and "diffalign/assets" not in text, f
    index = json.loads((run / "final" / "model_index.json").read_text())
    assert index["_name_or_path"] == "shapes"
    assert unchanged_weights(run) is not None  # the base itself, saved: nothing trained


def _front_matter(card_file):
    import yaml

    text = card_file.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1]), text


def test_card_quotes_the_evaluation_with_intervals(lora_dir):
    meta, text = _front_matter(lora_dir / "README.md")
    assert meta["license"] == "apache-2.0" and "base_model" not in meta  # a tiny base: no Hub repository to name
    assert "**Verdict:**" in text and "95 % paired bootstrap" in text
    assert "a tiny model built in code" in text


def test_card_license_other_names_the_license_and_shapes_widgets_use_the_grammar():
    from diffalign.hub import model_card
    from diffalign.shapes import parse_prompt

    meta = {"base_model": "stabilityai/stable-diffusion-3.5-medium", "family": "sd3", "algorithm": "flow_grpo",
            "reward": "pickscore", "iterations": 3, "lora": {"rank": 8, "alpha": 16}}
    card = model_card(meta, {"prompts": {"eval": ["a watercolour fox"]}}, [], fmt="lora", where=".",
                      images={"after": "images/after.png"})
    data = card.data.to_dict()
    assert data["base_model"] == "stabilityai/stable-diffusion-3.5-medium"
    assert data["license"] == "other" and data["license_name"]
    assert data["license_link"] == "https://huggingface.co/stabilityai/stable-diffusion-3.5-medium"
    assert data["widget"][0]["text"] == "a watercolour fox"
    shapes = model_card({**meta, "base_model": "shapes", "family": "shapes"}, {}, [], fmt="lora", where=".",
                        images={"after": "images/after.png"})
    prompt = shapes.data.to_dict()["widget"][0]["text"]
    assert parse_prompt(prompt).family == "position"  # in the world's grammar, not "a photo of a cat"
    assert "base_model" not in shapes.data.to_dict() and shapes.data.to_dict()["license"] == "apache-2.0"
    # the shipped model is under diffalign's license (pyproject.toml, LICENSE), which the card names
    assert "`apache-2.0`: the base model `shapes` (shipped in the diffalign package) is under diffalign's license, Apache-2.0" in shapes.text


def test_license_other_without_a_hub_base_links_a_license_file_of_the_export(run, tmp_path):
    from huggingface_hub import ModelCard

    from diffalign.export import export_run

    out = export_run(run, "lora", tmp_path / "other", license="other")
    meta, _ = _front_matter(out / "README.md")
    assert meta["license"] == "other" and meta["license_name"] == "tiny-sd3-license" and meta["license_link"] == "LICENSE"
    assert "tiny:sd3" in (out / "LICENSE").read_text()
    assert ModelCard.load(out / "README.md").data.to_dict()["license_link"] == "LICENSE"


def test_card_of_a_local_base_has_valid_front_matter_and_no_path():
    import yaml

    from diffalign.export import portable
    from diffalign.hub import model_card

    meta = portable({"base_model": "/home/someone/models/my-sd3", "family": "sd3", "algorithm": "flow_grpo",
                     "reward": "pickscore", "iterations": 2, "lora": {"rank": 4, "alpha": 4}, "weights": "last"})
    card = model_card(meta, {}, [], fmt="lora", where=".", images={})
    front = yaml.safe_load(str(card).split("---\n")[1])
    assert "base_model" not in front and front["license"] == "other"
    assert front["license_name"] == "my-sd3-license" and front["license_link"] == "LICENSE"
    assert front["widget"] == [{"text": "a photo of a cat"}]  # no prompt known, no image: text only
    assert "/home/someone" not in str(card) and "a local folder" in str(card)


# ---- the format of what was trained; a whole ShapesWorld pipeline that diffusers loads ------------
# a full fine-tune (the main job's recipe) of the tiny ShapesWorld model, one iteration
FULL_RUN = ["shapes/flow_grpo", "model.id=tiny:shapes", "max_iterations=1", "rollout.prompts_per_iteration=2",
            "rollout.group_size=2", "rollout.sample_batch_size=4", "train.batch_size=4", "sampling.num_steps=2",
            "sampling.eval_num_steps=2", "sampling.window_size=0", "eval.images_per_family=1", "eval.probe=false",
            "log.report=false", "log.progress_bar=false", "optim.lr=1e-2"]
# diffalign made unimportable: what a diffusers user without diffalign has
WITHOUT_DIFFALIGN = "import sys; sys.modules['diffalign'] = None\n"


def diffalign_cli(*args, cwd=ROOT, timeout=600) -> subprocess.CompletedProcess:
    """``python -m diffalign.cli ARGS`` in a subprocess, as a user runs it (this checkout's code)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "diffalign.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_card_snippet(folder, tmp_path, *, steps: int = 2, block_diffalign: bool = True) -> subprocess.CompletedProcess:
    """The model card's loading code, run in ``folder`` (its snippet loads ".") by a fresh Python
    (without diffalign unless ``block_diffalign`` is False), with ``steps`` sampling steps; prints the
    image's size and the pipeline's module."""
    text = (folder / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace("num_inference_steps=20", f"num_inference_steps={steps}")
    code += "print('image', image.size, type(pipe).__module__)\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"))
    return subprocess.run([sys.executable, "-c", (WITHOUT_DIFFALIGN if block_diffalign else "") + code], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "full_run"
    result = diffalign_cli("train", *FULL_RUN, f"output_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "final" / "diffalign.json").read_text())["format"] == "full"
    return out


@pytest.fixture(scope="module")
def full_export(full_run):
    """``diffalign export RUN`` with no options, on the full fine-tune."""
    result = diffalign_cli("export", full_run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == f"exported merged weights to {full_run / 'export' / 'merged'}"
    return full_run / "export" / "merged"


def test_export_without_format_follows_what_was_trained(full_export, run, tmp_path):
    """A full fine-tune exports its whole pipeline, a LoRA run its LoRA; --format lora on a full
    fine-tune is one error line that says what to do."""
    assert (full_export / "model_index.json").is_file() and not list(full_export.glob("*lora*"))
    assert json.loads((full_export / "diffalign.json").read_text())["format"] == "merged"

    lora_run = tmp_path / "lora_run"  # a copy: the shared run directory stays as it is
    shutil.copytree(run, lora_run, ignore=shutil.ignore_patterns("export", "checkpoints"))
    result = diffalign_cli("export", lora_run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == f"exported lora weights to {lora_run / 'export' / 'lora'}"
    assert (lora_run / "export" / "lora" / "pytorch_lora_weights.safetensors").is_file()

    result = diffalign_cli("export", full_export.parents[1], "--format", "lora", "--out", tmp_path / "never")
    assert result.returncode == 2 and not (tmp_path / "never").exists()
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "has no LoRA to export" in line and "without --format" in line, line


def test_export_help_says_what_each_format_holds_and_the_default():
    result = diffalign_cli("export", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "lora: the LoRA weights alone" in text and "(LoRA runs only)" in text
    assert "merged: the whole pipeline with the trained weights" in text and "a full fine-tune's weights as trained" in text
    assert "Default: what the run trained, lora for a LoRA run, merged for a full fine-tune" in text
    assert "LoRA fused, DiffusionPipeline" not in text  # what it said before: true of LoRA runs only


def test_a_shapes_pipeline_export_loads_with_diffusers_alone(full_export, full_run, tmp_path):
    """The folder holds ShapesPipeline's code and names it in model_index.json; the card's own
    loading code (``DiffusionPipeline.from_pretrained(".", trust_remote_code=True)``) runs in a
    Python where diffalign cannot be imported, and draws what diffalign's trained model draws."""
    import numpy as np

    index = json.loads((full_export / "model_index.json").read_text())
    assert index["_class_name"] == ["pipeline", "ShapesPipeline"]
    assert (full_export / "pipeline.py").is_file() and (full_export / "coordinates.py").is_file()
    card = (full_export / "README.md").read_text()
    assert 'pipe = DiffusionPipeline.from_pretrained(".", trust_remote_code=True)' in card
    assert "diffalign" not in card.split("```python\n", 1)[1].split("```", 1)[0]  # the snippet imports no diffalign

    result = run_card_snippet(full_export, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "image (32, 32) diffusers_modules.local.pipeline" in result.stdout  # the folder's code, run by diffusers
    assert "might require the following packages" not in result.stderr  # diffusers' check of the code's imports

    code = ("import numpy as np, torch\nfrom diffusers import DiffusionPipeline\n"
            "pipe = DiffusionPipeline.from_pretrained('.', trust_remote_code=True)\n"
            "x = pipe(['two red circles'], num_inference_steps=3, output_type='np', generator=torch.Generator().manual_seed(0)).images\n"
            "np.save('drawn.npy', x)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"))
    done = subprocess.run([sys.executable, "-c", WITHOUT_DIFFALIGN + code], cwd=full_export, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = load_trained_adapter(full_run).pipeline
    want = trained(["two red circles"], num_inference_steps=3, output_type="np", generator=torch.Generator().manual_seed(0)).images
    # the same code and weights; another process's thread count may change the order of float sums
    np.testing.assert_allclose(np.load(full_export / "drawn.npy"), want, rtol=0, atol=1e-5)
    assert np.abs(want - 0.5).max() > 0.1  # an image, not a blank
    (full_export / "drawn.npy").unlink()


def test_diffalign_loads_a_shapes_export_with_its_own_class(full_export):
    """The export names its code file, but diffalign's loaders read the folder with diffalign's
    ShapesPipeline (the folder's code is not run), family detected from the folder."""
    from diffalign.shapes.pipeline import ShapesPipeline

    adapter = load_adapter(str(full_export))
    assert adapter.family == "shapes" and type(adapter.pipeline) is ShapesPipeline
    assert type(ShapesPipeline.from_pretrained(str(full_export))) is ShapesPipeline


def test_card_of_a_full_fine_tune_lists_only_settings_that_took_effect(full_export):
    import yaml
    from huggingface_hub import ModelCard, ModelCardData

    front, text = _front_matter(full_export / "README.md")
    assert ModelCardData(**front).to_dict() == front  # the Hub's metadata round trip
    assert ModelCard.load(full_export / "README.md").data.to_dict() == front
    assert front["library_name"] == "diffusers" and "diffusers" in front["tags"] and "lora" not in front["tags"]
    assert front["license"] == "apache-2.0"
    assert ("`tiny:shapes` (a tiny shapes model with random weights built in code by diffalign) with all of its "
            "weights fine-tuned with **flow_grpo** on the **shapes_eval** reward for 1 iteration with diffalign") in text
    assert "(made by diffalign" not in text and "Fine-tuned `" not in text
    assert "- weights: the whole pipeline, all weights fine-tuned, the weights of the last optimizer step" in text
    rows = [line.split("`")[1] for line in text.splitlines() if line.startswith("| `")]
    config = yaml.safe_load((full_export.parents[1] / "config.yaml").read_text())
    assert config["lora"]["enabled"] is False and config["train"]["ema"]["enabled"] is False
    assert config["algorithm"]["guard_ratio_norm"] is False  # GRPO-Guard was off
    assert "optim.lr" in rows and "algorithm.clip_range" in rows and "model.resolution" in rows
    assert not [r for r in rows if r.startswith(("lora.", "train.ema.", "algorithm.guard"))], rows
    assert "| `model.resolution` | `32` |" in text  # 0 in config.yaml: the model's own, which the run used


def test_settings_in_effect_keep_what_was_on():
    from diffalign.hub import settings_in_effect

    config = {"lora": {"enabled": True, "rank": 8, "alpha": 16}, "train": {"ema": {"enabled": True, "decay": 0.9}},
              "model": {"resolution": 64},
              "algorithm": {"name": "flow_grpo", "guard_ratio_norm": True, "guard_norm_mode": "batch",
                            "guard_step_reweight": False, "guard_diagnostics": False}}
    rows = settings_in_effect(config, {"lora": {"rank": 8, "alpha": 16}})
    assert rows == {"model.resolution": 64, "lora.rank": 8, "lora.alpha": 16,
                    "train.ema.enabled": True, "train.ema.decay": 0.9, "algorithm.name": "flow_grpo",
                    "algorithm.guard_ratio_norm": True, "algorithm.guard_norm_mode": "batch"}
    config["algorithm"].update(guard_ratio_norm=False, guard_step_reweight=True)  # the mode applies to the normalisation only
    config["train"]["ema"]["enabled"] = False
    rows = settings_in_effect(config, {"lora": None}, resolution=32)
    assert rows == {"model.resolution": 64, "algorithm.name": "flow_grpo", "algorithm.guard_step_reweight": True}


def test_diffalign_loads_a_shapes_export_from_the_hub_with_its_own_class(full_export, tmp_path):
    """A Hub repo of the export (here: in the Hub cache, read offline) loads with diffalign's
    ShapesPipeline too: diffalign fetches the files and runs none of the repo's code (diffusers
    itself would ask for trust_remote_code)."""
    from diffalign.shapes.pipeline import ShapesPipeline

    revision = "0" * 40
    repo = tmp_path / "hub" / "models--someone--shapes-export"
    shutil.copytree(full_export, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    adapter = load_adapter("someone/shapes-export", family="shapes", cache_dir=str(tmp_path / "hub"), local_files_only=True)
    assert type(adapter.pipeline) is ShapesPipeline
    trained = load_trained_adapter(full_export.parents[1]).denoiser.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in adapter.denoiser.state_dict().items())
