"""The optimisation backend: the optimizer and its step on one process, DDP, ZeRO-1/2 or FSDP.

Losses are normalised by the global number of terms of an optimizer step, so gradients are summed
over micro-batches and processes. A non-finite loss poisons its step on every process: the step
is dropped and counted, and too many in a row stop the run (``train.max_nonfinite_losses``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from diffalign import distributed
from diffalign.errors import ConfigError, NonFiniteError
from diffalign.runs import RunDirError
from diffalign.training.policy import EMA


def make_optimizer(params: list, opt) -> torch.optim.Optimizer:
    """The optimizer of ``optim.name`` over ``params``: torch AdamW (bitsandbytes AdamW8bit with
    ``optim.use_8bit_adam``) or plain SGD, whose step is linear in the gradients."""
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    if opt.use_8bit_adam:
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError("config key 'optim.use_8bit_adam' needs bitsandbytes (pip install 'diffalign[gpu]')") from None
        optim_cls = bnb.optim.AdamW8bit
    else:
        optim_cls = torch.optim.AdamW
    return optim_cls(params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)


def lr_factor(iteration: int, total: int, schedule: str = "constant", warmup: int = 0, min_fraction: float = 0.0) -> float:
    """Multiplier of ``optim.lr`` for (0-based) ``iteration`` of ``total``: a linear warm-up over the
    first ``warmup`` iterations (iteration i gets (i + 1) / (warmup + 1)), then ``schedule`` from 1 down to
    ``min_fraction``, reached by the last iteration (constant: 1 throughout)."""
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown lr schedule {schedule!r}")
    if warmup > 0 and iteration < warmup:
        return (iteration + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    span = total - 1 - warmup
    progress = min(max((iteration - warmup) / span, 0.0), 1.0) if span > 0 else 0.0
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_fraction + (1.0 - min_fraction) * shape


def allow_precision(mixed_precision: str) -> None:
    """accelerate keeps one precision per process. A single, unlaunched process may run trainers of
    different precisions in turn (benchmarks, tests): forget the earlier one's. A launched
    multi-process run keeps accelerate's check."""
    from accelerate.state import AcceleratorState, PartialState

    if not AcceleratorState._shared_state or AcceleratorState._shared_state.get("_mixed_precision") in (None, mixed_precision):
        return
    if PartialState().num_processes == 1:
        AcceleratorState._reset_state()


@dataclass
class OptimizerStep:
    """One optimizer step of an update epoch, as planned by :meth:`Backend.plan_steps`."""

    micro: np.ndarray  # indices of its micro-batches in the epoch's list, consecutive
    global_terms: float  # its loss terms summed over processes: each micro-batch's loss sum is divided by this
    forwards: int  # micro-batches every process runs (FSDP: the global maximum; the extra ones are zero-loss forwards)


class Backend:
    """Trainable parameters, optimizer (plain, DeepSpeed ZeRO engine, or FSDP-sharded) and EMA.

    ``stats`` is the trainer's counter dict (``nonfinite_losses`` and ``skipped_steps`` are counted here)."""

    def __init__(self, denoiser: torch.nn.Module, cfg, accelerator, device, *, supports_fsdp: bool,
                 stats: dict, log: Callable[[str], None]):
        self.cfg = cfg
        self.accelerator = accelerator
        self.device = device
        self.stats = stats
        self.consecutive_bad_steps = 0
        self.fsdp_units = None
        fsdp = distributed.fsdp_requested(cfg.train.fsdp, cfg.train.zero_stage)
        if fsdp and not supports_fsdp:
            raise ConfigError(f"config key 'train.fsdp': algorithm {cfg.algorithm.name!r} does not support FSDP yet "
                              "(flow_grpo and stepwise_flow_grpo do); use train.zero_stage=2")
        settings = distributed.fsdp_settings() if fsdp else None  # read with one process too: bad settings stop anyway
        if fsdp and accelerator.num_processes > 1:  # one process: nothing to shard
            self.fsdp_units = distributed.shard_denoiser(denoiser, device, accelerator.num_processes, settings)
            log(f"FSDP: {len(self.fsdp_units)} units over {accelerator.num_processes} processes"
                f"{'' if settings.reshard_after_forward else ' (weights kept gathered between forward and backward)'}")
        self.trainable_names = [n for n, p in denoiser.named_parameters() if p.requires_grad]
        self.trainable = [p for p in denoiser.parameters() if p.requires_grad]
        if not self.trainable:
            raise ConfigError("config key 'lora' leaves no trainable parameters")
        self.optimizer = make_optimizer(self.trainable, cfg.optim)
        self.ds_engine = None
        stage = distributed.zero_stage(cfg.train.zero_stage, accelerator, mixed_precision=cfg.train.mixed_precision)
        if stage:
            # The rollouts call the raw denoiser (ZeRO-1/2 keep full weights on every process); the
            # engine owns the gradient reduction, clipping and the sharded optimizer step.
            self.ds_engine, self.optimizer = distributed.initialize(
                denoiser, self.optimizer, stage, accelerator.num_processes, batch_size=cfg.train.batch_size,
                grad_clip=cfg.optim.grad_clip)
            log(f"DeepSpeed ZeRO-{stage} over {accelerator.num_processes} processes")
        elif self.fsdp_units is None:  # under FSDP the plain optimizer steps the sharded parameters
            self.optimizer = accelerator.prepare(self.optimizer)
        self.ema = EMA(self.trainable, cfg.train.ema.decay, cfg.train.ema.every) if cfg.train.ema.enabled else None

    @property
    def sharded(self) -> bool:
        """FSDP: every process must run the same forwards (evaluation included)."""
        return self.fsdp_units is not None

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate one micro-batch's gradients."""
        if self.ds_engine is not None:
            distributed.backward(self.ds_engine, loss, self.accelerator.num_processes)
        else:
            self.accelerator.backward(loss)

    def discard_gradients(self) -> None:
        """Drop the accumulated gradients without a step (a non-finite loss poisoned them)."""
        if self.ds_engine is not None:
            distributed.discard(self.ds_engine, self.trainable)
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def lockstep_counts(self, counts: list[int]) -> list[int]:
        """How many micro-batches every process must run per optimizer step: the global maximum of
        ``counts`` under FSDP (processes with fewer run zero-loss forwards), else ``counts``."""
        if not self.sharded:
            return list(counts)
        import torch.distributed as dist

        t = torch.tensor(counts, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def plan_steps(self, terms: list[int]) -> list[OptimizerStep]:
        """Split an epoch's micro-batches (``terms[m]``: loss terms of micro-batch m on this process)
        into ``train.optimizer_steps_per_iteration`` optimizer steps of consecutive micro-batches.
        Each step carries its number of terms summed over processes, so that its loss is the global
        mean whatever the process count; steps with no term on any process are left out."""
        groups = np.array_split(np.arange(len(terms)), self.cfg.train.optimizer_steps_per_iteration)
        local = torch.tensor([sum(terms[m] for m in grp) for grp in groups], dtype=torch.float64)
        total = self.accelerator.reduce(local.to(self.device), reduction="sum").cpu() if self.accelerator.num_processes > 1 else local
        # the processes of a context-parallel group hold the same samples: their terms count once
        # (and their gradients, each the part through its own tokens, are summed in optimizer_step)
        total = total / self.cfg.train.context_parallel
        forwards = self.lockstep_counts([len(grp) for grp in groups])
        return [OptimizerStep(grp, float(n), f) for grp, n, f in zip(groups, total, forwards) if n != 0]

    def accumulate(self, loss: torch.Tensor) -> bool:
        """Backward one micro-batch's loss and return True; a non-finite loss is counted, its
        gradients never reach the parameters, and False marks the step as poisoned. Under FSDP a
        zero backward still runs so that every process takes part in the same collectives."""
        if torch.isfinite(loss):
            self.backward(loss)
            return True
        self.stats["nonfinite_losses"] += 1
        if self.sharded:
            self.backward(torch.nan_to_num(loss) * 0.0)
        return False

    def set_lr_factor(self, factor: float) -> float:
        """Scale every parameter group's learning rate to ``factor`` x its configured one (kept as
        ``initial_lr``, as torch's schedulers do, so the factor never compounds); returns the first
        group's new rate."""
        groups = self.optimizer.param_groups
        for group in groups:
            group.setdefault("initial_lr", group["lr"])
            group["lr"] = group["initial_lr"] * factor
        return float(groups[0]["lr"])

    def close_step(self, poisoned: bool) -> tuple[float, bool]:
        """End one optimizer step's accumulation: every process learns whether any of them saw a
        non-finite loss; if so the gradients are dropped and the step counted as skipped, else
        :meth:`optimizer_step` runs. Returns (grad_norm, applied); NaN for a dropped step."""
        if self.accelerator.num_processes > 1:  # every process must skip together
            flag = torch.tensor(float(poisoned), device=self.device)
            poisoned = bool(self.accelerator.reduce(flag, reduction="sum") > 0)
        if poisoned:
            self.discard_gradients()
            return self.bad_step(float("nan"), "losses")
        return self.optimizer_step()

    def optimizer_step(self) -> tuple[float, bool]:
        """Clip, check and apply the accumulated gradients. Returns (grad_norm, applied)."""
        params = self.trainable
        if self.ds_engine is not None:  # the engine reduces, clips, checks and steps
            norm, applied = distributed.step(self.ds_engine, params)
            if not applied:
                return self.bad_step(norm)
        else:
            if self.fsdp_units is not None:  # gradients already reduce-scattered (summed) by FSDP
                norm = distributed.fsdp_grad_norm_clip(params, self.cfg.optim.grad_clip)
            else:
                if self.accelerator.num_processes > 1:
                    # Losses are normalised by global term counts, so the global gradient is the sum.
                    import torch.distributed as dist

                    for p in params:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                if self.cfg.optim.grad_clip > 0:
                    norm = float(self.accelerator.clip_grad_norm_(params, self.cfg.optim.grad_clip))
                else:
                    norm = float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None)))
            if not math.isfinite(norm):
                self.optimizer.zero_grad(set_to_none=True)
                return self.bad_step(norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.consecutive_bad_steps = 0
        if self.ema is not None:
            self.ema.update()
        return norm, True

    def bad_step(self, norm: float, what: str = "gradients") -> tuple[float, bool]:
        """Count a skipped step; raise ``NonFiniteError`` after too many in a row."""
        self.stats["skipped_steps"] += 1
        self.consecutive_bad_steps += 1
        if self.consecutive_bad_steps > self.cfg.train.max_nonfinite_losses:
            # every process counts the same steps (close_step and the global gradient norm agree on
            # each), so every process stops here together
            stop = NonFiniteError(f"{self.consecutive_bad_steps} consecutive optimizer steps had non-finite {what}; stopping"
                                  " (lower optim.lr or check the reward)")
            stop.agreed = True
            raise stop
        return norm, False

    # ---- state ----------------------------------------------------------------------------------
    def optimizer_state(self) -> dict | None:
        """The optimizer's state; with ZeRO every process's partition, gathered on the main process
        (a collective: every process calls it). None on the other processes."""
        if self.ds_engine is not None:
            return distributed.gather_optimizer_state(self.optimizer, self.accelerator.is_main_process)
        if self.sharded:
            return distributed.to_full(self.optimizer.state_dict())
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict, where: str) -> None:
        """Load a checkpoint's optimizer state (``where`` names the checkpoint in errors)."""
        if self.ds_engine is not None:
            distributed.load_optimizer_state(self.optimizer, state, where)
        elif distributed.is_zero_state(state):
            raise RunDirError(f"checkpoint {where!r} holds ZeRO optimizer partitions: resume it with train.zero_stage "
                              f"{state['zero_stage']}")
        elif self.sharded:
            self.optimizer.load_state_dict(distributed.shard_optimizer_state(state, self.optimizer))
        else:
            self.optimizer.load_state_dict(state)
