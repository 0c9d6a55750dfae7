"""Horovod ring-allreduce (Gloo on CPU; NCCL or MPI where Horovod was built with them).

Done right where the reference went wrong: gradients are synchronized before they are unscaled and
clipped (`synchronize()`, then the step inside `skip_synchronize()`), accumulation defers the allreduce
with `backward_passes_per_step`, and the optimizer state saved is that of the object that steps.
"""

from __future__ import annotations

import dataclasses
import os

import horovod.torch as hvd
import torch

from .single import SingleBackend


class HorovodBackend(SingleBackend):
    name = "horovod"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.elastic = os.environ.get("HOROVOD_ELASTIC") == "1"  # set by horovodrun --min-np/--max-np
        self._state = None

    def setup(self) -> None:
        if not hvd.is_initialized():
            hvd.init()
        if self.elastic:  # ranks come from Horovod's rendezvous and change as workers come and go
            self.refresh_topology()
        elif hvd.size() != self.world_size or hvd.rank() != self.rank:
            raise RuntimeError(
                f"horovod sees rank {hvd.rank()}/{hvd.size()}, the launcher said {self.rank}/{self.world_size}"
            )
        self.device = self._pick_device()

    def refresh_topology(self) -> None:
        self.topo = dataclasses.replace(
            self.topo,
            rank=hvd.rank(),
            world_size=hvd.size(),
            local_rank=hvd.local_rank(),
            local_world_size=hvd.local_size(),
            node_rank=hvd.cross_rank(),
        )

    def run(self, steps, pos):
        if not self.elastic:
            return steps(pos)
        from .horovod_elastic import ElasticState

        self._state = ElasticState(self, pos)
        return hvd.elastic.run(lambda state: steps(state.pos))(self._state)

    def commit(self, pos) -> None:
        if self._state is not None and pos.step % self.options.commit_every == 0:
            self._state.commit()  # raises HostsUpdatedInterrupt when workers are waiting to join

    def teardown(self) -> None:
        if hvd.is_initialized():
            hvd.shutdown()

    def wrap_optimizer(self, optimizer, model):
        # every rank starts from rank 0's weights. Not hvd.broadcast_optimizer_state: on a new optimizer it
        # "initializes" the state by an optimizer.step() on zero gradients, which applies weight decay and
        # advances Adam's step count (so its bias correction) by one. A new optimizer's state is empty on
        # every rank, and a resumed one is read from the same checkpoint by every rank.
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        compression = (
            hvd.Compression.fp16
            if getattr(self.options, "horovod_compression", "none") == "fp16"
            else hvd.Compression.none
        )
        return hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            backward_passes_per_step=self.accumulation_steps,  # one allreduce per optimizer step
            compression=compression,
            op=hvd.Average,
        )

    def init_optimizer_state(self) -> None:
        # the torch optimizer's own step on zero gradients, without Horovod's allreduce; the weights it moves
        # and the state it creates are both overwritten by the checkpoint being loaded
        if len(self.optimizer.state) == 0:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            super(self.optimizer.__class__, self.optimizer).step()
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def synchronize_gradients(self) -> None:
        self.optimizer.synchronize()  # wait for the allreduce: clipping must see the averaged gradients

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()  # horovod's wrapper has no set_to_none

    def after_synchronize(self):
        return self.optimizer.skip_synchronize()

    def all_reduce(self, tensor, op="mean"):
        if op not in ("mean", "sum"):
            raise ValueError(f"unknown reduce op {op!r}")
        out = hvd.allreduce(tensor, op=hvd.Average if op == "mean" else hvd.Sum)
        tensor.copy_(out)
        return tensor

    def broadcast_object(self, obj, src=0):
        return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self) -> None:
        hvd.barrier()
