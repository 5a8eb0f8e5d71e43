"""What a command prints before its own first line: nothing from the libraries underneath.

Importing diffusers, transformers and peft imports the optional libraries they find (torchao,
bitsandbytes, DeepSpeed), which log as they load; diffalign filters those known messages by logger
and text (:mod:`diffalign.import_noise`) and turns the libraries' loading bars off. The commands
run in subprocesses, as a user runs them, and are stopped once their run header is out.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from diffalign.import_noise import KNOWN_IMPORT_MESSAGES, KnownMessageFilter, filter_known_import_messages
from tests.helpers.tiny_run import ROOT

HEADER = "diffalign: "  # the run header's first line: "diffalign: flow_grpo on tiny:sd3 (...) -> RUN_DIR"
# One message of each entry as the library logs it (getMessage), and one it must keep.
SAMPLES = {
    "torchao": "Failed to load /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
               "Could not load this library: /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so",
    "torch.utils._pytree": "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an "
                           "opaque value type. Calling register_constant() on Enum subclasses is deprecated and will be an error "
                           "in a future release.",
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community: Kernel repository "
                                     "'kernels-community/quantization-bitsandbytes' could not verify publisher trust status.. "
                                     "Please make sure you already `pip install kernels` and the kernels >= 0.11.1",
    "kernels._internals.hf_hub": "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' because "
                                 "Hugging Face Hub is in offline mode.",
    "diffusers.quantizers.torchao.torchao_quantizer": "Unable to import `torchao` Tensor objects. This may affect loading "
                                                      "checkpoints serialized with `torchao`",
    "transformers.utils.import_utils": "`CLIPImageProcessor` requires torchvision (not installed); falling back to "
                                       "`CLIPImageProcessorPil` for backward compatibility. Install torchvision to use the "
                                       "default backend, or import `CLIPImageProcessorPil` directly to silence this warning.",
    "DeepSpeed": "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
}


def test_each_known_message_is_dropped_and_nothing_else():
    assert sorted(SAMPLES) == sorted(name for name, _, _ in KNOWN_IMPORT_MESSAGES)
    filter_known_import_messages()
    filter_known_import_messages()  # idempotent: one filter per logger
    for name, message in SAMPLES.items():
        logger = logging.getLogger(name)
        assert sum(isinstance(f, KnownMessageFilter) for f in logger.filters) == 1, name
        kept = []
        handler = logging.Handler()
        handler.emit = lambda record: kept.append(record.getMessage())
        logger.addHandler(handler)
        # what earlier code in this process may have switched off: a logging.config.dictConfig (uvicorn,
        # DeepSpeed) disables existing loggers, --quiet disables logging below ERROR process-wide
        old_level, logger.level = logger.level, logging.WARNING
        old_disabled, logger.disabled = logger.disabled, False
        old_disable = logging.root.manager.disable
        logging.disable(logging.NOTSET)
        try:
            logger.warning(message)
            logger.warning("Failed to load the checkpoint: " + message[:20])  # another message of the same logger
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
            logger.disabled = old_disabled
            logging.disable(old_disable)
        assert kept == ["Failed to load the checkpoint: " + message[:20]], name


def _lines_before_header(args: list[str]) -> tuple[list[str], str | None]:
    """stdout and stderr of ``diffalign ARGS`` (interleaved) up to its run header; the process is
    killed there."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "diffalign.cli", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    before: list[str] = []
    try:
        for line in proc.stdout:
            if line.startswith(HEADER):
                return before, line
            before.append(line.rstrip("\n"))
        return before, None
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("config", ["configs/tiny/flow_grpo_sd3.yaml", "configs/shapes/flow_grpo.yaml"])
def test_a_run_prints_nothing_before_its_header(config, tmp_path):
    before, header = _lines_before_header(["train", config, f"output_dir={tmp_path / 'run'}"])
    assert header is not None, before
    assert before == []


def test_a_bad_option_is_the_only_line_on_stderr(tmp_path):
    """An adapter option the model does not have: found once diffusers and the model are loaded."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "diffalign.cli", "train", "configs/tiny/flow_grpo_sd3.yaml",
                           f"output_dir={tmp_path / 'run'}", "model.options.foo=1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("error: cannot build 'tiny:sd3'") and "'foo'" in line
