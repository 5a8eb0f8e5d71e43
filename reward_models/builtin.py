"""Imports every built-in reward module so that they register themselves.

Add a new module's import here. Modules must import heavy dependencies lazily.
"""

import importlib

_MODULES = [
    "reward_models.compression",
    "reward_models.clip_score",
    "reward_models.combine",
    "reward_models.pairwise",
    "reward_models.shapes_eval",
    "reward_models.shapes_soft",
    "reward_models.pickscore",
    "reward_models.aesthetic",
    "reward_models.hpsv2",
    "reward_models.imagereward",
    "reward_models.hpsv3",
    "reward_models.remote",
    "reward_models.vlm_judge",
    "reward_models.ocr",
    "reward_models.drm",
    "reward_models.spm",
    "reward_models.video",
    "reward_models.edit",
]

for _name in _MODULES:
    try:
        importlib.import_module(_name)
    except ModuleNotFoundError as exc:  # a module not written yet must not break the others
        if exc.name != _name:
            raise
