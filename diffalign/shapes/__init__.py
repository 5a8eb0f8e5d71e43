"""The embedded default task: a world of coloured shapes with GenEval-style prompts.

``diffalign.shapes.world`` defines the shapes, colours, prompt grammar and train/held-out split,
``diffalign.shapes.scenes`` the scene sampler, requirement check and renderer; ``reward_models.shapes_eval`` verifies generated images against it.
"""

from diffalign.shapes import scenes, world
from diffalign.shapes.scenes import *  # noqa: F401,F403 -- the names of scenes.__all__
from diffalign.shapes.world import *  # noqa: F401,F403 -- the names of world.__all__

__all__ = [*world.__all__, *scenes.__all__]
