"""diffalign: RL and preference alignment for diffusion and flow-matching image models."""

__version__ = "0.1.0"
