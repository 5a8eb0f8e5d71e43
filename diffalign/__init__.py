"""diffalign: RL and preference alignment for diffusion and flow-matching image models."""

__version__ = "0.1.0"
__license__ = "Apache-2.0"  # SPDX id of pyproject.toml's license: the code and the shipped model's weights
