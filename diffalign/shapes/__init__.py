"""The embedded default task: a world of coloured shapes with GenEval-style prompts.

``diffalign.shapes.world`` defines the shapes, colours, prompt grammar, train/held-out split,
scene sampler and renderer; ``reward_models.shapes_eval`` verifies generated images against it.
"""

from diffalign.shapes.world import (
    BACKGROUND,
    COLORS,
    FAMILIES,
    RELATIONS,
    SHAPES,
    ObjectSpec,
    PlacedObject,
    PromptError,
    PromptSpec,
    Scene,
    all_prompts,
    make_batch,
    parse_prompt,
    prompt_family,
    relation_holds,
    render,
    render_prompt,
    requirements_met,
    sample_scene,
    split_prompts,
    vocabulary,
)

__all__ = [
    "BACKGROUND",
    "COLORS",
    "FAMILIES",
    "RELATIONS",
    "SHAPES",
    "ObjectSpec",
    "PlacedObject",
    "PromptError",
    "PromptSpec",
    "Scene",
    "all_prompts",
    "make_batch",
    "parse_prompt",
    "prompt_family",
    "relation_holds",
    "render",
    "render_prompt",
    "requirements_met",
    "sample_scene",
    "split_prompts",
    "vocabulary",
]
