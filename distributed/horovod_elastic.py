"""Horovod elastic training (`horovodrun --min-np N --max-np M --host-discovery-script ...`).

Horovod keeps training when workers are lost or added: every `--commit_every` steps each worker copies
the training state to host memory (a commit, which also checks for new hosts); when a worker dies the
survivors' next collective raises HorovodInternalError, they roll back to the last commit, Horovod
re-forms the ring without the lost worker, and training continues; new workers join at a commit. After
each change rank 0's state is broadcast to every worker.

Not `hvd.elastic.TorchState`: its optimizer sync is `broadcast_optimizer_state`, which on a joining
worker's empty optimizer runs a step on zero gradients *after* the weights were broadcast, moving that
worker's weights by the weight decay; its replicas then drift apart. Here optimizer state is created
first and the weights are broadcast last, and a checksum confirms every worker holds the same weights.
"""

from __future__ import annotations

import copy
import dataclasses

import horovod.torch as hvd
import torch
from horovod.common.elastic import State, run_fn

from .torch_parts import TorchStepper


class ElasticState(State):
    """Model, optimizer, scheduler and loss scaler (the HorovodBackend's TorchStepper) and the loop position,
    committed together. `backend`: the HorovodBackend whose ranks change and whose optimizer state it creates."""

    def __init__(self, backend, stepper: TorchStepper, pos, tracked: dict):
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
        self.backend, self.stepper, self.pos, self.tracked = backend, stepper, pos, tracked
        self.save()

    def _module(self):
        return self.backend._unwrap(self.stepper.model)

    def save(self) -> None:
        s = self.stepper
        self._saved = _on_cpu(
            {
                "model": self._module().state_dict(),
                "optimizer": s.optimizer.state_dict(),
                "scheduler": s.scheduler.state_dict(),
                "scaler": s.scaler.state_dict(),
                "pos": dataclasses.asdict(self.pos),
                "tracked": self.tracked,
            }
        )

    def restore(self) -> None:
        s = self.stepper
        self._module().load_state_dict(self._saved["model"])
        s.optimizer.load_state_dict(self._saved["optimizer"])  # Horovod's also drops pending allreduces
        s.scheduler.load_state_dict(self._saved["scheduler"])
        s.scaler.load_state_dict(self._saved["scaler"])
        for k, v in self.tracked.items():
            v.copy_(self._saved["tracked"][k])
        for k, v in self._saved["pos"].items():
            setattr(self.pos, k, v)  # the loop holds this object

    def reset(self) -> None:
        """After Horovod re-formed the ring: new ranks and size, and no half-accumulated gradients."""
        b = self.backend
        b._refresh_topology()
        for p in self._module().parameters():
            p.grad = None
        self.stepper.optimizer.set_backward_passes_per_step(b._opts.accumulation_steps)
        if b.is_main:
            print(f"elastic: continuing on {b.world_size} workers from step {self.pos.step}", flush=True)

    def sync(self) -> None:
        """Every worker takes rank 0's state (a joining worker has none; survivors restored the same commit)."""
        s = self.stepper
        if hvd.broadcast_object(len(s.optimizer.state) > 0, root_rank=0):
            self.backend._init_optimizer_state()  # a joining worker's Adam state, to be overwritten; moves its weights
            sd = s.optimizer.state_dict()  # its tensors are the optimizer's own: broadcast in place
            # rank 0's list: a joiner's fresh state also covers parameters that never had a gradient on rank 0
            keys = [(i, k) for i, st in sorted(sd["state"].items()) for k, t in st.items() if torch.is_tensor(t)]
            keys = hvd.broadcast_object(keys, root_rank=0)
            tensors = [(f"{i}.{k}", sd["state"][i][k]) for i, k in keys]
            hvd.broadcast_parameters(tensors, root_rank=0)
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
            groups = hvd.broadcast_object(hyper)
            for g, saved in zip(s.optimizer.param_groups, groups):
                g.update(saved)
        hvd.broadcast_parameters(self.tracked, root_rank=0)  # the EMA: a joiner's began at its own weights
        hvd.broadcast_parameters(self._module().state_dict(), root_rank=0)  # weights last
        rest = {
            "scheduler": s.scheduler.state_dict(),
            "scaler": s.scaler.state_dict(),
            "pos": dataclasses.asdict(self.pos),
        }
        rest = hvd.broadcast_object(rest)
        s.scheduler.load_state_dict(rest["scheduler"])
        s.scaler.load_state_dict(rest["scaler"])
        for k, v in rest["pos"].items():
            setattr(self.pos, k, v)
        self._check_replicas()
        self.save()  # a failure before the next commit rolls back to this synchronized state

    def _check_replicas(self) -> None:
        for what, tensors in (("weights", list(self._module().parameters())), ("EMA", list(self.tracked.values()))):
            if not tensors:
                continue
            total = torch.stack([t.detach().double().sum() for t in tensors]).sum().cpu()
            sums = hvd.allgather(total.view(1))
            if not torch.equal(sums, sums[:1].expand_as(sums)):
                raise RuntimeError(f"elastic sync left the workers with different {what} (sums {sums.tolist()})")


def _on_cpu(obj):
    """A copy of a nested state with every tensor on the host: a commit must not double device memory."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(v) for v in obj)
    return copy.deepcopy(obj)


class ElasticRecovery:
    """Runs the loop's steps and, when workers are lost or added, runs them again from the last commit on
    the new ring of workers (hvd.elastic.run's contract, with our state). The loop calls commit() after
    every step; every `commit_every` steps it copies the state to host memory and checks for new hosts.
    Made by HorovodBackend.recovery(); this file and horovod_backend.py are one backend, so it reads the
    backend's own parts."""

    world_size_may_change = True

    def __init__(self, backend, commit_every: int):
        self.backend, self.commit_every = backend, commit_every
        self._state, self._tracked = None, {}

    def track(self, tensors: dict) -> None:
        self._tracked.update(tensors)

    def drive(self, steps, pos):
        self._state = ElasticState(self.backend, self.backend._stepper, pos, self._tracked)
        self.backend._joining = False

        return run_fn(lambda state: steps(state.pos), self.backend._reform_ring)(self._state)

    def commit(self, pos) -> None:
        if pos.step % self.commit_every == 0:
            self._state.commit()  # raises HostsUpdatedInterrupt when workers are waiting to join
