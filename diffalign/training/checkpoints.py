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
from diffalign.config_files import dump_config, to_dict


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
        "config": to_dict(trainer.cfg),
    }


def save_checkpoint(trainer, next_iteration: int) -> None:
    """Write ``checkpoints/iter-N`` (a collective: every process calls it)."""
    optimizer_state = trainer.backend.optimizer_state()  # every process (ZeRO / FSDP gather their shards)
    main = trainer.accelerator.is_main_process
    if trainer.sharded or main:  # under FSDP gathering the tensors is a collective
        state = state_dict(trainer, next_iteration, optimizer_state)
    if main:
        runs.save_checkpoint(trainer.run_dir, next_iteration, state, trainer.cfg.checkpoint.keep_last)


def load_latest(trainer) -> int:
    """Restore the trainer from its run directory's latest checkpoint; returns its iteration."""
    ckpt = runs.latest_checkpoint(trainer.run_dir)
    if ckpt is None:
        raise runs.RunDirError(f"cannot resume {str(trainer.run_dir)!r}: it has no checkpoint yet")
    state = runs.load_checkpoint(ckpt)
    saved = state.get("config", {})
    current = to_dict(trainer.cfg)
    ignore = {"max_iterations", "output_dir", "log", "checkpoint", "eval"}
    changed = sorted(k for k in current if k not in ignore and saved.get(k) != current[k])
    if changed:
        trainer.log(f"warning: resuming with changed config sections: {', '.join(changed)}")
    names = dict(zip(trainer.trainable_names, trainer.trainable))
    missing = set(names) - set(state["trainable"])
    if missing:
        raise runs.RunDirError(f"checkpoint {str(ckpt)!r} does not match the model: {len(missing)} trainable tensors missing")
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
    iteration = state["iteration"]
    if trainer.accelerator.is_main_process:
        trainer.metrics.truncate_from(iteration)
        runs.atomic_write_text(trainer.run_dir / "config.yaml", dump_config(trainer.cfg))
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
    from diffalign.export import save_trained_weights

    cfg = trainer.cfg
    save_trained_weights(trainer.adapter, final, lora=cfg.lora.enabled, metadata={
        "base_model": cfg.model.id, "family": trainer.adapter.family, "model_options": dict(cfg.model.options),
        "algorithm": cfg.algorithm.name, "reward": cfg.reward.name,
        "iterations": iteration, "ema": trainer.ema is not None and cfg.eval.use_ema,
        "lora": to_dict(cfg.lora) if cfg.lora.enabled else None,
    })
