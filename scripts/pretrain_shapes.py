"""Pretrain the embedded shapes text-to-image model from scratch on CPU.

Rectified-flow matching in pixel space (32x32, no VAE) on images rendered on the fly from
:mod:`diffalign.shapes.world`, conditioned on the TRAIN split's prompts only (held-out
colour-shape combinations are never seen), with ``--uncond-prob`` empty prompts for CFG.

    x0 = 2 * image - 1,  eps ~ N(0, I),  u ~ U(0, 1),  t = s u / (1 + (s - 1) u)  (s: --timestep-shift)
    x_t = (1 - t) * x0 + t * eps,  loss = || v_theta(x_t, t, c) - (eps - x0) ||^2

Reproduce the shipped model (diffalign/assets/shapes-t2i): a BERT prompt encoder, noise levels
drawn through a shift of 2 and position prompts twice as often (:data:`SHIPPED_RECIPE`), saved at
step 4,500 of the 5,500-step schedule; resumable at any point from the training state that
``--state-dir`` keeps (safetensors + JSON, no pickle)::

    python scripts/pretrain_shapes.py --text-encoder bert --timestep-shift 2 --family-weights position=2 --until 4500 \\
        --out diffalign/assets/shapes-t2i --state-dir scripts/pretrain_state/shapes-t2i-bert
    # interrupted? the same command with --resume continues exactly where the state was saved

A state is full (``state.json``: ``"kind": "full"``; weights, EMA, Adam moments, schedule, RNGs;
about 74 MB for the shipped model) or, with ``--light-state``, light (no Adam moments; about 37 MB).
``--resume`` continues a full state exactly; from a light one it says so in one line, starts Adam
with fresh moments and re-warms the rate linearly from 0 over ``--rewarm-steps`` (default: the
warm-up), and otherwise continues (step, schedule, EMA, RNGs). ``state.json`` records the schedule
(:class:`Schedule`), which a resume follows whatever the flags say.

``--extend-to N`` (with ``--resume``) continues a run beyond its schedule's end, to N steps in all:
from the resumed step the rate goes linearly from its current value to ``--final-lr-fraction`` x
``--lr`` at step N (continuous and non-increasing: every checkpoint on the way sits on one decay),
recorded in the state so that a later ``--resume`` follows it exactly; repeating the same N is a
no-op, so every piece can run the same command with its own ``--until``. ``--save-every K`` keeps
the state of every K-th step beside ``--state-dir`` (``<state-dir>-step<STEP>``, light unless
``--full-snapshots``), each exportable. Continuing the shipped state to 12,000 steps in pieces, a
checkpoint every 500 steps (on a copy: ``runs/`` is not tracked)::

    mkdir -p runs/pretrain && cp -r scripts/pretrain_state/shapes-t2i-bert runs/pretrain/bert-12k
    RECIPE="--text-encoder bert --timestep-shift 2 --family-weights position=2"
    EXTEND="--state-dir runs/pretrain/bert-12k --resume --extend-to 12000 --save-every 500 --no-eval --out runs/pretrain/bert-12k-model"
    python scripts/pretrain_shapes.py $RECIPE $EXTEND --until 6000   # then --until 7500, 9000, ... or none: to 12,000
    python scripts/pretrain_shapes.py $RECIPE --state-dir runs/pretrain/bert-12k-step006000 --resume --export-only \\
        --no-eval --out runs/pretrain/bert-6000   # a checkpoint's EMA model, for `diffalign eval --prompts validation`

(The state of the model shipped before, with the defaults' causal CLIP encoder, is in the history:
``git checkout b163d1d -- scripts/pretrain_state/shapes-t2i-xattn16-pooled``; the one before it, with cross-attention at 8x8 only, is in the
history (``git checkout 0b277bd -- scripts/pretrain_state/shapes-t2i``): ``--cross-attention-levels 1``
resumes it.)

Prints the loss while training and, at the end, the ShapesEval accuracy per family on held-out
and train prompts, sampled from the saved model with the pipeline's Euler ODE sampler.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

try:  # run from a source checkout without `pip install -e .`
    import diffalign  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffalign import progress  # noqa: E402 (after the source-checkout path)
from diffalign.shapes.model import TEXT_ENCODERS  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="diffalign/assets/shapes-t2i", help="save_pretrained folder")
    p.add_argument("--steps", type=int, default=5500, help="optimizer steps (the shipped model's budget)")
    p.add_argument("--minutes", type=float, default=None, help="also stop after this much wall time")
    p.add_argument("--until", type=int, default=None,
                   help="stop at this step (state saved; the schedule still runs to its end, --steps or "
                        "--extend-to's N): a planned interruption")
    p.add_argument("--extend-to", type=int, default=None, metavar="N",
                   help="with --resume: continue the state's run to N steps in all, beyond its schedule's end; from the "
                        "resumed step the rate goes linearly from its current value to --final-lr-fraction x lr at step "
                        "N (recorded in the state; repeating the same N is a no-op, so the pieces can share a command)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps, then constant")
    p.add_argument("--decay-steps", type=int, default=2500,
                   help="the last N of --steps decay the rate linearly to --final-lr-fraction of --lr")
    p.add_argument("--final-lr-fraction", type=float, default=0.1)
    p.add_argument("--mixed-precision", choices=("no", "bf16"), default="bf16",
                   help="bf16 autocast for the forward (loss and optimizer in fp32); about 1.5x on CPUs with avx512_bf16/AMX")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--ema-decay", type=float, default=0.999, help="EMA of weights that gets saved (0: off)")
    p.add_argument("--uncond-prob", type=float, default=0.1, help="share of empty prompts (for CFG)")
    p.add_argument("--timestep-shift", type=float, default=1.0,
                   help="draw t = s u / (1 + (s-1) u), u ~ U(0, 1): s > 1 trains more at high noise, where the layout "
                        "is decided, as the sampler's shift samples more there (1: uniform t, the shipped model)")
    p.add_argument("--family-weights", default="",
                   help="draw families in these proportions instead of uniformly, e.g. 'color_attr=3,position=2' "
                        "(unnamed families weigh 1); a curriculum for continuing a model on its weakest families")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a tiny architecture (for tests), not the shipped one")
    p.add_argument("--no-text-time-embedding", action="store_true",
                   help="architecture: no attention-pooled text vector in the time embedding (the prompt reaches "
                        "the UNet through cross-attention only)")
    p.add_argument("--cross-attention-levels", type=int, default=DEFAULT_ARCHITECTURE["cross_attention_levels"],
                   help="architecture: cross-attention at the lowest N resolution levels (1: 8x8 only; 2: also 16x16)")
    p.add_argument("--text-encoder", choices=TEXT_ENCODERS, default=DEFAULT_ARCHITECTURE["text_encoder"],
                   help="architecture: the prompt encoder (clip: causal CLIPTextModel, the model shipped before; "
                        "bert: bidirectional BertModel with absolute positions, the shipped model's, in which the first "
                        "shape of 'a circle left of a square' also sees the relation word; t5: bidirectional "
                        "T5EncoderModel, relative positions only)")
    p.add_argument("--coordinate-channels", action="store_true",
                   help="architecture: two extra UNet input channels with each pixel's x and y (CoordConv)")
    p.add_argument("--init-from", default=None,
                   help="start from this saved model (a --out folder) instead of random weights; a plain UNet "
                        "widens into a --coordinate-channels one with its new input weights at zero")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--state-dir", default=None,
                   help="keep the exact training state here (weights, EMA, Adam moments, schedule, RNGs), "
                        "rewritten atomically every --ckpt-every steps and at the end")
    p.add_argument("--light-state", action="store_true",
                   help="save the --state-dir state without the Adam moments (half the size); a resume from it "
                        "starts Adam afresh with a re-warm-up of the rate (--rewarm-steps) instead of exactly")
    p.add_argument("--ckpt-every", type=int, default=500, help="save the state (and quick-eval) every N steps")
    p.add_argument("--save-every", type=int, default=None, metavar="K",
                   help="also keep the state of every K-th step in its own folder beside --state-dir, "
                        "<state-dir>-step<STEP> (light unless --full-snapshots); each resumes or exports "
                        "(--state-dir <it> --resume --export-only)")
    p.add_argument("--full-snapshots", action="store_true", help="--save-every keeps full states (with the Adam moments)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the state in --state-dir: exactly from a full state; from a light one "
                        "with fresh Adam moments and a re-warm-up of the rate")
    p.add_argument("--rewarm-steps", type=int, default=None,
                   help="resuming a light state: the rate rises linearly from 0 over these steps (default: "
                        "the schedule's --warmup), as fresh Adam moments would otherwise take full-size steps")
    p.add_argument("--export-only", action="store_true",
                   help="with --resume: write --out from the state's EMA weights (and evaluate it) without training")
    p.add_argument("--eval-per-family", type=int, default=48, help="final eval: images per family and split")
    p.add_argument("--eval-steps", type=int, default=20, help="ODE steps for evaluation sampling")
    p.add_argument("--cfg", type=float, default=None, help="CFG scale for evaluation (default: the pipeline's)")
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


# ---- data -----------------------------------------------------------------------------------
class PromptSampler:
    """Train prompts drawn family-balanced (the families have 2 to 107 train prompts; uniform
    over prompts would all but ignore single-object and counting), or in the proportions
    ``weights`` ({family: weight}, unnamed families 1)."""

    def __init__(self, prompts, rng: np.random.Generator, weights: dict[str, float] | None = None):
        from diffalign.shapes.world import prompt_family

        self.by_family = defaultdict(list)
        for p in prompts:
            self.by_family[prompt_family(p)].append(p)
        self.families = sorted(self.by_family)
        self.rng = rng
        self.p = None
        if weights:
            unknown = sorted(set(weights) - set(self.families))
            if unknown:
                raise SystemExit(f"--family-weights: unknown families {unknown}; known: {', '.join(self.families)}")
            w = np.array([float(weights.get(f, 1.0)) for f in self.families])
            if (w < 0).any() or w.sum() <= 0:
                raise SystemExit("--family-weights: weights must be >= 0 with a positive sum")
            self.p = w / w.sum()

    def __call__(self, n: int) -> list[str]:
        if self.p is None:
            fams = self.rng.integers(len(self.families), size=n)
        else:
            fams = self.rng.choice(len(self.families), size=n, p=self.p)
        out = []
        for f in fams:
            choices = self.by_family[self.families[int(f)]]
            out.append(choices[int(self.rng.integers(len(choices)))])
        return out


def parse_family_weights(text: str) -> dict[str, float]:
    """``'color_attr=3,position=2'`` -> ``{'color_attr': 3.0, 'position': 2.0}``."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:  # no '=' (value '') or not a number
            raise SystemExit(f"--family-weights: expected FAMILY=WEIGHT, got {item!r}") from None
    return out


def shift_timesteps(u: torch.Tensor, shift: float) -> torch.Tensor:
    """``u`` in [0, 1] -> ``shift * u / (1 + (shift - 1) * u)``, the map a flow-matching scheduler's
    ``shift`` applies to its sigmas (SD3 trains and samples with the same one): ``shift`` > 1 moves
    mass to high noise, ``shift`` = 1 returns ``u`` unchanged."""
    if shift <= 0:
        raise SystemExit(f"--timestep-shift must be > 0, got {shift}")
    if shift == 1.0:
        return u
    return shift * u / (1 + (shift - 1) * u)


# ---- evaluation -----------------------------------------------------------------------------
@torch.no_grad()
def evaluate(pipe, prompts, per_family: int, steps: int, cfg: float, seed: int = 1234, batch: int = 64) -> dict:
    """ShapesEval accuracy per family: ``per_family`` images per family, spread round-robin over
    that family's prompts, one fixed noise seed. Returns {family: acc, "mean": family mean,
    "n": {family: count}}."""
    import reward_models
    from diffalign.shapes.world import prompt_family

    reward = reward_models.build("shapes_eval")
    by_family = defaultdict(list)
    for p in prompts:
        by_family[prompt_family(p)].append(p)
    eval_prompts = []
    for fam in sorted(by_family):
        ps = by_family[fam]
        eval_prompts += [ps[i % len(ps)] for i in range(per_family)]
    gen = torch.Generator().manual_seed(seed)
    scores = []
    for i in progress.bar(range(0, len(eval_prompts), batch), desc=f"ShapesEval on {len(eval_prompts)} images", unit="batch"):
        chunk = eval_prompts[i : i + batch]
        images = pipe(chunk, num_inference_steps=steps, guidance_scale=cfg, generator=gen, output_type="pt").images
        scores.append(reward(images, chunk, [{} for _ in chunk]).float())
    scores = torch.cat(scores)
    acc = defaultdict(list)
    for p, s in zip(eval_prompts, scores.tolist()):
        acc[prompt_family(p)].append(s)
    out = {f: float(np.mean(v)) for f, v in sorted(acc.items())}
    out["mean"] = float(np.mean(list(out.values())))
    return out


def format_table(rows: dict[str, dict]) -> str:
    """rows: {split: {family: acc, "mean": acc}} -> a text table with families as rows."""
    from diffalign.shapes.world import FAMILIES

    splits = list(rows)
    lines = [f"{'family':<14}" + "".join(f"{s:>10}" for s in splits)]
    for fam in list(FAMILIES) + ["mean"]:
        cells = [rows[s].get(fam) for s in splits]
        lines.append(f"{fam:<14}" + "".join(f"{'-':>10}" if c is None else f"{c:>10.3f}" for c in cells))
    return "\n".join(lines)


# ---- architecture ---------------------------------------------------------------------------
# The flags that reproduce the shipped model (its state: git checkout ac8de61 -- scripts/pretrain_state/shapes-t2i-bert):
# the defaults' UNet with a bidirectional prompt encoder, which reads the relation word where the
# causal CLIP one cannot; stopped at step 4,500 of the schedule, the last validation checkpoint
# whose per-image pass rate leaves room to align (docs/shapes_world.md).
SHIPPED_RECIPE = ("--text-encoder", "bert", "--timestep-shift", "2", "--family-weights", "position=2", "--until", "4500")
# The flags' defaults: cross-attention at 16x16 and 8x8 binds colours to objects, which
# cross-attention at 8x8 alone did not learn (docs/shapes_world.md).
DEFAULT_ARCHITECTURE = {"text_time_embedding": True, "cross_attention_levels": 2, "coordinate_channels": False,
                        "text_encoder": "clip"}
# What a state without an "architecture" record was trained with: every state saved before the
# flags existed (the earlier shipped model, cross-attention at 8x8 only), whatever the defaults become.
UNRECORDED_ARCHITECTURE = {"text_time_embedding": True, "cross_attention_levels": 1, "coordinate_channels": False,
                           "text_encoder": "clip"}


def architecture(args) -> dict:
    """The :class:`ShapesModelConfig` fields the architecture flags set (recorded in the state)."""
    return {"text_time_embedding": not args.no_text_time_embedding,
            "cross_attention_levels": args.cross_attention_levels,
            "coordinate_channels": args.coordinate_channels, "text_encoder": args.text_encoder}


def recorded_architecture(info: dict) -> dict:
    """The architecture a saved state (its ``state.json``) was trained with: the record, with the
    flags that did not exist when it was saved at the values that state was trained with."""
    return {**UNRECORDED_ARCHITECTURE, **info.get("architecture", {})}


# ---- schedule and training state ------------------------------------------------------------
def lr_factor(step: int, args) -> float:
    """Linear warmup, constant, then (``--decay-steps``) a linear decay to ``--final-lr-fraction``."""
    factor = min(1.0, (step + 1) / args.warmup)
    decay_from = args.steps - args.decay_steps
    if args.decay_steps and step >= decay_from:
        done = min(1.0, (step - decay_from) / args.decay_steps)
        factor *= 1.0 - done * (1.0 - args.final_lr_fraction)
    return factor


@dataclasses.dataclass
class Schedule:
    """The learning rate of step ``s`` (0-based) is ``lr * factor(s)``. Recorded in ``state.json``
    (``schedule``), so that a resume follows the curve the state was trained on, whatever the flags.

    * the base (:func:`lr_factor`): linear warm-up over ``warmup`` steps, constant, then a linear
      decay over the last ``decay_steps`` of ``steps`` to ``final_lr_fraction``;
    * ``extensions`` (``--extend-to``): ``{"from_step": S, "from_factor": f, "to_step": N}`` replaces
      the factor from step ``S`` on by a line from ``f`` (the schedule's factor at ``S``) to
      ``final_lr_fraction`` at step ``N``, the schedule's new end. Continuous at ``S`` and
      non-increasing after it wherever the schedule was, so every checkpoint of an extended run sits
      on one monotone decay;
    * ``rewarms`` (each resume of a light state): ``{"from_step": R, "steps": n}`` multiplies the
      factor by ``min(1, (s - R + 1) / n)`` from step ``R`` on: fresh Adam moments start at a small
      rate, as a fresh run does.
    """

    lr: float
    warmup: int
    steps: int
    decay_steps: int
    final_lr_fraction: float
    extensions: list = dataclasses.field(default_factory=list)
    rewarms: list = dataclasses.field(default_factory=list)

    @classmethod
    def from_args(cls, args) -> "Schedule":
        return cls(lr=args.lr, warmup=args.warmup, steps=args.steps, decay_steps=args.decay_steps,
                   final_lr_fraction=args.final_lr_fraction)

    @classmethod
    def from_record(cls, record: dict) -> "Schedule":
        return cls(**record)

    def record(self) -> dict:
        return dataclasses.asdict(self)

    def base(self) -> dict:
        """The fields the flags set (compared with the flags on a resume)."""
        return {k: getattr(self, k) for k in ("lr", "warmup", "steps", "decay_steps", "final_lr_fraction")}

    @property
    def end(self) -> int:
        """The step the schedule ends at (a run without ``--until`` stops there)."""
        return self.extensions[-1]["to_step"] if self.extensions else self.steps

    def extend(self, step: int, to_step: int) -> bool:
        """``--extend-to to_step`` from the state at ``step``: add the extension (True), or nothing when
        the schedule already ends there through one (False). ``ValueError`` when ``to_step`` is not
        beyond both ``step`` and the schedule's end."""
        if self.extensions and to_step == self.end:
            return False
        if to_step <= step:
            raise ValueError(f"--extend-to {to_step} is not above the state's step {step}")
        if to_step <= self.end:
            raise ValueError(f"--extend-to {to_step} is not beyond the schedule's end at step {self.end} "
                             f"(--resume without it continues inside the schedule)")
        self.extensions.append({"from_step": step, "from_factor": self.decay_factor(step), "to_step": to_step})
        return True

    def decay_factor(self, step: int) -> float:
        """The factor without the re-warm-ups: the base, or the extension in force at ``step``."""
        current = [e for e in self.extensions if e["from_step"] <= step]
        if not current:
            return lr_factor(step, self)
        e = current[-1]
        done = min(1.0, (step - e["from_step"]) / (e["to_step"] - e["from_step"]))
        return e["from_factor"] + done * (self.final_lr_fraction - e["from_factor"])

    def factor(self, step: int) -> float:
        f = self.decay_factor(step)
        for r in self.rewarms:
            if r["steps"] and step >= r["from_step"]:
                f *= min(1.0, (step - r["from_step"] + 1) / r["steps"])
        return f

    def describe(self) -> str:
        text = (f"lr {self.lr:g}, warm-up {self.warmup} steps, constant, then linear decay over the last "
                f"{self.decay_steps} of {self.steps} steps to {self.final_lr_fraction:g} x lr")
        for e in self.extensions:
            text += (f"; extended at step {e['from_step']}: linear from {e['from_factor']:.4g} x lr to "
                     f"{self.final_lr_fraction:g} x lr at step {e['to_step']}")
        for r in self.rewarms:
            text += f"; re-warmed linearly from 0 over {r['steps']} steps from step {r['from_step']}"
        return text


def set_rate(opt, sched, schedule: Schedule, step: int) -> None:
    """Give the optimizer the rate of ``step`` (the next one) as the LR scheduler would have."""
    sched._last_lr = [base * schedule.factor(step) for base in sched.base_lrs]
    for group, lr in zip(opt.param_groups, sched._last_lr):
        group["lr"] = lr


STATE_GROUPS = ("params", "ema", "exp_avg", "exp_avg_sq")  # one safetensors file each (<20 MB)
LIGHT_STATE_GROUPS = ("params", "ema")  # a light state: no Adam moments (half the size)


def snapshot_dir(state_dir: Path, step: int) -> Path:
    """Where ``--save-every`` keeps the state of ``step``: ``<state-dir>-step<STEP, 6 digits>``."""
    return state_dir.with_name(f"{state_dir.name}-step{step:06d}")


def usage_error(message: str) -> None:
    """A bad flag value: one line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def save_state(state_dir: Path, params, ema, opt, sched, rng, meta: dict, *, light: bool = False) -> None:
    """Write the training state to ``state_dir``: a safetensors file per tensor group and
    ``state.json`` (step, schedule, Adam step counts, both RNGs, ``kind``). ``light``: without the
    Adam moments (``kind: light``; a resume re-warms them), else exact (``kind: full``). Written
    to a sibling folder and swapped in, so an interruption leaves the previous state whole."""
    from safetensors.torch import save_file

    tmp = state_dir.with_name(state_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    # before the first step Adam has no state yet: its lazy initial one (zero moments, step 0)
    adam = [opt.state.get(p) or {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)} for p in params]
    groups = {"params": [p.detach() for p in params], "ema": ema or [],
              "exp_avg": [a["exp_avg"] for a in adam], "exp_avg_sq": [a["exp_avg_sq"] for a in adam]}
    for name in LIGHT_STATE_GROUPS if light else STATE_GROUPS:
        save_file({str(i): t.detach().contiguous() for i, t in enumerate(groups[name])}, str(tmp / f"{name}.safetensors"))
    save_file({"torch_rng": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
    info = dict(meta, kind="light" if light else "full", sched=sched.state_dict(), numpy_rng=rng.bit_generator.state)
    if not light:
        info["adam_steps"] = [float(a["step"]) for a in adam]
    (tmp / "state.json").write_text(json.dumps(info, indent=1))
    old = state_dir.with_name(state_dir.name + ".old")
    if state_dir.exists():
        state_dir.rename(old)
    tmp.rename(state_dir)
    if old.exists():
        shutil.rmtree(old)


def load_state(state_dir: Path, params, ema, opt, sched, rng, arch: dict = DEFAULT_ARCHITECTURE) -> dict:
    """Restore what :func:`save_state` wrote; returns its meta (step, loss_avg, kind, ...). ``arch``
    (the architecture flags' fields) must be the one the state was trained with. A light state
    (``kind: light``) leaves Adam without state: its first step starts fresh moments. States saved
    before the kinds existed are full."""
    from safetensors.torch import load_file

    if not (state_dir / "state.json").is_file():
        raise SystemExit(f"--resume: no training state in {str(state_dir)!r} (state.json missing)")
    info = json.loads((state_dir / "state.json").read_text())
    saved_arch = recorded_architecture(info)
    if saved_arch != arch:
        raise SystemExit(f"--resume: {str(state_dir)!r} was trained with architecture {saved_arch}, "
                         f"the arguments give {arch}; pass the same architecture flags")
    light = info.setdefault("kind", "full") == "light"
    groups = {name: load_file(str(state_dir / f"{name}.safetensors")) for name in (LIGHT_STATE_GROUPS if light else STATE_GROUPS)}
    if len(groups["params"]) != len(params):
        raise SystemExit(f"--resume: {str(state_dir)!r} holds {len(groups['params'])} tensors, the model has {len(params)}")
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(groups["params"][str(i)])
            if ema is not None:
                ema[i].copy_(groups["ema"][str(i)])
            if light:
                opt.state.pop(p, None)
            else:
                opt.state[p] = {"step": torch.tensor(info["adam_steps"][i]), "exp_avg": groups["exp_avg"][str(i)].clone(),
                                "exp_avg_sq": groups["exp_avg_sq"][str(i)].clone()}
    sched.load_state_dict(info["sched"])
    for group, lr in zip(opt.param_groups, sched.get_last_lr()):  # the rate of the next step
        group["lr"] = lr
    rng.bit_generator.state = info["numpy_rng"]
    torch.set_rng_state(load_file(str(state_dir / "rng.safetensors"))["torch_rng"])
    return info


def init_weights(pipe, folder: str) -> None:
    """Load the UNet and text encoder of the saved model in ``folder`` into ``pipe`` (same
    widths; a plain UNet into a coordinate one via :func:`widen_for_coordinates`)."""
    from diffalign.shapes.model import uses_coordinates, widen_for_coordinates
    from diffalign.shapes.pipeline import ShapesPipeline

    if not (Path(folder) / "model_index.json").is_file():
        raise SystemExit(f"--init-from: no saved model in {folder!r} (model_index.json missing)")
    source = ShapesPipeline.from_pretrained(folder)
    try:
        if uses_coordinates(pipe.unet) and not uses_coordinates(source.unet):
            widen_for_coordinates(pipe.unet, source.unet.float())
        else:
            pipe.unet.load_state_dict(source.unet.float().state_dict())
        pipe.text_encoder.load_state_dict(source.text_encoder.float().state_dict())
    except RuntimeError as err:  # shape mismatch: another architecture
        raise SystemExit(f"--init-from: {folder!r} does not fit the architecture flags ({str(err).splitlines()[0]})") from None


# ---- saving ---------------------------------------------------------------------------------
def save(pipe, unet_weights, out: str) -> None:
    """save_pretrained with the UNet stored in fp16 (halves the shipped size; diffusers loads it
    back in fp32) and the small text encoder in fp32."""
    to_save = copy.copy(pipe)  # shallow: shares tokenizer / scheduler / text encoder
    unet = copy.deepcopy(pipe.unet)
    unet.load_state_dict(unet_weights)
    unet.to(torch.float16)
    to_save.register_modules(unet=unet)
    to_save.save_pretrained(out)


# ---- main -----------------------------------------------------------------------------------
def main(argv=None) -> None:
    args = parse_args(argv)
    if args.timestep_shift <= 0:
        raise SystemExit(f"--timestep-shift must be > 0, got {args.timestep_shift}")
    if args.rewarm_steps is not None and args.rewarm_steps < 0:
        usage_error(f"--rewarm-steps must be >= 0, got {args.rewarm_steps}")
    if args.light_state and args.state_dir is None:
        usage_error("--light-state needs --state-dir (the state it makes light)")
    if args.rewarm_steps is not None and not args.resume:
        usage_error("--rewarm-steps applies to --resume from a light state")
    if args.extend_to is not None and not args.resume:
        usage_error("--extend-to needs --resume (the state whose run it continues)")
    if args.extend_to is not None and args.export_only:
        usage_error("--extend-to continues training; --export-only does not train")
    if args.save_every is not None and args.save_every < 1:
        usage_error(f"--save-every must be >= 1, got {args.save_every}")
    if args.save_every is not None and args.state_dir is None:
        usage_error("--save-every needs --state-dir (the snapshots sit beside it)")
    if args.full_snapshots and args.save_every is None:
        usage_error("--full-snapshots applies to --save-every")
    progress.set_quiet(args.quiet)
    torch.set_num_threads(args.threads)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # the fp16 save cast warns about nothing
    diffusers_logging.disable_progress_bar()
    from diffalign.shapes.model import TINY_CONFIG, ShapesModelConfig, build_pipeline
    from diffalign.shapes.pipeline import DEFAULT_GUIDANCE_SCALE, ShapesPipeline
    from diffalign.shapes.scenes import make_batch
    from diffalign.shapes.world import split_prompts

    cfg_scale = DEFAULT_GUIDANCE_SCALE if args.cfg is None else args.cfg
    split = split_prompts(seed=0)
    train_prompts, heldout_prompts = split.train, split.evaluation()
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    sampler = PromptSampler(train_prompts, rng, parse_family_weights(args.family_weights))

    arch = architecture(args)

    def state_meta(step: int, loss_avg) -> dict:
        return {"step": step, "loss_avg": loss_avg, "architecture": arch, "timestep_shift": args.timestep_shift,
                "schedule": schedule.record()}
    config = dataclasses.replace(TINY_CONFIG if args.tiny else ShapesModelConfig(), **arch)
    levels = len(config.block_out_channels)
    if not 1 <= args.cross_attention_levels <= levels:
        raise SystemExit(f"--cross-attention-levels must be 1..{levels} (the UNet's levels), got {args.cross_attention_levels}")
    pipe = build_pipeline(config=config, seed=args.seed)
    pipe.set_progress_bar_config(disable=True)
    unet, text_encoder = pipe.unet, pipe.text_encoder
    n_unet = sum(p.numel() for p in unet.parameters())
    n_text = sum(p.numel() for p in text_encoder.parameters())
    print(f"unet {n_unet / 1e6:.2f}M params, text encoder {n_text / 1e6:.2f}M params, "
          f"{len(train_prompts)} train / {len(heldout_prompts)} held-out prompts, "
          f"batch {args.batch_size}, {args.steps} steps, lr {args.lr}", flush=True)

    if args.init_from and not args.resume:
        init_weights(pipe, args.init_from)
        print(f"initialised from {args.init_from}", flush=True)
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    schedule = Schedule.from_args(args)  # a resume replaces it with the state's record
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule.factor(s))  # reads `schedule` when called
    ema = [p.detach().clone() for p in params] if args.ema_decay > 0 else None

    def ema_state():
        """(unet_state_dict, text_encoder_state_dict) of the EMA weights (or the raw ones)."""
        if ema is None:
            return unet.state_dict(), text_encoder.state_dict()
        backup = [p.detach().clone() for p in params]
        for p, e in zip(params, ema):
            p.data.copy_(e)
        states = copy.deepcopy(unet.state_dict()), copy.deepcopy(text_encoder.state_dict())
        for p, b in zip(params, backup):
            p.data.copy_(b)
        return states

    def eval_pipe(unet_sd, text_sd):
        ev = copy.deepcopy(pipe)
        ev.unet.load_state_dict(unet_sd)
        ev.text_encoder.load_state_dict(text_sd)
        ev.unet.eval(), ev.text_encoder.eval()
        return ev

    unet.train(), text_encoder.train()
    start = time.time()
    loss_avg = None
    step = 0
    state_dir = Path(args.state_dir) if args.state_dir else None
    if args.resume:  # weights, EMA, LR schedule, both RNGs and (a full state) the Adam moments
        if state_dir is None:
            raise SystemExit("--resume needs --state-dir")
        info = load_state(state_dir, params, ema, opt, sched, rng, arch)
        step, loss_avg = info["step"], info["loss_avg"]
        print(f"resumed from {state_dir} at step {step} ({info['kind']} state)", flush=True)
        if "schedule" in info:
            schedule = Schedule.from_record(info["schedule"])
            flags = Schedule.from_args(args).base()
            if flags != schedule.base() and not args.export_only:
                changed = ", ".join(f"{k} {flags[k]:g}" for k in flags if flags[k] != schedule.base()[k])
                print(f"note: the state's recorded schedule goes on ({schedule.describe()}); the flags' {changed} "
                      f"are not used", flush=True)
        elif not args.export_only:  # saved before the record: the flags give the schedule, and should give its rate
            saved, ours = info["sched"]["_last_lr"][0], sched.base_lrs[0] * schedule.factor(step)
            if not math.isclose(saved, ours, rel_tol=1e-9):
                print(f"note: these flags' schedule gives step {step} the rate {ours:.3g}, the state's gave {saved:.3g}: "
                      f"the rate jumps (the flags it was trained with continue its curve)", flush=True)
        if info["kind"] == "light" and not args.export_only:
            rewarm = schedule.warmup if args.rewarm_steps is None else args.rewarm_steps
            schedule.rewarms.append({"from_step": step, "steps": rewarm})
            how = (f"the rate re-warmed linearly from 0 over {rewarm} steps (--rewarm-steps)" if rewarm
                   else "no re-warm-up of the rate (--rewarm-steps 0)")
            print(f"light state: no Adam moments saved; Adam starts fresh moments at step {step}, with {how}", flush=True)
        elif args.rewarm_steps is not None and not args.export_only:
            print(f"note: --rewarm-steps is not used: {state_dir} is a full state (its Adam moments resume exactly)", flush=True)
        if args.extend_to is not None:
            try:
                schedule.extend(step, args.extend_to)
            except ValueError as err:
                usage_error(str(err))
        set_rate(opt, sched, schedule, step)
        saved_shift = float(info.get("timestep_shift", 1.0))  # states saved before the flag: uniform t
        if saved_shift != args.timestep_shift and not args.export_only:
            print(f"note: the state was trained with --timestep-shift {saved_shift:g}; continuing with "
                  f"{args.timestep_shift:g}", flush=True)
    first_step = step
    if not args.export_only:
        print(f"schedule: {schedule.describe()}", flush=True)
    stop_at = schedule.end if args.until is None else min(args.until, schedule.end)
    if args.export_only:
        if not args.resume:
            raise SystemExit("--export-only needs --resume (the state to export)")
        stop_at = step
    bar = progress.bar(total=stop_at, desc="pretraining", unit="step", leave=True)
    bar.update(step)
    say = (lambda msg: bar.write(msg, file=sys.stdout)) if progress.interactive() else (lambda msg: print(msg, flush=True))
    while step < stop_at:
        if args.minutes is not None and time.time() - start > 60 * args.minutes:
            print(f"time limit of {args.minutes} min reached at step {step}", flush=True)
            break
        prompts = sampler(args.batch_size)
        x0 = 2 * make_batch(prompts, rng) - 1  # pixels in [-1, 1]
        drop = rng.random(len(prompts)) < args.uncond_prob
        cond_prompts = ["" if d else p for p, d in zip(prompts, drop)]

        eps = torch.randn_like(x0)
        t = shift_timesteps(torch.rand(x0.shape[0]), args.timestep_shift)
        x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
        ids = pipe.tokenize(cond_prompts)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.mixed_precision == "bf16"):
            context = text_encoder(ids).last_hidden_state
            v = unet(x_t, t * 1000.0, encoder_hidden_states=context).sample
        loss = torch.nn.functional.mse_loss(v.float(), eps - x0)

        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        bar.update(1)
        if ema is not None:
            decay = min(args.ema_decay, (1 + step) / (10 + step))  # short memory early on
            with torch.no_grad():
                torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)

        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        if step % args.log_every == 0 or step == 1:
            el = time.time() - start
            say(f"step {step:5d}  loss {loss_avg:.4f}  grad {grad_norm:.2f}  lr {sched.get_last_lr()[0]:.2e}  "
                f"{(step - first_step) / el:.2f} steps/s  {el / 60:.1f} min")
        if state_dir is not None and step % args.ckpt_every == 0:
            save_state(state_dir, params, ema, opt, sched, rng, state_meta(step, loss_avg), light=args.light_state)
            if not args.no_eval and step % args.ckpt_every == 0:
                t_ev = time.time()
                res = evaluate(eval_pipe(*ema_state()), heldout_prompts, 16, args.eval_steps, cfg_scale)
                say(f"[eval step {step}, {time.time() - t_ev:.0f}s] " + "  ".join(f"{k} {v:.2f}" for k, v in res.items()))
                unet.train(), text_encoder.train()
        if args.save_every and step % args.save_every == 0:
            save_state(snapshot_dir(state_dir, step), params, ema, opt, sched, rng, state_meta(step, loss_avg),
                       light=not args.full_snapshots)

    bar.close()
    print(f"trained to step {step} ({step - first_step} steps) in {(time.time() - start) / 60:.1f} min", flush=True)
    if state_dir is not None and not args.export_only:
        save_state(state_dir, params, ema, opt, sched, rng, state_meta(step, loss_avg), light=args.light_state)
    unet_sd, text_sd = ema_state()
    save(eval_pipe(unet_sd, text_sd), unet_sd, args.out)
    print(f"saved to {args.out}", flush=True)

    if not args.no_eval:
        final = ShapesPipeline.from_pretrained(args.out)  # evaluate exactly what was saved
        final.set_progress_bar_config(disable=True)
        t_ev = time.time()
        rows = {
            "heldout": evaluate(final, heldout_prompts, args.eval_per_family, args.eval_steps, cfg_scale),
            "train": evaluate(final, train_prompts, args.eval_per_family, args.eval_steps, cfg_scale),
        }
        print(f"\nShapesEval accuracy ({args.eval_steps} ODE steps, CFG {cfg_scale}, "
              f"{args.eval_per_family} images per family; {time.time() - t_ev:.0f}s)")
        print(format_table(rows), flush=True)


if __name__ == "__main__":
    main()
