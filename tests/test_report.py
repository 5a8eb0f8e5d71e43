"""report.md of a ShapesWorld run: intervals before/after, the paired difference, the probe."""

import json

from diffalign.evaluation import Evaluation, interval_record
from diffalign.report import write_report
from diffalign.training.evaluator import eval_records_path


def fake_records(passes: dict[str, list[list[bool]]]) -> list[dict]:
    """passes: family -> per prompt, per image outcomes."""
    return [{"prompt": f"{fam} prompt {i}", "family": fam, "passed": ok, "score": 1.0 if ok else 0.25}
            for fam, prompts in passes.items() for i, outcomes in enumerate(prompts) for ok in outcomes]


def write_eval(run, iteration, heldout, probe=None):
    ev = Evaluation.from_records(heldout, meta={"num_images": len(heldout)})
    record = {"iteration": iteration, "eval": True, "eval/reward_mean": ev.metrics["partial"], "eval/num_images": len(heldout),
              **interval_record(ev.intervals, "eval/")}
    saved = {"iteration": iteration, "heldout": ev.to_json()}
    if probe is not None:
        pev = Evaluation.from_records(probe, meta={"num_images": len(probe)})
        record.update(interval_record(pev.intervals, "eval/probe/"))
        saved["probe"] = pev.to_json()
    path = eval_records_path(run, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved))
    return record


def test_report_shows_intervals_paired_difference_and_probe(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # 8 prompts per family, 4 images each; after training every prompt of "colors" gains one image
    before = {"single_object": [[True, False, False, False]] * 3, "colors": [[j < i % 4 for j in range(4)] for i in range(8)]}
    after = {"single_object": before["single_object"], "colors": [[j < i % 4 + 1 for j in range(4)] for i in range(8)]}
    probe = {"color_attr": [[False, False]] * 5}
    log = [write_eval(run, 0, fake_records(before), fake_records(probe)),
           {"iteration": 0, "reward_mean": 0.3, "seconds": 1.0},
           {"iteration": 1, "reward_mean": 0.4, "seconds": 1.0},
           write_eval(run, 1, fake_records(before)),  # an intermediate evaluation: no probe
           write_eval(run, 2, fake_records(after), fake_records(probe))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    text = write_report(run).read_text()
    assert "## Held-out evaluation" in text and "## Generalisation probe (reported apart)" in text
    assert "| metric | before (iteration 0) | after (iteration 2) | paired difference |" in text
    colors = next(line for line in text.splitlines() if line.startswith("| acc/colors |"))
    assert colors.endswith("| +0.250 [+0.250, +0.250] * |")  # one more image of four on every prompt
    single = next(line for line in text.splitlines() if line.startswith("| acc/single_object (in-distribution) |"))
    assert single.endswith("| +0.000 [+0.000, +0.000] |")
    probe_rows = text.split("## Generalisation probe")[1]
    assert "| acc/color_attr | 0.000 [0.000, 0.000] | 0.000 [0.000, 0.000] | +0.000 [+0.000, +0.000] |" in probe_rows
    assert "stratified bootstrap" in text and "(report/curves.png)" in text
    assert (run / "report" / "curves.png").stat().st_size > 1000


def test_report_without_records_keeps_the_plain_table(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    log = [{"iteration": 0, "eval": True, "eval/reward_mean": 0.2, "eval/num_images": 4},
           {"iteration": 0, "reward_mean": 0.3, "seconds": 1.0},
           {"iteration": 1, "eval": True, "eval/reward_mean": 0.5, "eval/num_images": 4}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    text = write_report(run).read_text()
    assert "| reward_mean | 0.200 | 0.500 | +0.300 |" in text and "paired difference" not in text
