"""Saving trained weights in the formats diffusers users load in one line.

- :func:`save_trained_weights`: a run's ``final/`` (written by the trainer);
- :func:`load_trained_adapter`: base model + ``final/`` back as an adapter;
- :func:`export_run`: ``diffalign export``: a self-contained folder for the Hub in the format of
  what was trained (:func:`default_format`): a LoRA run's LoRA (``pipe.load_lora_weights(folder)``),
  or the whole pipeline with the trained weights (``DiffusionPipeline.from_pretrained(folder)``):
  a fully fine-tuned run's as trained, or a LoRA run's LoRA fused into the base on request
  (``merged``), with a model card, a before / after pair of one prompt (the card's widget) and the
  before / after evaluation grids. Uploading it is :mod:`diffalign.hub`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from diffalign import __version__, hub, progress, runs, stats
from diffalign.adapters import load_adapter
from diffalign.adapters.base import ModelAdapter
from diffalign.config import EvalConfig, SamplingConfig
from diffalign.errors import RunDirError
from diffalign.images import labelled_grid, save_png
from diffalign.report import evaluation_summary
from diffalign.runs import METADATA_FILE, eval_records_path, read_final_metadata
from diffalign.sampling import sample_images

# lora: the LoRA file alone, loaded onto the base model (LoRA runs only); merged: the whole pipeline
# with the trained weights (a LoRA run's LoRA fused into the base, a full fine-tune's weights as trained)
EXPORT_FORMATS = ("lora", "merged")
LORA_WEIGHTS_FILE = "pytorch_lora_weights.safetensors"  # diffusers' default LoRA file name
WIDGET_FILE = "images/widget.png"  # the card's widget image: one prompt, base | trained, same noise
WIDGET_TILE_PX = 256  # each image of the pair shown this wide (ShapesWorld's 32 px enlarged 8x, nearest)


def denoiser_attr(adapter: ModelAdapter) -> str:
    """Name of the denoiser in the pipeline's components ("transformer" or "unet"); for a denoiser
    of several parts (Wan2.2's experts) the first one's."""
    return next(iter(adapter.denoiser_parts()))


def lora_file(part: str, main: str) -> str:
    """The LoRA file of denoiser part ``part``: diffusers' default name for the ``main`` (first)
    part, ``pytorch_lora_weights_<part>.safetensors`` for the others (loaded with
    ``load_lora_weights(folder, weight_name=..., load_into_<part>=True)``, diffusers' way for
    Wan2.2's ``transformer_2``)."""
    return LORA_WEIGHTS_FILE if part == main else f"pytorch_lora_weights_{part}.safetensors"


def lora_files(adapter: ModelAdapter) -> dict[str, str]:
    """Denoiser part -> its LoRA file name (one entry but for multi-part denoisers)."""
    parts = list(adapter.denoiser_parts())
    return {part: lora_file(part, parts[0]) for part in parts}


def lora_state_dict(adapter: ModelAdapter, part: str | None = None) -> dict[str, torch.Tensor]:
    """The LoRA weights of the denoiser's part ``part`` (its first part by default; the whole
    denoiser for one-network families) in peft naming, as diffusers' ``save_lora_weights`` expects."""
    from peft.utils import get_peft_model_state_dict

    parts = adapter.denoiser_parts()
    module = parts[part if part is not None else next(iter(parts))]
    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(module).items()}


def save_trained_weights(adapter: ModelAdapter, out_dir: Path, *, lora: bool, metadata: dict) -> Path:
    """Write ``out_dir`` atomically (temporary folder + rename).

    - LoRA: ``pytorch_lora_weights.safetensors`` through the pipeline class's own
      ``save_lora_weights`` -> ``pipeline.load_lora_weights(out_dir)``.
    - Full fine-tuning: the whole pipeline -> ``DiffusionPipeline.from_pretrained(out_dir)``.
    Plus ``diffalign.json`` with what was trained how.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        if lora:
            pipe_cls = type(adapter.pipeline)
            attr = denoiser_attr(adapter)
            if not hasattr(pipe_cls, "save_lora_weights"):
                raise RunDirError(f"{pipe_cls.__name__} cannot save LoRA weights (no LoRA loader mixin)")
            for part, name in lora_files(adapter).items():  # every part's LoRA under the main part's keyword
                pipe_cls.save_lora_weights(str(tmp), weight_name=name, **{f"{attr}_lora_layers": lora_state_dict(adapter, part)})
        else:
            adapter.pipeline.save_pretrained(str(tmp))
            scrub_local_paths(tmp, str(metadata.get("base_model", "")))
        if lora and len(adapter.denoiser_parts()) > 1:  # Wan2.2: which file holds which expert's LoRA
            metadata = {**metadata, "lora_files": lora_files(adapter)}
        (tmp / METADATA_FILE).write_text(json.dumps({"format": "lora" if lora else "full", **metadata}, indent=2, default=str))
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def scrub_local_paths(folder: Path, name: str) -> None:
    """Replace the absolute local paths that ``save_pretrained`` records (``_name_or_path`` of the
    folder a model was loaded from, e.g. the shipped model inside site-packages) by ``name``, the
    model id, in every JSON file under ``folder``: a saved or exported folder names no path of the
    machine that wrote it."""

    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, str) and os.path.isabs(value) and len(value) > 1:
            return name
        return value

    for f in sorted(folder.rglob("*.json")):
        try:
            data = json.loads(f.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        cleaned = clean(data)
        if cleaned != data:
            f.write_text(json.dumps(cleaned, indent=2, sort_keys=False) + "\n")


def unchanged_weights(run_dir: str | os.PathLike) -> str | None:
    """Why ``final/`` of a run holds exactly the base model's weights, or None when it does not.

    LoRA: every adapted layer's update ``B @ A`` is zero (``lora_B`` or ``lora_A`` all zeros, as
    before any training). Full fine-tuning: every denoiser tensor equals the base model's.
    """
    final = Path(run_dir) / "final"
    meta = json.loads((final / METADATA_FILE).read_text())
    if meta.get("format") == "lora":
        from safetensors.torch import load_file

        tensors = {}
        for f in sorted(final.glob("pytorch_lora_weights*.safetensors")):  # every denoiser part's file
            tensors.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
        pairs = [(tensors[k], tensors.get(k.replace("lora_A", "lora_B"))) for k in tensors if "lora_A" in k]
        if pairs and all(b is None or not a.any() or not b.any() for a, b in pairs):
            return f"every LoRA update B @ A in {str(final)!r} is zero"
        return None
    trained = load_trained_adapter(run_dir).denoiser.state_dict()
    options = meta.get("model_options") or {}
    base = load_adapter(meta["base_model"], family=meta.get("family", "auto"), **options).denoiser.state_dict()
    if trained.keys() == base.keys() and all(torch.equal(trained[k], base[k].to(trained[k].dtype)) for k in trained):
        return f"every denoiser weight in {str(final)!r} equals {meta['base_model']!r}'s"
    return None


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move the finished folder ``tmp`` to ``out_dir`` with renames only, so that readers see the
    old folder or the new one, never a half-written one."""
    if out_dir.exists():
        backup = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-old-"))
        os.replace(out_dir, backup)  # an empty backup folder is replaced by a rename on POSIX
        os.replace(tmp, out_dir)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


def load_trained_adapter(run_or_final: str | os.PathLike, *, device="cpu", dtype=torch.float32) -> ModelAdapter:
    """Base model + the weights of a run's ``final/`` (or a final folder itself), via diffusers'
    own loading code (``load_lora_weights`` / ``from_pretrained``)."""
    path = Path(run_or_final)
    final = path / "final" if (path / "final").is_dir() else path
    meta_file = final / "diffalign.json"
    if not meta_file.is_file():
        raise RunDirError(f"{str(path)!r} has no final weights (no final/diffalign.json); has the run finished?")
    meta = json.loads(meta_file.read_text())
    options = meta.get("model_options") or {}  # adapter options of the run (model.options), e.g. wan num_frames
    if meta["format"] == "full":
        return load_adapter(str(final), family=meta.get("family", "auto"), device=device, dtype=dtype, **options)
    adapter = load_adapter(meta["base_model"], family=meta.get("family", "auto"), device=device, dtype=dtype, **options)
    try:
        main = denoiser_attr(adapter)
        for part, name in lora_files(adapter).items():
            into = {} if part == main else {f"load_into_{part}": True}  # Wan2.2: load_into_transformer_2
            adapter.pipeline.load_lora_weights(str(final), weight_name=name, **into)
    except Exception as exc:
        raise RunDirError(f"LoRA weights in {str(final)!r} do not fit base model {meta['base_model']!r}: {str(exc).splitlines()[0]}") from None
    adapter.denoiser.requires_grad_(False)
    return adapter


# ---- diffalign export ---------------------------------------------------------------------------
def is_export_dir(path: Path) -> bool:
    """A folder written by :func:`export_run` (its ``diffalign.json`` has an ``export`` entry)."""
    try:
        return "export" in json.loads((Path(path) / METADATA_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return False


def portable(value):
    """``value`` with absolute local paths reduced to their last part (exported files name no
    folder of this machine); dicts and lists are walked."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v) for v in value]
    if isinstance(value, str) and (os.path.isabs(value) or value.startswith("~")):
        return Path(value).name
    return value


def _regular_file(path: Path) -> Path:
    """``path`` when it is a plain file; a symbolic link is refused (it may point anywhere)."""
    if path.is_symlink():
        raise RunDirError(f"{str(path)!r} is a symbolic link; refusing to export it")
    return path


def _check_out_dir(out: Path, run_dir: Path) -> None:
    """Replace only an earlier export or an empty folder; never a run, its ``final/`` or user files."""
    out_r, run_r = out.resolve(), run_dir.resolve()
    if out_r == run_r or out_r in run_r.parents:
        raise RunDirError(f"--out {str(out)!r} would replace the run directory {str(run_dir)!r}; choose another folder")
    if out.is_file():
        raise RunDirError(f"--out {str(out)!r} is a file; expected a folder")
    if out.is_dir() and any(out.iterdir()) and not is_export_dir(out):
        raise RunDirError(f"--out {str(out)!r} exists and is not a diffalign export folder; refusing to overwrite it")


def eval_grids(run_dir: Path, evals: list[dict]) -> dict[str, Path]:
    """The eval sample grids to show as before / after (same prompts and seed): the grid of
    iteration 0 (the base model) when the run evaluated it, and the last one."""
    samples = run_dir / "samples"
    found = {int(p.stem.rsplit("-", 1)[-1]): p for p in samples.glob("eval-iter-*.png")} if samples.is_dir() else {}
    evaluated = [e["iteration"] for e in evals if e["iteration"] in found]
    last = max(evaluated) if evaluated else (max(found) if found else None)
    grids = {}
    if 0 in found and last != 0:
        grids["before"] = found[0]
    if last is not None:
        grids["after"] = found[last]
    return grids


def _side_by_side(before: Path, after: Path, out: Path, gap: int = 8) -> None:
    """One image: before grid | white gap | after grid."""
    from PIL import Image

    a, b = Image.open(before).convert("RGB"), Image.open(after).convert("RGB")
    canvas = Image.new("RGB", (a.width + gap + b.width, max(a.height, b.height)), "white")
    canvas.paste(a, (0, 0))
    canvas.paste(b, (a.width + gap, 0))
    canvas.save(out)


def _eval_prompts(run_dir: Path) -> list[str]:
    """The run's evaluation prompts as resolved at its start (``prompts.json``), [] when absent."""
    try:
        prompts = json.loads((run_dir / "prompts.json").read_text()).get("eval")
    except (OSError, ValueError, AttributeError):
        return []
    return [p for p in prompts if isinstance(p, str)] if isinstance(prompts, list) else []


def widget_pair(adapter: ModelAdapter, meta: dict, config: dict, prompt: str, out: Path) -> dict:
    """Draw ``prompt`` with the base model and with the trained one (``adapter``, loaded from
    ``final/``) from the same noise, and write the two side by side to ``out``: the card's widget
    image. Returns what the card says about it (prompt, seed, num_steps, guidance_scale, resolution).

    The sampler, steps, guidance scale, resolution and seed are the run's evaluation settings
    (:func:`diffalign.sampling.sample_images`: ODE, ``eval.seed``). The base is the same network
    with its LoRA disabled, or for full fine-tuning the base model loaded beside it. A video
    shows its first frame."""
    # a key missing from config.yaml: what the run ran with, the config's default
    sampling, model, evaluation = (config.get(k) or {} for k in ("sampling", "model", "eval"))
    settings = {"num_steps": int(sampling.get("eval_num_steps", SamplingConfig.eval_num_steps)),
                "guidance_scale": float(sampling.get("guidance_scale", SamplingConfig.guidance_scale)),
                "resolution": int(model.get("resolution") or adapter.default_resolution),
                "seed": int(evaluation.get("seed", EvalConfig.seed))}

    def draw(model_adapter: ModelAdapter) -> torch.Tensor:
        images = sample_images(model_adapter, [prompt], batch_size=1, **settings)
        return images[:, 0] if images.ndim == 5 else images  # (1, 3, H, W)

    after = draw(adapter)
    if meta.get("format") == "lora":
        adapter.pipeline.disable_lora()
        try:
            before = draw(adapter)
        finally:
            adapter.pipeline.enable_lora()
    else:
        base = load_adapter(str(meta["base_model"]), family=meta.get("family", "auto"), device=adapter.device,
                            dtype=adapter.dtype, **(meta.get("model_options") or {}))
        before = draw(base)
        del base
    grid = labelled_grid(torch.cat([before, after]).float(), ["before (base model)", "after (trained)"],
                         nrow=2, tile=WIDGET_TILE_PX)
    save_png(grid, out)
    return {"prompt": prompt, "seed": settings["seed"], "num_steps": settings["num_steps"],
            "guidance_scale": settings["guidance_scale"], "resolution": settings["resolution"]}


def paired_reward_differences(run_dir: Path, evals: list[dict]) -> dict:
    """``{"eval/reward_mean": Difference}``: the last evaluation's mean reward minus the first's with
    its 95 % paired bootstrap interval over prompts, from the per-image rewards the evaluator keeps
    in ``eval_records/`` (the pairing :mod:`diffalign.report` uses for its verdict). Empty when the
    two evaluations cannot be paired (no records, other prompts, one evaluation only)."""
    if len(evals) < 2 or evals[0]["iteration"] == evals[-1]["iteration"]:
        return {}
    values = []
    for e in (evals[0], evals[-1]):
        try:
            saved = json.loads(eval_records_path(run_dir, e["iteration"]).read_text()).get("rewards") or {}
        except (OSError, ValueError, AttributeError):
            return {}
        values.append((saved.get("prompts"), saved.get("values")))
    (prompts_a, a), (prompts_b, b) = values
    if not (isinstance(a, list) and isinstance(b, list)) or prompts_a != prompts_b or len(a) != len(b):
        return {}
    keep = [i for i, (x, y) in enumerate(zip(a, b)) if isinstance(x, (int, float)) and isinstance(y, (int, float))]
    if not keep:
        return {}
    # one stratum; the reward as the "partial" score, so that the partial metric is the mean reward
    records = [[{"prompt": prompts_a[i], "family": "all", "passed": False, "score": v[i]} for i in keep] for v in (a, b)]
    diff = stats.paired_difference(*records, resamples=stats.DEFAULT_RESAMPLES, seed=stats.DEFAULT_SEED)
    return {"eval/reward_mean": diff["partial"]}


def default_format(run_dir: str | os.PathLike) -> str:
    """The export format of what the run trained: ``lora`` for a LoRA run (the adapter alone, a
    few MB), ``merged`` for a fully fine-tuned one (its whole pipeline: there is no LoRA)."""
    return "lora" if read_final_metadata(Path(run_dir)).get("format") == "lora" else "merged"


def export_run(
    run_dir: str | os.PathLike,
    fmt: str | None = None,
    out: str | os.PathLike | None = None,
    *,
    repo_id: str | None = None,
    license: str | None = None,
    log=None,
) -> Path:
    """Write a Hub-ready folder for a finished run and return its path.

    Args:
        run_dir: a run directory with ``final/`` (see :mod:`diffalign.runs`).
        fmt: ``"lora"``: ``pytorch_lora_weights.safetensors`` (copied from ``final/``), loaded
            with ``pipe.load_lora_weights(folder)``, for LoRA runs only; ``"merged"``: the whole
            pipeline with the trained weights (a LoRA run's LoRA fused into the base weights, a
            fully fine-tuned run's weights as trained), loaded with
            ``DiffusionPipeline.from_pretrained``. Default (None): :func:`default_format`, the
            format of what was trained.
        out: the folder to write (default ``RUN_DIR/export/<fmt>``). It is written next to its
            final place and renamed into it; an existing folder is replaced only when it is an
            earlier export or empty.
        repo_id: the Hub repo the folder is meant for; the card's loading snippet names it
            (otherwise ``"."``, the folder itself: exported files name no local path).
        license: the card's license (default: diffalign's own, :func:`diffalign.hub.own_license`,
            for the models diffalign makes (the shipped ``shapes``, ``tiny:*``), else ``other``: a
            model derived from a base model inherits its license).
    Also written: ``README.md`` (model card, see :func:`diffalign.hub.model_card`),
    ``images/widget.png`` (one prompt drawn by the base and the trained model from the same noise:
    :func:`widget_pair`), ``images/`` before / after eval grids, ``diffalign.json``,
    ``pipeline.py`` and its neighbours in a whole pipeline of a class diffusers lacks
    (:func:`write_pipeline_code`), and ``LICENSE`` when the card's ``license_link`` points at it.
    Prints one ``warning:`` line on
    stderr when the weights equal the base model's (:func:`unchanged_weights`).
    """
    import yaml


    log = log or (lambda msg: None)
    run_dir = Path(run_dir)
    if fmt is not None and fmt not in EXPORT_FORMATS:
        raise RunDirError(f"unknown export format {fmt!r}; use one of {', '.join(EXPORT_FORMATS)}")
    meta = read_final_metadata(run_dir)
    fmt = fmt or default_format(run_dir)
    if fmt == "lora" and meta.get("format") != "lora":
        raise RunDirError(f"run {str(run_dir)!r} fine-tuned all weights and has no LoRA to export; "
                          f"export it without --format (or with --format merged): the whole pipeline")
    out = Path(out) if out is not None else run_dir / "export" / fmt
    _check_out_dir(out, run_dir)
    config = portable(yaml.safe_load((run_dir / "config.yaml").read_text()) or {})
    local_meta, meta = meta, portable(meta)  # the first loads the base (a local folder's path), the second is written
    evals = [r for r in runs.MetricsLog(run_dir / "metrics.jsonl").read() if r.get("eval")]

    same = unchanged_weights(run_dir)
    if same:  # a warning that matters: on stderr under --quiet too
        print(f"warning: the exported weights equal the base model's ({same}): the run changed nothing "
              f"(too few updates, lr 0, or EMA weights that never averaged: see final/{METADATA_FILE} 'weights')",
              file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        prompt = hub.widget_prompt(config, meta.get("family"), _eval_prompts(run_dir))
        with progress.bar(total=3 if fmt == "merged" else 2, desc=f"export {fmt}", unit="step") as bar:
            # long steps without finer progress: the bar's clock keeps ticking through them. One load
            # (fp32: the fusion's precision) serves the widget pair and, for merged exports, the fusion.
            bar.set_postfix_str("loading the trained model")
            adapter = load_trained_adapter(run_dir, device=device)
            bar.update(1)
            bar.set_postfix_str("drawing the before / after pair")
            widget = {**widget_pair(adapter, local_meta, config, prompt, tmp / WIDGET_FILE), "image": WIDGET_FILE}
            bar.update(1)
            if fmt == "lora":
                for name in lora_files(adapter).values():
                    shutil.copy2(_regular_file(run_dir / "final" / name), tmp / name)
                pipeline_class = None
            else:
                log(f"fusing the trained weights into {meta['base_model']} ...")
                bar.set_postfix_str("fusing and writing the pipeline")
                if meta.get("format") == "lora":
                    fuse_lora(adapter)
                adapter.pipeline.save_pretrained(str(tmp), safe_serialization=True)
                scrub_local_paths(tmp, str(meta["base_model"]))
                pipeline_class = type(adapter.pipeline)
                if not hub.is_diffusers_pipeline(pipeline_class):
                    write_pipeline_code(pipeline_class, tmp)
                bar.update(1)
        del adapter
        grids = eval_grids(run_dir, evals)
        images = {}
        for name, src in grids.items():
            shutil.copy2(_regular_file(src), tmp / "images" / f"{name}.png")
            images[name] = f"images/{name}.png"
        if len(grids) == 2:
            _side_by_side(tmp / "images" / "before.png", tmp / "images" / "after.png", tmp / "images" / "before_after.png")
            images["before_after"] = "images/before_after.png"
        card = hub.model_card(meta, config, evals, fmt=fmt, where=repo_id or ".", images=images,
                              license=license, pipeline_class=pipeline_class, name=f"{run_dir.name}-{fmt}",
                              evaluation=evaluation_summary(run_dir), widget=widget,
                              differences=paired_reward_differences(run_dir, evals))
        card.save(tmp / "README.md")
        if card.data.to_dict().get("license_link") == hub.LICENSE_FILE:  # the card links it: it must exist
            (tmp / hub.LICENSE_FILE).write_text(hub.license_file_text(str(meta["base_model"])))
        info = {k: v for k, v in meta.items() if k != "format"}
        info["format"] = fmt
        info["export"] = {"diffalign_version": __version__, "run": run_dir.resolve().name, "repo_id": repo_id,
                          "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        (tmp / METADATA_FILE).write_text(json.dumps(info, indent=2, default=str))
        _check_out_dir(out, run_dir)  # again: something may have appeared there meanwhile
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_pipeline_code(pipeline_class: type, folder: Path) -> None:
    """Make ``folder`` (a saved pipeline of a class diffusers does not have, e.g. ``ShapesPipeline``)
    load with diffusers alone: the class's module as :data:`diffalign.hub.PIPELINE_CODE_FILE` and
    the files it imports relatively, and ``model_index.json``'s ``_class_name`` as ``[file, class]``,
    diffusers' layout for a pipeline whose code is in the folder; then
    ``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)`` loads it, from the Hub
    too. The module must import only installed libraries and its neighbours (relatively)."""
    import inspect

    from diffusers.utils.dynamic_modules_utils import get_relative_import_files

    source = Path(inspect.getsourcefile(pipeline_class))
    shutil.copyfile(_regular_file(source), folder / hub.PIPELINE_CODE_FILE)
    for needed in get_relative_import_files(str(source)):  # what diffusers copies beside it when loading
        shutil.copyfile(_regular_file(Path(needed)), folder / Path(needed).name)
    index_file = folder / "model_index.json"
    index = json.loads(index_file.read_text())
    index["_class_name"] = [Path(hub.PIPELINE_CODE_FILE).stem, pipeline_class.__name__]
    index_file.write_text(json.dumps(index, indent=2) + "\n")


def fuse_lora(adapter: ModelAdapter) -> None:
    """Fuse the loaded LoRA into the base weights in place (diffusers' own ``fuse_lora`` +
    ``unload_lora_weights``), so that ``pipeline.save_pretrained`` writes plain weights."""
    pipe = adapter.pipeline
    if not hasattr(pipe, "fuse_lora"):
        raise RunDirError(f"{type(pipe).__name__} cannot fuse LoRA weights (no LoRA loader mixin)")
    pipe.fuse_lora(components=list(adapter.denoiser_parts()), lora_scale=1.0)
    pipe.unload_lora_weights()  # after fuse_lora this keeps the fused weights and drops the peft layers


def merged_adapter(run_dir: str | os.PathLike, *, device="cpu", dtype=torch.float32) -> ModelAdapter:
    """The run's trained model with its LoRA fused into the base weights (:func:`fuse_lora`). A
    fully fine-tuned run is returned as loaded."""
    adapter = load_trained_adapter(run_dir, device=device, dtype=dtype)
    if read_final_metadata(Path(run_dir)).get("format") == "lora":
        fuse_lora(adapter)
    return adapter
