"""Prompt files: plain text, .jsonl, .csv, .parquet and datasets folders, eval splits, one-line
errors; and a tiny run that trains on a .jsonl file's prompts."""

from __future__ import annotations

import csv
import importlib.util
import json

import pytest

from diffalign.config_files import load_config
from diffalign.errors import ConfigError
from diffalign.prompts import read_prompt_file, resolve_prompts
from tests.helpers.tiny_run import CONFIG, FAST, ROOT, run_cli

PROMPTS = ["a red cube", "two blue balls", "a green cone on a box"]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path, *overrides):
    return load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'run'}", "prompts.source=file", *overrides])


def test_jsonl_csv_and_text(tmp_path):
    jsonl = _jsonl(tmp_path / "p.jsonl", [{"prompt": p, "id": i} for i, p in enumerate(PROMPTS)])
    assert read_prompt_file(str(jsonl)) == PROMPTS
    with (tmp_path / "p.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "caption"])
        w.writerows([[i, p] for i, p in enumerate(PROMPTS)])
    assert read_prompt_file(str(tmp_path / "p.csv"), column="caption") == PROMPTS
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS) + "\n\n")
    assert read_prompt_file(str(tmp_path / "p.txt")) == PROMPTS


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow is not installed")
def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": PROMPTS, "n": [1, 2, 3]}), tmp_path / "p.parquet")
    assert read_prompt_file(str(tmp_path / "p.parquet"), column="text") == PROMPTS
    with pytest.raises(ConfigError, match=r"prompts.file.*row 1 of column 'n' is not text"):
        read_prompt_file(str(tmp_path / "p.parquet"), column="n")


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="datasets is not installed")
def test_datasets_folder_with_splits(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": PROMPTS[:2]}),
                               "test": datasets.Dataset.from_dict({"prompt": PROMPTS[2:]})})
    dd.save_to_disk(str(tmp_path / "ds"))
    train, ev = resolve_prompts(_cfg(tmp_path, f"prompts.file={tmp_path / 'ds'}", "prompts.eval_split=test"))
    assert (train, ev) == (PROMPTS[:2], PROMPTS[2:])
    with pytest.raises(ConfigError, match=r"prompts.split.*'valid'.*splits: train, test"):
        resolve_prompts(_cfg(tmp_path, f"prompts.file={tmp_path / 'ds'}", "prompts.split=valid"))
    datasets.Dataset.from_dict({"prompt": PROMPTS}).save_to_disk(str(tmp_path / "one"))
    assert read_prompt_file(str(tmp_path / "one")) == PROMPTS


def test_eval_fraction_holds_out_a_fixed_subset(tmp_path):
    prompts = [f"prompt {i}" for i in range(10)]
    f = _jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in prompts])
    train, ev = resolve_prompts(_cfg(tmp_path, f"prompts.file={f}", "prompts.eval_fraction=0.2"))
    assert len(ev) == 2 and not set(ev) & set(train) and sorted(train + ev) == sorted(prompts)
    assert resolve_prompts(_cfg(tmp_path, f"prompts.file={f}", "prompts.eval_fraction=0.2", "seed=5")) == (train, ev)


@pytest.mark.parametrize("content, column, match", [
    ("", "prompt", r"prompts.file.*no prompts"),
    ('{"text": "a cat"}\n', "prompt", r"prompts.column.*line 1 .* has no 'prompt' \(keys: text\)"),
    ('{"prompt": "a cat"}\n{"prompt": 3}\n', "prompt", r"prompts.file.*row 2 of column 'prompt' is not text \(int: 3\)"),
    ('{"prompt": "a cat"\n', "prompt", r"prompts.file.*line 1 is not JSON"),
])
def test_bad_jsonl_is_a_one_line_error(tmp_path, content, column, match):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    with pytest.raises(ConfigError, match=match) as exc:
        read_prompt_file(str(f), column=column)
    assert "\n" not in str(exc.value)


def test_csv_missing_column_lists_the_columns(tmp_path):
    (tmp_path / "p.csv").write_text("caption\na cat\n")
    with pytest.raises(ConfigError, match=r"prompts.column.*'prompt' is not in .*columns: caption"):
        read_prompt_file(str(tmp_path / "p.csv"))


def test_train_on_a_jsonl_file(tmp_path, capsys):
    f = _jsonl(tmp_path / "P.jsonl", [{"prompt": p} for p in PROMPTS])
    out = tmp_path / "run"
    assert run_cli("train", CONFIG, f"output_dir={out}", "prompts.source=file", f"prompts.file={f}", "prompts.column=prompt",
                   *FAST, "max_iterations=1", "checkpoint.every=0", "eval.num_prompts=2") == 0
    recorded = json.loads((out / "prompts.json").read_text())
    assert recorded == {"train": PROMPTS, "eval": PROMPTS}
    assert (out / "samples" / "eval-prompts.txt").read_text().splitlines() == PROMPTS[:2]
    # a missing column stops before the run directory exists, exit code 2, one line naming the key
    capsys.readouterr()
    bad = tmp_path / "bad"
    assert run_cli("train", CONFIG, f"output_dir={bad}", "prompts.source=file", f"prompts.file={f}",
                   "prompts.column=caption", *FAST) == 2
    err = capsys.readouterr().err.strip()
    assert "prompts.column" in err and "\n" not in err and not bad.exists()
