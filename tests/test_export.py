"""``diffalign export``: LoRA and merged folders reproduce the trained model, the model card,
the Hub upload operations, safe output folders, and one-line errors for pushes that cannot happen."""

import json
import os
import uuid

import pytest
import torch

from diffalign.adapters import load_adapter
from diffalign.cli import main
from diffalign.export import load_trained_adapter, merged_adapter
from diffalign.hub import upload_operations
from diffalign.sampling import sample_images
from tests.helpers.tiny_run import trained_run

PROMPTS = ["a cat", "a red car"]
SAMPLE = dict(num_steps=4, guidance_scale=4.5, resolution=32, seed=7)
CARD_FILES = {"README.md", "diffalign.json", "images/before.png", "images/after.png", "images/before_after.png"}
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
    assert data["license"] == "apache-2.0" and data["library_name"] == "diffusers"
    assert data["pipeline_tag"] == "text-to-image"
    assert "base_model" not in data  # tiny:sd3 has no Hub page; a hub id would be linked
    text = card.text
    assert 'pipe.load_lora_weights(".")' in text
    assert "tiny:sd3" in text and "jpeg_compressibility" in text
    assert "| reward_mean |" in text and "before (base)" in text  # eval before / after from metrics.jsonl
    assert "`optim.lr` | `0.01`" in text and "`algorithm.beta`" in text and "`lora.rank` | `8`" in text
    assert "![before](images/before.png)" in text and "![after](images/after.png)" in text
    for image in ("before", "after", "before_after"):
        assert (lora_dir / "images" / f"{image}.png").stat().st_size > 0
    meta = json.loads((lora_dir / "diffalign.json").read_text())
    assert meta["format"] == "lora" and meta["algorithm"] == "flow_grpo" and "export" in meta


def test_exported_files_name_no_local_path(run, lora_dir, merged_dir):
    for folder in (lora_dir, merged_dir):
        for f in folder.rglob("*"):
            if f.is_file() and f.suffix in (".md", ".json"):
                text = f.read_text()
                assert str(run.resolve().parent) not in text and str(folder) not in text, f


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
