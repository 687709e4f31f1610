"""Run ``train/distill.py`` under accelerate's FSDP on CPU processes (gloo), for tests only.

accelerate applies FSDP only on accelerators: a CPU process group is always plain DDP
(``DistributedType.MULTI_CPU``). Launched by ``accelerate launch --config_file
recipes/accelerate/fsdp.yaml`` (which exports the FSDP settings as ``FSDP_*`` variables), this shim
turns the CPU state into FSDP with the plugin those variables describe, so the drafter really is
sharded (FSDP2 ``fully_shard``, DTensor parameters) and the loop, checkpoints and final save run
exactly as they would on GPUs.

    accelerate launch --config_file recipes/accelerate/fsdp.yaml --num_processes 2 \\
        tests/helpers/fsdp_on_cpu.py recipe=tiny ...
"""

import sys
from pathlib import Path

import accelerate
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
_init = accelerate.Accelerator.__init__


def _fsdp_on_cpu(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    state = AcceleratorState()
    if state.distributed_type == DistributedType.MULTI_CPU:
        # AcceleratorState re-reads PartialState's fields when it is built again: change both.
        PartialState().distributed_type = state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables of the config
        print(f"fsdp on cpu: version {state.fsdp_plugin.fsdp_version}, "
              f"state dict {state.fsdp_plugin.state_dict_type}", flush=True)


accelerate.Accelerator.__init__ = _fsdp_on_cpu

if __name__ == "__main__":
    from models.support import run_cli
    from train.distill import main

    run_cli(main)
