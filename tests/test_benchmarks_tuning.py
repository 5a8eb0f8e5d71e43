"""Smoke runs of the tuning benchmarks on the tiny shapes model (no timing assertions)."""

import importlib.util
import json
import sys

import pytest

TINY = ["model.id=tiny:shapes", "rollout.prompts_per_iteration=2", "rollout.group_size=4", "rollout.sample_batch_size=8",
        "train.batch_size=8", "sampling.eval_num_steps=2", "eval.num_prompts=4"]
BRIGHTNESS = ["reward.name=brightness", "reward.kwargs={}"]  # a reward the random tiny model varies on


def _load(repo_root, name):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", repo_root / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_sweep_runs_each_variant_once_and_resumes(repo_root, tmp_path, capsys):
    sweep = _load(repo_root, "sweep_flow_grpo")
    args = ["--iterations", "1", "--variants", "shipped,lora_lr1e-3", "--out", str(tmp_path), *TINY]
    assert sweep.main(args) == 0
    first = capsys.readouterr().out
    assert "best:" in first and first.count("- shipped: (as shipped)") == 1
    piece = json.loads((tmp_path / "lora_lr1e-3.json").read_text())
    assert piece["overrides"] == [*sweep.LORA, "optim.lr=1e-3"] and piece["iterations"] == 1
    assert set(piece["after"]) == set(sweep.METRICS)
    # the paired difference of the pass rate, from the run's own per-image records, with its interval
    diff, lo, hi = piece["paired"]["acc/images"]
    assert lo <= diff <= hi and diff == pytest.approx(piece["after"]["eval/acc/images"] - piece["before"]["eval/acc/images"], abs=1e-9)
    # the validation prompts come from the training split only
    cfg = (tmp_path / "runs" / "lora_lr1e-3" / "config.yaml").read_text()
    assert "evaluate_on: validation" in cfg and "enabled: true" in cfg
    assert sweep.main(args) == 0  # everything done: nothing is trained again
    again = capsys.readouterr().out
    assert again.count("done earlier") == 2


def test_every_sweep_variant_is_a_valid_config(repo_root):
    from diffalign.config_files import load_config

    sweep = _load(repo_root, "sweep_flow_grpo")
    for name, overrides in sweep.VARIANTS.items():
        cfg = load_config(str(repo_root / "configs/shapes/flow_grpo.yaml"), overrides)
        own_weights = [o for o in overrides if o.startswith("prompts.family_weights=") and o not in sweep.UNIFORM]
        if name != "shipped" and not own_weights:  # named variants keep uniform draws whatever the config ships
            assert cfg.prompts.family_weights == {}, name


def test_iteration_speed_prints_the_ratio(repo_root, capsys):
    speed = _load(repo_root, "iteration_speed")
    assert speed.main(["--iterations", "1", *TINY, *BRIGHTNESS]) == 0
    out = capsys.readouterr().out
    assert "old/new" in out and "self-check" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("old ", "new "))}
    assert rows["old"].endswith("LoRA r16") and rows["new"].endswith("full")  # the main job's training as shipped


def test_paired_runs_pairs_the_last_evaluations(repo_root, tmp_path, capsys):
    paired = _load(repo_root, "paired_runs")
    families = ["counting", "colors"]
    prompts = [f"{f} prompt {i}" for f in families for i in range(6)]

    def write(run: str, passed_from: int, iteration: int = 4) -> None:
        records = [{"prompt": p, "family": p.split()[0], "passed": float(i >= passed_from), "score": float(i >= passed_from)}
                   for i, p in enumerate(prompts) for _ in range(2)]
        path = tmp_path / run / "eval_records" / f"iter-{iteration:06d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"iteration": iteration, "heldout": {"records": records}}))

    write("base_run", passed_from=8)  # 4 of 12 prompts pass
    write("better_run", passed_from=0)  # all pass
    assert paired.main([str(tmp_path / "base_run"), str(tmp_path / "better_run")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("acc/images"))
    assert "+0.667" in line and line.rstrip().endswith("*")
    (tmp_path / "other" / "eval_records").mkdir(parents=True)
    with pytest.raises(SystemExit, match="no eval_records"):
        paired.main([str(tmp_path / "base_run"), str(tmp_path / "other")])
    # one run: each later evaluation against its first (iteration 4 here)
    write("base_run", passed_from=2, iteration=8)  # 10 of 12 prompts pass
    assert paired.main([str(tmp_path / "base_run")]) == 0
    out = capsys.readouterr().out
    assert "iteration 8 - iteration 4" in out
    line = next(x for x in out.splitlines() if x.startswith("acc/images"))
    assert "+0.500" in line and line.rstrip().endswith("*")
    with pytest.raises(SystemExit, match="fewer than two"):
        paired.main([str(tmp_path / "better_run")])


def test_shapes_failures_sorts_each_failed_image_once(repo_root, capsys):
    failures = _load(repo_root, "shapes_failures")
    record = lambda passed, **met: {"passed": passed, "requirements": met}  # noqa: E731
    assert failures.failure_category(record(True, **{"count:circle": True, "no_extra": True})) is None
    assert failures.failure_category(record(False)) == "rejected"  # a gate failed before any requirement
    assert failures.failure_category(record(False, **{"count:circle": True, "color:red circle": False, "no_extra": False})) == "count"
    assert failures.failure_category(record(False, **{"count:circle": True, "count:square": True, "relation": False,
                                                      "no_extra": True})) == "relation"
    assert failures.failure_category(record(False, **{"count:circle": True, "color:red circle": False, "no_extra": True})) == "colour"
    table = failures.breakdown([{"family": "colors", **record(True)}, {"family": "colors", **record(False)},
                                {"family": "colors", **record(False, **{"count:circle": False, "no_extra": True})},
                                {"family": "colors", **record(False, **{"count:circle": True, "color:red circle": False})}])
    assert table["colors"] == {"images": 4, "passed": 0.25, "rejected": 0.25, "count": 0.25, "relation": 0.0, "colour": 0.25}
    # colour attribution's colour failures by what the objects show
    prompt = "a photo of a red circle and a blue square"
    met = {"count:circle": True, "count:square": True, "no_extra": True, "color:red circle": False}

    def shown(circle, square, passed=False):
        return {"family": "color_attr", "prompt": prompt, "passed": passed, "requirements": met,
                "objects": [{"shape": "circle", "color": circle}, {"shape": "square", "color": square}]}

    assert failures.binding_kind(shown("blue", "red")) == "swapped"
    assert failures.binding_kind(shown("red", "red")) == failures.binding_kind(shown("blue", "blue")) == "one_colour"
    assert failures.binding_kind(shown("red", "green")) == failures.binding_kind(shown("cyan", "blue")) == "one_right"
    assert failures.binding_kind(shown("green", "green")) == failures.binding_kind(shown("blue", "green")) == "other"
    assert failures.binding_kind(shown("red", "blue", passed=True)) is None
    assert failures.binding_kind({**shown("blue", "red"), "family": "colors"}) is None
    assert failures.binding_breakdown([shown("blue", "red"), shown("red", "red"), shown("red", "blue", passed=True),
                                       {"family": "colors", **record(True)}]) == {
        "images": 3, "swapped": pytest.approx(1 / 3), "one_colour": pytest.approx(1 / 3), "one_right": 0.0, "other": 0.0}
    # position images with the right objects: which relation holds (pixel rows grow downwards)
    prompt = "a photo of a circle left of a square"
    met = {"count:circle": True, "count:square": True, "no_extra": True, "relation": False}

    def placed(circle_xy, square_xy, passed=False):
        box = {"width": 6.0, "height": 6.0}
        return {"family": "position", "prompt": prompt, "passed": passed, "requirements": met,
                "objects": [{"shape": "circle", "color": "red", "cx": circle_xy[0], "cy": circle_xy[1], **box},
                            {"shape": "square", "color": "blue", "cx": square_xy[0], "cy": square_xy[1], **box}]}

    assert failures.relation_kind(placed((6, 16), (26, 16), passed=True)) == "prompted"
    assert failures.relation_kind(placed((26, 16), (6, 16))) == "opposite"
    assert failures.relation_kind(placed((16, 4), (16, 28))) == "neither"  # circle above the square
    assert failures.relation_kind({**placed((26, 16), (6, 16)), "requirements": {**met, "no_extra": False}}) is None
    assert failures.relation_kind({**placed((26, 16), (6, 16)), "family": "two_object"}) is None
    assert failures.relation_breakdown([placed((6, 16), (26, 16), passed=True), placed((26, 16), (6, 16)),
                                        {"family": "position", **record(False)}, {"family": "colors", **record(True)}]) == {
        "images": 3, "prompted": pytest.approx(1 / 3), "opposite": pytest.approx(1 / 3), "neither": 0.0}
    # a whole run on the tiny model: one row per family and scale, shares that sum to 1
    assert failures.main(["--model", "tiny:shapes", "--prompts", "validation", "--images-per-family", "2", "--steps", "2",
                          "--guidance-scales", "1,4", "--threads", "1"]) == 0
    out, relations = capsys.readouterr().out.split("\n\nposition, images")
    out = out.split("\n\ncolour attribution")
    assert len(out) == 2 and len(out[1].strip().splitlines()) == 1 + 1 + 2  # title, header, one row per scale
    assert len(relations.strip().splitlines()) == 1 + 1 + 2
    rows = [line.split() for line in out[0].splitlines()[2:]]
    assert len(rows) == 2 * 6 and {r[0] for r in rows} == {"1.0", "4.0"}
    for row in rows:
        assert row[2] == "2" and sum(float(x) for x in row[3:]) == pytest.approx(1.0)
    with pytest.raises(SystemExit, match="unknown 'nope'"):
        failures.main(["--prompts", "nope"])


def test_shapes_commitment_matches_objects_and_runs(repo_root, capsys):
    commitment = _load(repo_root, "shapes_commitment")
    obj = lambda shape, color, x, y: {"shape": shape, "color": color, "cx": x, "cy": y}  # noqa: E731
    original = [obj("circle", "red", 6, 16), obj("square", "blue", 26, 16)]
    # the same objects listed the other way round, moved 1 px: all kept
    assert commitment.compare(original, [obj("square", "blue", 25, 16), obj("circle", "red", 7, 16)], 3.0) == {
        "layout": True, "colours": True, "shapes": True}
    # same places, the shapes swapped (the relation flips), colours stay
    assert commitment.compare(original, [obj("square", "red", 6, 16), obj("circle", "blue", 26, 16)], 3.0) == {
        "layout": True, "colours": True, "shapes": False}
    moved = commitment.compare(original, [obj("circle", "red", 6, 16), obj("square", "green", 26, 25)], 3.0)
    assert moved == {"layout": False, "colours": False, "shapes": True}
    assert commitment.compare(original, original[:1], 3.0) is None  # different object counts: no match
    assert commitment.compare([], [], 3.0) is None
    records = [{"objects": [obj("square", "red", 6, 16), obj("circle", "blue", 26, 16)], "passed": False},
               {"objects": original, "passed": True}, {"objects": original[:1], "passed": False},
               {"objects": [obj("circle", "red", 6, 30), obj("square", "blue", 26, 16)], "passed": False}]
    row = commitment.summarise(records, [{"objects": original}] * 4, 3.0)
    assert row == {"images": 4, "matched": 0.75, "layout": 0.5, "colours": 1.0, "shapes": 0.5, "passed": 0.25}
    # a whole run on the tiny model: one row per branch step
    assert commitment.main(["--model", "tiny:shapes", "--images", "3", "--steps", "3", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines[3:]] == ["0", "1", "2"]
    with pytest.raises(SystemExit, match="--family"):
        commitment.main(["--model", "tiny:shapes", "--family", "nope"])


def test_shapes_layout_probe_pairs_prompts_by_one_property_and_runs(repo_root, capsys):
    probe = _load(repo_root, "shapes_layout_probe")
    from diffalign.shapes import split_prompts
    from diffalign.shapes.world import parse_prompt

    pairs = probe.contrast_pairs(list(split_prompts().train))
    assert all(pairs[k] for k in probe.KINDS)
    for a, b in pairs["axis"]:
        sa, sb = parse_prompt(a), parse_prompt(b)
        assert [o.shape for o in sa.objects] == [o.shape for o in sb.objects]
        assert {sa.relation in probe.HORIZONTAL, sb.relation in probe.HORIZONTAL} == {True, False}
    for a, b in pairs["side"]:
        sa, sb = parse_prompt(a), parse_prompt(b)
        assert sa.relation == sb.relation and [o.shape for o in sa.objects] == [o.shape for o in sb.objects][::-1]
    for a, b in pairs["count"]:
        assert parse_prompt(a).objects[0].count != parse_prompt(b).objects[0].count
    assert probe.rms([0.0, 0.0], [3.0, 4.0]) == pytest.approx(12.5 ** 0.5)
    # renders of a horizontal and a vertical pair differ far more than two draws of one prompt
    horizontal, vertical = "a photo of a circle left of a square", "a photo of a circle above a square"
    assert probe.rms(probe.render_mean(horizontal, 400, 0), probe.render_mean(vertical, 400, 0)) > 3 * probe.rms(
        probe.render_mean(horizontal, 400, 0), probe.render_mean(horizontal, 400, 1))
    assert probe.main(["--model", "tiny:shapes", "--samples", "4", "--renders", "3", "--max-pairs", "1",
                       "--threads", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].startswith("noise floor") and [line.split()[0] for line in lines[3:]] == list(probe.KINDS)
    with pytest.raises(SystemExit, match="--sigma"):
        probe.main(["--model", "tiny:shapes", "--sigma", "0"])


def test_eval_steps_pairs_each_step_count_with_the_largest(repo_root, capsys):
    eval_steps = _load(repo_root, "eval_steps")
    assert eval_steps.main(["--model", "tiny:shapes", "--steps", "3,1", "--images-per-family", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "paired against 3 steps" in out and "1 steps - 3 steps" in out
    assert "1 steps: sampled and scored in" in out and "3 steps: sampled and scored in" in out
    with pytest.raises(SystemExit, match="at least two"):
        eval_steps.main(["--steps", "10"])


def test_shapes_configs_runs_one_iteration_of_each(repo_root, tmp_path, capsys):
    configs = _load(repo_root, "shapes_configs")
    small = ["model.id=tiny:shapes", "rollout.prompts_per_iteration=2", "rollout.sample_batch_size=8", "sampling.eval_num_steps=2"]
    assert configs.main(["--configs", "flow_grpo", "--out", str(tmp_path), "--eval-images", "4", *small]) == 0
    out = capsys.readouterr().out
    assert "flow_grpo" in out and "1 of 1 configs ran" in out
    rows = [json.loads(line) for line in (tmp_path / "flow_grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if not r.get("eval")] == [0]  # one iteration, then one evaluation
    assert [r["eval/num_images"] for r in rows if r.get("eval")] == [4]
    with pytest.raises(SystemExit, match="unknown"):
        configs.main(["--configs", "nope"])


def test_training_curve_averages_windows_of_training_records(repo_root, tmp_path, capsys):
    curve = _load(repo_root, "training_curve")
    records = [{"iteration": 0, "eval": True, "eval/acc/images": 0.5}]
    for it in range(5):
        rec = {"iteration": it, "reward_mean": 0.1 * it, "zero_std_frac": 0.0, "reward/acc/images": 0.2 * it,
               "reward/acc/overall": 0.2 * it}
        if it % 2 == 0:  # the family is drawn in iterations 0, 2, 4 only
            rec["reward/acc/position"] = 0.25 * it
        records.append(rec)
    rows = curve.windows(records, 2)
    assert [(r["first"], r["last"]) for r in rows] == [(0, 1), (2, 3), (4, 4)]
    assert rows[0]["reward"] == pytest.approx(0.05) and rows[1]["images"] == pytest.approx(0.5)
    assert [r["families"]["position"] for r in rows] == pytest.approx([0.0, 0.5, 1.0])  # over the iterations that drew it
    assert list(rows[0]["families"]) == ["position"]  # overall / images are not families
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert curve.main([str(tmp_path / "run"), "--window", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:3] == ["iterations", "reward", "pass"] and len(out) == 5
    with pytest.raises(SystemExit, match="no such file"):
        curve.main([str(tmp_path / "nope")])


def test_guidance_scales_pairs_every_scale_and_reuses_stored_evaluations(repo_root, tmp_path, capsys):
    from diffalign.adapters import load_adapter
    from diffalign.export import save_trained_weights

    scales = _load(repo_root, "guidance_scales")
    # A "run" whose final weights are the base model itself: every same-scale difference is exactly 0.
    save_trained_weights(load_adapter("tiny:shapes"), tmp_path / "run" / "final", lora=False,
                         metadata={"base_model": "tiny:shapes", "family": "shapes"})
    argv = ["--model", "tiny:shapes", "--run", str(tmp_path / "run"), "--scales", "1,2", "--reference", "2",
            "--images-per-family", "2", "--steps", "2", "--mixed-precision", "no", "--out", str(tmp_path / "out")]
    assert scales.main(argv) == 0
    first = capsys.readouterr().out
    first = first[first.index("validation prompts"):]  # after any import-time log line
    assert "paired against CFG 2" in first and "CFG 1 - CFG 2" in first
    rows = [line.split() for line in first.splitlines() if line.startswith("CFG ")]
    assert [r[:2] for r in rows] == [["CFG", "1"], ["CFG", "2"]]
    assert all(r[2] == r[3] and r[4] == "+0.000" for r in rows)  # base == run at each scale, paired to 0
    stored = sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*.json"))
    assert stored == ["base/cfg1.json", "base/cfg2.json", "run_1/cfg1.json", "run_1/cfg2.json"]
    assert scales.main(argv) == 0  # the second time every evaluation is read back, with the same table
    assert capsys.readouterr().out.endswith(first)
    with pytest.raises(SystemExit, match="at least two"):
        scales.main(["--scales", "4"])
    with pytest.raises(SystemExit, match="validation or heldout"):
        scales.main(["--prompts", "train"])


def test_pass_at_k_hand_computed_cases_and_table(repo_root, tmp_path, capsys):
    pak = _load(repo_root, "pass_at_k")
    assert pak.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pak.pass_at_k(4, 1, 1) == pytest.approx(0.25) and pak.pass_at_k(3, 0, 3) == 0.0 and pak.pass_at_k(3, 3, 1) == 1.0
    assert pak.pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)/C(5,3)
    with pytest.raises(ValueError):
        pak.pass_at_k(2, 1, 3)
    rec = lambda prompt, family, passed: {"prompt": prompt, "family": family, "passed": passed, "score": float(passed)}
    records = ([rec("a", "position", p) for p in (True, False, False, False)] + [rec("b", "position", False)] * 2
               + [rec("c", "colors", True)] * 3)
    table = pak.family_table(records, [1, 2, 3])
    assert table["position"]["min_images"] == 2 and "pass@3" not in table["position"]  # prompt b has 2 images
    assert table["position"]["pass@1"] == pytest.approx((0.25 + 0.0) / 2)  # prompts weighted equally
    assert table["position"]["pass@2"] == pytest.approx((0.5 + 0.0) / 2)
    assert table["colors"]["pass@3"] == 1.0
    run = tmp_path / "run"
    (run / "eval_records").mkdir(parents=True)
    for it in (0, 8):
        (run / "eval_records" / f"iter-{it:06d}.json").write_text(json.dumps({"iteration": it, "heldout": {"records": records}}))
    assert pak.main([str(run), "--iteration", "0", "--k", "1,2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "iteration 0, 9 images" in out[0]
    rows = {line.split()[0]: line.split() for line in out[2:]}
    assert rows["position"][-2:] == ["0.125", "0.250"] and rows["colors"][-2:] == ["1.000", "1.000"]
    assert out[-1].split()[-2:] == ["0.562", "0.625"]  # mean of the two families
    with pytest.raises(SystemExit, match="no evaluation at iteration 4"):
        pak.main([str(run), "--iteration", "4"])
    with pytest.raises(SystemExit, match="no 'probe' records"):
        pak.main([str(run), "--split", "probe"])
