"""Regenerate diffalign/planner/activations.json: the activation memory of each family's blocks,
measured on CPU on the family's tiny build (one training micro-batch of 2 samples, fp32, CFG as in
the family's tiny recipe), for LoRA and full fine-tuning, with and without gradient checkpointing.

    python scripts/measure_activations.py [FAMILY ...]

Each entry gives elements per (row x token x width) per block of every block list, outside the
blocks, of the backward's working set and of a no-grad forward (diffalign.planner.measure); the
planner multiplies them by a recipe's rows, tokens, width, blocks and activation bytes. About
half a minute per family on two cores.
"""

from __future__ import annotations

import json
import sys
import time

import yaml

from diffalign import shipped
from diffalign.adapters import load_adapter
from diffalign.config_files import load_config
from diffalign.planner.measure import coefficients, measure_step
from diffalign.planner.memory import ACTIVATIONS, MEASURED_AS

MEASURE_BATCH = 2  # samples per micro-batch (x2 rows with CFG)
VARIANTS = {"lora": ["lora.enabled=true"], "lora_checkpointing": ["lora.enabled=true", "train.gradient_checkpointing=true"],
            "full": ["lora.enabled=false"], "full_checkpointing": ["lora.enabled=false", "train.gradient_checkpointing=true"]}


def tiny_recipes() -> dict[str, str]:
    """family -> its tiny recipe: configs/tiny/flow_grpo_FAMILY.yaml. Editing families (FLUX.1
    Kontext, Qwen-Image-Edit) run the blocks of their base family and are planned with its entry."""
    names = {r.name for r in shipped.available()}
    found = {}
    for recipe in sorted(names):
        model = (yaml.safe_load(shipped.find(recipe).path.read_text()) or {}).get("model", {}) if recipe.startswith("tiny/flow_grpo_") else {}
        family = str(model.get("id", "")).removeprefix("tiny:")
        if recipe in (f"tiny/flow_grpo_{family}", f"tiny/flow_grpo_ddim_{family}") and family not in MEASURED_AS:
            found[family] = recipe
    return found


def main(families: list[str]) -> None:
    table = json.loads(ACTIVATIONS.read_text()) if ACTIVATIONS.exists() else {"families": {}}
    table["how"] = ("measured by scripts/measure_activations.py on each family's tiny build (CPU, fp32, "
                    f"micro-batch {MEASURE_BATCH}): elements per row x token x width")
    recipes = tiny_recipes()
    for family in families or sorted(recipes):
        start = time.time()
        entry = {"recipe": recipes[family]}
        for variant, overrides in VARIANTS.items():
            cfg = load_config(recipes[family], [*overrides, f"train.batch_size={MEASURE_BATCH}"])
            adapter = load_adapter(cfg.model.id, **cfg.model.options)
            entry[variant] = coefficients(measure_step(adapter, cfg))
        table["families"][family] = entry
        print(f"{family}: {time.time() - start:.0f} s", file=sys.stderr)
    ACTIVATIONS.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
