"""Training and evaluation prompts: which prompts a run uses, and the order it visits them in.

:func:`resolve_prompts` turns ``cfg.prompts`` (ShapesWorld's split, an inline list or prompt files)
into (train, eval) lists; :class:`PromptSampler` cycles through the train prompts in a fresh
random order every epoch, deterministic per seed, with ``state_dict`` for exact resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from diffalign.config import RunConfig
from diffalign.errors import ConfigError


class PromptSampler:
    """Cycles through the prompts in a fresh random order every epoch; deterministic per seed."""

    def __init__(self, prompts: Sequence[str], seed: int):
        if not prompts:
            raise ConfigError("config key 'prompts' yields no training prompts")
        self.prompts = list(prompts)
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(len(self.prompts))
        self.pos = 0
        self.epoch = 0

    def next(self, n: int) -> list[str]:
        out = []
        for _ in range(n):
            if self.pos == len(self.order):
                self.order = self.rng.permutation(len(self.prompts))
                self.pos = 0
                self.epoch += 1
            out.append(self.prompts[self.order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "order": self.order.tolist(), "pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.order = np.asarray(state["order"])
        self.pos = state["pos"]
        self.epoch = state["epoch"]


def resolve_prompts(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """(train prompts, eval prompts) from ``cfg.prompts``."""
    p = cfg.prompts
    if p.source == "shapes":
        from diffalign.shapes import prompt_family, split_prompts, validation_split

        split = split_prompts()
        train, heldout = validation_split(split) if p.evaluate_on == "validation" else (split.train, split.evaluation())
        if p.families:
            unknown = sorted(set(p.families) - {prompt_family(x) for x in train + heldout})
            if unknown:
                raise ConfigError(f"config key 'prompts.families' has unknown families: {', '.join(unknown)}")
            train = [x for x in train if prompt_family(x) in p.families]
            heldout = [x for x in heldout if prompt_family(x) in p.families]
        if p.balance_families:
            # Repeat each family's prompts up to the largest family's count, so that an epoch of the
            # prompt sampler visits every family about equally often.
            by_family: dict[str, list[str]] = {}
            for x in train:
                by_family.setdefault(prompt_family(x), []).append(x)
            largest = max(len(v) for v in by_family.values())
            train = [v[i % len(v)] for v in by_family.values() for i in range(largest)]
        return train, heldout
    if p.source == "list":
        return list(p.train), list(p.eval or p.train)

    def read(path: str, key: str) -> list[str]:
        f = Path(path)
        if not f.is_file():
            raise ConfigError(f"config key '{key}': prompt file {path!r} does not exist")
        lines = [line.strip() for line in f.read_text().splitlines() if line.strip()]
        if not lines:
            raise ConfigError(f"config key '{key}': prompt file {path!r} is empty")
        return lines

    train = read(p.file, "prompts.file")
    return train, read(p.eval_file, "prompts.eval_file") if p.eval_file else train


def resolve_probe_prompts(cfg: RunConfig) -> list[str]:
    """The generalisation probe's prompts (``split_prompts().probe``, restricted to
    ``prompts.families`` when set) for ``prompts.source: shapes`` with ``eval.probe``; else [] (also
    when tuning on validation prompts: the probe informs no choice)."""
    if cfg.prompts.source != "shapes" or not cfg.eval.probe or cfg.prompts.evaluate_on == "validation":
        return []
    from diffalign.shapes import prompt_family, split_prompts

    probe = split_prompts().probe
    return [x for x in probe if prompt_family(x) in cfg.prompts.families] if cfg.prompts.families else list(probe)
