"""The GPU recipes of the newer model families (configs/<family>/*.yaml): each validates as shipped,
names its hub model, family and launch, and trains one iteration with the same keys on the family's
tiny build (only the sizes, the dtype, the prompts and the weight-bearing reward swapped)."""

import math

import pytest

from diffalign.config_files import load_config
from tests.helpers.tiny_run import FAST_ONE_PROMPT, ROOT, run_cli, train_records

EDIT_PROMPTS = "configs/tiny/edit/prompts.jsonl"  # four 32 px sources with instructions
TEXT = ["reward.name=jpeg_compressibility", "prompts.source=list", "prompts.train=[a cat, a dog]", "prompts.eval=[a cat]"]
EDIT = ["reward.kwargs.instruction=jpeg_compressibility", "reward.kwargs.preservation=pixel",
        f"prompts.file={EDIT_PROMPTS}", f"prompts.eval_file={EDIT_PROMPTS}", "model.options.image_resolution=32"]
VIDEO = [*TEXT, "model.options.num_frames=5"]  # 5 frames: the tiny VAEs' smallest clip
# name -> (family, hub id, the tiny run's own overrides)
RECIPES = {
    "flux_kontext/flow_grpo_edit_consistency": ("flux_kontext", "black-forest-labs/FLUX.1-Kontext-dev", EDIT),
    "qwen/flow_grpo_pickscore": ("qwen", "Qwen/Qwen-Image", TEXT),
    "qwen_edit/flow_grpo_edit_consistency": ("qwen_edit", "Qwen/Qwen-Image-Edit", EDIT),
    "wan/flow_grpo_ocr": ("wan", "Wan-AI/Wan2.1-T2V-14B-Diffusers", VIDEO),
    "wan/flow_grpo_ocr_1_3b": ("wan", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", VIDEO),
    # tiny:wan builds Wan2.2's two experts when boundary_ratio is set (the real checkpoint brings its own)
    "wan/flow_grpo_ocr_wan22": ("wan", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", [*VIDEO, "model.options.boundary_ratio=0.875"]),
    "hunyuan_video/flow_grpo_hpsv2": ("hunyuan_video", "hunyuanvideo-community/HunyuanVideo", VIDEO),
    "ltx/flow_grpo_pickscore": ("ltx", "Lightricks/LTX-Video", VIDEO),
    "zimage/flow_grpo_pickscore": ("zimage", "Tongyi-MAI/Z-Image", TEXT),
}
# what makes a real recipe a tiny one: 32 px, fp32 on the CPU, 2 groups of 2 in one batch, 4 steps
TINY = ["max_iterations=1", "model.dtype=float32", "model.resolution=32", "train.mixed_precision=no",
        "rollout.prompts_per_iteration=2", "rollout.group_size=2", "rollout.sample_batch_size=4", "train.batch_size=4",
        "sampling.num_steps=4", *FAST_ONE_PROMPT]


def header(name: str) -> str:
    """The comment block above the first key of recipe ``name``."""
    lines = (ROOT / "configs" / f"{name}.yaml").read_text().splitlines()
    return "\n".join(line for line in lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))])


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_validates_and_names_model_launch_and_memory_command(name, tmp_path, capsys):
    family, hub_id, _ = RECIPES[name]
    prompts = EDIT_PROMPTS if family in ("flux_kontext", "qwen_edit") else tmp_path / "prompts.txt"
    if prompts != EDIT_PROMPTS:
        prompts.write_text("a cat\na dog\n")
    assert run_cli("config", f"configs/{name}.yaml", f"prompts.file={prompts}", f"prompts.eval_file={prompts}") == 0
    assert hub_id in capsys.readouterr().out
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    assert (cfg.model.id, cfg.model.family, cfg.model.dtype) == (hub_id, family, "bfloat16")
    assert cfg.train.mixed_precision == "bf16" and cfg.algorithm.name == "flow_grpo"
    text = header(name)
    # the memory figure is the plan command's (tests/test_plan_all.py checks it against the current plan)
    assert f"# GPU memory per GPU (`diffalign plan {name}" in text
    assert "accelerate launch --config_file configs/accelerate/" in text and f"-m diffalign train {name}\n" in text + "\n"
    assert "Hyperparameters:" in text and "github.com/" in text  # the recipe it follows


def test_recipes_keep_the_reference_keys():
    """Spot checks against the references named in the headers (Flow-GRPO config/grpo.py and scripts,
    DanceGRPO's HunyuanVideo script, Flow-Factory's Z-Image example)."""
    qwen = load_config(ROOT / "configs/qwen/flow_grpo_pickscore.yaml")  # pickscore_qwenimage
    assert (qwen.sampling.num_steps, qwen.sampling.eval_num_steps, qwen.sampling.guidance_scale) == (10, 50, 4.0)
    assert (qwen.sampling.noise_level, qwen.sampling.window_size, qwen.sampling.window_mode) == (1.2, 2, "random")
    assert (qwen.rollout.group_size, qwen.rollout.prompts_per_iteration * 8) == (16, 32)
    assert (qwen.algorithm.beta, qwen.train.ema.enabled, qwen.train.gradient_checkpointing) == (0.0, False, True)
    assert (qwen.lora.rank, qwen.lora.alpha, len(qwen.lora.targets)) == (64, 128, 12)
    wan = load_config(ROOT / "configs/wan/flow_grpo_ocr_1_3b.yaml")  # general_ocr_wan2_1
    assert (wan.sampling.num_steps, wan.sampling.guidance_scale, wan.model.options["num_frames"]) == (20, 4.5, 33)
    assert (wan.algorithm.beta, wan.algorithm.clip_range, wan.optim.lr, wan.algorithm.advantage_std) == (0.004, 1e-3, 1e-4, "group")
    assert wan.rollout.prompts_per_iteration * wan.rollout.group_size == 2 * wan.rollout.sample_batch_size == 16
    kontext = load_config(ROOT / "configs/flux_kontext/flow_grpo_edit_consistency.yaml")  # counting_flux_kontext
    assert (kontext.model.options["guidance"], kontext.sampling.guidance_scale, kontext.sampling.noise_level) == (2.5, 1.0, 0.9)
    assert (kontext.rollout.group_size, kontext.rollout.prompts_per_iteration * 8) == (21, 48)
    assert kontext.reward.kwargs["instruction_weight"] == kontext.reward.kwargs["preservation_weight"] == 0.5
    edit = load_config(ROOT / "configs/qwen_edit/flow_grpo_edit_consistency.yaml")  # counting_qwenimage_edit
    assert (edit.sampling.noise_level, edit.sampling.window_size, edit.derived()["trained_steps_per_sample"]) == (1.0, 0, 9)
    hunyuan = load_config(ROOT / "configs/hunyuan_video/flow_grpo_hpsv2.yaml")  # DanceGRPO
    assert (hunyuan.sampling.kernel, hunyuan.sampling.noise_level, hunyuan.sampling.num_steps) == ("dance", 0.25, 16)
    assert not hunyuan.lora.enabled and hunyuan.rollout.shared_noise and hunyuan.derived()["trained_steps_per_sample"] == 9
    zimage = load_config(ROOT / "configs/zimage/flow_grpo_pickscore.yaml")  # Flow-Factory: w = 4 is diffalign's 5
    assert (zimage.sampling.guidance_scale, zimage.sampling.window_size, zimage.lora.rank) == (5.0, 1, 64)


@pytest.mark.parametrize("name", [n for n in sorted(RECIPES) if load_config(ROOT / "configs" / f"{n}.yaml").lora.targets])
def test_every_listed_lora_target_names_modules_of_the_family(name):
    """peft stops only when no target matches; a misspelt entry among others would silently train
    fewer layers. The tiny builds use the released models' module names."""
    from diffalign.adapters import load_adapter

    family, _, _ = RECIPES[name]
    names = [module_name for module_name, _ in load_adapter(f"tiny:{family}").denoiser.named_modules()]
    for target in load_config(ROOT / "configs" / f"{name}.yaml").lora.targets:
        assert any(n == target or n.endswith("." + target) for n in names), target


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_trains_one_iteration_on_the_tiny_build(name, tmp_path):
    family, _, overrides = RECIPES[name]
    out = tmp_path / "run"
    assert run_cli("train", f"configs/{name}.yaml", f"output_dir={out}", f"model.id=tiny:{family}", *TINY, *overrides) == 0
    (record,) = train_records(out)
    assert record["optimizer_steps"] >= 1 and math.isfinite(record["loss"]) and record["nonfinite_rewards"] == 0
    assert record["ratio_mean"] == pytest.approx(1.0, abs=1e-3)  # on-policy: the update re-scores what it sampled
    assert (out / "final").is_dir()
