"""Horovod ring-allreduce (Gloo on CPU; NCCL or MPI where Horovod was built with them).

Done right where the reference went wrong: gradients are synchronized before they are unscaled and
clipped (`synchronize()`, then the step inside `skip_synchronize()`), accumulation defers the allreduce
with `backward_passes_per_step`, and the optimizer state saved is that of the object that steps.
Elastic runs (horovodrun --min-np/--max-np) are recovered from outside the loop: horovod_elastic.py.
"""

from __future__ import annotations

import dataclasses
import os
import time

import horovod.torch as hvd
import torch

from .base import Backend, Recovery, StepOptions, Workload
from .horovod_config import HorovodOptions
from .topology import Topology, pick_device
from .torch_parts import TorchStepper, torch_parts


class HorovodCollectives:
    def __init__(self, backend: HorovodBackend):
        self.backend = backend

    def all_reduce(self, tensor, op="mean"):
        if op not in ("mean", "sum"):
            raise ValueError(f"unknown reduce op {op!r}")
        tensor.copy_(hvd.allreduce(tensor, op=hvd.Average if op == "mean" else hvd.Sum))
        return tensor

    def all_reduce_async(self, tensor, op="sum"):
        if op not in ("mean", "sum"):
            raise ValueError(f"unknown reduce op {op!r}")
        handle = hvd.allreduce_async(tensor, op=hvd.Average if op == "mean" else hvd.Sum)
        return lambda: hvd.synchronize(handle)

    def all_gather(self, tensor):
        return _AllGather.apply(tensor)

    def explain(self, error):
        if type(error).__name__ != "HorovodInternalError":
            return None
        return (
            f"a Horovod collective failed ({error}): a rank stopped answering within --dist_timeout "
            f"{self.backend._opts.dist_timeout:g} s or died (Horovod's stall report above names the ranks it waited "
            "for); the other ranks stop. Resume with --resume auto"
        )

    def barrier(self) -> None:
        if self.backend._joining:  # the running workers wait in the state sync, not here (see _ring_started)
            return
        hvd.barrier()


class _AllGather(torch.autograd.Function):
    """hvd.allgather whose backward sums every rank's gradient of this rank's rows (Horovod's own averages
    them, which would shrink a contrastive loss's gradients by the world size under the optimizer's average)."""

    @staticmethod
    def forward(ctx, tensor):
        ctx.rows = tensor.shape[0]
        return hvd.allgather(tensor)

    @staticmethod
    def backward(ctx, grad):
        total = hvd.allreduce(grad.contiguous(), op=hvd.Sum)
        return total[hvd.rank() * ctx.rows : (hvd.rank() + 1) * ctx.rows]


class HorovodBackend(Backend):
    name = "horovod"

    def __init__(self, topo: Topology, opts: StepOptions = StepOptions(), options: HorovodOptions | None = None):
        super().__init__(topo, opts)
        self._options = options or HorovodOptions()
        self._elastic = os.environ.get("HOROVOD_ELASTIC") == "1"  # set by horovodrun --min-np/--max-np
        self._joining = False  # an elastic worker joining a running job: no collective before the state sync
        self._collectives = HorovodCollectives(self)
        self._stepper: TorchStepper | None = None  # set by prepare(); the elastic state commits its parts

    def setup(self) -> None:
        # --dist_timeout: Horovod's stall inspector names the ranks a collective waits for, then shuts down
        timeout = max(1, round(self._opts.dist_timeout))
        os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(1, min(60, timeout // 2))))
        os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(timeout))
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(timeout))
        if not hvd.is_initialized():
            hvd.init()
        if self._elastic:  # ranks come from Horovod's rendezvous and change as workers come and go
            self._refresh_topology()
            self._joining = _ring_started(training=False)
        elif hvd.size() != self.world_size or hvd.rank() != self.rank:
            raise RuntimeError(
                f"horovod sees rank {hvd.rank()}/{hvd.size()}, the launcher said {self.rank}/{self.world_size}"
            )
        self.device = pick_device(self.topo.local_rank)

    def teardown(self) -> None:
        if hvd.is_initialized():
            hvd.shutdown()

    def recovery(self) -> Recovery:
        """Elastic (horovodrun --min-np/--max-np): the loop runs again from its last commit when workers come or
        go (horovod_elastic.py); otherwise once."""
        if not self._elastic:
            return Recovery()
        self._options.validate()
        from .horovod_elastic import ElasticRecovery

        return ElasticRecovery(self, self._options.commit_every)

    def _reform_ring(self) -> None:
        """hvd.elastic.run's reset, then tell workers starting in the new ring that they join a running job."""
        hvd.shutdown()
        hvd.init()
        _ring_started(training=True)

    def _refresh_topology(self) -> None:
        self.topo = dataclasses.replace(
            self.topo,
            rank=hvd.rank(),
            world_size=hvd.size(),
            local_rank=hvd.local_rank(),
            local_world_size=hvd.local_size(),
            node_rank=hvd.cross_rank(),
        )

    def prepare(self, model, make_optimizer, make_scheduler, workload: Workload = Workload()):
        model = model.to(self.device)
        # every rank starts from rank 0's weights. Not hvd.broadcast_optimizer_state: on a new optimizer it
        # "initializes" the state by an optimizer.step() on zero gradients, which applies weight decay and
        # advances Adam's step count (so its bias correction) by one. A new optimizer's state is empty on
        # every rank, and a resumed one is read from the same checkpoint by every rank.
        if not self._elastic:  # elastic: the state sync at the start of the run broadcasts everything
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        compression = hvd.Compression.fp16 if self._options.horovod_compression == "fp16" else hvd.Compression.none

        def make_distributed_optimizer(m):
            return hvd.DistributedOptimizer(
                make_optimizer(m),
                named_parameters=m.named_parameters(),
                backward_passes_per_step=self._opts.accumulation_steps,  # one allreduce per optimizer step
                compression=compression,
                op=hvd.Average,
            )

        self._stepper, self._checkpointer = torch_parts(
            self,
            model,
            make_distributed_optimizer,
            make_scheduler,
            init_optimizer_state=self._init_optimizer_state,
            synchronize=lambda: self._stepper.optimizer.synchronize(),  # clipping must see the averaged gradients
            stepping=lambda: self._stepper.optimizer.skip_synchronize(),
        )
        return model, self._stepper.optimizer, self._stepper.scheduler

    def _init_optimizer_state(self) -> None:
        """The torch optimizer's own step on zero gradients, without Horovod's allreduce; the weights it moves
        and the state it creates are both overwritten by the checkpoint or state sync that follows."""
        optimizer = self._stepper.optimizer
        if len(optimizer.state) == 0:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            super(optimizer.__class__, optimizer).step()
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None


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
