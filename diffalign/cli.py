"""The ``diffalign`` command line: thin wrappers that parse, build and run.

Errors caused by input (config, names, paths, run directories) print one line
``error: ...`` and exit with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from diffalign.errors import DiffalignError

EXIT_USAGE = 2


def _cmd_train(args) -> int:
    from diffalign.config import load_config
    from diffalign.recipes import build_trainer

    cfg = load_config(args.config, args.overrides)
    trainer = build_trainer(cfg, resume=args.resume, overwrite=args.overwrite)
    trainer.train()
    print(f"run directory: {cfg.output_dir}")
    report = Path(cfg.output_dir) / "report.md"
    if report.exists():
        print(f"report: {report}")
    return 0


def _cmd_resume(args) -> int:
    from diffalign.config import load_config
    from diffalign.recipes import build_trainer

    run_dir = Path(args.run_dir)
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise DiffalignError(f"{str(run_dir)!r} is not a run directory (no config.yaml)")
    cfg = load_config(cfg_file, list(args.overrides) + [f"output_dir={run_dir}"])
    build_trainer(cfg, resume=True).train()
    print(f"run directory: {cfg.output_dir}")
    return 0


def _cmd_config(args) -> int:
    from diffalign.config import dump_config, load_config

    cfg = load_config(args.config, args.overrides)
    print(dump_config(cfg), end="")
    print("# derived: " + ", ".join(f"{k}={v}" for k, v in cfg.derived().items()))
    return 0


def _cmd_eval(args) -> int:
    from diffalign.adapters import load_adapter
    from diffalign.evaluation import evaluate_adapter, format_table
    from diffalign.export import load_trained_adapter

    prompts = _eval_prompts(args)
    kwargs = dict(reward=args.reward, num_steps=args.steps, guidance_scale=args.guidance_scale, seed=args.seed,
                  samples_per_prompt=args.samples_per_prompt)
    columns = {}
    models = [] if args.no_base else [("base", lambda: load_adapter(args.base))]
    for run in args.runs:
        if not Path(run).exists():
            raise DiffalignError(f"run directory {run!r} does not exist")
        models.append((Path(run).name, lambda run=run: load_trained_adapter(run)))
    for name, build in models:
        print(f"evaluating {name} on {len(prompts)} prompts x {args.samples_per_prompt} ...", file=sys.stderr, flush=True)
        columns[name] = evaluate_adapter(build(), prompts, **kwargs)
    print(format_table(columns))
    return 0


def _eval_prompts(args) -> list[str]:
    if args.prompts in ("heldout", "train"):
        from diffalign.shapes import split_prompts

        train, heldout = split_prompts()
        prompts = heldout if args.prompts == "heldout" else train
    else:
        f = Path(args.prompts)
        if not f.is_file():
            raise DiffalignError(f"--prompts: {args.prompts!r} is neither heldout/train nor a prompt file")
        prompts = [line.strip() for line in f.read_text().splitlines() if line.strip()]
    return prompts[: args.num_prompts] if args.num_prompts else prompts


def _cmd_list(args) -> int:
    import reward_models
    from diffalign.adapters import FAMILIES
    from diffalign.recipes import available

    print("model families: " + ", ".join(sorted(FAMILIES)))
    print("rewards:        " + ", ".join(reward_models.available()))
    print("algorithms:     " + ", ".join(available()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffalign", description="Align diffusion / flow-matching image models with RL.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a YAML config: diffalign train CONFIG [key=value ...]")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.add_argument("--resume", action="store_true", help="continue the run in output_dir from its latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete a previous run in output_dir first")
    p.set_defaults(fn=_cmd_train)

    p = sub.add_parser("resume", help="continue a run directory: diffalign resume RUN_DIR [key=value ...]")
    p.add_argument("run_dir")
    p.add_argument("overrides", nargs="*", help="e.g. max_iterations=20")
    p.set_defaults(fn=_cmd_resume)

    p = sub.add_parser("config", help="validate a config and print it resolved, with derived numbers")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(fn=_cmd_config)

    p = sub.add_parser("eval", help="held-out accuracy per family for the base model and run directories")
    p.add_argument("runs", nargs="*", help="run directories to compare with the base model")
    p.add_argument("--base", default="shapes", help="base model id (default: the shipped shapes model)")
    p.add_argument("--no-base", action="store_true", help="skip the base model column")
    p.add_argument("--prompts", default="heldout", help="heldout | train | a file with one prompt per line")
    p.add_argument("--num-prompts", type=int, default=0, help="first N prompts only (0 = all)")
    p.add_argument("--samples-per-prompt", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance-scale", type=float, default=4.5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--reward", default="shapes_eval")
    p.set_defaults(fn=_cmd_eval)

    p = sub.add_parser("list", help="known model families, rewards and algorithms")
    p.set_defaults(fn=_cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # overrides may follow flags (`train c.yaml --overwrite a.b=1`): collect them from the leftovers
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.fn(args)
    except DiffalignError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted; resume with: diffalign resume <output_dir>", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
