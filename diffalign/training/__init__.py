"""The parts the :class:`~diffalign.trainer.Trainer` composes, each usable and testable alone.

- :mod:`~diffalign.training.policy`: LoRA (or full fine-tuning), the frozen reference, EMA weights;
- :mod:`~diffalign.training.backend`: the optimizer and its step on one process, DDP, ZeRO or FSDP,
  with non-finite losses and gradients skipped and counted;
- :mod:`~diffalign.training.rewards`: calling and checking the reward, on a worker thread;
- :mod:`~diffalign.training.metrics`: statistics averaged over processes, eval summaries;
- :mod:`~diffalign.training.evaluator`: the held-out evaluation and its records;
- :mod:`~diffalign.training.checkpoints`: run state, checkpoints, resume, the final weights;
- :mod:`~diffalign.training.groups`: an iteration's prompts and noise for group rollouts;
- :mod:`~diffalign.training.checks`: the on-policy self-check.
"""
