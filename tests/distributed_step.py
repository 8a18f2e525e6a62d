"""A DDP and an FSDP2 training step of a small model built from the generated modules, compared
with the same step on one GPU. Run on a machine with 2+ GPUs (NVLink multicast off):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc-per-node 2 tests/distributed_step.py

Exits non-zero when a parameter after the step differs from the single-GPU step by more than
fp32 all-reduce rounding allows.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from generated.add_layernorm import AddLayerNorm  # noqa: E402
from generated.layernorm import LayerNorm  # noqa: E402
from generated.rmsnorm import RMSNorm  # noqa: E402
from generated.softmax import softmax  # noqa: E402

HIDDEN, LAYERS, BATCH, SEQ = 256, 3, 8, 64
TOLERANCE = 2e-5


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = AddLayerNorm(HIDDEN, prenorm=True)
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)
        self.gate = RMSNorm(HIDDEN, weight_offset=1.0)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None):
        normed, residual = self.norm(hidden, residual)
        mixed = self.mix(normed)
        return self.gate(mixed * softmax(mixed, dim=-1)), residual


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.final = LayerNorm(HIDDEN, memory="invertible")
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, residual = x, None
        for block in self.blocks:
            hidden, residual = block(hidden, residual)
        return self.head(self.final(hidden + residual)).square().mean()


def step(model: torch.nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(batch).backward()
    optimizer.step()
    return {name: p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
            for name, p in model.named_parameters()}


def compare(label: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, value in want.items():
        key = name if name in got else f"module.{name}"
        worst = max(worst, (got[key].float() - value.float()).abs().max().item())
    print(f"{label}: max |param difference| after one step = {worst:.3g}", flush=True)
    return worst


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    reference = Model().to(device)
    batch = torch.randn(BATCH * world, SEQ, HIDDEN, device=device,
                        generator=torch.Generator(device=device).manual_seed(1))
    local = batch.chunk(world)[rank]
    # One GPU, the whole batch: the mean loss of the shards is the loss of the whole batch.
    single = step(copy.deepcopy(reference), batch)

    ddp = DistributedDataParallel(copy.deepcopy(reference), device_ids=[rank])
    worst = compare(f"rank {rank} DDP", step(ddp, local), single)

    sharded = copy.deepcopy(reference)
    for block in sharded.blocks:
        fully_shard(block)
    fully_shard(sharded)
    worst = max(worst, compare(f"rank {rank} FSDP2", step(sharded, local), single))
    dist.destroy_process_group()
    if worst > TOLERANCE:
        sys.exit(f"rank {rank}: parameters differ from the single-GPU step by {worst:.3g}")


if __name__ == "__main__":
    main()
