"""Align, evaluate and export from Python with the objects the CLI uses (about 20 lines of code).

    python scripts/python_api.py [OUTPUT_DIR] [key=value ...]     # default runs/python_api

Trains Flow-GRPO on the shipped ShapesWorld model for a few iterations, evaluates the base model
and the run on the held-out prompts with the same seeds (paired differences with 95 % intervals),
and exports the trained weights as a folder diffusers loads (the LoRA, or the merged pipeline when
the run fine-tuned all weights, as the main config does). See docs/python_api.md.
"""

import sys

from diffalign.adapters import load_adapter
from diffalign.config_files import load_config
from diffalign.evaluation import comparison_columns, evaluate_shapes, format_table
from diffalign.export import default_format, export_run, load_trained_adapter
from diffalign.trainer import build_trainer
from diffalign.shapes import split_prompts

out = sys.argv[1] if len(sys.argv) > 1 else "runs/python_api"
cfg = load_config("configs/shapes/flow_grpo.yaml", [f"output_dir={out}", "max_iterations=4", *sys.argv[2:]])
cfg.log.progress_bar = False  # overrides in code: the config is a tree of dataclasses
trainer = build_trainer(cfg, overwrite=True)
trainer.train()  # writes OUTPUT_DIR: checkpoints, metrics.jsonl, report.md, final/

prompts = split_prompts().evaluation()  # held-out prompts + the in-distribution families
images = cfg.eval.images_per_family
base = evaluate_shapes(load_adapter(cfg.model.id), prompts, images_per_family=images)
run = evaluate_shapes(load_trained_adapter(out), prompts, images_per_family=images)  # same seeds: paired
print(format_table(comparison_columns({"base": base, "run": run}, base="base")))
fmt = default_format(out)  # what was trained: "lora", or "merged" (the whole pipeline) for a full fine-tune
print(f"{fmt} weights exported to", export_run(out, fmt))
