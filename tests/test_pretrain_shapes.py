"""scripts/pretrain_shapes.py: an interrupted pretraining resumes exactly, from safetensors state."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pretrain_shapes.py"


@pytest.fixture(scope="module")
def pretrain():
    spec = importlib.util.spec_from_file_location("pretrain_shapes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pretrain_shapes"] = module  # importlib's recipe: its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("pretrain_shapes", None)


def _run(pretrain, tmp_path, name, steps, *extra):
    threads = torch.get_num_threads()
    common = ["--tiny", "--no-eval", "--batch-size", "4", "--warmup", "2", "--decay-steps", "2", "--threads", "1",
              "--ema-decay", "0.9", "--ckpt-every", "100"]
    pretrain.main([*common, "--steps", str(steps), "--out", str(tmp_path / name / "model"),
                   "--state-dir", str(tmp_path / name / "state"), *extra])
    torch.set_num_threads(threads)
    return tmp_path / name / "state"


def test_interrupted_pretraining_resumes_exactly(pretrain, tmp_path):
    straight = _run(pretrain, tmp_path, "straight", 5)
    _run(pretrain, tmp_path, "resumed", 5, "--until", "2")  # interrupted after 2 of the 5 steps
    resumed = _run(pretrain, tmp_path, "resumed", 5, "--resume")
    assert json.loads((resumed / "state.json").read_text())["step"] == 5
    for group in pretrain.STATE_GROUPS:
        a, b = load_file(str(straight / f"{group}.safetensors")), load_file(str(resumed / f"{group}.safetensors"))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (group, k)
    # the saved model is a loadable diffusers-format pipeline
    from diffalign.shapes.pipeline import ShapesPipeline

    ShapesPipeline.from_pretrained(str(tmp_path / "resumed" / "model"))


def test_resume_without_state_is_a_clear_error(pretrain, tmp_path):
    with pytest.raises(SystemExit, match="no training state"):
        _run(pretrain, tmp_path, "none", 2, "--resume")


def test_architecture_flags_build_save_and_guard_the_resume(pretrain, tmp_path):
    state = _run(pretrain, tmp_path, "arch", 2, "--until", "1", "--no-text-time-embedding", "--cross-attention-levels", "2")
    assert json.loads((state / "state.json").read_text())["architecture"] == {
        "text_time_embedding": False, "cross_attention_levels": 2, "coordinate_channels": False, "text_encoder": "clip"}
    with pytest.raises(SystemExit, match="was trained with architecture"):
        _run(pretrain, tmp_path, "arch", 2, "--resume")  # the default flags: another architecture
    _run(pretrain, tmp_path, "arch", 2, "--resume", "--no-text-time-embedding", "--cross-attention-levels", "2")
    from diffalign.shapes.pipeline import ShapesPipeline

    unet = ShapesPipeline.from_pretrained(str(tmp_path / "arch" / "model")).unet
    assert unet.config.addition_embed_type is None
    assert list(unet.config.down_block_types) == ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"]
    with pytest.raises(SystemExit, match="--cross-attention-levels"):
        _run(pretrain, tmp_path, "bad", 2, "--cross-attention-levels", "4")


def test_text_encoder_flag_is_recorded_saved_and_guarded(pretrain, tmp_path):
    state = _run(pretrain, tmp_path, "enc", 2, "--until", "1", "--text-encoder", "bert")
    assert json.loads((state / "state.json").read_text())["architecture"]["text_encoder"] == "bert"
    with pytest.raises(SystemExit, match="was trained with architecture"):
        _run(pretrain, tmp_path, "enc", 2, "--resume")  # the default (CLIP) encoder: another architecture
    _run(pretrain, tmp_path, "enc", 2, "--resume", "--text-encoder", "bert")
    from diffalign.shapes.pipeline import ShapesPipeline

    assert type(ShapesPipeline.from_pretrained(str(tmp_path / "enc" / "model")).text_encoder).__name__ == "BertModel"
    # a CLIP model does not initialise a BERT one: a clear error
    _run(pretrain, tmp_path, "clip", 1)
    with pytest.raises(SystemExit, match="does not fit the architecture flags"):
        _run(pretrain, tmp_path, "bert_from_clip", 1, "--text-encoder", "bert", "--init-from", str(tmp_path / "clip" / "model"))


def test_states_without_an_architecture_record_resume_with_cross_attention_at_8x8(pretrain, tmp_path):
    """States saved before the architecture flags existed (the earlier shipped model's) record no
    architecture: they are the 8x8-only UNet, so they resume with ``--cross-attention-levels 1`` and
    are refused with the (16x16) defaults."""
    state = _run(pretrain, tmp_path, "old", 2, "--until", "1", "--cross-attention-levels", "1")
    info = json.loads((state / "state.json").read_text())
    del info["architecture"]
    (state / "state.json").write_text(json.dumps(info))
    with pytest.raises(SystemExit, match="was trained with architecture"):
        _run(pretrain, tmp_path, "old", 2, "--resume")
    _run(pretrain, tmp_path, "old", 2, "--resume", "--cross-attention-levels", "1")
    assert json.loads((state / "state.json").read_text())["step"] == 2


def test_learning_rate_warms_up_holds_then_decays(pretrain):
    args = pretrain.parse_args(["--steps", "100", "--warmup", "10", "--decay-steps", "20", "--final-lr-fraction", "0.1"])
    f = [pretrain.lr_factor(s, args) for s in range(101)]
    assert f[0] == pytest.approx(0.1) and f[9] == 1.0 and f[79] == 1.0 and f[80] == 1.0
    assert f[90] == pytest.approx(0.55) and f[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))


def test_export_only_writes_the_state_without_training(pretrain, tmp_path):
    state = _run(pretrain, tmp_path, "run", 4, "--until", "3")
    before = (state / "state.json").read_text()
    _run(pretrain, tmp_path, "run", 4, "--resume", "--export-only")
    assert (state / "state.json").read_text() == before  # not trained, not rewritten
    from diffalign.shapes.pipeline import ShapesPipeline

    exported = ShapesPipeline.from_pretrained(str(tmp_path / "run" / "model"))
    ema = load_file(str(state / "ema.safetensors"))
    first = next(iter(exported.unet.parameters()))
    torch.testing.assert_close(first.float(), ema["0"].half().float())  # the EMA weights, stored in fp16


def test_committed_state_continues_the_shipped_run(pretrain, repo_root):
    """scripts/pretrain_state holds one state: the shipped run (SHIPPED_RECIPE, stopped at step 4,500)
    continued along its recorded extension to 12,000 steps; a light state (no Adam moments), each
    file under 20 MB, the recipe's architecture and timestep shift."""
    states = sorted(p for p in (repo_root / "scripts" / "pretrain_state").iterdir() if p.is_dir())
    assert [p.name for p in states] == ["shapes-t2i-bert-12k-step008500"]
    state = states[0]
    info = json.loads((state / "state.json").read_text())
    recipe = pretrain.parse_args(list(pretrain.SHIPPED_RECIPE))
    assert info["kind"] == "light" and info["step"] == 8500
    assert info["schedule"]["extensions"][0]["from_step"] == recipe.until == 4500
    assert info["schedule"]["extensions"][0]["to_step"] == 12000
    assert pretrain.recorded_architecture(info) == pretrain.architecture(recipe)
    assert pretrain.architecture(recipe)["text_encoder"] == "bert"
    assert info["timestep_shift"] == recipe.timestep_shift == 2.0
    for name in ("params", "ema", "rng"):
        f = state / f"{name}.safetensors"
        assert f.is_file() and f.stat().st_size < 20 * 2**20, f
    assert not (state / "exp_avg.safetensors").exists()
    ema = load_file(str(state / "ema.safetensors"))
    from diffalign.shapes.pipeline import ShapesPipeline

    pipe = ShapesPipeline.from_pretrained(str(repo_root / "diffalign" / "assets" / "shapes-t2i"))
    shapes = [tuple(p.shape) for p in (*pipe.unet.parameters(), *pipe.text_encoder.parameters())]
    assert [tuple(ema[str(i)].shape) for i in range(len(ema))] == shapes  # the shipped model's architecture


def test_family_weights_set_the_share_of_each_family(pretrain):
    import numpy as np

    from diffalign.shapes.world import prompt_family, split_prompts

    assert pretrain.parse_family_weights("color_attr=3, position=2") == {"color_attr": 3.0, "position": 2.0}
    assert pretrain.parse_family_weights("") == {}
    train = split_prompts(seed=0).train
    draws = pretrain.PromptSampler(train, np.random.default_rng(0), {"color_attr": 3, "position": 2})(9000)
    share = {f: sum(prompt_family(p) == f for p in draws) / len(draws) for f in ("color_attr", "position", "counting")}
    assert share["color_attr"] == pytest.approx(3 / 9, abs=0.02) and share["position"] == pytest.approx(2 / 9, abs=0.02)
    assert share["counting"] == pytest.approx(1 / 9, abs=0.02)
    # no weights: the default family-uniform draws, unchanged
    plain, empty = (pretrain.PromptSampler(train, np.random.default_rng(1), w)(64) for w in (None, {}))
    assert plain == empty
    for bad, match in (("color_attr", "FAMILY=WEIGHT"), ("color_attr=x", "FAMILY=WEIGHT")):
        with pytest.raises(SystemExit, match=match):
            pretrain.parse_family_weights(bad)
    with pytest.raises(SystemExit, match="unknown families"):
        pretrain.PromptSampler(train, np.random.default_rng(0), {"colour": 2})
    with pytest.raises(SystemExit, match=">= 0"):
        pretrain.PromptSampler(train, np.random.default_rng(0), {"color_attr": -1})


def test_init_from_widens_a_saved_model_into_coordinate_channels(pretrain, tmp_path):
    """--coordinate-channels --init-from a plain model: the new model starts as the saved one (its
    two new input channels at zero) and records the architecture it resumes with."""
    from diffalign.shapes.pipeline import ShapesPipeline

    _run(pretrain, tmp_path, "plain", 1)
    plain_dir = str(tmp_path / "plain" / "model")
    state = _run(pretrain, tmp_path, "coord", 0, "--coordinate-channels", "--init-from", plain_dir)
    assert json.loads((state / "state.json").read_text())["architecture"]["coordinate_channels"] is True
    plain, coord = ShapesPipeline.from_pretrained(plain_dir), ShapesPipeline.from_pretrained(str(tmp_path / "coord" / "model"))
    assert coord.unet.config.in_channels == 5
    assert not coord.unet.conv_in.weight[:, 3:].any()
    x, t = torch.randn(2, 3, 32, 32), torch.tensor([600.0, 50.0])
    with torch.no_grad():
        context = plain.encode_prompt(["a red circle", ""])
        torch.testing.assert_close(coord.encode_prompt(["a red circle", ""]), context)
        torch.testing.assert_close(coord.unet(x, t, encoder_hidden_states=context).sample,
                                   plain.unet(x, t, encoder_hidden_states=context).sample, atol=1e-3, rtol=1e-3)
    with pytest.raises(SystemExit, match="--init-from"):
        _run(pretrain, tmp_path, "missing", 1, "--init-from", str(tmp_path / "nowhere"))


def test_timestep_shift_moves_training_to_high_noise_and_is_recorded(pretrain, tmp_path):
    u = torch.linspace(0, 1, 1001)
    assert torch.equal(pretrain.shift_timesteps(u, 1.0), u)  # the default: uniform t, unchanged
    t = pretrain.shift_timesteps(u, 2.0)
    assert t[0] == 0 and t[-1] == 1 and bool((t[1:] > t[:-1]).all())
    assert float(t[500]) == pytest.approx(2 / 3)  # the scheduler's sigma map: 2 * 0.5 / (1 + 0.5)
    assert float((t > 0.85).float().mean()) == pytest.approx(1 - 0.85 / 1.15, abs=2e-3)  # 0.26, not 0.15
    with pytest.raises(SystemExit, match="timestep-shift"):
        pretrain.shift_timesteps(u, 0.0)
    with pytest.raises(SystemExit, match="timestep-shift"):
        _run(pretrain, tmp_path, "bad", 1, "--timestep-shift", "0")
    state = _run(pretrain, tmp_path, "shifted", 2, "--timestep-shift", "2")
    assert json.loads((state / "state.json").read_text())["timestep_shift"] == 2.0


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


def test_light_state_leaves_out_the_adam_moments(pretrain, tmp_path):
    full = _run(pretrain, tmp_path, "full", 3)
    light = _run(pretrain, tmp_path, "light", 3, "--light-state")
    assert json.loads((full / "state.json").read_text())["kind"] == "full"
    info = json.loads((light / "state.json").read_text())
    assert info["kind"] == "light" and "adam_steps" not in info
    assert sorted(f.name for f in light.iterdir()) == ["ema.safetensors", "params.safetensors", "rng.safetensors", "state.json"]
    assert 0.45 < _size(light) / _size(full) < 0.55
    for group in pretrain.LIGHT_STATE_GROUPS:  # the same run: the same weights and EMA
        a, b = load_file(str(full / f"{group}.safetensors")), load_file(str(light / f"{group}.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_from_a_light_state_rewarms_fresh_moments_and_continues(pretrain, tmp_path, capsys):
    light = _run(pretrain, tmp_path, "light", 6, "--light-state", "--until", "3")
    saved = json.loads((light / "state.json").read_text())
    capsys.readouterr()
    _run(pretrain, tmp_path, "light", 6, "--resume", "--rewarm-steps", "2", "--light-state")
    out = capsys.readouterr().out
    notice = [line for line in out.splitlines() if line.startswith("light state:")]
    assert notice == ["light state: no Adam moments saved; Adam starts fresh moments at step 3, with the rate "
                      "re-warmed linearly from 0 over 2 steps (--rewarm-steps)"]
    assert "resumed from" in out and "at step 3 (light state)" in out
    info = json.loads((light / "state.json").read_text())
    assert info["step"] == 6 and info["kind"] == "light"
    assert info["schedule"]["rewarms"] == [{"from_step": 3, "steps": 2}]
    assert info["sched"]["last_epoch"] == 6 and saved["sched"]["last_epoch"] == 3  # the schedule's step counter went on
    schedule = pretrain.Schedule.from_record(info["schedule"])
    plain = pretrain.Schedule.from_record({**info["schedule"], "rewarms": []})
    assert [schedule.factor(s) / plain.factor(s) for s in range(2, 7)] == [1.0, 0.5, 1.0, 1.0, 1.0]
    # the default re-warm-up is the schedule's warm-up; a later full save records the re-warm-up,
    # so an exact resume inside it follows the same rate
    light2 = _run(pretrain, tmp_path, "light2", 8, "--light-state", "--until", "2")
    _run(pretrain, tmp_path, "light2", 8, "--resume", "--until", "3")  # without --light-state: saved full
    info = json.loads((light2 / "state.json").read_text())
    assert info["kind"] == "full" and info["schedule"]["rewarms"] == [{"from_step": 2, "steps": 2}]  # --warmup 2


def test_a_light_state_exports(pretrain, tmp_path):
    state = _run(pretrain, tmp_path, "run", 4, "--light-state", "--until", "3")
    _run(pretrain, tmp_path, "run", 4, "--resume", "--export-only")
    from diffalign.shapes.pipeline import ShapesPipeline

    exported = ShapesPipeline.from_pretrained(str(tmp_path / "run" / "model"))
    torch.testing.assert_close(next(iter(exported.unet.parameters())).float(),
                               load_file(str(state / "ema.safetensors"))["0"].half().float())


@pytest.mark.parametrize("extra, needle", [
    (["--resume", "--rewarm-steps", "-1"], "--rewarm-steps must be >= 0"),
    (["--rewarm-steps", "3"], "--rewarm-steps applies to --resume"),
])
def test_bad_light_state_flags_exit_2_with_one_line(pretrain, tmp_path, capsys, extra, needle):
    with pytest.raises(SystemExit) as err:
        _run(pretrain, tmp_path, "bad", 2, *extra)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]


def test_extend_to_continues_the_rate_linearly_to_the_final_one(pretrain):
    """A 10-step schedule (warm-up 2, decay over the last 4 to 0.1) extended at step 8 to 20 steps:
    unchanged before step 8, then a line from its value there to 0.1 at step 20, the new end; a
    second extension starts where the first one is. The same N again is a no-op."""
    args = pretrain.parse_args(["--steps", "10", "--warmup", "2", "--decay-steps", "4", "--final-lr-fraction", "0.1"])
    schedule = pretrain.Schedule.from_args(args)
    before = [schedule.factor(s) for s in range(21)]
    assert schedule.end == 10 and before[8] == pytest.approx(1 - 2 / 4 * 0.9)  # 0.55
    assert schedule.extend(8, 20) and schedule.end == 20
    after = [schedule.factor(s) for s in range(25)]
    assert after[:9] == before[:9]
    assert after[14] == pytest.approx((0.55 + 0.1) / 2) and after[20] == pytest.approx(0.1) and after[24] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(after[8:], after[9:]))
    assert [after[s] for s in range(8, 21)] == pytest.approx([0.55 - 0.45 * (s - 8) / 12 for s in range(8, 21)])
    assert not schedule.extend(14, 20) and schedule.end == 20  # already extended to 20
    assert schedule.extend(14, 26) and schedule.factor(14) == pytest.approx(after[14])
    assert schedule.factor(20) == pytest.approx(0.325 + (0.1 - 0.325) * 6 / 12)
    for step, n, match in ((10, 10, "not above the state's step 10"), (6, 10, "not beyond the schedule's end at step 10"),
                           (6, 8, "not beyond the schedule's end at step 10")):
        with pytest.raises(ValueError, match=match):
            pretrain.Schedule.from_args(args).extend(step, n)
    assert pretrain.Schedule.from_record(schedule.record()) == schedule


def test_extended_run_in_pieces_equals_one_uninterrupted_extended_run(pretrain, tmp_path, capsys):
    _run(pretrain, tmp_path, "straight", 5, "--until", "3")
    straight = _run(pretrain, tmp_path, "straight", 5, "--resume", "--extend-to", "8")
    _run(pretrain, tmp_path, "pieces", 5, "--until", "3")
    pieces = _run(pretrain, tmp_path, "pieces", 5, "--resume", "--extend-to", "8", "--until", "5")
    info = json.loads((pieces / "state.json").read_text())
    factor3 = pretrain.lr_factor(3, pretrain.parse_args(["--steps", "5", "--warmup", "2", "--decay-steps", "2"]))
    assert info["step"] == 5 and info["schedule"]["extensions"] == [{"from_step": 3, "from_factor": factor3, "to_step": 8}]
    capsys.readouterr()
    _run(pretrain, tmp_path, "pieces", 5, "--resume", "--until", "6")  # the recorded extension goes on
    assert "extended at step 3" in capsys.readouterr().out
    _run(pretrain, tmp_path, "pieces", 5, "--resume", "--extend-to", "8")  # the same N again: the same schedule
    a_info, b_info = (json.loads((d / "state.json").read_text()) for d in (straight, pieces))
    assert a_info["step"] == b_info["step"] == 8 and a_info["schedule"] == b_info["schedule"]
    assert a_info["sched"] == b_info["sched"]
    for group in pretrain.STATE_GROUPS:
        a, b = load_file(str(straight / f"{group}.safetensors")), load_file(str(pieces / f"{group}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), group


@pytest.mark.parametrize("first, extra, needle", [
    (3, ["--resume", "--extend-to", "2"], "--extend-to 2 is not above the state's step 3"),
    (3, ["--resume", "--extend-to", "3"], "--extend-to 3 is not above the state's step 3"),
    (2, ["--resume", "--extend-to", "4"], "--extend-to 4 is not beyond the schedule's end at step 5"),
    (0, ["--extend-to", "9"], "--extend-to needs --resume"),
    (0, ["--resume", "--export-only", "--extend-to", "9"], "--export-only does not train"),
    (0, ["--save-every", "0"], "--save-every must be >= 1"),
    (0, ["--full-snapshots"], "--full-snapshots applies to --save-every"),
])
def test_bad_extension_flags_exit_2_with_one_line(pretrain, tmp_path, capsys, first, extra, needle):
    if first:
        _run(pretrain, tmp_path, "run", 5, "--until", str(first))
    capsys.readouterr()
    with pytest.raises(SystemExit) as err:
        _run(pretrain, tmp_path, "run", 5, *extra)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_save_every_keeps_light_snapshots_that_export(pretrain, tmp_path):
    state = _run(pretrain, tmp_path, "run", 5, "--save-every", "2")
    snaps = sorted(p.name for p in tmp_path.joinpath("run").iterdir() if p.name.startswith("state-"))
    assert snaps == ["state-step000002", "state-step000004"]
    snap = state.with_name("state-step000004")
    info = json.loads((snap / "state.json").read_text())
    assert info["step"] == 4 and info["kind"] == "light" and not (snap / "exp_avg.safetensors").exists()
    assert json.loads((state / "state.json").read_text())["kind"] == "full"  # the main state: full unless --light-state
    pretrain.main(["--tiny", "--no-eval", "--threads", "1", "--state-dir", str(snap), "--resume", "--export-only",
                   "--out", str(tmp_path / "export4")])
    from diffalign.shapes.pipeline import ShapesPipeline

    exported = ShapesPipeline.from_pretrained(str(tmp_path / "export4"))
    torch.testing.assert_close(next(iter(exported.unet.parameters())).float(),
                               load_file(str(snap / "ema.safetensors"))["0"].half().float())
    full = _run(pretrain, tmp_path, "full", 2, "--save-every", "2", "--full-snapshots").with_name("state-step000002")
    assert json.loads((full / "state.json").read_text())["kind"] == "full" and (full / "exp_avg_sq.safetensors").exists()


def test_extending_the_shipped_state_starts_from_its_rate(pretrain, repo_root):
    """The documented continuation of the shipped state to 12,000 steps: the extension starts at the
    rate the state's next step would take (4.6e-4) and ends at 1e-4."""
    info = json.loads((repo_root / "scripts" / "pretrain_state" / "shapes-t2i-bert-12k-step008500" / "state.json").read_text())
    recipe = [a for a in pretrain.SHIPPED_RECIPE if a not in ("--until", "4500")]
    schedule = pretrain.Schedule.from_args(pretrain.parse_args(recipe))
    assert schedule.extend(4500, 12000)
    assert schedule.extensions == pretrain.Schedule.from_record(info["schedule"]).extensions  # what the run recorded
    rates = [schedule.lr * schedule.factor(s) for s in (4500, 6000, 9000, 12000)]
    assert schedule.lr * schedule.factor(8500) == pytest.approx(info["sched"]["_last_lr"][0], rel=1e-9)
    assert rates == pytest.approx([4.6e-4, 3.88e-4, 2.44e-4, 1e-4])


def test_a_state_without_a_schedule_record_takes_the_flags_and_names_a_jump(pretrain, tmp_path, capsys):
    """States saved before the record (the shipped one) follow the flags, as before; flags whose rate
    at the resumed step differs from the state's say so."""
    state = _run(pretrain, tmp_path, "old", 6, "--until", "4")
    info = json.loads((state / "state.json").read_text())
    del info["schedule"]
    (state / "state.json").write_text(json.dumps(info))
    capsys.readouterr()
    _run(pretrain, tmp_path, "old", 6, "--resume", "--until", "5")  # the same flags: no note
    assert "note:" not in capsys.readouterr().out
    info = json.loads((state / "state.json").read_text())
    assert info["schedule"]["steps"] == 6  # recorded from the flags from now on
    del info["schedule"]
    (state / "state.json").write_text(json.dumps(info))
    _run(pretrain, tmp_path, "old", 20, "--resume", "--until", "6")
    assert "note: these flags' schedule gives step 5 the rate" in capsys.readouterr().out
