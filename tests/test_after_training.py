"""What a user does with a finished shapes run, as they do it: ``diffalign`` in a subprocess from
their own folder holding ``runs/shapes_flow_grpo`` (the main job's recipe, made quick). The four
commands of the README's "After training" section run as written there (with flags that make
them quick appended); ``resume`` of the finished run changes nothing; the report numbers
iterations as the log does."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time

import pytest

from tests.helpers.launch import free_port
from tests.helpers.tiny_run import ROOT, diffalign, shapes_run, user_env

RUN = "runs/shapes_flow_grpo"
# appended to the README's commands: the same commands on fewer images and steps
QUICK = {"eval": ["--num-prompts", "6", "--steps", "2"], "sample": ["--steps", "2"], "export": [], "demo": []}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return shapes_run(tmp_path_factory)


def readme_commands() -> dict[str, list[str]]:
    """The ``diffalign`` commands of the README's "After training" block, by subcommand."""
    section = (ROOT / "README.md").read_text().split("## After training", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("diffalign ")]
    return {argv[1]: argv[1:] for argv in commands}


def test_train_prints_what_the_readme_says(home):
    """The README's "What command 1 prints": the evaluation before and after, a line per iteration,
    the run directory and the report; the model loads behind diffalign's own line, no library bars."""
    out, err = (home / "train.stdout").read_text(), (home / "train.stderr").read_text()
    assert f"run directory: {RUN}" in out and f"report: {RUN}/report.md" in out, out
    assert "eval before training:" in err and "iteration 1/2: reward" in err and "eval after training:" in err, err
    assert "Loading pipeline components" not in err and "Loading weights" not in err


def test_the_readme_names_the_four_follow_ups_on_the_run():
    commands = readme_commands()
    assert set(commands) == {"eval", "sample", "export", "demo"}
    assert all(RUN in argv for name, argv in commands.items() if name != "demo")  # demo: the latest run under runs/


def test_eval(home):
    done = diffalign(*readme_commands()["eval"], *QUICK["eval"], cwd=home)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Loading pipeline components" not in done.stderr  # two models loaded, no library bars
    header, *table = done.stdout.splitlines()
    # 6 images spread over the 6 families, each family's first, and what each column is
    assert ("6 images, each family's first (single_object 1 of 96, two_object 1 of 96, counting 1 of 96, colors 1 of 96, "
            "position 1 of 96, color_attr 1 of 96)") in header, header
    assert "base = shapes, shapes_flow_grpo = shapes + shapes_flow_grpo/final" in header, header
    rows = {line.split()[0] for line in table if line.startswith("acc/")}
    assert {f"acc/{f}" for f in ("single_object", "two_object", "counting", "colors", "position", "color_attr")} <= rows


def test_sample(home):
    argv = readme_commands()["sample"]
    done = diffalign(*argv, *QUICK["sample"], cwd=home)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((home / "samples" / "samples.json").read_text())
    assert [row["prompt"] for row in saved["images"]] == [argv[argv.index("--prompt") + 1]]
    assert saved["summary"]["seed"] == 1234  # the evaluation's seed and CFG scale by default
    assert (home / "samples" / "grid.png").stat().st_size > 1000


def test_export(home, tmp_path):
    import shutil

    user = tmp_path / "user"  # a copy: the export writes into the run, which other tests read
    shutil.copytree(home / "runs", user / "runs")
    done = diffalign(*readme_commands()["export"], *QUICK["export"], cwd=user)
    assert done.returncode == 0, done.stderr[-3000:]
    merged = user / RUN / "export" / "merged"
    assert (merged / "model_index.json").is_file() and (merged / "README.md").is_file()


def test_demo_serves_the_run_with_labelled_rewards(home):
    pytest.importorskip("gradio", reason="the demo needs gradio: pip install gradio gradio_client")
    from gradio_client import Client

    port = free_port()
    argv = [sys.executable, "-m", "diffalign.cli", *readme_commands()["demo"], "--port", str(port)]
    server = subprocess.Popen(argv, cwd=home, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 240
        while url is None and time.monotonic() < deadline and server.poll() is None:
            line = server.stdout.readline()
            found = re.search(r"Running on local URL:\s*(\S+)", line)
            url = found.group(1) if found else None
        assert url is not None, server.stderr.read() if server.poll() is not None else "no URL within 240 s"
        assert url.rstrip("/") == f"http://127.0.0.1:{port}"
        client = Client(url, verbose=False)
        _, rewards, _, _ = client.predict("a photo of a red circle", 5, 2, 4.0, ["shapes_eval"], api_name="/generate")
        assert rewards["headers"] == ["reward", "shapes", "shapes_flow_grpo", "change"]
        ((label, base, aligned, change),) = rewards["data"]
        assert label == "shapes_eval (1 = pass, 0 = fail)" and {base, aligned} <= {0, 1}
    finally:
        server.terminate()
        server.wait(timeout=30)


def snapshot(root):
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def test_resume_of_a_finished_run_changes_nothing_and_says_how_to_extend_it(home):
    before = snapshot(home / RUN)
    done = diffalign("resume", RUN, cwd=home)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (f"run '{RUN}' is finished: 2 iterations trained (max_iterations=2), final/ and its evaluation written; "
            f"nothing was changed. To train it further: diffalign resume {RUN} max_iterations=4") in done.stderr
    assert "eval (iteration" not in done.stderr and "probe (iteration" not in done.stderr  # no evaluation ran
    assert snapshot(home / RUN) == before


def test_the_report_counts_iterations_as_the_log(home):
    """The log's `iteration 1/2` is the first training record; the report's evaluations are at 0
    (before training) and 2 (after both iterations), its curves on one axis (tests/test_report.py)."""
    text = (home / RUN / "report.md").read_text()
    assert "(iterations 0 and 2)" in text and "2 iterations in" in text
    records = [json.loads(line) for line in (home / RUN / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if r.get("eval")] == [0, 2]
