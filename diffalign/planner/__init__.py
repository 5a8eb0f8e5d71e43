"""GPU memory planner: what a recipe needs per GPU, before anything loads (docs/memory.md).

``plan_config(cfg, gpus)`` counts the recipe's real architectures on the meta device
(``components``), the trainable state of its LoRA or full fine-tuning, optimizer, EMA and sharding,
and the activations of its micro-batches from measured per-block figures (``activations.json``);
``suggestions`` tries the settings that lower the peak, one change and then pairs, and
``format_plan`` prints the table ``diffalign plan`` shows.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

from diffalign import distributed

from diffalign.planner.memory import GB, Line, Plan, Settings, plan
from diffalign.training.text_encoders import PLACEMENTS

__all__ = ["GB", "Line", "Plan", "Settings", "first_fit", "fit_table", "format_plan", "plan", "plan_config", "suggestions"]

DEEPSPEED_STAGE_ENV = "ACCELERATE_DEEPSPEED_ZERO_STAGE"  # set by accelerate launch with a DeepSpeed config
GPU_SIZES_GB = (24, 40, 48, 80)  # the cards docs/memory.md sizes recipes for


def plan_config(cfg, gpus: int = 1) -> Plan:
    """The plan of a run config on ``gpus`` processes."""
    return plan(Settings.from_config(cfg, gpus))


def _changes(s: Settings) -> list[tuple[str, dict]]:
    """Single changes that lower memory, in the order a user would try them, as (override, fields)."""
    out = []
    if not s.checkpointing:
        out.append(("train.gradient_checkpointing=true", {"checkpointing": True}))
    for placement in ("cache", "offload"):
        if s.text_encoders == "resident":
            out.append((f"model.text_encoders={placement}", {"text_encoders": placement}))
    if not s.use_8bit_adam:
        out.append(("optim.use_8bit_adam=true", {"use_8bit_adam": True}))
    batch = s.batch_size // 2
    while batch >= 1:
        out.append((f"train.batch_size={batch}", {"batch_size": batch}))
        batch //= 2
    if s.lora and s.rank > 8:
        out.append((f"lora.rank={s.rank // 4}", {"rank": s.rank // 4}))
    if s.sample_batch_size > 1:
        out.append((f"rollout.sample_batch_size={max(s.sample_batch_size // 2, 1)}", {"sample_batch_size": max(s.sample_batch_size // 2, 1)}))
    if s.gpus > 1 and not s.fsdp and not s.zero_stage:
        out.append(("train.zero_stage=2", {"zero_stage": 2}) if s.lora else ("train.fsdp=true", {"fsdp": True}))
    for gpus in (2, 4, 8):
        if gpus > s.gpus:
            if s.lora:
                out.append((f"--gpus {gpus} train.zero_stage=2", {"gpus": gpus, "zero_stage": 2}))
            else:
                out.append((f"--gpus {gpus} train.fsdp=true", {"gpus": gpus, "fsdp": True}))
    return out


def suggestions(s: Settings, limit_bytes: float, max_changes: int = 3) -> list[tuple[str, Plan]]:
    """Settings that fit ``limit_bytes``: every single change that fits, else the fitting pairs,
    then triples (fewest changes first, each with its plan)."""
    changes = _changes(s)
    for n in range(1, max_changes + 1):
        found = []
        for combo in itertools.combinations(changes, n):
            fields: dict = {}
            for _, f in combo:
                if any(k in fields for k in f):
                    break
                fields.update(f)
            else:
                p = plan(dataclasses.replace(s, **fields))
                if p.peak <= limit_bytes:
                    found.append((" ".join(c for c, _ in combo), p))
        if found:
            return found
    return []


def first_fit(s: Settings, limit_bytes: float) -> tuple[str, Plan] | None:
    fits = suggestions(s, limit_bytes)
    return fits[0] if fits else None


def format_plan(p: Plan, gpu_memory_gb: float | None = None, name: str = "") -> str:
    """The plan as text: the peak phase's lines (bytes, how obtained, note), the other phases'
    totals, and, when ``gpu_memory_gb`` is given and the peak exceeds it, settings that fit."""
    s = p.settings
    head = (f"{name or s.model_id}: {s.family}, {s.resolution} px, {'LoRA r ' + str(s.rank) if s.lora else 'full fine-tuning'}, "
            f"micro-batch {s.batch_size}{' x2 (CFG)' if s.cfg_rows == 2 else ''}, checkpointing {'on' if s.checkpointing else 'off'}, "
            f"text encoders {s.text_encoders}, {s.gpus} GPU{'s' if s.gpus > 1 else ''}"
            f"{f', ZeRO-{s.zero_stage}' if s.zero_stage else ''}{', FSDP2' if s.fsdp else ''}"
            f"{f', context parallel {s.context_parallel}' if s.context_parallel > 1 else ''}")
    out = [head, f"per GPU (each of {s.gpus}), phase '{p.peak_phase}' is the peak:"]
    width = max(len(line.name) for line in p.phases[p.peak_phase])
    for line in p.phases[p.peak_phase]:
        out.append(f"  {line.name:<{width}}  {line.bytes / GB:8.2f} GB  {line.how:<8}  {line.note}".rstrip())
    out.append(f"  {'peak':<{width}}  {p.peak / GB:8.2f} GB")
    out.append("  phases: " + ", ".join(f"{phase} {p.total(phase) / GB:.1f} GB" for phase in p.phases))
    if gpu_memory_gb is not None:
        limit = gpu_memory_gb * GB
        if p.peak <= limit:
            out.append(f"fits a {gpu_memory_gb:g} GB GPU ({(limit - p.peak) / GB:.1f} GB spare)")
        else:
            fits = suggestions(s, limit)
            out.append(f"does not fit a {gpu_memory_gb:g} GB GPU; settings that fit:" if fits else
                       f"does not fit a {gpu_memory_gb:g} GB GPU, and no combination of up to 3 changes fits")
            out.extend(f"  {change}  ->  {q.peak / GB:.1f} GB" for change, q in fits[:8])
    return "\n".join(out)


def fit_table(s: Settings, sizes_gb=GPU_SIZES_GB) -> list[tuple[str, float, str]]:
    """``(settings, peak GB, smallest GPU of sizes_gb it fits or '-')`` for each combination of
    gradient checkpointing, text-encoder placement, 8-bit AdamW and LoRA / full fine-tuning."""
    rows = []
    for lora, ckpt, placement, adam8 in itertools.product((True, False), (False, True), PLACEMENTS, (False, True)):
        p = plan(dataclasses.replace(s, lora=lora, checkpointing=ckpt, text_encoders=placement, use_8bit_adam=adam8))
        fit = next((f"{g} GB" for g in sizes_gb if p.peak <= g * GB), "-")
        label = (f"{'LoRA r ' + str(s.rank) if lora else 'full'}, ckpt {'on' if ckpt else 'off'}, encoders {placement}, "
                 f"{'8-bit AdamW' if adam8 else 'AdamW'}")
        rows.append((label, p.peak / GB, fit))
    return rows


def check_fits(cfg, processes: int, free_bytes: dict[str, int]) -> str | None:
    """None when the plan of ``cfg`` on ``processes`` fits every device's free memory in ``free_bytes``;
    else the one line ``diffalign train`` stops with: the estimate, the free memory and the first
    setting that fits. FSDP and the ZeRO stage are read as the optimisation backend reads them (the
    run config, or the launch's accelerate config)."""
    s = Settings.from_config(cfg, processes)
    # a launch's accelerate config may ask for FSDP or a ZeRO stage that the run config does not name
    s = dataclasses.replace(s, fsdp=distributed.fsdp_requested(cfg.train.fsdp, cfg.train.zero_stage),
                            zero_stage=s.zero_stage or int(os.environ.get(DEEPSPEED_STAGE_ENV, "0") or 0))
    p = plan(s)
    device, free = min(free_bytes.items(), key=lambda kv: kv[1])
    if p.peak <= free:
        return None
    fit = first_fit(s, free)
    hint = f"first setting that fits: {fit[0]} ({fit[1].peak / GB:.1f} GB)" if fit else "no setting of up to 3 changes fits"
    return (f"the memory plan needs {p.peak / GB:.1f} GB per GPU ({p.peak_phase} phase) but {device} has {free / GB:.1f} GB free; "
            f"{hint} (diffalign plan shows the details; --no-plan-check skips this check)")
