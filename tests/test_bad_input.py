"""Bad input to every command: exit code 2, one stderr line starting ``error:``, no traceback, and
a run directory that existed before left byte for byte as it was.

Table-driven and in process (``diffalign.cli.main``). ``{run}`` is a finished tiny run (shared
with the export tests), ``{tmp}`` a scratch folder holding the files named below; most cases fail
while parsing, before any model loads.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.tiny_run import CONFIG, ROOT, trained_run

FILES = {
    "empty.yaml": b"",
    "comments.yaml": b"# nothing but a comment\n",
    "binary.yaml": bytes(range(256)) * 4,
    "garbled.yaml": b"model:\n  id: [tiny:sd3\n  rank: }\n",
    "list.yaml": b"- 1\n- 2\n",
    "empty_prompts.txt": b"\n  \n",
    "binary_prompts.txt": b"\xff\xfe\x00\x01" * 64,
    "file.txt": b"precious\n",
    "foreign/keep.txt": b"precious\n",
    "notrun/.keep": b"",
}

T = "train"
CASES = [
    # ---- train: files
    ("train-missing-config", [T, "{tmp}/nope.yaml"], "does not exist"),
    ("train-empty-config", [T, "{tmp}/empty.yaml"], "is empty"),
    ("train-comments-only-config", [T, "{tmp}/comments.yaml"], "is empty"),
    ("train-binary-config", [T, "{tmp}/binary.yaml"], "not a text"),
    ("train-garbled-yaml", [T, "{tmp}/garbled.yaml"], "not valid YAML"),
    ("train-list-yaml", [T, "{tmp}/list.yaml"], "mapping"),
    ("train-config-is-a-directory", [T, "{tmp}/notrun"], "is a directory"),
    ("train-launcher-config", [T, "accelerate/ddp"], "is a launcher config, not a training recipe"),
    # ---- train: keys and values
    ("train-unknown-key", [T, CONFIG, "output_dir={run}", "bogus.key=1"], "'bogus'"),
    ("train-unknown-nested-key", [T, CONFIG, "output_dir={run}", "sampling.bogus=1"], "'sampling.bogus'"),
    ("train-override-without-value", [T, CONFIG, "output_dir={run}", "max_iterations"], "dotted.key=value"),
    ("train-wrong-type-int", [T, CONFIG, "output_dir={run}", "max_iterations=abc"], "max_iterations"),
    ("train-wrong-type-list", [T, CONFIG, "output_dir={run}", "lora.rank=[1]"], "lora.rank"),
    ("train-group-size-1", [T, CONFIG, "output_dir={run}", "rollout.group_size=1"], "rollout.group_size"),
    ("train-guidance-nan", [T, CONFIG, "output_dir={run}", "sampling.guidance_scale=nan"], "finite"),
    ("train-lr-inf", [T, CONFIG, "output_dir={run}", "optim.lr=inf"], "finite"),
    ("train-lr-negative", [T, CONFIG, "output_dir={run}", "optim.lr=-1"], "optim.lr"),
    ("train-noise-negative", [T, CONFIG, "output_dir={run}", "sampling.noise_level=-0.5"], "sampling.noise_level"),
    ("train-max-failures-negative", [T, CONFIG, "output_dir={run}", "reward.max_failures=-1"], "reward.max_failures"),
    ("train-unknown-algorithm", [T, CONFIG, "output_dir={run}", "algorithm.name=nope"], "algorithm.name"),
    ("train-unknown-kernel", [T, CONFIG, "output_dir={run}", "sampling.kernel=nope"], "sampling.kernel"),
    ("train-unknown-reward", [T, CONFIG, "output_dir={tmp}/out", "reward.name=no_such_reward"], "no_such_reward"),
    ("train-missing-model", [T, CONFIG, "output_dir={tmp}/out", "model.id=./no/such/model"], "no/such/model"),
    ("train-wrong-family", [T, CONFIG, "output_dir={tmp}/out", "model.id=tiny:nope"], "nope"),
    ("train-existing-run", [T, CONFIG, "output_dir={run}"], "--resume"),
    ("train-output-is-a-file", [T, CONFIG, "output_dir={tmp}/file.txt"], "is a file"),
    ("train-allow-change-without-resume", [T, CONFIG, "output_dir={tmp}/out", "--allow-config-change"], "--resume"),
    ("train-untrained-spm", [T, "configs/shapes/spo.yaml", "output_dir={tmp}/out"], "diffalign train-spm configs/shapes/spo.yaml"),
    ("train-untrained-drm", [T, "configs/shapes/drm_step_grpo.yaml", "output_dir={tmp}/out"], "diffalign train-reward"),
    ("train-resume-other-rank", [T, CONFIG, "output_dir={run}", "--resume", "lora.rank=4"], "lora.rank"),
    # ---- resume
    ("resume-missing-dir", ["resume", "{tmp}/nope"], "not a run directory"),
    ("resume-a-file", ["resume", "{tmp}/file.txt"], "not a run directory"),
    ("resume-not-a-run", ["resume", "{tmp}/notrun"], "not a run directory"),
    ("resume-other-model", ["resume", "{run}", "model.id=tiny:flux"], "model.id"),
    ("resume-other-algorithm", [T, "configs/tiny/diffusion_nft_sd3.yaml", "output_dir={run}", "--resume"], "algorithm.name"),
    ("resume-other-lora-rank", ["resume", "{run}", "lora.rank=4"], "--allow-config-change"),
    ("resume-other-prompts", ["resume", "{run}", "prompts.train=[a horse]"], "prompts"),
    ("resume-unknown-key", ["resume", "{run}", "bogus=1"], "'bogus'"),
    ("resume-guidance-nan", ["resume", "{run}", "sampling.guidance_scale=nan"], "finite"),
    # ---- config
    ("config-missing", ["config", "{tmp}/nope.yaml"], "does not exist"),
    ("config-empty", ["config", "{tmp}/empty.yaml"], "is empty"),
    ("config-binary", ["config", "{tmp}/binary.yaml"], "not a text"),
    ("config-garbled", ["config", "{tmp}/garbled.yaml"], "not valid YAML"),
    ("config-guidance-nan", ["config", CONFIG, "sampling.guidance_scale=nan"], "sampling.guidance_scale"),
    ("config-eval-every-negative", ["config", CONFIG, "eval.every=-1"], "eval.every"),
    ("config-lora-rank-zero", ["config", CONFIG, "lora.rank=0"], "lora.rank"),
    ("config-prompts-file-missing", ["config", CONFIG, "prompts.source=file"], "prompts.file"),
    # ---- eval
    ("eval-empty-prompts", ["eval", "--no-base", "{run}", "--prompts", "{tmp}/empty_prompts.txt"], "is empty"),
    ("eval-binary-prompts", ["eval", "{run}", "--prompts", "{tmp}/binary_prompts.txt"], "not a text"),
    ("eval-missing-prompts", ["eval", "{run}", "--prompts", "{tmp}/nope.txt"], "--prompts"),
    ("eval-missing-run", ["eval", "{tmp}/nope"], "does not exist"),
    ("eval-guidance-nan", ["eval", "{run}", "--guidance-scale", "nan"], "--guidance-scale"),
    ("eval-steps-zero", ["eval", "{run}", "--steps", "0"], "--steps"),
    ("eval-bad-precision", ["eval", "{run}", "--mixed-precision", "fp8"], "--mixed-precision"),
    ("eval-images-per-family-zero", ["eval", "{run}", "--images-per-family", "0"], "--images-per-family"),
    ("eval-shapes-eval-of-sd3-run", ["eval", "{run}", "--reward", "shapes_eval"], "based on 'tiny:sd3'"),
    ("eval-run-of-another-base", ["eval", "{run}", "--base", "shapes"], "trained from 'tiny:sd3'"),
    ("config-unknown-reward", ["config", CONFIG, "reward.name=pickscor"], "did you mean 'pickscore'"),
    # ---- export
    ("export-missing-run", ["export", "{tmp}/nope"], "not a run directory"),
    ("export-not-a-run", ["export", "{tmp}/notrun"], "not a run directory"),
    ("export-out-is-the-run", ["export", "{run}", "--out", "{run}"], "would replace the run directory"),
    ("export-out-above-the-run", ["export", "{run}", "--out", "{run}/.."], "would replace the run directory"),
    ("export-out-into-final", ["export", "{run}", "--out", "{run}/final"], "not a diffalign export"),
    ("export-out-is-a-file", ["export", "{run}", "--out", "{tmp}/file.txt"], "is a file"),
    ("export-out-foreign-folder", ["export", "{run}", "--out", "{tmp}/foreign"], "not a diffalign export"),
    ("export-hub-dotdot", ["export", "{run}", "--push-to-hub", "../evil"], "--push-to-hub"),
    ("export-hub-traversal", ["export", "{run}", "--push-to-hub", "user/repo/../../x"], "--push-to-hub"),
    ("export-hub-offline", ["export", "{run}", "--push-to-hub", "user/repo"], "HF_HUB_OFFLINE"),
    ("export-public-without-push", ["export", "{run}", "--public"], "--push-to-hub"),
    # ---- sample
    ("sample-steps-zero", ["sample", "--steps", "0", "--out", "{tmp}/s"], "--steps"),
    ("sample-guidance-nan", ["sample", "--guidance-scale", "nan", "--out", "{tmp}/s"], "--guidance-scale"),
    ("sample-noise-inf", ["sample", "--noise-level", "inf", "--out", "{tmp}/s"], "--noise-level"),
    ("sample-empty-prompts", ["sample", "--prompts", "{tmp}/empty_prompts.txt", "--out", "{tmp}/s"], "is empty"),
    ("sample-out-is-a-run", ["sample", "--out", "{run}"], "holds other files"),
    ("sample-out-is-a-file", ["sample", "--out", "{tmp}/file.txt"], "is a file"),
    ("sample-missing-model", ["sample", "--model", "./no/such/model", "--out", "{tmp}/s"], "no/such/model"),
    # ---- train-reward, train-spm
    ("train-reward-missing", ["train-reward", "{tmp}/nope.yaml"], "does not exist"),
    ("train-reward-empty", ["train-reward", "{tmp}/empty.yaml"], "is empty"),
    ("train-reward-unknown-key", ["train-reward", "configs/shapes/drm_step_grpo.yaml", "bogus.key=1"], "bogus"),
    ("train-spm-binary", ["train-spm", "{tmp}/binary.yaml"], "not a text"),
    ("train-spm-unknown-key", ["train-spm", "configs/shapes/spo.yaml", "bogus.key=1"], "bogus"),
    # ---- demo
    ("demo-bad-auth", ["demo", "--auth", "no-colon"], "--auth"),
    ("demo-empty-password", ["demo", "--auth", "user:"], "--auth"),
    ("demo-port-zero", ["demo", "--port", "0"], "--port"),
]


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root``: file bytes, None for folders."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return trained_run(tmp_path_factory)


@pytest.mark.parametrize("argv, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(argv, needle, run, tmp_path, capsys, monkeypatch):
    from diffalign.cli import main

    for name, data in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    before, scratch = snapshot(run), snapshot(tmp_path)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()
    code = main([a.replace("{run}", str(run)).replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0], lines[0]
    assert snapshot(run) == before, "the run directory changed"
    assert snapshot(tmp_path) == scratch, "the scratch folder changed"
