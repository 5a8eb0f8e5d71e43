"""The memory planner's arithmetic, its command and the check before training.

Counts are checked against hand-computed values on small modules; the recipes' plans offline;
``diffalign train`` on a GPU without enough free memory (``torch.cuda.mem_get_info`` monkeypatched)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffalign.config_files import load_config
from diffalign.planner import GB, Settings, fit_table, format_plan, plan, suggestions
from diffalign.planner.memory import ADAMW_STATE, FP32, lora_params
from tests.helpers.tiny_run import run_cli

RECIPE = "sd3/flow_grpo_pickscore"


@pytest.fixture(scope="module")
def sd3():
    return Settings.from_config(load_config(RECIPE, []))


def _line(p, phase: str, prefix: str) -> float:
    return sum(line.bytes for line in p.phases[phase] if line.name.startswith(prefix))


def test_lora_parameters_hand_computed():
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.to_q, self.to_k, self.other = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16), torch.nn.Linear(8, 8)

    block = torch.nn.Module()
    block.attn = Attn()
    block.conv = torch.nn.Conv2d(4, 6, 3)
    # r * (in + out) per Linear: 4 * 24 twice; Conv2d: r * (in * k * k + out) = 4 * (36 + 6)
    assert lora_params(block, ("attn.to_q", "to_k"), 4) == 4 * 24 * 2
    assert lora_params(block, ("conv",), 4) == 4 * (4 * 9 + 6)


def test_trainable_state_optimizer_and_sharding(sd3):
    p = plan(sd3)
    lora = _line(p, "train", "LoRA r 32")
    n = lora / FP32  # LoRA parameters
    assert 1e6 < n < 1e8
    assert _line(p, "train", "optimizer states") == pytest.approx(n * ADAMW_STATE)
    assert _line(p, "train", "gradients") == pytest.approx(n * FP32)
    assert _line(p, "train", "EMA") == pytest.approx(n * FP32)
    q = plan(dataclasses.replace(sd3, use_8bit_adam=True))
    assert _line(q, "train", "optimizer states") == pytest.approx(n * 2)
    z2 = plan(dataclasses.replace(sd3, gpus=4, zero_stage=2))
    assert _line(z2, "train", "optimizer states") == pytest.approx(n * ADAMW_STATE / 4)
    assert _line(z2, "train", "gradients") == pytest.approx(n * FP32 / 4)
    z1 = plan(dataclasses.replace(sd3, gpus=4, zero_stage=1))
    assert _line(z1, "train", "gradients") == pytest.approx(n * FP32)


def test_full_fine_tuning_and_fsdp(sd3):
    full = plan(dataclasses.replace(sd3, lora=False))
    weights = _line(full, "train", "transformer weights (fp32")
    pos_embed = 384 * 384 * 1536  # the position-embedding buffer, kept in bf16
    assert weights == pytest.approx(2.2432e9 * FP32 + pos_embed * 2, rel=0.001)
    assert _line(full, "train", "optimizer states") == pytest.approx(2.2432e9 * ADAMW_STATE, rel=0.01)
    assert _line(full, "train", "frozen reference") == pytest.approx(2.2432e9 * 2, rel=0.01)  # beta 0.01: bf16 copy
    fsdp = plan(dataclasses.replace(sd3, lora=False, gpus=8, fsdp=True))
    assert _line(fsdp, "train", "optimizer states") == pytest.approx(_line(full, "train", "optimizer states") / 8)
    assert fsdp.peak < full.peak


def test_text_encoder_placements(sd3):
    resident = plan(sd3)
    offload = plan(dataclasses.replace(sd3, text_encoders="offload"))
    cache = plan(dataclasses.replace(sd3, text_encoders="cache"))
    t5 = _line(resident, "train", "text_encoder_3")
    assert t5 == pytest.approx(4.762e9 * 2, rel=0.01)  # T5-XXL encoder in bf16
    assert _line(offload, "train", "text_encoder") == 0 and _line(cache, "train", "text_encoder") == 0
    assert _line(offload, "encode", "text_encoder_3") == pytest.approx(t5)
    assert _line(offload, "encode", "optimizer") > 0 and _line(cache, "encode", "optimizer") == 0  # cache encodes before setup
    assert resident.total("train") - offload.total("train") == pytest.approx(_line(resident, "train", "text_encoder"))


def test_activations_scale_with_rows_and_checkpointing(sd3):
    acts = lambda p: _line(p, "train", "saved activations")  # noqa: E731
    one, two = plan(dataclasses.replace(sd3, batch_size=1)), plan(dataclasses.replace(sd3, batch_size=2))
    assert acts(two) == pytest.approx(2 * acts(one))
    assert acts(plan(dataclasses.replace(sd3, checkpointing=True))) < acts(plan(sd3)) / 3
    assert {line.how for line in plan(sd3).phases["train"]} <= {"counted", "measured", "assumed"}


def test_suggestions_fit_and_are_ordered_by_number_of_changes(sd3):
    limit = 40 * GB
    assert plan(sd3).peak > limit
    fits = suggestions(sd3, limit)
    assert fits and all(p.peak <= limit for _, p in fits)
    assert len({len(c.split()) for c, _ in fits}) >= 1
    text = format_plan(plan(sd3), 40, name=RECIPE)
    assert "does not fit a 40 GB GPU" in text and fits[0][0] in text


def test_fit_table_names_the_smallest_gpu(sd3):
    rows = fit_table(sd3)
    assert len(rows) == 24
    for label, peak, fit in rows:
        assert fit == next((f"{g} GB" for g in (24, 40, 48, 80) if peak <= g), "-"), label


def test_plan_command_errors(capsys):
    assert run_cli("plan") == 2
    assert "needs a RECIPE" in capsys.readouterr().err
    assert run_cli("plan", RECIPE, "--gpus", "0") == 2
    assert run_cli("plan", RECIPE, "model.id=org/unknown-model") == 2
    assert "model.id" in capsys.readouterr().err


@pytest.fixture
def small_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=0: (30 * 10**9, 80 * 10**9))


def test_train_stops_when_the_plan_exceeds_free_memory(small_gpu, capsys, monkeypatch):
    import diffalign.trainer

    monkeypatch.setattr(diffalign.trainer, "build_trainer", lambda *a, **k: pytest.fail("the model must not load"))
    assert run_cli("train", RECIPE) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "GB per GPU" in err and "cuda:0 has 30.0 GB free" in err and "first setting that fits: " in err


def test_no_plan_check_skips_it(small_gpu, monkeypatch, tmp_path):
    import diffalign.trainer

    loaded = []

    class Stub:
        def train(self):
            loaded.append(True)

    monkeypatch.setattr(diffalign.trainer, "build_trainer", lambda *a, **k: Stub())
    assert run_cli("train", RECIPE, "--no-plan-check", f"output_dir={tmp_path / 'run'}") == 0
    assert loaded


def test_train_on_cpu_has_no_check(monkeypatch):
    from diffalign import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=0: pytest.fail("no CUDA query on CPU"))
    cli._check_memory_plan(load_config(RECIPE, []))


def test_plan_vs_cuda_skips_without_a_gpu(monkeypatch, capsys):
    from tests.helpers.scripts import load_script

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bench = load_script("benchmarks/gpu/plan_vs_cuda.py", "plan_vs_cuda")
    assert bench.main([]) == 0
    assert "skipped" in capsys.readouterr().out


def test_measurement_script_finds_a_tiny_recipe_per_measured_family():
    from diffalign.planner.memory import MEASURED_AS, activation_table
    from tests.helpers.scripts import load_script

    script = load_script("scripts/measure_activations.py", "measure_activations")
    recipes = script.tiny_recipes()
    assert set(activation_table()["families"]) == set(recipes)
    assert not set(MEASURED_AS) & set(recipes)


def test_copies_of_the_denoiser_are_counted():
    """OPD's fused teachers in the model dtype; Sol-RL's NVFP4 copy at 4.5 bits per weight."""
    transformer = 2.2432e9  # SD3.5 Medium's MMDiT parameters (test_plan_components)
    opd = plan(Settings.from_config(load_config("sd3/opd_two_teachers", [])))
    teachers = [line.bytes for line in opd.phases["train"] if line.name.startswith("teacher")]
    assert teachers == [pytest.approx(transformer * 2, rel=0.01)] * 2
    sol = plan(Settings.from_config(load_config("sd3/sol_rl_pickscore", [])))
    large = 8.0566e9  # SD3.5 Large's MMDiT parameters
    assert _line(sol, "train", "nvfp4 policy copy") == pytest.approx(large * 4.5 / 8, rel=0.01)


def test_the_check_reads_a_launchs_fsdp_config(monkeypatch):
    """Under ``accelerate launch --config_file fsdp.yaml`` (ACCELERATE_USE_FSDP) the check plans FSDP
    over the launch's processes, as the backend shards."""
    from diffalign.planner import check_fits

    cfg = load_config(RECIPE, ["lora.enabled=false"])
    free = {"cuda:0": 40 * 10**9}
    assert "first setting that fits: train.gradient_checkpointing=true train.fsdp=true" in check_fits(cfg, 8, free)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with_fsdp = check_fits(cfg, 8, {"cuda:0": 10**12})
    assert with_fsdp is None
    sharded = plan(dataclasses.replace(Settings.from_config(cfg, 8), fsdp=True)).peak
    assert check_fits(cfg, 8, {"cuda:0": sharded + 1}) is None and check_fits(cfg, 8, {"cuda:0": sharded - 1}) is not None


def test_context_parallel_divides_the_blocks_activations_only():
    """``train.context_parallel=2``: each process holds half of a sample's tokens inside the blocks;
    the activations outside them, the weights and the trainable state stay whole."""
    flux = Settings.from_config(load_config("flux/flow_grpo_pickscore", []))
    split = Settings.from_config(load_config("flux/flow_grpo_pickscore", ["train.context_parallel=2"]))
    assert (flux.context_parallel, split.context_parallel) == (1, 2)
    one, two = plan(flux), plan(split)
    blocks = lambda p: _line(p, "train", "saved activations: ")  # noqa: E731
    assert blocks(two) == pytest.approx(blocks(one) / 2) and blocks(one) > 0
    for prefix in ("saved activations outside", "backward working set", "gradients", "optimizer states", "transformer weights"):
        assert _line(two, "train", prefix) == _line(one, "train", prefix), prefix
    rollout = lambda p: _line(p, "rollout", "denoiser forward working set")  # noqa: E731
    assert rollout(two) == pytest.approx(rollout(one) / 2)
    assert two.peak < one.peak
