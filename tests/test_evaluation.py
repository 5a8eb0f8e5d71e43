"""diffalign.evaluation: ShapesWorld evaluation with per-image records, intervals, paired tables."""

import json

import pytest

from diffalign.evaluation import (
    Evaluation,
    comparison_columns,
    evaluate_shapes,
    format_table,
    interval_record,
    is_bound_key,
    metric_order,
)
from diffalign.stats import Difference, Interval


def records_of(passes: dict[str, list[bool]]) -> list[dict]:
    out = []
    for family, outcomes in passes.items():
        for i, ok in enumerate(outcomes):
            out.append({"prompt": f"{family}-{i % 2}", "family": family, "passed": ok, "score": float(ok)})
    return out


def test_table_cells_labels_and_order():
    cols = {
        "base": {"acc/overall": Interval(0.198, 0.158, 0.243), "acc/two_object": Interval(0.5, 0.4, 0.6),
                 "acc/colors": Interval(0.25, 0.2, 0.3)},
        "run - base": {"acc/overall": Difference(0.03, 0.003, 0.061), "acc/colors": Difference(0.01, -0.02, 0.04)},
    }
    lines = format_table(cols).splitlines()
    assert lines[0].split() == ["base", "run", "-", "base"]
    assert lines[1].startswith("acc/two_object (in-distribution)")  # FAMILIES order, in-distribution marked
    assert lines[2].startswith("acc/colors ") and "(in-distribution)" not in lines[2]
    assert lines[-1].startswith("acc/overall") and lines[-1].endswith("0.198 [0.158, 0.243]  +0.030 [+0.003, +0.061] *")
    assert lines[2].rstrip().endswith("+0.010 [-0.020, +0.040]")
    assert lines[1].rstrip().endswith("-")  # no difference for that family
    assert len({len(line.rstrip()) for line in lines[1:] if not line.rstrip().endswith("-")}) == 1  # aligned
    assert metric_order(["partial", "acc/overall", "acc/images", "acc/single_object", "x"]) == [
        "acc/single_object", "x", "acc/images", "partial", "acc/overall"]


def test_evaluation_compare_and_log_keys():
    base = Evaluation.from_records(records_of({"colors": [True, False, False, False], "counting": [True, True, False, False]}))
    run = Evaluation.from_records(records_of({"colors": [True, True, False, False], "counting": [True, True, True, False]}))
    assert base.metrics["acc/overall"] == pytest.approx(0.375)
    diff = run.compare(base)
    assert diff["acc/overall"].value == pytest.approx(0.25)
    assert diff["acc/images"].value == pytest.approx(0.25)
    assert set(diff) == set(base.intervals) == {"acc/colors", "acc/counting", "acc/overall", "acc/images", "partial"}
    cols = comparison_columns({"base": base, "run": run}, "base")
    assert list(cols) == ["base", "run", "run - base"]
    flat = interval_record(base.intervals, "eval/")
    assert flat["eval/acc/overall"] == pytest.approx(0.375)
    assert flat["eval/acc/overall_lo"] <= 0.375 <= flat["eval/acc/overall_hi"]
    assert is_bound_key("eval/acc/overall_lo") and not is_bound_key("eval/acc/overall")
    json.dumps(run.to_json())  # storable


def test_evaluate_shapes_records_and_self_comparison():
    from diffalign.adapters import load_adapter
    from diffalign.shapes import FAMILIES, evaluation_prompts, split_prompts

    adapter = load_adapter("tiny:shapes")
    prompts = split_prompts().evaluation()
    ev = evaluate_shapes(adapter, prompts, images_per_family=2, num_steps=2, seed=5, batch_size=8)
    items = evaluation_prompts(prompts, 2)
    assert [r["prompt"] for r in ev.records] == items and len(items) == 2 * len(FAMILIES)
    assert all(set(r) == {"prompt", "family", "passed", "score"} for r in ev.records)
    assert set(ev.intervals) == {f"acc/{f}" for f in FAMILIES} | {"acc/overall", "acc/images", "partial"}
    again = evaluate_shapes(adapter, prompts, images_per_family=2, num_steps=2, seed=5, batch_size=8)
    assert again.records == ev.records  # same seed, same images
    assert all(d.value == 0 and d.width == 0 for d in again.compare(ev).values())
    short = evaluate_shapes(adapter, prompts, images_per_family=2, num_steps=2, seed=5, batch_size=8, limit=3)
    assert len(short.records) == 3
