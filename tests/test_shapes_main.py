"""The main job on the shipped model: one iteration of configs/shapes/flow_grpo.yaml, eval table."""

import json

import pytest

from diffalign.evaluation import format_table
from tests.helpers.tiny_run import run_cli

MAIN = "configs/shapes/flow_grpo.yaml"


@pytest.mark.slow
def test_main_config_one_iteration(repo_root, tmp_path, capsys):
    out = tmp_path / "main"
    code = run_cli("train", MAIN, f"output_dir={out}", "max_iterations=1", "eval.images_per_family=2",
                   "sampling.eval_num_steps=4", "log.progress_bar=false")
    assert code == 0
    printed = capsys.readouterr().out
    assert f"report: {out}/report.md" in printed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if not r.get("eval")]
    evals = [r for r in records if r.get("eval")]
    assert len(train) == 1 and len(evals) == 2  # before and after
    assert 0.0 <= train[0]["reward_mean"] <= 1.0
    assert "eval/acc/overall" in evals[0] and any(k.startswith("reward/acc/") for k in train[0])
    for e in evals:  # 2 images in each of the 6 families; probe: colors + color_attr
        assert e["eval/num_images"] == 12 and e["eval/probe/num_images"] == 4
        assert e["eval/acc/overall_lo"] <= e["eval/acc/overall"] <= e["eval/acc/overall_hi"]
        assert "eval/probe/acc/overall" in e and "eval/partial" in e
    saved = json.loads((out / "eval_records" / "iter-000001.json").read_text())
    assert len(saved["heldout"]["records"]) == 12 and len(saved["probe"]["records"]) == 4
    assert set(saved["heldout"]["records"][0]) == {"prompt", "family", "passed", "score"}
    # full fine-tuning: the whole pipeline in diffusers format, loadable as a model id
    assert (out / "final" / "model_index.json").is_file() and (out / "final" / "unet").is_dir()
    assert not (out / "final" / "pytorch_lora_weights.safetensors").exists()
    report = (out / "report.md").read_text()
    assert "acc/overall" in report and "samples/eval-iter-000000.png" in report
    assert "| paired difference |" in report and "Generalisation probe" in report
    assert "acc/single_object (in-distribution)" in report
    assert (out / "samples" / "eval-iter-000001.png").is_file()


def test_format_table_aligns_columns():
    text = format_table({"base": {"acc/overall": 0.5, "acc/colors": 0.25}, "run": {"acc/overall": 0.75}})
    lines = text.splitlines()
    assert lines[0].split() == ["base", "run"]
    assert lines[-1].split() == ["acc/overall", "0.500", "0.750"]
    assert "-" in lines[1].split()


def test_eval_command_prints_a_table_with_intervals(repo_root, capsys):
    code = run_cli("eval", "--base", "tiny:shapes", "--images-per-family", "1", "--steps", "2")
    assert code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("held-out evaluation") and "6 images" in out[0]
    assert out[1].split() == ["base"]
    overall = next(line for line in out if line.startswith("acc/overall"))
    assert "[" in overall and "]" in overall
    assert any(line.startswith("acc/two_object (in-distribution)") for line in out)


def test_eval_command_precision(repo_root, capsys):
    """--mixed-precision no runs the denoiser in fp32, bf16 under autocast; both are named in the header."""
    for flag, name in (("no", "float32"), ("bf16", "bfloat16")):
        code = run_cli("eval", "--base", "tiny:shapes", "--images-per-family", "1", "--steps", "2",
                       "--mixed-precision", flag)
        assert code == 0
        header = capsys.readouterr().out.splitlines()[0]
        assert header.endswith(f"{name} forwards"), header


def test_eval_command_paired_difference_against_the_base(repo_root, tmp_path, capsys):
    from diffalign.config_files import load_config
    from diffalign.trainer import build_trainer

    run = tmp_path / "same"  # a run with no update: its difference against the base is exactly 0
    cfg = load_config(repo_root / MAIN, [f"output_dir={run}", "model.id=tiny:shapes", "max_iterations=0", "eval.at_start=false",
                                         "eval.images_per_family=1", "sampling.eval_num_steps=2", "log.progress_bar=false",
                                         "log.report=false"])
    build_trainer(cfg).train()
    capsys.readouterr()
    code = run_cli("eval", str(run), "--base", "tiny:shapes", "--prompts", "probe", "--images-per-family", "2",
                   "--steps", "2")
    assert code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("generalisation probe") and "4 images" in out[0]
    assert out[1].split() == ["base", "same", "same", "-", "base"]
    overall = next(line for line in out if line.startswith("acc/overall"))
    assert overall.rstrip().endswith("+0.000 [+0.000, +0.000]")


def test_eval_validation_prompts_are_the_sweeps_and_never_held_out(repo_root):
    """``--prompts validation`` evaluates the prompts a run with ``prompts.evaluate_on=validation``
    (the tuning sweeps) evaluates on: training prompts only, none held out or in the probe."""
    import argparse

    from diffalign.cli import _eval_prompt_set
    from diffalign.config_files import load_config
    from diffalign.prompts import resolve_prompts
    from diffalign.shapes import split_prompts

    prompts, what = _eval_prompt_set(argparse.Namespace(prompts="validation"))
    _, sweep_eval = resolve_prompts(load_config(repo_root / MAIN, ["prompts.evaluate_on=validation"]))
    split = split_prompts()
    assert prompts == list(sweep_eval) and what.startswith("validation prompts")
    assert set(prompts) <= set(split.train) and not set(prompts) & (set(split.heldout) | set(split.probe))


@pytest.mark.parametrize("args, message", [
    (["--no-base", "no/such/run"], "no/such/run"),
    (["--prompts", "nonsense"], "--prompts: 'nonsense' is neither heldout/probe/train/validation nor a prompt file"),
    (["--samples-per-prompt", "2"], "--samples-per-prompt is for other rewards"),
    (["--images-per-family", "0"], "--images-per-family must be >= 1"),
    (["--mixed-precision", "fp8"], "--mixed-precision must be auto, bf16 or no, got 'fp8'"),
])
def test_eval_command_bad_input_is_one_line(repo_root, capsys, args, message):
    assert run_cli("eval", "--base", "tiny:shapes", *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_balanced_family_sampling(tmp_path):
    from collections import Counter

    from diffalign.config_files import load_config
    from diffalign.shapes import prompt_family
    from diffalign.prompts import PromptSampler, resolve_prompts

    cfg = load_config(None, [f"output_dir={tmp_path}", "prompts.balance_families=true"])
    train, heldout = resolve_prompts(cfg)
    counts = Counter(prompt_family(p) for p in PromptSampler(train, 0).next(600))
    assert len(counts) == 6 and max(counts.values()) - min(counts.values()) <= 10
    plain, _ = resolve_prompts(load_config(None, [f"output_dir={tmp_path}"]))
    assert set(train) == set(plain) and len(heldout) > 0


def test_validation_mode_trains_and_evaluates_on_training_prompts_only(repo_root):
    from diffalign.config_files import load_config
    from diffalign.shapes import split_prompts, validation_split
    from diffalign.prompts import resolve_prompts

    cfg = load_config(str(repo_root / MAIN), ["prompts.evaluate_on=validation", "prompts.balance_families=false",
                                                  "prompts.family_weights={}"])
    train, evaluation = resolve_prompts(cfg)
    split = split_prompts()
    assert (sorted(train), sorted(evaluation)) == validation_split(split)
    assert set(evaluation).isdisjoint(split.heldout + split.probe)


def test_family_weights_set_each_familys_share_of_the_rollouts(tmp_path):
    from collections import Counter

    from diffalign.config_files import load_config
    from diffalign.errors import ConfigError
    from diffalign.prompts import PromptSampler, resolve_prompts
    from diffalign.shapes import prompt_family

    base = [f"output_dir={tmp_path}", "prompts.balance_families=true"]
    train, _ = resolve_prompts(load_config(None, [*base, "prompts.family_weights={position: 3, color_attr: 2}"]))
    epoch = Counter(prompt_family(p) for p in train)  # one pass of the sampler: the exact shares
    assert epoch["position"] == 3 * epoch["counting"] and epoch["color_attr"] == 2 * epoch["counting"]
    assert epoch["single_object"] == epoch["two_object"] == epoch["colors"] == epoch["counting"]
    counts = Counter(prompt_family(p) for p in PromptSampler(train, 0).next(len(train)))
    assert counts == epoch
    with pytest.raises(ConfigError, match="prompts.family_weights.*known"):
        resolve_prompts(load_config(None, [*base, "prompts.family_weights={colour: 2}"]))
    # the main config's weights leave a run restricted to other families as it was
    only, _ = resolve_prompts(load_config(None, [*base, "prompts.family_weights={position: 4}", "prompts.families=[colors]"]))
    assert {prompt_family(p) for p in only} == {"colors"}
    with pytest.raises(ConfigError, match="prompts.family_weights.position"):
        load_config(None, [*base, "prompts.family_weights={position: 0}"])
    with pytest.raises(ConfigError, match="balance_families"):
        load_config(None, [f"output_dir={tmp_path}", "prompts.family_weights={position: 2}"])
