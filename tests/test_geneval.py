"""The GenEval protocol end to end: a tiny model, GenEval's metadata layout, and a fake GenEval
server on 127.0.0.1 (the remote reward's wire format) whose verdicts make every score known."""

from __future__ import annotations

import json

import pytest

from diffalign.geneval import GenEvalResult, format_table
from tests.helpers.tiny_run import run_cli
from tests.test_remote_reward import serve

# GenEval's prompts/evaluation_metadata.jsonl layout: tag, include (class, count, color, position), exclude, prompt
METADATA = [
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
    {"tag": "two_object", "include": [{"class": "toilet", "count": 1}, {"class": "motorcycle", "count": 1}],
     "prompt": "a photo of a toilet and a motorcycle"},
    {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}],
     "prompt": "a photo of two clocks"},
    {"tag": "colors", "include": [{"class": "cake", "count": 1, "color": "red"}], "prompt": "a photo of a red cake"},
    {"tag": "colors", "include": [{"class": "vase", "count": 1, "color": "blue"}], "prompt": "a photo of a blue vase"},
    {"tag": "position", "include": [{"class": "cup", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}],
     "prompt": "a photo of a dog left of a cup"},
]


def _judge():
    """Verdicts by task: single_object always right, two_object never, counting only the first image
    of each prompt, colors only red objects, position half credit (not a correct image)."""
    seen: dict[str, int] = {}

    def respond(payload, index):
        scores = []
        for prompt, meta in zip(payload["prompts"], payload["metadata"]):
            assert meta["prompt"] == prompt and isinstance(meta["include"], list)
            n = seen[prompt] = seen.get(prompt, 0) + 1
            scores.append({"single_object": 1.0, "two_object": 0.0, "counting": float(n == 1),
                           "colors": float(meta["include"][0].get("color") == "red"), "position": 0.5}[meta["tag"]])
        return 200, {"scores": scores}

    return respond


def test_geneval_protocol_against_a_fake_server(tmp_path, capsys):
    meta = tmp_path / "evaluation_metadata.jsonl"
    meta.write_text("".join(json.dumps(m) + "\n" for m in METADATA))
    out = tmp_path / "geneval.json"
    with serve(_judge()) as (url, received):
        rc = run_cli("eval", "tiny:sd3", "--protocol", "geneval", "--metadata", str(meta), "--url", url, "--steps", "2",
                     "--batch-size", "8", "--out", str(out), "--mixed-precision", "no")
    assert rc == 0
    assert sum(len(r["images"]) for r in received) == 4 * len(METADATA)  # 4 images per prompt, the default
    table = capsys.readouterr().out
    header = table.splitlines()[0].split()
    assert header[:2] == ["Model", "Overall"] and "Attr." not in header  # tasks absent from the file get no column
    scores = json.loads(out.read_text())["tiny:sd3"]["scores"]
    assert scores["images"] == pytest.approx({"single_object": 1, "two_object": 0, "counting": 0.25, "colors": 0.5,
                                              "position": 0, "overall": 1.75 / 5})
    assert scores["prompts"] == pytest.approx({"single_object": 1, "two_object": 0, "counting": 1, "colors": 0.5,
                                               "position": 0, "overall": 2.5 / 5})
    rows = {line.split(")")[0] + ")": line.split(")")[1].split() for line in table.splitlines()[1:3]}
    assert rows["tiny:sd3 (images)"][:4] == ["0.35", "1.00", "0.00", "0.25"]
    assert rows["tiny:sd3 (prompts)"][:4] == ["0.50", "1.00", "0.00", "1.00"]


def test_table_follows_the_paper_column_order():
    records = [{"index": i, "tag": t, "prompt": "p", "score": 1.0, "correct": True}
               for i, t in enumerate(["color_attr", "position", "colors", "counting", "two_object", "single_object"])]
    head = format_table({"m": GenEvalResult(records)}).splitlines()[0]
    assert head.split() == ["Model", "Overall", "Single", "Obj.", "Two", "Obj.", "Counting", "Colors", "Position",
                            "Attr.", "Binding"]


def test_bad_metadata_is_a_one_line_error(tmp_path, capsys):
    meta = tmp_path / "m.jsonl"
    meta.write_text(json.dumps({"include": [], "prompt": "a photo of a cat"}) + "\n")
    assert run_cli("eval", "tiny:sd3", "--protocol", "geneval", "--metadata", str(meta), "--url", "http://127.0.0.1:9") == 2
    err = capsys.readouterr().err.strip()
    assert "--metadata" in err and "line 1" in err and "'tag'" in err and "\n" not in err
