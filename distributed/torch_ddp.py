"""torch.distributed DistributedDataParallel, launched by torchrun (or SLURM / a hand-made env)."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .single import SingleBackend


class DDPBackend(SingleBackend):
    name = "ddp"

    def setup(self) -> None:
        self.device = self._pick_device()
        if not dist.is_initialized():
            # env:// lets torchrun hand over its own store (and a fresh one after a restart); SLURM and
            # mpirun only describe the topology, so the variables are filled from it
            for key, value in (
                ("MASTER_ADDR", self.topo.master_addr),
                ("MASTER_PORT", self.topo.master_port),
                ("RANK", self.rank),
                ("WORLD_SIZE", self.world_size),
                ("LOCAL_RANK", self.local_rank),
            ):
                os.environ.setdefault(key, str(value))
            dist.init_process_group(
                "nccl" if self.device.type == "cuda" else "gloo",
                init_method="env://",
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(minutes=30),
            )

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def wrap_model(self, model):
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def accumulate(self, model, sync: bool):
        # no_sync: gradients of non-final micro-batches stay local, one all-reduce per optimizer step
        return super().accumulate(model, sync) if sync else model.no_sync()

    def all_reduce(self, tensor, op="mean"):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        if op == "mean":
            tensor /= self.world_size
        elif op != "sum":
            raise ValueError(f"unknown reduce op {op!r}")
        return tensor

    def broadcast_object(self, obj, src=0):
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()
