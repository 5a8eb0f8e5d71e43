"""The GenEval protocol (Ghosh et al., 2023): per-task accuracy on GenEval's prompt metadata.

GenEval's ``evaluation_metadata.jsonl`` holds one JSON object per prompt::

    {"tag": "counting", "include": [{"class": "cat", "count": 2}],
     "exclude": [{"class": "cat", "count": 3}], "prompt": "a photo of two cats"}

``tag`` is the task (``single_object``, ``two_object``, ``counting``, ``colors``, ``position``,
``color_attr``); ``include`` / ``exclude`` are what the detector must (not) find, with optional
``color`` and ``position`` (``["left of", 0]``: left of include[0]). The protocol samples
``images_per_prompt`` images per prompt (4 in the paper), and a judge decides for each image
whether it is correct: a GenEval server behind the ``remote`` reward (it receives each prompt's
metadata object with the image), or any other reward (``shapes_eval`` for ShapesWorld prompts).
An image is correct when its score is 1 (GenEval's strict verdict; a partial-credit judge counts
only images meeting every requirement).

Scores, as GenEval's ``summary_scores.py`` reports them: per task, "% correct images" (the mean
over the task's images) and "% correct prompts" (the share of its prompts with at least one correct
image); overall = the mean over tasks (not over images), for both. :func:`format_table` prints them
in the layout of the Flow-GRPO paper's GenEval table (one row per model, Overall first, values as
fractions).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

import reward_models
from diffalign import progress
from diffalign.adapters import load_adapter
from diffalign.errors import DiffalignError
from diffalign.evaluation import maybe_autocast
from diffalign.export import load_trained_adapter
from diffalign.prompts import jsonl_objects
from diffalign.sampling.linear import SampleSpec

#: GenEval's tasks in the order of the Flow-GRPO paper's table, with its column names
TASKS = {"single_object": "Single Obj.", "two_object": "Two Obj.", "counting": "Counting", "colors": "Colors",
         "position": "Position", "color_attr": "Attr. Binding"}
KINDS = ("images", "prompts")  # "% correct images", "% correct prompts"
CORRECT = 1.0 - 1e-6  # a score at least this is a correct image (1 = every requirement met)


def read_metadata(path: str | Path, key: str = "--metadata") -> list[dict]:
    """GenEval metadata entries (one JSON object per non-empty line, each with a text ``prompt``,
    a text ``tag`` and an ``include`` list), in file order. One-line errors name the file and line."""
    f = Path(path)
    if not f.is_file():
        raise DiffalignError(f"{key}: metadata file {str(path)!r} does not exist")
    entries = []
    for n, entry in jsonl_objects(f, f"{key}: {str(path)!r}", DiffalignError):
        for name, kind in (("prompt", str), ("tag", str), ("include", list)):
            if not isinstance(entry.get(name), kind):
                raise DiffalignError(f"{key}: line {n} of {str(path)!r} has no {kind.__name__} {name!r} "
                                     "(GenEval's evaluation_metadata.jsonl layout: tag, include, exclude, prompt)")
        entries.append(entry)
    if not entries:
        raise DiffalignError(f"{key}: metadata file {str(path)!r} is empty")
    return entries


@dataclass
class GenEvalResult:
    """One model's GenEval evaluation: a record per image (``index`` of its prompt, ``tag``,
    ``prompt``, ``score``, ``correct``) and the seconds it took."""

    records: list[dict]
    seconds: float = 0.0
    meta: dict = field(default_factory=dict)

    def task_scores(self) -> dict[str, dict[str, float]]:
        """``{"images": {tag: acc, ..., "overall": mean over tasks}, "prompts": {...}}``."""
        by_tag: dict[str, dict[int, list[bool]]] = {}
        for r in self.records:
            by_tag.setdefault(r["tag"], {}).setdefault(r["index"], []).append(r["correct"])
        tags = [t for t in TASKS if t in by_tag] + [t for t in by_tag if t not in TASKS]
        out: dict[str, dict[str, float]] = {"images": {}, "prompts": {}}
        for tag in tags:
            prompts = by_tag[tag].values()
            out["images"][tag] = sum(map(sum, prompts)) / sum(map(len, prompts))
            out["prompts"][tag] = sum(any(p) for p in prompts) / len(prompts)
        for kind in KINDS:
            out[kind]["overall"] = sum(out[kind].values()) / len(out[kind]) if out[kind] else math.nan
        return out

    def to_json(self) -> dict:
        return {"meta": self.meta, "seconds": self.seconds, "scores": self.task_scores(), "records": self.records}


def evaluate_geneval(
    adapter,
    entries: Sequence[Mapping],
    reward_fn: Callable,
    *,
    images_per_prompt: int = 4,
    sampling: SampleSpec = SampleSpec(num_steps=40, seed=1234),
    autocast_dtype: torch.dtype | None = None,
    show_progress: bool = True,
) -> GenEvalResult:
    """Sample ``images_per_prompt`` images per metadata entry and judge each with ``reward_fn``
    (``images, prompts, metadata -> (B,)``; the entry is the image's metadata). Batches of
    ``sampling.batch_size`` images are sampled and scored in turn (memory stays one batch); batch k
    uses noise seed ``sampling.seed + k``, so the evaluation is the same for every model at the same
    seed."""
    if images_per_prompt < 1:
        raise DiffalignError(f"--images-per-prompt must be >= 1, got {images_per_prompt}")
    items = [(i, e) for i, e in enumerate(entries) for _ in range(images_per_prompt)]
    t0 = time.perf_counter()
    records: list[dict] = []
    bar = progress.bar(total=len(items), desc="geneval images", unit="img", disable=not show_progress)
    for k, start in enumerate(range(0, len(items), sampling.batch_size)):
        chunk = items[start : start + sampling.batch_size]
        prompts = [e["prompt"] for _, e in chunk]
        with maybe_autocast(autocast_dtype, torch.device(adapter.device).type):
            images = sampling.sample(adapter, prompts, seed_offset=k)
        scores = reward_fn(images, prompts, [dict(e) for _, e in chunk])
        scores = torch.as_tensor(scores, dtype=torch.float32).reshape(-1)
        if scores.numel() != len(chunk):
            raise DiffalignError(f"the GenEval judge returned {scores.numel()} scores for {len(chunk)} images")
        for (index, entry), score in zip(chunk, scores.tolist()):
            records.append({"index": index, "tag": entry["tag"], "prompt": entry["prompt"], "score": score,
                            "correct": bool(score >= CORRECT)})
        bar.update(len(chunk))
    bar.close()
    meta = {"num_prompts": len(entries), "images_per_prompt": images_per_prompt,
            **dataclasses.asdict(sampling), "resolution": sampling.side(adapter)}
    return GenEvalResult(records, time.perf_counter() - t0, meta)


def format_table(results: Mapping[str, GenEvalResult]) -> str:
    """The Flow-GRPO paper's GenEval table: a row per model and kind ("% correct images",
    "% correct prompts"), columns Overall then the tasks; values are fractions (0.63 = 63 %)."""
    scores = {name: r.task_scores() for name, r in results.items()}
    tags: list[str] = []
    for s in scores.values():
        tags += [t for t in s["images"] if t != "overall" and t not in tags]
    headers = ["Model", "Overall"] + [TASKS.get(t, t) for t in tags]
    rows = []
    for name, s in scores.items():
        for kind in KINDS:
            rows.append([f"{name} ({kind})"] + [f"{s[kind].get(t, math.nan):.2f}" for t in ["overall", *tags]])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    legend = ("images = % correct images (mean over the task's images); prompts = % correct prompts (at least one of "
              "the prompt's images correct); Overall = mean over tasks.")
    return "\n".join([line(headers), *(line(r) for r in rows), legend])


def run_from_args(args) -> int:
    """``diffalign eval RUN_OR_MODEL ... --protocol geneval --metadata PATH [--url URL]``."""
    if not args.metadata:
        raise DiffalignError("--protocol geneval needs --metadata PATH (GenEval's evaluation_metadata.jsonl)")
    entries = read_metadata(args.metadata)
    if args.num_prompts:
        entries = entries[: args.num_prompts]
    if args.url:
        reward_fn = reward_models.build("remote", url=args.url, device="cpu")
        judge = f"GenEval server {args.url}"
    else:
        reward_fn = reward_models.build(args.reward, device="cpu")
        judge = f"reward {args.reward}"
    model_refs = list(args.runs) or [args.base]
    results, per_image = {}, {}
    for model_ref in model_refs:
        path = Path(model_ref)
        name = path.name if path.is_dir() else model_ref
        progress.phase(f"geneval: {name} on {len(entries)} prompts x {args.images_per_prompt} images, judged by {judge} ...")
        adapter = load_trained_adapter(path) if (path / "final").is_dir() or (path / "diffalign.json").is_file() \
            else load_adapter(model_ref)
        sampling = SampleSpec(num_steps=args.steps, guidance_scale=args.guidance_scale, seed=args.seed, batch_size=args.batch_size)
        result = evaluate_geneval(adapter, entries, reward_fn, images_per_prompt=args.images_per_prompt, sampling=sampling,
                                  autocast_dtype=args.autocast_dtype)
        progress.phase(f"  {len(result.records)} images in {result.seconds:.0f} s")
        results[name], per_image[name] = result, result.to_json()
    print(format_table(results))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(per_image, indent=1) + "\n")
        print(f"per-image results: {out}", file=sys.stderr)
    return 0
