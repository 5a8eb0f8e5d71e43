"""The SLURM script scripts/slurm/train.sbatch and the several-node accelerate config, checked
without a cluster: bash parses the script, and it runs under SLURM variables set by hand with srun,
scontrol and accelerate replaced through its variables (SRUN, SCONTROL, ACCELERATE) by small scripts
that run each node's task in turn and record the launcher's arguments. accelerate's own launch
parser then reads those arguments as it would on every node. (tests/test_distributed.py runs two
nodes for real, on loopback.)"""

import json
import os
import subprocess
import sys

import pytest
import yaml

SCRIPT = "scripts/slurm/train.sbatch"

# srun as SLURM runs it in an allocation: the task once per node, with that node's SLURM_NODEID
FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node SLURM_PROCID=$node "$@" || exit $?; done
"""
# scontrol show hostnames: the allocation's hosts, one per line (a fixed allocation here)
FAKE_SCONTROL = """#!/bin/bash
[[ "$1 $2 $3" == "show hostnames gpu-[07-08]" ]] || { echo "unexpected: $*" >&2; exit 1; }
printf 'gpu-07\\ngpu-08\\n'
"""
# accelerate: one JSON line per call with its arguments and the node it ran on
FAKE_ACCELERATE = f"""#!{sys.executable}
import json, os, sys
print(json.dumps({{"node": os.environ["SLURM_NODEID"], "argv": sys.argv[1:]}}))
"""


def _fakes(tmp_path):
    paths = {}
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("accelerate", FAKE_ACCELERATE)):
        paths[name] = tmp_path / name
        paths[name].write_text(text)
        paths[name].chmod(0o755)
    return paths


def run_script(tmp_path, args, **env):
    fakes = _fakes(tmp_path)
    env = {"PATH": os.environ["PATH"], "SRUN": str(fakes["srun"]), "SCONTROL": str(fakes["scontrol"]),
           "ACCELERATE": str(fakes["accelerate"]), **env}
    return subprocess.run(["bash", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=60)


def test_slurm_script_parses():
    res = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def test_slurm_script_launches_one_accelerate_per_node(tmp_path):
    """Two nodes of four GPUs: node r runs ``accelerate launch`` with machine_rank r of 2, eight
    processes in all, the rendezvous on the first host, then the training command and overrides."""
    res = run_script(tmp_path, ["configs/tiny/flow_grpo_sd3.yaml", "max_iterations=3", "optim.lr=1e-4"],
                     SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu-[07-08]", SLURM_GPUS_ON_NODE="4",
                     TRAIN_ARGS="train.fsdp=true lora.enabled=false")
    assert res.returncode == 0, res.stderr
    calls = [json.loads(line) for line in res.stdout.splitlines()]
    assert [c["node"] for c in calls] == ["0", "1"]
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    for node, call in enumerate(calls):
        argv = call["argv"]
        assert argv[0] == "launch"
        args = _validate_launch_command(launch_command_parser().parse_args(argv[1:]))[0]
        assert args.config_file == "configs/accelerate/multi_node_ddp.yaml"
        assert (args.num_machines, args.machine_rank, args.num_processes) == (2, node, 8)
        assert (args.main_process_ip, args.main_process_port) == ("gpu-07", 29500)
        assert args.module and args.training_script == "diffalign.cli"
        assert args.training_script_args == ["train", "configs/tiny/flow_grpo_sd3.yaml", "max_iterations=3", "optim.lr=1e-4",
                                             "train.fsdp=true", "lora.enabled=false"]
        assert args.multi_gpu and not args.cpu  # torch.distributed.run, one process per GPU
    assert "2 nodes x 4 processes, rendezvous at gpu-07:29500" in res.stderr


def test_slurm_script_settings_from_the_environment(tmp_path):
    res = run_script(tmp_path, ["CONFIG"], SLURM_NNODES="3", SLURM_JOB_NODELIST="gpu-[07-08]", GPUS_PER_NODE="2",
                     MAIN_PROCESS_IP="10.1.2.3", MAIN_PROCESS_PORT="31000", ACCELERATE_CONFIG="my.yaml")
    assert res.returncode == 0, res.stderr
    argv = [json.loads(line)["argv"] for line in res.stdout.splitlines()]
    assert len(argv) == 3
    expected = ["--config_file", "my.yaml", "--num_machines", "3", "--num_processes", "6",
                "--main_process_ip", "10.1.2.3", "--main_process_port", "31000"]
    for node, a in enumerate(argv):
        flags = dict(zip(a[1::2], a[2::2]))
        assert flags["--machine_rank"] == str(node)
        assert all(flags[k] == v for k, v in zip(expected[::2], expected[1::2]))


@pytest.mark.parametrize("args, env, needle", [
    ([], {"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-[07-08]"}, "usage: sbatch"),
    (["CONFIG"], {}, "not inside a SLURM allocation"),
])
def test_slurm_script_bad_use_exits_2(tmp_path, args, env, needle):
    res = run_script(tmp_path, args, **env)
    assert res.returncode == 2 and res.stdout == ""  # nothing launched
    assert needle in res.stderr


def test_multi_node_config_documents_its_placeholders():
    """Every per-node value of the several-node config is a flag the launch overrides, named in its comments."""
    text = open("configs/accelerate/multi_node_ddp.yaml").read()
    cfg = yaml.safe_load(text)
    assert cfg["distributed_type"] == "MULTI_GPU" and cfg["same_network"] and cfg["rdzv_backend"] == "static"
    for key in ("num_machines", "num_processes", "machine_rank", "main_process_ip", "main_process_port"):
        assert key in cfg and f"--{key}" in text, key
