"""Horovod ring-allreduce (Gloo on CPU; NCCL or MPI where Horovod was built with them).

Done right where the reference went wrong: gradients are synchronized before they are unscaled and
clipped (`synchronize()`, then the step inside `skip_synchronize()`), accumulation defers the allreduce
with `backward_passes_per_step`, and the optimizer state saved is that of the object that steps.
"""

from __future__ import annotations

import dataclasses
import os
import time

import horovod.torch as hvd
import torch
from horovod.common.elastic import run_fn

from .single import SingleBackend


class HorovodBackend(SingleBackend):
    name = "horovod"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.elastic = os.environ.get("HOROVOD_ELASTIC") == "1"  # set by horovodrun --min-np/--max-np
        self._state = None
        self._joining = False

    def setup(self) -> None:
        if not hvd.is_initialized():
            hvd.init()
        if self.elastic:  # ranks come from Horovod's rendezvous and change as workers come and go
            self._check_elastic_options()
            self.refresh_topology()
            self._joining = _ring_started(training=False)
        elif hvd.size() != self.world_size or hvd.rank() != self.rank:
            raise RuntimeError(
                f"horovod sees rank {hvd.rank()}/{hvd.size()}, the launcher said {self.rank}/{self.world_size}"
            )
        self.device = self._pick_device()

    @property
    def world_size_may_change(self) -> bool:
        return self.elastic

    def _check_elastic_options(self) -> None:
        """What must not depend on the number of workers, since workers come and go and joiners compute it anew."""
        o = self.options
        if not o.steps:
            raise ValueError(
                "horovodrun --min-np/--max-np: set --steps (with --epochs the step count would change with the workers)"
            )
        if o.global_batch_size:
            raise ValueError(
                "horovodrun --min-np/--max-np: drop --global_batch_size; the global batch follows the workers "
                "(--batch_size per worker)"
            )
        if o.commit_every < 1:
            raise ValueError(f"--commit_every must be at least 1 (got {o.commit_every})")

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
        self._joining = False

        def reset():  # hvd.elastic.run's, then tell workers starting in the new ring that they join a run
            hvd.shutdown()
            hvd.init()
            _ring_started(training=True)

        return run_fn(lambda state: steps(state.pos), reset)(self._state)

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
        if not self.elastic:  # elastic: the state sync at the start of the run broadcasts everything
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
        if self._joining:  # the running workers wait in the state sync, not here (see _ring_started)
            return
        hvd.barrier()


def _ring_started(training: bool, timeout: float = 600.0) -> bool:
    """Called by every worker right after hvd.init: rank 0 says whether this ring of workers is already
    training (after a reset) or just starting; the others wait for its word, through horovodrun's
    rendezvous store, which starts empty for each new ring. Returns whether this worker joins a run.

    A worker joining a running job must call no collective before the state sync, where the running
    workers wait (Horovod's rule for elastic jobs): its startup barriers (the BPE file, checkpoint
    loading) are skipped; what they guard exists already and the sync overwrites what it read."""
    from horovod.runner.http.http_client import put_data_into_kvstore, read_data_from_kvstore

    addr, port = os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"], os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"]
    if hvd.rank() == 0:
        put_data_into_kvstore(addr, port, "dalle-pytorch", "training", training)
        return False
    end = time.monotonic() + timeout
    while True:
        try:
            return bool(read_data_from_kvstore(addr, port, "dalle-pytorch", "training"))
        except RuntimeError:  # 404 until rank 0 has written it
            if time.monotonic() > end:
                raise TimeoutError(f"elastic: rank 0 did not start within {timeout:.0f}s") from None
            time.sleep(0.05)
