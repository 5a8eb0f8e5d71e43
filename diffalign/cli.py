"""The ``diffalign`` command line: thin wrappers that parse, build and run.

Errors caused by input (config, names, paths, run directories) print one line
``error: ...`` and exit with code 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
from pathlib import Path

from diffalign.errors import DiffalignError, Interrupted

EXIT_USAGE = 2  # bad input, or a run that cannot go on (unwritable checkpoint, reward server down): "error: ..."
EXIT_SIGINT = 130  # 128 + SIGINT: stopped by Ctrl-C (after a checkpoint, or at once on a second Ctrl-C)
EXIT_SIGTERM = 143  # 128 + SIGTERM: stopped after finishing the iteration and writing a checkpoint


def _cmd_train(args) -> int:
    from diffalign import progress

    # torch and diffusers take seconds to import: a terminal-only bar that clears itself, so that
    # bad input still ends in one line
    with progress.bar(desc="loading libraries and the config", unit="", disable=not progress.interactive()):
        from diffalign.config_files import load_config
        from diffalign.trainer import build_trainer
        from diffalign.training.checks import check_judges_trained

        cfg = load_config(args.config, args.overrides)
    check_judges_trained(cfg, args.config)
    if args.allow_config_change and not args.resume:
        raise DiffalignError("--allow-config-change only applies with --resume")
    if not args.no_plan_check:
        _check_memory_plan(cfg)
    trainer = build_trainer(cfg, resume=args.resume, overwrite=args.overwrite, allow_config_change=args.allow_config_change)
    trainer.train()
    print(f"run directory: {cfg.output_dir}")
    report = Path(cfg.output_dir) / "report.md"
    if report.exists():
        print(f"report: {report}")
    return 0


def _check_memory_plan(cfg) -> None:
    """On CUDA, stop before loading when the memory plan exceeds the free memory of this process's
    GPU (docs/memory.md); a model the planner has no architecture for is trained unchecked."""
    import torch

    from diffalign.errors import ConfigError
    from diffalign.planner import check_fits

    if not torch.cuda.is_available():
        return
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    index = int(os.environ.get("LOCAL_RANK", "0"))
    free, _ = torch.cuda.mem_get_info(index)
    try:
        problem = check_fits(cfg, processes, {f"cuda:{index}": free})
    except ConfigError as exc:
        print(f"memory plan skipped: {exc}", file=sys.stderr)
        return
    if problem is not None:
        raise DiffalignError(problem)


def _cmd_plan(args) -> int:
    from diffalign import shipped
    from diffalign.config_files import load_config
    from diffalign.planner import GB, Settings, fit_table, format_plan, plan

    if args.gpus < 1 or (args.gpu_memory is not None and args.gpu_memory <= 0):
        raise DiffalignError("--gpus must be >= 1 and --gpu-memory > 0")
    if args.all:
        if args.config is not None:
            raise DiffalignError("`diffalign plan --all` takes no RECIPE")
        names = [r.name for r in shipped.available() if r.name.split("/")[0] not in NON_GPU_RECIPE_FOLDERS]
    elif args.config is None:
        raise DiffalignError("`diffalign plan` needs a RECIPE (or --all)")
    else:
        names = [args.config]
    for i, name in enumerate(names):
        cfg = load_config(name, args.overrides)
        settings = Settings.from_config(cfg, args.gpus)
        if i:
            print()
        if args.table:
            print(f"{name}: smallest GPU each combination fits (peak per GPU)")
            for label, peak, fit in fit_table(settings):
                print(f"  {label:<58} {peak:7.1f} GB  {fit}")
        else:
            print(format_plan(plan(settings), args.gpu_memory, name=name))
    return 0


def _cmd_resume(args) -> int:
    from diffalign.config_files import load_config
    from diffalign.trainer import build_trainer
    from diffalign.training.checks import check_judges_trained

    run_dir = Path(args.run_dir)
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise DiffalignError(f"{str(run_dir)!r} is not a run directory (no config.yaml)")
    cfg = load_config(cfg_file, list(args.overrides) + [f"output_dir={run_dir}"])
    check_judges_trained(cfg, str(cfg_file))
    build_trainer(cfg, resume=True, allow_config_change=args.allow_config_change).train()
    print(f"run directory: {cfg.output_dir}")
    return 0


def _cmd_config(args) -> int:
    from diffalign.config_files import dump_config, load_config
    from diffalign.training.checks import check_config

    cfg = load_config(args.config, args.overrides)
    check_config(cfg)  # the names and files train resolves, with train's errors; no model loads
    print(dump_config(cfg), end="")
    print("# derived: " + ", ".join(f"{k}={v}" for k, v in cfg.derived().items()))
    return 0


def _check_sampling_args(args) -> None:
    """Numbers of eval / sample that would only fail (or silently misbehave) after a model loads."""
    import math

    if args.steps < 1:
        raise DiffalignError(f"--steps must be >= 1, got {args.steps}")
    if args.guidance_scale is not None and not math.isfinite(args.guidance_scale):  # None: eval --best-scale
        raise DiffalignError(f"--guidance-scale must be a finite number, got {args.guidance_scale}")
    if getattr(args, "batch_size", 1) < 1:
        raise DiffalignError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.num_prompts < 0:
        raise DiffalignError(f"--num-prompts must be >= 0 (0 = all), got {args.num_prompts}")
    if (args.samples_per_prompt or 1) < 1:
        raise DiffalignError(f"--samples-per-prompt must be >= 1, got {args.samples_per_prompt}")
    noise = getattr(args, "noise_level", 0.0)
    if not (math.isfinite(noise) and noise >= 0):
        raise DiffalignError(f"--noise-level must be a finite number >= 0, got {noise}")


def _cmd_eval(args) -> int:
    from diffalign.adapters import load_adapter, model_family
    from diffalign.evaluation import (DEFAULT_BASE, DEFAULT_REWARD, check_shapes_eval, eval_autocast_dtype, eval_base,
                                      eval_reward, read_run_source)
    from diffalign.export import load_trained_adapter

    _check_best_scale_args(args)
    _check_sampling_args(args)
    if args.images_per_family < 1:
        raise DiffalignError(f"--images-per-family must be >= 1, got {args.images_per_family}")
    args.autocast_dtype = eval_autocast_dtype(args.mixed_precision)
    if args.protocol == "geneval":
        from diffalign.geneval import run_from_args

        args.base, args.reward = args.base or DEFAULT_BASE, args.reward or DEFAULT_REWARD
        return run_from_args(args)
    runs = [read_run_source(run) for run in args.runs]
    if not runs and args.no_base:
        raise DiffalignError("nothing to evaluate: give run directories or drop --no-base")
    base = None if args.no_base else eval_base(runs, args.base)  # refuses runs of another base
    reward, reward_kwargs = eval_reward(runs, args.reward)
    # (column, what it is, build): built one at a time, so that one model is in memory at once
    models = [] if base is None else [("base", base, lambda: load_adapter(base))]
    models += [(r.name, f"{r.base} + {r.name}/final", lambda r=r: load_trained_adapter(r.path)) for r in runs]
    if args.best_scale and reward != DEFAULT_REWARD:
        raise DiffalignError(f"--best-scale evaluates ShapesEval only (ShapesWorld models), not reward {reward!r}")
    if reward == DEFAULT_REWARD:
        check_shapes_eval(base, base and model_family(base), runs)
        if args.best_scale:
            from diffalign.best_scale import final_weights_id

            ids = {"base": base} | {r.name: final_weights_id(r.path) for r in runs}
            return _eval_best_scale(args, [(name, what, build, ids[name]) for name, what, build in models])
        prompts, what = _eval_prompt_set(args)
        return _eval_shapes(args, prompts, what, models)
    prompts, what = _eval_run_prompts(args, runs)
    return _eval_other(args, prompts, what, models, reward, reward_kwargs)


def _eval_run_prompts(args, runs) -> tuple[list[str], str]:
    """Other rewards: ``--prompts`` when given, else the eval prompts the runs were trained with."""
    if args.prompts is not None or not runs or not runs[0].eval_prompts:
        return _eval_prompt_set(args)
    if any(r.eval_prompts != runs[0].eval_prompts for r in runs):
        raise DiffalignError("the runs were trained with different eval prompts: give --prompts (a set or a file) to "
                             "evaluate them all on one")
    return list(runs[0].eval_prompts), f"eval prompts of {runs[0].name}"


def _eval_header(args, sampled: str, models) -> str:
    """The line above an eval table: what was sampled, from which models, how."""
    precision = str(args.autocast_dtype).removeprefix("torch.") if args.autocast_dtype else "float32"
    named = ", ".join(f"{name} = {what}" for name, what, _ in models)
    return (f"{sampled}; {named}; {args.steps} ODE steps, CFG {args.guidance_scale:g}, seed {args.seed}, "
            f"{precision} forwards")


def _eval_other(args, prompts: list[str], what: str, models, reward: str, reward_kwargs: dict) -> int:
    """Any reward other than ShapesEval: the mean per model, no intervals."""
    from diffalign import progress
    from diffalign.evaluation import evaluate_adapter, format_table

    samples = args.samples_per_prompt or 1
    kwargs = dict(reward=reward, reward_kwargs=reward_kwargs, num_steps=args.steps, guidance_scale=args.guidance_scale,
                  seed=args.seed, samples_per_prompt=samples, batch_size=args.batch_size, autocast_dtype=args.autocast_dtype)
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    sampled = f"{what}: {len(prompts)} prompts x {samples} = {len(prompts) * samples} images, reward {reward}"
    columns = {}
    for name, model, build in models:
        progress.phase(f"evaluating {name} ({model}) on {len(prompts)} prompts x {samples} ...")
        columns[name] = evaluate_adapter(build(), prompts, **kwargs)
    print(_eval_header(args, sampled, models))
    print(format_table(columns))
    return 0


def _eval_shapes(args, prompts: list[str], what: str, models) -> int:
    """ShapesEval with intervals: images_per_family images per family, paired differences vs base."""
    from diffalign import progress
    from diffalign.evaluation import (LEGEND, comparison_columns, describe_families, evaluate_shapes, format_table,
                                      shapes_eval_list)

    if args.samples_per_prompt is not None:
        raise DiffalignError("--samples-per-prompt is for other rewards; ShapesEval evaluates --images-per-family images per family")
    items = shapes_eval_list(prompts, args.images_per_family, args.num_prompts)  # what is sampled, as sampled
    whole = len(shapes_eval_list(prompts, args.images_per_family))
    spread = ", each family's first" if len(items) < whole else ""  # --num-prompts: spread over the families
    sampled = f"{len(items)} images{spread} ({describe_families(items, args.images_per_family)})"
    kwargs = dict(images_per_family=args.images_per_family, num_steps=args.steps, guidance_scale=args.guidance_scale,
                  seed=args.seed, batch_size=args.batch_size, limit=args.num_prompts, autocast_dtype=args.autocast_dtype)
    evaluations = {}
    for name, model, build in models:
        progress.phase(f"evaluating {name} ({model}) on {what}, {sampled} ...")
        ev = evaluate_shapes(build(), prompts, **kwargs)
        progress.phase(f"  {ev.meta['num_images']} images in {ev.seconds:.0f} s")
        evaluations[name] = ev
    base = "base" if "base" in evaluations else None
    print(_eval_header(args, f"{what}: {sampled}", models))
    print(format_table(comparison_columns(evaluations, base)))
    print(LEGEND)
    return 0


def _check_best_scale_args(args) -> None:
    """The flags of ``eval --best-scale``, checked before anything loads; ``--guidance-scale`` gets its default."""
    only = [flag for flag, given in (("--scales", args.scales is not None),
                                     ("--validation-images-per-family", args.validation_images_per_family is not None),
                                     ("--cache", args.cache is not None)) if given]
    if not args.best_scale:
        if only:
            raise DiffalignError(f"{only[0]} only applies with --best-scale")
        args.guidance_scale = DEFAULT_EVAL_GUIDANCE if args.guidance_scale is None else args.guidance_scale
        return
    from diffalign.best_scale import DEFAULT_SCALES, DEFAULT_VALIDATION_IMAGES_PER_FAMILY, parse_scales

    clashes = [flag for flag, given in (("--guidance-scale", args.guidance_scale is not None),
                                        ("--prompts", args.prompts is not None),
                                        ("--samples-per-prompt", args.samples_per_prompt is not None),
                                        ("--protocol geneval", args.protocol == "geneval")) if given]
    if clashes:
        raise DiffalignError(f"{clashes[0]} does not apply with --best-scale (it chooses each model's scale among --scales "
                             "on the validation prompts and reports the held-out prompts there)")
    args.scales = parse_scales(args.scales, "--scales") if args.scales is not None else list(DEFAULT_SCALES)
    if args.validation_images_per_family is None:
        args.validation_images_per_family = DEFAULT_VALIDATION_IMAGES_PER_FAMILY
    if args.validation_images_per_family < 1:
        raise DiffalignError(f"--validation-images-per-family must be >= 1, got {args.validation_images_per_family}")
    if args.cache is not None and Path(args.cache).exists() and not Path(args.cache).is_dir():
        raise DiffalignError(f"--cache: {args.cache!r} is not a folder")


def _eval_best_scale(args, models) -> int:
    """Each model at its validation-best CFG scale, the held-out table there, paired against the base at its own."""
    from diffalign import progress
    from diffalign.best_scale import BestScaleSpec, compare_best_scales, evaluate_best_scale, scale_text
    from diffalign.evaluation import LEGEND, describe_families, format_table
    from diffalign.shapes import prompt_set

    spec = BestScaleSpec(tuple(args.scales), tuple(prompt_set("validation")), tuple(prompt_set("heldout")),
                         validation_images_per_family=args.validation_images_per_family,
                         images_per_family=args.images_per_family, heldout_limit=args.num_prompts, num_steps=args.steps,
                         seed=args.seed, batch_size=args.batch_size, autocast_dtype=args.autocast_dtype)
    cache = Path(args.cache) if args.cache is not None else None
    results = {}
    for name, what, build, model_id in models:
        progress.phase(f"evaluating {name} ({what}) at CFG {', '.join(map(scale_text, spec.scales))} ...")
        results[name] = evaluate_best_scale(build, spec, model=model_id, cache=cache / name if cache else None,
                                            log=progress.phase)
    validation, heldout = spec.items("validation"), spec.items("heldout")
    named = ", ".join(f"{name} = {what}" for name, what, _, _ in models)
    print(f"best CFG scale per model: chosen on {EVAL_PROMPT_SETS['validation']}, {len(validation)} images per scale "
          f"({describe_families(validation, spec.validation_images_per_family)}); per-image pass rate, ties: the lower "
          f"scale; {named}; {args.steps} ODE steps, seed {args.seed}, {spec.precision} forwards")
    header = ["", *(f"CFG {scale_text(s)}" for s in spec.scales), "chosen"]
    rows = [[name, *(f"{r.validation_rates[s]:.3f}" for s in spec.scales), f"CFG {scale_text(r.scale)}"]
            for name, r in results.items()]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print()
    print(f"{EVAL_PROMPT_SETS['heldout']}: {len(heldout)} images ({describe_families(heldout, spec.images_per_family)}), "
          "each model at its chosen scale")
    columns = {}
    for name, r in results.items():
        columns[f"{name} (CFG {scale_text(r.scale)})"] = r.heldout.intervals
        if name != "base" and "base" in results:
            columns[f"{name} - base"] = compare_best_scales(r, results["base"]).differences
    print(format_table(columns))
    print(LEGEND)
    if "base" in results:
        for name, r in results.items():
            if name != "base":
                print(f"{name}: " + compare_best_scales(r, results["base"]).sentence(trained=name))
    return 0


EVAL_PROMPT_SETS = {
    "heldout": "held-out evaluation (held-out prompts + in-distribution families)",
    "probe": "generalisation probe (colour-shape pairs never trained)",
    "train": "training prompts",
    "validation": "validation prompts (carved from the training split, for choosing hyperparameters and checkpoints)",
}


def _eval_prompt_set(args) -> tuple[list[str], str]:
    """(distinct prompts, description) for --prompts (None: heldout)."""
    if (args.prompts or "heldout") in EVAL_PROMPT_SETS:
        from diffalign.shapes import prompt_set

        return prompt_set(args.prompts or "heldout"), EVAL_PROMPT_SETS[args.prompts or "heldout"]
    f = Path(args.prompts)
    if not f.is_file():
        raise DiffalignError(f"--prompts: {args.prompts!r} is neither {'/'.join(EVAL_PROMPT_SETS)} nor a prompt file")
    try:
        prompts = [line.strip() for line in f.read_bytes().decode("utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise DiffalignError(f"--prompts: {args.prompts!r} is not a text (UTF-8) file") from None
    if not prompts:
        raise DiffalignError(f"--prompts: prompt file {args.prompts!r} is empty")
    return prompts, f"prompts of {f.name}"


def _eval_prompts(args) -> list[str]:
    prompts, _ = _eval_prompt_set(args)
    return prompts[: args.num_prompts] if args.num_prompts else prompts


def _cmd_list(args) -> int:
    import reward_models
    from diffalign.adapters import FAMILIES
    from diffalign.recipes import available

    print("model families: " + ", ".join(sorted(FAMILIES)))
    print("rewards:        " + ", ".join(reward_models.available()))
    print("algorithms:     " + ", ".join(available()))
    return 0


def _cmd_export(args) -> int:
    from diffalign import hub, progress
    from diffalign.export import default_format, export_run

    if (args.private or args.public) and not args.push_to_hub:
        raise DiffalignError(f"--{'public' if args.public else 'private'} only applies with --push-to-hub USER/REPO")
    if args.private and args.public:
        raise DiffalignError("--private and --public contradict each other")
    token = hub.check_push_target(args.push_to_hub) if args.push_to_hub else None  # fail before the work
    fmt = args.format or default_format(args.run_dir)  # what the run trained: lora, or the whole pipeline
    out = export_run(args.run_dir, fmt, args.out, repo_id=args.push_to_hub, license=args.license, log=progress.phase)
    print(f"exported {fmt} weights to {out}")
    if args.push_to_hub:
        print(f"pushed to {hub.push_folder(out, args.push_to_hub, token=token, private=not args.public)}")
    return 0


def _cmd_demo(args) -> int:
    # the checkout's demo/app.py, installed as diffalign._demo (pyproject.toml: package-dir)
    from diffalign._demo.app import run_from_args

    return run_from_args(args)


def _cmd_recipes(args) -> int:
    from diffalign import shipped

    if args.action == "list":
        if args.name is not None:
            raise DiffalignError(f"`diffalign recipes` takes no name (got {args.name!r}); use: diffalign recipes show NAME")
        recipes = shipped.available()
        width = max((len(r.name) for r in recipes), default=0)
        columns = shutil.get_terminal_size().columns if sys.stdout.isatty() else 0  # a pipe: one line per recipe
        for recipe in recipes:
            line = f"{recipe.name:<{width}}  {recipe.description}".rstrip()
            print(textwrap.fill(line, columns, subsequent_indent=" " * (width + 2)) if columns > width + 20 else line)
        print(f"# run one: diffalign train NAME; copy one to edit: diffalign recipes show NAME > my.yaml; files: {shipped.root()}")
        return 0
    if args.name is None:
        raise DiffalignError(f"`diffalign recipes {args.action}` needs a recipe NAME (diffalign recipes lists them)")
    recipe = shipped.find(args.name)
    if args.action == "show":
        print(recipe.path.read_text(encoding="utf-8"), end="")
    else:  # path: for tools that want a file, e.g. accelerate launch --config_file
        print(recipe.path)
    return 0


def _cmd_train_spm(args) -> int:
    from diffalign.spm.train import load_spm_config, train_spm

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).is_file():  # no CONFIG, only overrides
        config, overrides = None, [config, *overrides]
    cfg = load_spm_config(config, overrides)
    train_spm(cfg, overwrite=args.overwrite)
    print(f"step-aware preference model: {cfg.output_dir} (reward: spm with model={cfg.output_dir})")
    print(f"accuracy vs t: {Path(cfg.output_dir) / 'accuracy_vs_t.png'}")
    return 0


def _cmd_train_reward(args) -> int:
    from diffalign.drm.train import load_drm_config, train_drm

    cfg = load_drm_config(args.config, args.overrides)
    train_drm(cfg, overwrite=args.overwrite)
    print(f"DRM: {cfg.output_dir} (use with reward.name=drm reward.kwargs.path={cfg.output_dir})")
    return 0


def _cmd_sample(args) -> int:
    from diffalign.drm.sampling import check_sample_out, run_sample

    _check_sampling_args(args)
    check_sample_out(Path(args.out))
    prompts = list(args.prompt) if args.prompt else _eval_prompts(args)
    prompts = [p for p in prompts for _ in range(args.samples_per_prompt)]
    run_sample(model=args.model, prompts=prompts, out_dir=args.out, steps=args.steps, guidance_scale=args.guidance_scale,
               seed=args.seed, resolution=args.resolution, drm_path=args.drm, branches=args.branches, kernel=args.kernel,
               noise_level=args.noise_level, reward=args.reward, device=args.device)
    print(f"samples: {args.out}")
    return 0


def _config_command(sub, name: str, help: str, fn, *, config_help: str | None = None, optional: bool = False,
                    overwrite: str | None = None) -> argparse.ArgumentParser:
    """A subcommand taking a YAML config and ``dotted.key=value`` overrides (and ``--overwrite``)."""
    p = sub.add_parser(name, help=help)
    p.add_argument("config", nargs="?" if optional else None, help=config_help)
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    if overwrite:
        p.add_argument("--overwrite", action="store_true", help=overwrite)
    p.set_defaults(fn=fn)
    return p


NON_GPU_RECIPE_FOLDERS = ("tiny", "shapes", "accelerate")  # recipes `diffalign plan --all` skips: CPU models, launch files
DEFAULT_EVAL_GUIDANCE = 4.0  # eval's CFG scale: the shipped model's reported one (not its best; see --best-scale)

RUN_CONFIG_HELP = ("a YAML file, or a shipped recipe's name (shapes/flow_grpo: its path under configs/ without .yaml; "
                   "`diffalign recipes` lists them); a file that exists wins")


def build_parser() -> argparse.ArgumentParser:
    from diffalign import __version__
    from diffalign.config import BEST_SCALE_GRID, BEST_SCALE_VALIDATION_IMAGES  # no torch: --help stays quick

    parser = argparse.ArgumentParser(prog="diffalign", description="Align diffusion / flow-matching image models with RL.")
    parser.add_argument("--version", action="version", version=f"diffalign {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _config_command(sub, "train", "train from a YAML config: diffalign train CONFIG [key=value ...]", _cmd_train,
                        config_help=RUN_CONFIG_HELP, overwrite="delete a previous run in output_dir first")
    p.add_argument("--resume", action="store_true", help="continue the run in output_dir from its latest checkpoint")
    p.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: accept another model, algorithm, LoRA shape or prompt set (logged in the run directory)")
    p.add_argument("--no-plan-check", action="store_true",
                   help="on CUDA, do not compare the memory plan with the GPU's free memory before loading")

    p = _config_command(sub, "plan", "GPU memory per GPU of a recipe, counted before anything loads: "
                        "diffalign plan RECIPE [key=value ...] [--gpus N] [--gpu-memory GB]", _cmd_plan,
                        config_help=RUN_CONFIG_HELP, optional=True)
    p.add_argument("--gpus", type=int, default=1, help="processes (one GPU each); ZeRO and FSDP shard over them")
    p.add_argument("--gpu-memory", type=float, default=None, help="GB per GPU: say whether the plan fits, else settings that do")
    p.add_argument("--all", action="store_true", help="every shipped GPU recipe (all but tiny/, shapes/)")
    p.add_argument("--table", action="store_true",
                   help="the smallest GPU (24, 40, 48, 80 GB) each combination of settings fits")

    p = sub.add_parser("resume", help="continue a run directory: diffalign resume RUN_DIR [key=value ...]")
    p.add_argument("run_dir")
    p.add_argument("overrides", nargs="*", help="e.g. max_iterations=20")
    p.add_argument("--allow-config-change", action="store_true",
                   help="accept another model, algorithm, LoRA shape or prompt set (logged in the run directory)")
    p.set_defaults(fn=_cmd_resume)

    _config_command(sub, "config", "validate a config and print it resolved, with derived numbers", _cmd_config,
                    config_help=RUN_CONFIG_HELP)

    p = sub.add_parser("eval", help="held-out accuracy per family with 95 %% intervals for the base model and run "
                                    "directories, and each run's paired difference against the base; other rewards: "
                                    "the mean per model")
    p.add_argument("runs", nargs="*", help="run directories to compare with the base model they were trained from")
    p.add_argument("--base", default=None,
                   help="base model id (default: the runs' own base model, model.id of RUN/config.yaml; without runs "
                        "the shipped shapes model); runs trained from another base are refused")
    p.add_argument("--no-base", action="store_true", help="skip the base model column (and the paired differences)")
    p.add_argument("--prompts", default=None,
                   help="heldout (the headline evaluation) | probe (the generalisation probe) | train | validation "
                        "(training prompts set aside for choosing hyperparameters) | a file with one prompt per line "
                        "(default: heldout for ShapesEval, else the runs' own eval prompts)")
    p.add_argument("--images-per-family", type=int, default=96, help="ShapesEval: images per GenEval family (default 96)")
    p.add_argument("--num-prompts", type=int, default=0,
                   help="N prompts only (0 = all): a quick check, not the headline. ShapesEval: N images spread over "
                        "the families, each family's first (the header line names them); other rewards: the first N prompts")
    p.add_argument("--samples-per-prompt", type=int, default=None, help="other rewards: images per prompt (default 1)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance-scale", type=float, default=None,
                   help=f"CFG scale (default {DEFAULT_EVAL_GUIDANCE:g}, the shipped model's; not with --best-scale)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=64, help="images sampled per batch")
    p.add_argument("--best-scale", action="store_true",
                   help="ShapesEval: choose each model's CFG scale among --scales on the validation prompts (per-image "
                        "pass rate, ties: the lower scale), then evaluate the held-out prompts at it and pair each run "
                        "against the base at the base's own chosen scale. With the defaults about 2,000 images per "
                        "model: a few minutes per model for the shipped one on a 2-core CPU")
    p.add_argument("--scales", default=None, help="--best-scale: comma-separated CFG scales (default "
                                                  f"{','.join(f'{s:g}' for s in BEST_SCALE_GRID)})")
    p.add_argument("--validation-images-per-family", type=int, default=None,
                   help=f"--best-scale: validation images per family at each scale (default {BEST_SCALE_VALIDATION_IMAGES}; "
                        "--images-per-family is the held-out list's)")
    p.add_argument("--cache", default=None,
                   help="--best-scale: store every evaluation in this folder (one JSON per model, prompt set and "
                        "scale) and reuse it when present; refused when stored with other settings")
    p.add_argument("--reward", default=None,
                   help="shapes_eval (intervals and paired differences; ShapesWorld models only) or any reward (mean and "
                        "its summary only); default: the runs' own reward (reward.name and kwargs), shapes_eval without runs")
    p.add_argument("--mixed-precision", default="auto",
                   help="auto (bf16 autocast where the CPU has AVX512-BF16 or AMX, as train.mixed_precision: auto; "
                        "the default) | bf16 | no (fp32)")
    p.add_argument("--protocol", choices=("shapes", "geneval"), default="shapes",
                   help="geneval: GenEval's per-task %% correct images and prompts on --metadata for each RUN_OR_MODEL "
                        "(run directory or model id; default --base), judged by --url or --reward (docs/geneval.md)")
    p.add_argument("--metadata", default=None, help="geneval: GenEval's evaluation_metadata.jsonl")
    p.add_argument("--images-per-prompt", type=int, default=4, help="geneval: images per prompt (default 4, the paper's)")
    p.add_argument("--url", default=None, help="geneval: GenEval server scoring through the remote reward")
    p.add_argument("--out", default=None, help="geneval: write per-image results and scores to this JSON file")
    p.set_defaults(fn=_cmd_eval)

    p = sub.add_parser("export", help="a Hub-ready folder (weights, model card, sample grids) from a finished run")
    p.add_argument("run_dir")
    p.add_argument("--format", choices=("lora", "merged"), default=None,
                   help="lora: the LoRA weights alone, for pipe.load_lora_weights(DIR) on the base model (LoRA runs "
                        "only); merged: the whole pipeline with the trained weights, for DiffusionPipeline."
                        "from_pretrained(DIR) (the model card gives the exact call): a LoRA run's LoRA fused into "
                        "the base, a full fine-tune's weights as trained. Default: what the run trained, lora for "
                        "a LoRA run, merged for a full fine-tune")
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/export/FORMAT)")
    p.add_argument("--push-to-hub", metavar="USER/REPO", default=None, help="upload the folder (needs HF_TOKEN)")
    p.add_argument("--private", action="store_true", help="create the Hub repo private (the default)")
    p.add_argument("--public", action="store_true", help="create the Hub repo public (default: private)")
    p.add_argument("--license", default=None, help="model card license (default: diffalign's own, apache-2.0, for the models diffalign makes: "
                        "shapes, tiny:*; else other: the base model's license applies)")
    p.set_defaults(fn=_cmd_export)

    p = sub.add_parser("demo", help="Gradio app: base vs aligned images, rewards and x0 previews for one prompt")
    p.add_argument("--base", default=None, help="base model id (default: the aligned run's base model)")
    p.add_argument("--aligned", default=None, help="run directory with final/ (default: the latest one under runs/)")
    p.add_argument("--rewards", default=None, help="comma-separated reward names (default: shapes_eval for shapes runs, else the run's reward)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    p.add_argument("--auth", metavar="USER:PASS", default=None,
                   help="require this login (use it with --host or --share; or set DIFFALIGN_DEMO_AUTH)")
    p.add_argument("--device", default="cpu")
    p.set_defaults(fn=_cmd_demo)

    _config_command(sub, "train-spm", "train a step-aware preference model (SPO) on preference pairs: "
                    "diffalign train-spm [CONFIG] [key=value ...]", _cmd_train_spm, optional=True,
                    config_help="YAML config (diffalign.spm.train.SPMTrainConfig) or an spo recipe (shapes/spo); optional",
                    overwrite="replace a previous SPM in output_dir")

    _config_command(sub, "train-reward", "train a diffusion-based reward model (DRM) on preference pairs: "
                    "diffalign train-reward CONFIG", _cmd_train_reward, config_help="YAML config or a recipe name (shapes/drm_step_grpo)",
                    overwrite="replace a previous DRM in output_dir")

    p = sub.add_parser("sample", help="sample images: plain (ODE) or step-wise (k SDE branches per step, the best under a DRM kept)")
    p.add_argument("--model", default="shapes", help="model id or a run directory (its final/ weights)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable); else --prompts")
    p.add_argument("--prompts", default="heldout", help="heldout | probe | train | validation | a file with one prompt per line")
    p.add_argument("--num-prompts", type=int, default=8, help="first N prompts only (0 = all)")
    p.add_argument("--samples-per-prompt", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance-scale", type=float, default=4.0, help="CFG scale (default 4.0, as eval and the shipped model)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the first image's noise (default 1234, as eval)")
    p.add_argument("--resolution", type=int, default=0, help="0 = the model's default")
    p.add_argument("--drm", default=None, help="DRM folder (diffalign train-reward) for step-wise sampling")
    p.add_argument("--branches", type=int, default=1, help="k candidates per step; 1 = plain ODE sampling")
    p.add_argument("--kernel", default="flow_grpo", help="SDE kernel of the branches (flow_grpo, cps, dance; ddim for epsilon models)")
    p.add_argument("--noise-level", type=float, default=0.7)
    p.add_argument("--reward", default=None, help="also score the samples with this reward (e.g. shapes_eval)")
    p.add_argument("--out", default="samples", help="output folder: grid.png, samples.json")
    p.add_argument("--device", default="cpu")
    p.set_defaults(fn=_cmd_sample)

    p = sub.add_parser("list", help="known model families, rewards and algorithms")
    p.set_defaults(fn=_cmd_list)

    p = sub.add_parser("recipes", help="the shipped recipes: diffalign recipes [show NAME | path NAME]; "
                                       "NAME (e.g. shapes/flow_grpo) also works as CONFIG of train, config, train-spm, train-reward")
    p.add_argument("action", nargs="?", choices=("list", "show", "path"), default="list",
                   help="list (default): names and descriptions; show: print the file (> my.yaml to edit a copy); "
                        "path: print where the file is (e.g. for accelerate launch --config_file)")
    p.add_argument("name", nargs="?", help="a recipe name: its path under configs/ without .yaml (accelerate/ddp)")
    p.set_defaults(fn=_cmd_recipes)
    for p in sub.choices.values():
        p.add_argument("--quiet", action="store_true", help="no progress bars or phase lines (results and errors only)")
    return parser


def _reports(exc: BaseException) -> bool:
    """Whether this process prints ``exc``: an error every process of a launch raised together
    (``agreed``) is printed by the first one only (``RANK`` as torchrun and accelerate set it)."""
    return not getattr(exc, "agreed", False) or os.environ.get("RANK", "0") == "0"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # plain `diffalign`: what it can do, not an error
        parser.print_help()
        return 0
    # overrides may follow flags (`train c.yaml --overwrite a.b=1`): collect them from the leftovers
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from diffalign.import_noise import filter_known_import_messages

    filter_known_import_messages()  # before anything imports diffusers: the known import chatter of its dependencies
    if args.quiet:  # before anything imports torch or diffusers (see progress.silence_libraries)
        from diffalign import progress

        progress.set_quiet(True)
        progress.silence_libraries()
    try:
        return args.fn(args)
    except DiffalignError as exc:
        if _reports(exc):
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as exc:
        if _reports(exc):
            print(f"interrupted: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted; resume with: diffalign resume <output_dir>", file=sys.stderr)
        return EXIT_SIGINT


def _exit(code: int) -> None:
    """Exit with ``code``. A launched process (torchrun and accelerate set ``WORLD_SIZE``) leaves
    at once after flushing its output, without the interpreter's shutdown: FSDP2's device mesh and
    the modules keep gloo's process group, and its threads, alive after
    ``destroy_process_group`` (:func:`diffalign.distributed.end_process_group`), and tearing them
    down while Python finalizes can end in ``std::terminate`` (SIGABRT) after a finished run. Files
    are written and synced as they go and trackers are closed by the trainer, so nothing is left
    for the shutdown to do."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())
