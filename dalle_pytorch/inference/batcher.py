"""The service's batching (serve.py): requests wait in a queue and one worker thread samples whatever is waiting as
one batch on the static KV cache: after the first request it waits for others while they keep coming (at most
`max_wait` seconds, and a fifth of that after the last arrival), up to `max_batch` image rows (vLLM's scheduler,
without paged memory: the model is small). Sampling is latency-bound at small batches, so requests that arrive
together share their decode steps, and a lone client waits a few milliseconds, not `max_wait`.

Every image row has a generator of its own, seeded with the image's seed, so an image is the same whether its
request ran alone or batched with others, and `generate.py --seed S --num_images 1` (the same sampling settings)
redraws it: each image is decoded alone, as generate.py decodes one image. Only requests with the same sampling
settings share a batch (the settings are the step's, not the rows'); the others wait for the next round, first
come first served. No training, no distributed: a model on one device."""

from __future__ import annotations

import collections
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..models.sampling import SJD_WINDOW, generate_image_tokens


@dataclass(frozen=True)
class Settings:
    """generate_image_tokens' sampling keywords; requests batch together only when theirs are equal."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    cond_scale: float = 1.0
    decoding: str = "sequential"
    window: int = SJD_WINDOW


@dataclass
class Job:
    text: torch.Tensor  # (1, text_seq_len) caption ids, or (1, text_seq_len, F) a frozen encoder's features
    seeds: list[int]  # one image per seed
    settings: Settings
    future: Future = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)


class Batcher:
    """Samples submitted captions in batches on a thread of its own; `submit` returns a Future of the images
    (n, c, s, s) in [0, 1]. Cancelling the Future before its batch starts drops the work."""

    def __init__(self, dalle, vae, max_batch: int = 16, max_wait: float = 0.05):
        if max_batch < 1 or max_wait < 0:
            raise ValueError(f"--max_batch must be >= 1 and --max_wait >= 0 (got {max_batch}, {max_wait})")
        self.dalle, self.vae, self.max_batch, self.max_wait = dalle, vae, max_batch, max_wait
        self.device = next(dalle.parameters()).device
        self.batches: collections.deque[int] = collections.deque(maxlen=1000)  # rows of the recent batches
        self.batches_run = 0  # since the start
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._held: list[Job] = []  # taken from the queue, waiting for a round with their settings
        self._thread = threading.Thread(target=self._run, name="dalle-batcher", daemon=True)
        self._thread.start()

    def submit(self, text: torch.Tensor, seeds: list[int], settings: Settings = Settings()) -> Future:
        one = text.shape[-2:] if text.is_floating_point() else text.shape[-1:]  # (T, F) features or (T,) ids
        job = Job(text.reshape(1, *one), list(seeds), settings)
        self._queue.put(job)
        return job.future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the worker thread
    def _run(self) -> None:
        while True:
            first = self._held.pop(0) if self._held else self._queue.get()
            if first is None:
                return
            jobs = self._gather(first)
            if jobs is None:
                return
            self._sample(jobs)

    def _gather(self, first: Job) -> list[Job] | None:
        """`first` and the jobs with its settings that are held or arrive while requests keep coming (see the
        module's docstring), up to max_batch rows; the others stay held for a later round, in their order."""
        jobs = [first]

        def take(job: Job) -> bool:  # into this round: the same settings, and room for its rows
            fits = job.settings == first.settings and sum(len(j.seeds) for j in jobs) + len(job.seeds) <= self.max_batch
            if fits:
                jobs.append(job)
            return fits

        self._held = [job for job in self._held if not take(job)]
        # Wait while requests keep coming: at most max_wait after the first, and no longer than a fifth of it after
        # the last one (a lone client then pays a few ms, not max_wait; a burst of clients is gathered whole)
        deadline, quiet = first.arrived + self.max_wait, self.max_wait / 5
        last = max(j.arrived for j in jobs)
        while sum(len(j.seeds) for j in jobs) < self.max_batch:
            try:
                job = self._queue.get(timeout=max(0.0, min(deadline, last + quiet) - time.monotonic()))
            except queue.Empty:
                break
            if job is None:  # closing: finish this round, then stop
                self._sample(jobs)
                return None
            last = job.arrived
            if not take(job):
                self._held.append(job)
        return jobs

    @torch.no_grad()
    def _sample(self, jobs: list[Job]) -> None:
        jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]  # a cancelled one is dropped
        if not jobs:
            return
        try:
            text = torch.cat([j.text.expand(len(j.seeds), *j.text.shape[1:]) for j in jobs]).to(self.device)
            generators = [torch.Generator(self.device).manual_seed(s) for j in jobs for s in j.seeds]
            self.batches.append(len(generators))
            self.batches_run += 1
            s = jobs[0].settings
            tokens = generate_image_tokens(
                self.dalle, text, generator=generators, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                cond_scale=s.cond_scale, decoding=s.decoding, window=s.window,
            )  # fmt: skip
            images = torch.cat([self.vae.decode(tokens[i : i + 1]) for i in range(len(tokens))]).cpu()
        except Exception as e:  # every request of the batch hears of it; the service goes on
            for j in jobs:
                j.future.set_exception(e)
            return
        start = 0
        for j in jobs:
            j.future.set_result(images[start : start + len(j.seeds)])
            start += len(j.seeds)
