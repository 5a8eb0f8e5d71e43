import pytest
import torch

from diffalign.config import ModelConfig, RunConfig, sections
from diffalign.recipes.flow_grpo import FlowGRPOConfig
from diffalign.config_files import apply_overrides, dump_config, load_config
from diffalign.errors import ConfigError
from tests.helpers.tiny_run import ROOT


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(write(tmp_path, "output_dir: out\nmax_iterations: 3\n"), ["optim.lr=1e-3", "sampling.num_steps=7", "lora.targets=[a, b]"])
    assert isinstance(cfg, RunConfig)
    assert cfg.output_dir == "out" and cfg.max_iterations == 3 and cfg.seed == 0
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.sampling.num_steps == 7
    assert cfg.lora.targets == ["a", "b"]
    assert isinstance(cfg.algorithm, FlowGRPOConfig)


def test_run_config_sections_are_fresh_instances_of_their_class():
    a, b = RunConfig(), RunConfig()
    assert type(a.model) is ModelConfig and a.model is not b.model  # no shared mutable default
    assert type(a.algorithm) is FlowGRPOConfig  # the one section typed by algorithm.name
    with pytest.raises(TypeError, match="Bad.count: .* config section class, got 'int'"):
        sections(type("Bad", (), {"__annotations__": {"count": "int"}}))


def test_yaml_scientific_string_is_a_float(tmp_path):
    cfg = load_config(write(tmp_path, "optim:\n  lr: 1e-4\n"))  # YAML 1.1 reads 1e-4 as a string
    assert cfg.optim.lr == pytest.approx(1e-4)


@pytest.mark.parametrize(
    "text, key",
    [
        ("optim:\n  lrr: 1\n", "optim.lrr"),
        ("bogus: 1\n", "bogus"),
        ("algorithm:\n  name: flow_grpo\n  betaa: 0\n", "algorithm.betaa"),
    ],
)
def test_unknown_keys_are_named(tmp_path, text, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(
    "override, key",
    [
        ("sampling.num_steps=abc", "sampling.num_steps"),
        ("sampling.num_steps=0", "sampling.num_steps"),
        ("rollout.group_size=1", "rollout.group_size"),
        ("sampling.kernel=euler", "sampling.kernel"),
        ("algorithm.name=nope", "algorithm.name"),
        ("lora.enabled=maybe", "lora.enabled"),
        ("sampling.window_size=20", "sampling.window_size"),
        ("algorithm.clip_range=2", "algorithm.clip_range"),
        ("optim.name=adam", "optim.name"),
        ("optim.momentum=1", "optim.momentum"),
        ("eval.images_per_family=0", "eval.images_per_family"),
        ("eval.probe=sometimes", "eval.probe"),
    ],
)
def test_bad_values_name_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(write(tmp_path, "seed: 0\n"), [override])


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["optim.momentum=0.9"], "optim.momentum"),  # AdamW has no momentum knob
        (["optim.name=sgd", "optim.use_8bit_adam=true"], "optim.use_8bit_adam"),
    ],
)
def test_optimizer_settings_that_do_not_combine(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
        load_config(write(tmp_path, "seed: 0\n"), overrides)
    assert "\n" not in str(info.value)


def test_optim_name_picks_the_optimizer():
    from diffalign.training.backend import make_optimizer

    params = [torch.nn.Parameter(torch.ones(3))]
    assert RunConfig().optim.name == "adamw"
    assert type(make_optimizer(params, RunConfig().optim)) is torch.optim.AdamW
    sgd = make_optimizer(params, load_config(None, ["optim.name=sgd", "optim.momentum=0.5", "optim.lr=0.1"]).optim)
    assert type(sgd) is torch.optim.SGD
    assert sgd.defaults["momentum"] == 0.5 and sgd.defaults["lr"] == pytest.approx(0.1)
    assert sgd.defaults["weight_decay"] == pytest.approx(1e-4)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1, 2\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_override_syntax():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_overrides({}, ["novalue"])
    assert apply_overrides({}, ["a.b.c=3"]) == {"a": {"b": {"c": 3}}}


def test_dump_round_trip(tmp_path):
    cfg = load_config(write(tmp_path, "seed: 5\nsampling:\n  window_size: 2\n  window_mode: sliding\n"))
    again = load_config(write(tmp_path, dump_config(cfg)))
    assert again == cfg


def test_derived_numbers():
    cfg = RunConfig()
    d = cfg.derived()
    # 4 prompts x 8 images; 10 SDE steps x 0.99 -> 9 trained steps; 32 / 8 = 4 micro-batches per step
    assert d["images_per_iteration"] == 32
    assert d["trained_steps_per_sample"] == 9
    assert d["micro_batches_per_iteration"] == 36


def test_every_shipped_config_loads(repo_root):
    files = sorted((repo_root / "configs").rglob("*.yaml"))
    assert files
    for f in files:
        if f.parent.name == "accelerate":
            continue
        load_config(f)


def test_bad_images_per_family_is_one_line_naming_the_key(tmp_path, capsys):
    from diffalign.cli import main

    assert main(["config", str(write(tmp_path, "seed: 0\n")), "eval.images_per_family=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: config key 'eval.images_per_family' must be >= 1"]


def test_shared_method_options_are_declared_once_with_each_methods_defaults():
    import re

    from diffalign.recipes import config_class

    # SPO's and Diffusion-DPO's beta and clip_range belong to other losses (a DPO temperature, a ratio clamp)
    files = [ROOT / "diffalign" / "config.py", *(p for p in (ROOT / "diffalign" / "recipes").glob("*.py")
                                                 if p.stem not in ("spo", "diffusion_dpo"))]
    sources = "".join(p.read_text() for p in files)
    for key in ("clip_range", "beta", "logprob_reduction", "advantage_clip", "advantage_eps", "advantage_std",
                "filter_zero_std_groups"):
        assert len(re.findall(rf"^    {key}: .* = ", sources, re.M)) == 1, key
    defaults = {name: config_class(name)() for name in ("flow_grpo", "branch_grpo", "stepwise_flow_grpo", "drm_step_grpo",
                                                         "diffusion_nft", "awm")}
    assert (defaults["flow_grpo"].beta, defaults["flow_grpo"].clip_range) == (0.04, 1e-4)
    assert (defaults["branch_grpo"].clip_range, defaults["branch_grpo"].advantage_eps) == (1e-3, 1e-8)
    assert not defaults["diffusion_nft"].filter_zero_std_groups and not defaults["awm"].filter_zero_std_groups
    assert all(c.advantage_clip == 5.0 for c in defaults.values())


def test_renamed_keys_and_recipes_still_load_with_a_notice(capsys):
    cfg = load_config(None, ["algorithm.name=diffusion_nft", "algorithm.adv_clip=3.0"])
    assert cfg.algorithm.advantage_clip == 3.0
    assert "'algorithm.adv_clip' is deprecated" in capsys.readouterr().err
    cfg = load_config(None, ["algorithm.name=drm_step_grpo", "algorithm.filter_zero_std=false"])
    assert cfg.algorithm.filter_zero_std_groups is False
    with pytest.raises(ConfigError, match="old name of 'filter_zero_std_groups'"):
        load_config(None, ["algorithm.name=branch_grpo", "algorithm.filter_zero_std_trees=false",
                           "algorithm.filter_zero_std_groups=false"])
    cfg = load_config("tiny/ddpo_sd15")
    assert cfg.sampling.kernel == "ddim" and "now called 'tiny/flow_grpo_ddim_sd15'" in capsys.readouterr().err


def test_a_nested_method_config_names_its_path():
    with pytest.raises(ConfigError, match="'algorithm.flow_grpo.clip_range'"):
        load_config(None, ["algorithm.name=sol_rl", "algorithm.flow_grpo.clip_range=2"])
    with pytest.raises(ConfigError, match="'algorithm.diffusion_nft.advantage_clip'"):
        load_config(None, ["algorithm.name=sol_rl", "algorithm.diffusion_nft.advantage_clip=0"])
