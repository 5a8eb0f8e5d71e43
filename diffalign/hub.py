"""Hugging Face Hub: the model card of an exported run, the upload operations, and the push.

The export folder (:func:`diffalign.export.export_run`) and its list of
``CommitOperationAdd`` are built offline; only :func:`push_folder` talks to the Hub, and
:func:`check_push_target` says why it cannot (bad repo id, offline mode, no token) before any
work is done.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from diffalign import __license__
from diffalign.adapters import DEFAULT_ALIASES, PIPELINE_FAMILIES, TINY_PREFIX
from diffalign.config import SamplingConfig
from diffalign.errors import DiffalignError
from diffalign.shapes import prompt_family, prompt_set

# Config keys shown in the card besides every ``algorithm.*`` key: what it takes to reproduce the
# run's character (sizes of the rollout, the kernel, the learning rate), not every knob.
CARD_HPARAMS = (
    "max_iterations", "seed", "model.resolution", "lora.rank", "lora.alpha", "lora.targets",
    "sampling.num_steps", "sampling.eval_num_steps", "sampling.guidance_scale", "sampling.kernel",
    "sampling.noise_level", "sampling.window_size", "rollout.prompts_per_iteration", "rollout.group_size",
    "reward.name", "reward.kwargs", "optim.name", "optim.lr", "optim.weight_decay", "optim.grad_clip", "train.batch_size",
    "train.optimizer_steps_per_iteration", "train.inner_epochs", "train.mixed_precision",
    "train.ema.enabled", "train.ema.decay", "train.ema.every",
)
FALLBACK_PROMPT = "a photo of a cat"  # the widget prompt of a run whose prompts are unknown
LICENSE_FILE = "LICENSE"  # license_link of a "license: other" card whose base has no Hub page
# Pipelines that are not part of diffusers: where their class is imported from.
NON_DIFFUSERS_PIPELINES = {"ShapesPipeline": "diffalign.shapes.pipeline"}
# A whole-pipeline export of such a class carries its code under this name (diffusers' custom
# pipeline file, named in model_index.json: diffalign.export.write_pipeline_code)
PIPELINE_CODE_FILE = "pipeline.py"
EVAL_SKIP = ("eval/seconds", "eval/num_images", "eval/probe/num_images")


def _flatten(d: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _hub_base_model(base: str) -> Optional[str]:
    """``base`` when it names a Hub model (``user/name``), else None: tiny models built in code,
    the shipped ``shapes`` model and local folders have no Hub page to link."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id


    if base.startswith(TINY_PREFIX) or base in DEFAULT_ALIASES or "/" not in base or Path(base).expanduser().exists():
        return None
    try:
        validate_repo_id(base)
    except HFValidationError:
        return None
    return base


def _is_own_model(base: str) -> bool:
    return base.startswith(TINY_PREFIX) or base in DEFAULT_ALIASES


def is_diffusers_pipeline(pipeline_class: type) -> bool:
    """Whether diffusers itself has the class (``DiffusionPipeline.from_pretrained`` finds it by name)."""
    return pipeline_class.__name__ not in NON_DIFFUSERS_PIPELINES


def needs_diffalign(meta: dict, fmt: str) -> bool:
    """Whether loading the export takes diffalign: a LoRA on a base that diffalign makes (the shipped
    ``shapes`` model, a ``tiny:*`` build), which no Hub repo holds. Every whole-pipeline export
    loads with diffusers alone (a pipeline class diffusers lacks comes with its code)."""
    return fmt == "lora" and _is_own_model(str(meta["base_model"]))


def loading_snippet(meta: dict, fmt: str, where: str, *, pipeline_class: Optional[type] = None,
                    prompt: str = FALLBACK_PROMPT, steps: int = 28, guidance_scale: float = 4.5) -> str:
    """Python that loads the export (``where``: Hub repo id or local folder) and draws one image."""
    base, family = str(meta["base_model"]), meta.get("family")
    family_pipelines = {f: c for c, f in PIPELINE_FAMILIES.items()}
    class_name = pipeline_class.__name__ if pipeline_class is not None else family_pipelines.get(family, "DiffusionPipeline")
    module = NON_DIFFUSERS_PIPELINES.get(class_name)
    q = json.dumps  # a double-quoted Python string literal
    if fmt == "lora" and base.startswith(TINY_PREFIX):
        head = ["from diffalign.adapters import load_adapter",
                f"pipe = load_adapter({q(base)}).pipeline  # tiny random model built in code by diffalign"]
    elif module is None:
        head = ["from diffusers import DiffusionPipeline",
                f"pipe = DiffusionPipeline.from_pretrained({q(where if fmt == 'merged' else base)})"]
    elif fmt == "merged":  # the folder holds the class's code: diffusers runs it when allowed to
        head = ["from diffusers import DiffusionPipeline",
                f"# {class_name}'s code is {PIPELINE_CODE_FILE} of the model's folder (diffusers' custom pipeline): "
                f"trust_remote_code runs it",
                f"pipe = DiffusionPipeline.from_pretrained({q(where)}, trust_remote_code=True)"]
    elif base in DEFAULT_ALIASES:
        head = [f"from {module} import SHIPPED_MODEL_DIR, {class_name}  # pip install diffalign: the base model ships in it",
                f"pipe = {class_name}.from_pretrained(SHIPPED_MODEL_DIR)"]
    else:
        head = [f"from {module} import {class_name}", f"pipe = {class_name}.from_pretrained({q(base)})"]
    lines = ["import torch"] + head + ([f"pipe.load_lora_weights({q(where)})"] if fmt == "lora" else [])
    if fmt == "lora":  # further denoiser parts (Wan2.2's transformer_2): their own file, diffusers' load_into_<part>
        lines += [f"pipe.load_lora_weights({q(where)}, weight_name={q(name)}, load_into_{part}=True)"
                  for part, name in list((meta.get("lora_files") or {}).items())[1:]]
    lines.append(f"image = pipe({q(prompt)}, num_inference_steps={steps}, guidance_scale={guidance_scale},\n"
                 f"             generator=torch.Generator().manual_seed(0)).images[0]")
    return "\n".join(lines)


def _eval_cell(record: dict, key: str) -> str:
    """``0.1980`` or, where the record holds its bootstrap interval, ``0.1980 [0.1580, 0.2430]``."""
    lo, hi = record.get(f"{key}_lo"), record.get(f"{key}_hi")
    bounds = f" [{lo:.4f}, {hi:.4f}]" if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) else ""
    return f"{record[key]:.4f}{bounds}"


def _change_cell(key: str, a: float, b: float, differences: dict) -> str:
    """``+0.0020 [+0.0010, +0.0030]`` with the paired interval of ``differences[key]``; the bare
    difference when the per-image values that pairing needs were not recorded."""
    d = differences.get(key)
    if d is None:
        return f"{b - a:+.4f}"
    return f"{d.value:+.4f} [{d.lo:+.4f}, {d.hi:+.4f}]"


def _eval_table(evals: list[dict], differences: Optional[dict] = None) -> list[str]:
    """The first and the last evaluation of ``evals`` side by side; ``differences``:
    ``{metric key: stats.Difference}``, the paired intervals the change column shows."""
    differences = differences or {}
    if not evals:
        return ["No evaluation was logged."]
    first, last = evals[0], evals[-1]
    before = first if first is not last and first["iteration"] == 0 else None
    keys = [k for k in last if k.startswith("eval/") and k not in EVAL_SKIP and not k.endswith(("_lo", "_hi"))
            and isinstance(last[k], (int, float))]
    if before is None:
        rows = ["| metric | value |", "|---|---:|"] + [f"| {k[5:]} | {_eval_cell(last, k)} |" for k in keys]
        return [f"Held-out evaluation at iteration {last['iteration']} ({last.get('eval/num_images', '?')} images):", ""] + rows
    rows = ["| metric | before (base) | after | change [95 % paired interval] |", "|---|---:|---:|---:|"]
    bare = []
    for k in keys:
        a, b = before.get(k), last[k]
        if isinstance(a, (int, float)):
            rows.append(f"| {k[5:]} | {_eval_cell(before, k)} | {_eval_cell(last, k)} | {_change_cell(k, a, b, differences)} |")
            bare += [k[5:]] if k not in differences else []
    note = ([] if not bare else ["", f"Paired intervals: bootstrap over prompts from the per-image values; "
                                 f"{', '.join(bare)}: no per-image values recorded, so no interval."])
    return [f"Held-out evaluation, iteration 0 vs {last['iteration']} (same prompts and seed, "
            f"{last.get('eval/num_images', '?')} images):", ""] + rows + note


def widget_prompt(config: dict, family: Optional[str], eval_prompts: Optional[list[str]] = None) -> str:
    """A prompt from the base model's own domain, for the widget and the loading snippet.

    ShapesWorld (the shipped model knows only its grammar): the first held-out prompt that relates
    two objects. Other bases: the run's first evaluation prompt as resolved at its start
    (``eval_prompts``, from ``prompts.json``), else the config's first evaluation or training
    prompt, else :data:`FALLBACK_PROMPT`."""
    if family == "shapes":
        held_out = prompt_set("heldout")
        return next((p for p in held_out if prompt_family(p) == "position"), held_out[0])
    prompts = config.get("prompts") or {}
    listed = [p for p in (prompts.get("eval") or []) + (prompts.get("train") or []) if isinstance(p, str)]
    return next(iter(list(eval_prompts or []) + listed), FALLBACK_PROMPT)


def _license_fields(license: str, base: str, hub_base: Optional[str]) -> dict:
    """The Hub's license fields: ``license: other`` always comes with ``license_name`` and
    ``license_link``: the base model's page, whose license a derived model inherits, or for a base
    with no Hub page the :data:`LICENSE_FILE` the export writes beside the card (the Hub accepts a
    link to a file of the repo)."""
    if license != "other":
        return {"license": license}
    slug = "".join(c if c.isalnum() else "-" for c in Path(base).name.lower()).strip("-") or "base-model"
    return {"license": "other", "license_name": f"{slug}-license",
            "license_link": f"https://huggingface.co/{hub_base}" if hub_base else LICENSE_FILE}


def own_license() -> str:
    """The Hub's id of diffalign's own licence (``apache-2.0``: pyproject.toml's ``license``, the
    LICENSE file), which covers the models diffalign makes: the shipped ``shapes`` model's weights and
    the ``tiny:*`` builds. The Hub's ids are the SPDX ids in lower case."""
    return __license__.lower()


def license_file_text(base: str) -> str:
    """:data:`LICENSE_FILE` of an export whose base has no Hub page to link."""
    return (f"These weights were trained with diffalign from the base model `{Path(base).name}`, which has no "
            "Hugging Face Hub page to link.\nThey derive from that model: its license applies to them.\n")


def _base_model_note(base: str, family: Optional[str], hub_base: Optional[str]) -> str:
    """Why the front matter has no ``base_model``: the Hub takes only the id of a Hub model there
    (it links the page and lists the model among the base's fine-tunes and adapters), and a base
    made by diffalign or read from a local folder has no such page."""
    if hub_base:
        return ""
    made = ("a local folder" if not _is_own_model(base) else "a tiny model built in code by diffalign"
            if base.startswith(TINY_PREFIX) else "the model shipped in the diffalign package")
    return f" (no `base_model` in the metadata: the Hub accepts only a Hub model id there, and this base is {made})"


def _license_text(license: str, base: str) -> str:
    """The card's licence paragraph: which licence applies to the weights, and why."""
    if not _is_own_model(base):
        return f"`{license}`. These weights derive from `{base}`: its license applies."
    if license != own_license():  # --license chose another one
        return f"`{license}`."
    made = "random weights built in code by diffalign" if base.startswith(TINY_PREFIX) else "shipped in the diffalign package"
    return (f"`{license}`: the base model `{base}` ({made}) is under diffalign's license, "
            f"{__license__} (the LICENSE file of diffalign's repository and wheel), and so are these weights.")


def _base_reference(base: str, family: Optional[str], hub_base: Optional[str]) -> str:
    """The base model as the card's first sentence names it."""
    if hub_base:
        return f"[`{hub_base}`](https://huggingface.co/{hub_base}) ({family})"
    if base.startswith(TINY_PREFIX):
        return f"`{base}` (a tiny {family} model with random weights built in code by diffalign)"
    if base in DEFAULT_ALIASES:
        return f"`{base}` (the ShapesWorld text-to-image model shipped in the diffalign package)"
    return f"`{base}` ({family})"


# GRPO-Guard's switches (diffalign.config.GuardOptions): with all of them off the guard is off, and
# its mode applies only with the ratio normalisation on
GUARD_SWITCHES = ("algorithm.guard_ratio_norm", "algorithm.guard_step_reweight", "algorithm.guard_diagnostics")
GUARD_NORM_MODE = "algorithm.guard_norm_mode"


def settings_in_effect(config: dict, meta: dict, *, resolution: Optional[int] = None) -> dict:
    """The card's settings table: every ``algorithm.*`` key and :data:`CARD_HPARAMS`, less those
    that did not take effect: a section switched off (``lora`` of a full fine-tune, ``train.ema``
    with ``enabled: false``), GRPO-Guard's switches that were off (and its mode without the ratio
    normalisation), and empty values. ``model.resolution`` 0 (the model's default) reads as
    ``resolution``, the one the run used, when given."""
    flat = {k: v for k, v in _flatten(config).items()
            if (k.startswith("algorithm.") or k in CARD_HPARAMS) and v not in (None, {}, [])}
    off = [k[: -len("enabled")] for k, v in _flatten(config).items() if k.endswith(".enabled") and v is False]
    if not meta.get("lora"):
        off.append("lora.")
    flat = {k: v for k, v in flat.items() if not any(k.startswith(prefix) for prefix in off)}
    flat = {k: v for k, v in flat.items() if not (k in GUARD_SWITCHES and v is False)}
    if not flat.get("algorithm.guard_ratio_norm"):
        flat.pop(GUARD_NORM_MODE, None)
    if not flat.get("model.resolution") and resolution:
        flat["model.resolution"] = resolution
    return flat


def _weights_exported(meta: dict, fmt: str) -> str:
    """What the folder holds: the LoRA, the pipeline with the LoRA fused, or the fine-tuned pipeline."""
    lora = meta.get("lora")
    shape = f"LoRA rank {lora.get('rank')}, alpha {lora.get('alpha')}" if lora else ""
    if fmt == "lora":
        return f"LoRA ({shape})"
    return f"the whole pipeline, {'the LoRA (' + shape + ') fused into it' if lora else 'all weights fine-tuned'}"


def _weights_held(meta: dict) -> str:
    """Which weights ``final/`` held: the EMA's (with its decay and number of averages) or the last."""
    if meta.get("weights") == "ema" or (meta.get("weights") is None and meta.get("ema")):
        updates = meta.get("ema_updates")
        return (f"the exponential moving average of the weights (decay {meta.get('ema_decay')}"
                + (f", {updates} average{'' if updates == 1 else 's'}" if updates is not None else "") + ")")
    return "the weights of the last optimizer step"


def model_card(meta: dict, config: dict, evals: list[dict], *, fmt: str, where: str, images: dict[str, str],
               license: Optional[str] = None, pipeline_class: Optional[type] = None, name: str = "diffalign-model",
               evaluation: Optional[list[str]] = None, widget: Optional[dict] = None, differences: Optional[dict] = None):
    """A ``huggingface_hub.ModelCard`` for an exported run.

    Args:
        meta: ``final/diffalign.json`` (base_model, family, algorithm, reward, iterations, lora, weights).
        config: the run's ``config.yaml`` as a dict; evals: its eval records (``"eval": true``).
        fmt: ``lora`` or ``merged``; where: Hub repo id or local folder for the snippet.
        images: ``{"before"|"after"|"before_after": path in the folder}``: the evaluation grids.
        evaluation: markdown lines to quote (the run report's verdict and, for ShapesWorld, its
            held-out table with intervals and paired differences).
        widget: the before / after pair of one prompt (:func:`diffalign.export.widget_pair`:
            ``prompt``, ``image``, ``seed``, ``num_steps``, ``guidance_scale``): the widget's prompt
            and image. Without it the widget has a prompt of the base's domain and no image.
        differences: ``{metric key: stats.Difference}``, the paired intervals of the change column.
    """
    from huggingface_hub import ModelCard, ModelCardData


    base, algorithm, reward, family = str(meta["base_model"]), meta.get("algorithm"), meta.get("reward"), meta.get("family")
    hub_base = _hub_base_model(base)
    license = license or (own_license() if _is_own_model(base) else "other")
    # library_name (the Hub's "Use in diffusers" button) only where diffusers alone loads the folder
    diffusers_alone = not needs_diffalign(meta, fmt)
    tags = ["diffalign", algorithm, family, "text-to-image"] + (["diffusers"] if diffusers_alone else []) + (["lora"] if fmt == "lora" else [])
    tags = [t for i, t in enumerate(tags) if t and t not in tags[:i]]
    prompt = widget["prompt"] if widget else widget_prompt(config, family)
    sampling = config.get("sampling") or {}
    # base_model only when the base is a Hub model (see _base_model_note; the card's text names the base either way)
    data = ModelCardData(
        base_model=hub_base, **_license_fields(license, base, hub_base), library_name="diffusers" if diffusers_alone else None,
        pipeline_tag="text-to-image", tags=tags, model_name=name,
        widget=[{"text": prompt, **({"output": {"url": widget["image"]}} if widget else {})}],
    )
    iterations = f"{meta.get('iterations')} iteration{'' if meta.get('iterations') == 1 else 's'}"
    how = (f"with **{algorithm}** on the **{reward}** reward for {iterations} with diffalign"
           + (" (the exponential moving average of the weights)" if meta.get("ema") else ""))
    base_ref = _base_reference(base, family, hub_base)
    if fmt == "lora":
        summary = f"A LoRA adapter for {base_ref}, trained {how}."
    elif meta.get("lora"):
        summary = f"{base_ref} with a LoRA fused into its weights, the whole pipeline; the LoRA was trained {how}."
    else:
        summary = f"{base_ref} with all of its weights fine-tuned {how}: the whole pipeline."
    lines = [
        f"# {name}", "", summary, "",
        "## Use", "", "```python",
        loading_snippet(meta, fmt, where, pipeline_class=pipeline_class, prompt=prompt,
                        steps=int(sampling.get("eval_num_steps", SamplingConfig.eval_num_steps)),
                        guidance_scale=float(sampling.get("guidance_scale", SamplingConfig.guidance_scale))),
        "```", "",
    ]
    if widget or images:
        lines += ["## Samples: before / after", ""]
    if widget:
        lines += [f"One prompt, the same noise: the base model (left) and the aligned model (right), drawn with the run's "
                  f"evaluation sampler ({widget['num_steps']} ODE steps, guidance scale {widget['guidance_scale']:g}, "
                  f"seed {widget['seed']}).", "", f"*{prompt}*", "", f"![before / after]({widget['image']})", ""]
    if "before" in images and "after" in images:
        lines += ["Evaluation grids of the base model (left) and the aligned model (right), same prompts and seed.", "",
                  "| before (base model) | after |", "|---|---|", f"| ![before]({images['before']}) | ![after]({images['after']}) |", ""]
    elif "after" in images:
        lines += ["Evaluation grid of the aligned model.", "", f"![after]({images['after']})", ""]
    evaluation = list(evaluation or [])
    has_table = any(line.startswith("|") for line in evaluation)  # ShapesWorld: intervals and paired differences
    lines += ["## Evaluation", ""] + evaluation + ([] if has_table else _eval_table(evals, differences) + [""])
    hparams = settings_in_effect(config, meta, resolution=(widget or {}).get("resolution"))
    lines += ["## Training", "", f"- base model: `{base}`" + _base_model_note(base, family, hub_base),
              f"- algorithm: `{algorithm}`", f"- reward: `{reward}`", f"- iterations: {meta.get('iterations')}",
              f"- weights: {_weights_exported(meta, fmt)}, {_weights_held(meta)}",
              "", "| hyperparameter | value |", "|---|---|"] + [f"| `{k}` | `{v}` |" for k, v in hparams.items()] + [""]
    lines += ["## License", "",
              _license_text(license, base), ""]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))


# ---- upload -------------------------------------------------------------------------------------
def upload_operations(folder: str | os.PathLike) -> list:
    """One ``CommitOperationAdd`` per file of ``folder`` (sorted, hidden files skipped). A symbolic
    link anywhere in the folder is refused: it could point at any file of this machine."""
    from huggingface_hub import CommitOperationAdd

    folder = Path(folder)
    if folder.is_symlink():
        raise DiffalignError(f"refusing to upload {str(folder)!r}: it is a symbolic link")
    files = []
    for root, dirs, names in os.walk(folder, followlinks=False):
        for name in dirs + names:
            p = Path(root) / name
            if p.is_symlink():
                raise DiffalignError(f"refusing to upload {str(folder)!r}: {p.relative_to(folder).as_posix()} is a symbolic link")
        files += [Path(root) / n for n in names]
    files = sorted(p for p in files if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    return [CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p)) for p in files]


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as set now (huggingface_hub reads it once at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        return bool(constants.HF_HUB_OFFLINE)
    return value.strip().upper() in constants.ENV_VARS_TRUE_VALUES


def check_push_target(repo_id: str) -> str:
    """Validate ``USER/REPO`` and that an upload can happen; returns the token.
    Raises :class:`DiffalignError` (one line) for a bad id, offline mode or a missing token."""
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise DiffalignError(f"--push-to-hub: invalid repo id {repo_id!r}: {str(e).splitlines()[0]}") from None
    if repo_id.count("/") != 1:
        raise DiffalignError(f"--push-to-hub: expected USER/REPO, got {repo_id!r}")
    if hub_offline():
        raise DiffalignError("--push-to-hub: HF_HUB_OFFLINE is set; unset it to upload, or export without --push-to-hub")
    token = get_token()
    if not token:
        raise DiffalignError("--push-to-hub needs a Hugging Face token: set HF_TOKEN or run `hf auth login`")
    return token


def push_folder(folder: str | os.PathLike, repo_id: str, *, token: str, private: bool = True,
                commit_message: str = "Upload with diffalign export") -> str:
    """Create ``repo_id`` if needed (private unless ``private=False``; it only applies to a new
    repo) and commit every file of ``folder`` in one commit. Returns the repo URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    operations = upload_operations(folder)
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.create_commit(repo_id, operations, commit_message=commit_message, repo_type="model")
    except Exception as e:  # HTTP errors, no permission, network: one line for the CLI
        first = (str(e).strip().splitlines() or [""])[0]
        raise DiffalignError(f"upload to {repo_id!r} failed ({type(e).__name__}: {first})") from e
    return str(url)
