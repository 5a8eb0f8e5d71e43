"""Messages that dependencies log while they import, known to say nothing about the run, filtered.

Importing diffusers, transformers and peft imports the optional libraries they find installed
(torchao and bitsandbytes through their quantizer registries, DeepSpeed through accelerate on some
setups), whatever the run uses, and those libraries log as they load. Each entry below is one such
message, matched on the logger that emits it and on its text: a filter on that logger drops that
message and nothing else, so every other warning of the same library still shows. ``--quiet``
silences the libraries wholesale instead (:func:`diffalign.progress.silence_libraries`).

diffalign itself imports optional libraries (DeepSpeed, torchao, bitsandbytes, open_clip, ...) only
inside the code paths that use them.
"""

from __future__ import annotations

import logging
import re

# (logger name, message pattern, why it is harmless)
KNOWN_IMPORT_MESSAGES: tuple[tuple[str, str, str], ...] = (
    ("torchao", r"^Failed to load \S*torchao/_C\S*: Could not load this library",
     "torchao's prebuilt C++/CUDA kernels built for another torch or CUDA; its Python API loads without them"),
    ("torch.utils._pytree", r"^<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile",
     "torchao registering its enums with pytree as older torch releases needed"),
    ("bitsandbytes.backends.cpu.ops", r"^Failed to load CPU gemm_4bit_forward from kernels-community: ",
     "bitsandbytes' optional CPU kernel from the Hub's `kernels` package, refused untrusted or offline; "
     "the built-in path is used"),
    ("kernels._internals.hf_hub",
     r"^Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' because Hugging Face Hub "
     r"is in offline mode\.",
     "the same optional bitsandbytes kernel looked up with HF_HUB_OFFLINE=1"),
    ("diffusers.quantizers.torchao.torchao_quantizer", r"^Unable to import `torchao` Tensor objects\. ",
     "diffusers' torchao quantizer probing a torchao release it does not know; only torchao-serialized "
     "checkpoints need it"),
    ("transformers.utils.import_utils",
     r"^`\w+ImageProcessor` requires torchvision \(not installed\); falling back to `\w+ImageProcessorPil`",
     "transformers' PIL image processors stand in for the torchvision ones (diffusers' pipeline modules "
     "import the classes; diffalign preprocesses on tensors)"),
    ("DeepSpeed", r"^Setting accelerator to CPU\. If you have GPU or other accelerator, we were unable to detect it\.",
     "DeepSpeed's accelerator probe on a machine without a GPU (printed on stdout)"),
)


class KnownMessageFilter(logging.Filter):
    """Drops the records of one logger whose message matches ``pattern``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def filter_known_import_messages() -> None:
    """Attach the filters of :data:`KNOWN_IMPORT_MESSAGES` to their loggers (once; idempotent).
    Call it before the libraries import: they log while importing. A logger's filters survive the
    levels and handlers that torch and DeepSpeed set on their loggers when they import."""
    for name, pattern, _ in KNOWN_IMPORT_MESSAGES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownMessageFilter) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(KnownMessageFilter(pattern))
