"""The frozen target sharded over the processes of an FSDP launch: each holds 1/N of its decoder layers.

Head training runs the target forward only. Under `accelerate launch --config_file configs/accelerate/fsdp.yaml`
every decoder layer is wrapped with FSDP2's `fully_shard` over all the processes: a process keeps 1/N of each
layer's weights and gathers a layer's whole weights only for its forward (freed right after), so N devices train
heads for a target N times larger than one device holds. The embeddings, the final norm and the lm_head stay whole
(the losses read them outside the forward). Nothing of the target trains, so no optimizer state is kept for it.

Each forward gathers with every process, so every process must run the target the same number of times: the
training loop and the evaluation do; the feature cache pass pads a process's share with spare forwards
(`train/features.py`).
"""

from __future__ import annotations

import os

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's list of decoder layers (`model.get_decoder().layers`), or a ValueError naming the model class."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"cannot shard {type(model).__name__} over an FSDP launch: its decoder has no `layers` list")
    return layers


def fsdp_launch(accelerator) -> bool:
    """Whether this is an FSDP launch of two processes or more. On CPUs Accelerate runs such a launch as plain
    data parallel (its FSDP plugin needs accelerators) but still marks it (ACCELERATE_USE_FSDP): the heads then
    train as under DDP, and the target is sharded all the same."""
    from accelerate.utils import DistributedType

    asked = accelerator.distributed_type == DistributedType.FSDP or os.environ.get("ACCELERATE_USE_FSDP") == "true"
    return asked and accelerator.num_processes > 1


def shard_target(model: nn.Module, accelerator) -> bool:
    """Shard the frozen `model`'s decoder layers over the processes of an FSDP launch; returns whether it did."""
    if not fsdp_launch(accelerator):
        return False
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    return True


def held_share(model: nn.Module) -> tuple[int, int]:
    """(elements this process holds, elements in all) of the decoder layers' parameters."""
    held = total = 0
    for p in decoder_layers(model).parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # a sharded parameter is a DTensor
        held, total = held + local.numel(), total + p.numel()
    return held, total


def forwards_to_match(count: int, device: torch.device) -> int:
    """How many spare forwards this process runs so that every process ran as many as the busiest one."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    most = torch.tensor([count], device=device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return int(most.item()) - count
