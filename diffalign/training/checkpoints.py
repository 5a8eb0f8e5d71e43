"""Run state: what a checkpoint holds, writing it, resuming from the latest, and the final weights.

A checkpoint holds the trainable tensors, the optimizer (ZeRO partitions gathered, FSDP shards
made full), EMA, every random state, the prompt sampler, counters, the recipe's own state
(``Trainer.extra_state``) and the config, so that a resumed run continues exactly.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from diffalign import distributed, runs
from diffalign.config_files import dump_config, to_dict, upgraded
from diffalign.export import save_trained_weights


def state_dict(trainer, next_iteration: int, optimizer_state: dict | None = None) -> dict:
    sharded = trainer.sharded
    return {
        "iteration": next_iteration,
        "trainable": {n: distributed.to_full(p) if sharded else p.detach().cpu().clone()
                      for n, p in zip(trainer.trainable_names, trainer.trainable)},
        "optimizer": optimizer_state if optimizer_state is not None else trainer.optimizer.state_dict(),
        "ema": (distributed.to_full(trainer.ema.state_dict()) if sharded else trainer.ema.state_dict()) if trainer.ema is not None else None,
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "generator": trainer.generator.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        },
        "prompts": trainer.prompt_sampler.state_dict(),
        "stats": dict(trainer.stats),
        "extra": trainer.extra_state(),
        "guard": trainer.guard.state_dict() if trainer.guard is not None else None,  # the reward-hacking guard's curves
        "config": to_dict(trainer.cfg),
        "metrics_records": trainer.metrics.count(),  # what metrics.jsonl held: a resume cuts it back to this
    }


def stream_state(trainer) -> dict:
    """What an iteration changes before its first update: the random streams, the prompt
    sampler, the recipe's state (copied)."""
    import copy

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "generator": trainer.generator.get_state(), "prompts": copy.deepcopy(trainer.prompt_sampler.state_dict()),
            "extra": copy.deepcopy(trainer.extra_state())}


def load_stream_state(trainer, state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    trainer.generator.set_state(state["generator"])
    trainer.prompt_sampler.load_state_dict(state["prompts"])
    trainer.load_extra_state(state["extra"])


def save_checkpoint(trainer, next_iteration: int) -> None:
    """Write ``checkpoints/iter-N`` (a collective: every process calls it)."""
    optimizer_state = trainer.backend.optimizer_state()  # every process (ZeRO / FSDP gather their shards)
    main = trainer.accelerator.is_main_process
    if trainer.sharded or main:  # under FSDP gathering the tensors is a collective
        state = state_dict(trainer, next_iteration, optimizer_state)
    if main:
        runs.save_checkpoint(trainer.run_dir, next_iteration, state, trainer.cfg.checkpoint.keep_last)


# What a resumed run may not change silently: another model, algorithm, LoRA shape or prompt set
# trains something else under the same run directory.
GUARDED_KEYS = ("model.id", "model.family", "algorithm.name", "lora.enabled", "lora.rank", "lora.targets", "prompts")
CHANGES_FILE = "config_changes.jsonl"  # changes accepted with --allow-config-change, one record per resume


def _lookup(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def guarded_changes(run_dir: Path, cfg) -> dict[str, tuple]:
    """``{key: (run's value, new value)}`` for the guarded keys that differ from the run's config.yaml."""
    import yaml

    try:
        saved = yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise runs.RunDirError(f"cannot resume {str(run_dir)!r}: its config.yaml cannot be read ({type(exc).__name__})") from None
    if not isinstance(saved, dict):
        raise runs.RunDirError(f"cannot resume {str(run_dir)!r}: its config.yaml is not a mapping")
    saved, current = upgraded(saved), to_dict(cfg)
    return {k: (_lookup(saved, k), _lookup(current, k)) for k in GUARDED_KEYS if _lookup(saved, k) != _lookup(current, k)}


def check_resume_config(run_dir: Path, cfg, allow_change: bool) -> dict[str, tuple]:
    """Refuse (one line) to resume with a guarded key changed unless ``allow_change``; returns the changes."""
    changes = guarded_changes(run_dir, cfg)
    if changes and not allow_change:
        def short(v):
            text = repr(v)
            return text if len(text) <= 40 else text[:37] + "..."

        what = "; ".join(f"{k} was {short(a)}, now {short(b)}" for k, (a, b) in changes.items())
        raise runs.RunDirError(f"cannot resume {str(run_dir)!r} with a different setup ({what}); "
                               f"pass --allow-config-change to resume anyway")
    return changes


def _log_changes(trainer, changes: dict[str, tuple], iteration: int) -> None:
    import json
    from datetime import datetime, timezone

    record = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "iteration": iteration,
              "changes": {k: {"was": a, "now": b} for k, (a, b) in changes.items()}}
    with open(trainer.run_dir / CHANGES_FILE, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")
    trainer.log(f"warning: resuming with changed {', '.join(changes)} (--allow-config-change; logged in {CHANGES_FILE})")


def _read_usable(trainer) -> tuple[Path, dict] | None:
    """The newest checkpoint that reads back whole; an unreadable one (truncated, altered, half
    written) is renamed ``corrupt-iter-N`` and the previous one is used, with a warning."""
    dirs = runs.checkpoint_dirs(trainer.run_dir)
    for i, ckpt in enumerate(reversed(dirs)):
        if (ckpt / "state.pt").is_file() and not (ckpt / "state.json").is_file():
            runs.load_checkpoint(ckpt)  # raises: old pickle format, refused
        try:
            return ckpt, runs.load_checkpoint(ckpt)
        except runs.RunDirError as exc:
            older = dirs[-i - 2] if i + 1 < len(dirs) else None
            if trainer.accelerator.is_main_process:
                ckpt.rename(ckpt.with_name(f"corrupt-{ckpt.name}"))
            trainer.log(f"warning: {exc}; " + (f"falling back to {older.name}" if older is not None else "no earlier checkpoint")
                        + f" (kept as corrupt-{ckpt.name})")
    return None


def load_latest(trainer) -> int | None:
    """Restore the trainer from its run directory's latest readable checkpoint; returns its
    iteration. With no checkpoint at all (a run stopped before its first one) the run starts over
    from iteration 0, which is what the uninterrupted run did: returns None."""
    changes = check_resume_config(trainer.run_dir, trainer.cfg, trainer.allow_config_change)
    if trainer.accelerator.is_main_process:
        for p in runs.clean_partial_writes(trainer.run_dir):
            trainer.log(f"removed {p.name}, left by an interrupted write")
    trainer.accelerator.wait_for_everyone()
    found = _read_usable(trainer)
    if found is None:
        if trainer.accelerator.is_main_process:
            trainer.metrics.truncate(records=0)
            runs.atomic_write_text(trainer.run_dir / "config.yaml", dump_config(trainer.cfg))
            if changes:
                _log_changes(trainer, changes, 0)
        trainer.log(f"no checkpoint in {trainer.run_dir}: starting over from iteration 0")
        return None
    ckpt, state = found
    saved = upgraded(state.get("config", {}))
    current = to_dict(trainer.cfg)
    ignore = {"max_iterations", "output_dir", "log", "checkpoint", "eval"}
    changed = sorted(k for k in current if k not in ignore and saved.get(k) != current[k])
    if changed:
        trainer.log(f"warning: resuming with changed config sections: {', '.join(changed)}")
    names = dict(zip(trainer.trainable_names, trainer.trainable))
    missing = set(names) - set(state["trainable"])
    if missing:
        raise runs.RunDirError(f"checkpoint {str(ckpt)!r} does not match the model: {len(missing)} trainable tensors missing")
    for n, p in names.items():
        full = tuple(p.shape)  # a DTensor's shape is the global one
        if tuple(state["trainable"][n].shape) != full:
            raise runs.RunDirError(f"checkpoint {str(ckpt)!r} does not match the model: {n} has shape "
                                   f"{tuple(state['trainable'][n].shape)} there, {full} here")
    with torch.no_grad():
        for n, p in names.items():
            p.copy_(distributed.shard_like(state["trainable"][n].to(p.dtype), p))
    trainer.backend.load_optimizer_state(state["optimizer"], str(ckpt))
    if trainer.ema is not None and state["ema"] is not None:
        ema = state["ema"]
        if trainer.sharded:
            ema = {**ema, "shadow": [distributed.shard_like(v, s) for v, s in zip(ema["shadow"], trainer.ema.shadow)]}
        trainer.ema.load_state_dict(ema)
    rng = state["rng"]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    trainer.generator.set_state(rng["generator"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    trainer.prompt_sampler.load_state_dict(state["prompts"])
    trainer.stats.update(state["stats"])
    trainer.load_extra_state(state.get("extra") or {})
    if trainer.guard is not None and state.get("guard"):
        trainer.guard.load_state_dict(state["guard"])
    iteration = state["iteration"]
    if trainer.accelerator.is_main_process:
        records = state.get("metrics_records")
        if records is not None:
            trainer.metrics.truncate(records=records, warn=trainer.log)
        else:
            trainer.metrics.truncate(iteration=iteration, warn=trainer.log)
        runs.atomic_write_text(trainer.run_dir / "config.yaml", dump_config(trainer.cfg))
        if changes:
            _log_changes(trainer, changes, iteration)
    trainer.log(f"resumed from {ckpt} at iteration {iteration}")
    return iteration


def save_final(trainer, iteration: int) -> Path:
    """``final/``: LoRA weights (``pipeline.load_lora_weights(final/)``) or the full pipeline
    (``DiffusionPipeline.from_pretrained(final/)``), the EMA weights when eval uses them."""
    final = trainer.run_dir / "final"
    acc = trainer.accelerator
    if trainer.sharded:  # every process gathers the full weights; the main one writes them
        with trainer.eval_weights(), distributed.full_parameters(trainer.adapter.denoiser, swap=acc.is_main_process):
            if acc.is_main_process:
                _save_weights(trainer, final, iteration)
        acc.wait_for_everyone()
        return final
    if acc.is_main_process:
        with trainer.eval_weights():
            _save_weights(trainer, final, iteration)
    return final


def _save_weights(trainer, final: Path, iteration: int) -> None:
    cfg = trainer.cfg
    save_trained_weights(trainer.adapter, final, lora=cfg.lora.enabled, metadata={
        "base_model": cfg.model.id, "family": trainer.adapter.family, "model_options": dict(cfg.model.options),
        "algorithm": cfg.algorithm.name, "reward": cfg.reward.name,
        "iterations": iteration, "ema": trainer.ema is not None and cfg.eval.use_ema,
        # which weights final/ holds: the EMA's (with how many averages it has taken) or the last trained
        "weights": "ema" if trainer.ema is not None and cfg.eval.use_ema else "last",
        "ema_decay": cfg.train.ema.decay if trainer.ema is not None else None,
        "ema_updates": trainer.ema.updates if trainer.ema is not None else None,
        "lora": to_dict(cfg.lora) if cfg.lora.enabled else None,
    })
