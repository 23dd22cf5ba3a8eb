"""The in-process session: one model host and the threads that run the clients' calls.

    session = create_session(SessionSpec(model="tiny", lora=LoraSettings(rank=8)))
    tc = session.training_client                      # session.clients, over this executor
    tc.forward_backward(datums, "ppo"); tc.optim_step(AdamParams(learning_rate=3e-4))

All calls that touch the model run on one worker thread, the trainer's lane, in submission
order, so a forward_backward and an optim_step may both be submitted before either is awaited.
Forward(_backward) calls are pipelined on that lane: a call's work is queued on the device
(`host.launch_forward`, which never waits for the GPU), then the results of the call before it
are read back (`host.read_back`), so the host prepares and launches call n + 1 while the GPU
still runs call n's backward; the last call's results are read when the lane has nothing else
queued. Futures resolve in the order of the calls, each with what `host.forward` returns.
A SamplingClient is bound to the weights version it was created with: it swaps that LoRA
snapshot in for its calls and the trainer's weights back afterwards. With vLLM (an engine with
weights of its own) its `sample` and `play` instead run in order on a second thread, the
sampler's lane, from the version's snapshot, so a rollout can run while the trainer updates
(`algorithm.off_policy_steps=1`); `compute_logprobs` (the model's own forward) stays on the first.

The behaviour is the public functions of `session.host`; the Ray backend (`workbench.cluster`)
runs the same functions inside its trainer and sampler actors.
"""

from __future__ import annotations

import json
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from workbench.model import LoraSettings
from workbench.session import checkpoint, host
from workbench.session.clients import Call, TrainingClient
from workbench.session.host import ModelHost
from workbench.session.spec import SessionSpec
from workbench.session.types import Datum


class Session:
    """An in-process session: one model host and the thread that runs its calls in order. With
    an engine that samples from weights of its own (vLLM), sampling calls run in order on a
    second thread, the sampler lane, beside the trainer's calls (`overlaps_sampling`). It is the
    clients' `Executor` with one replica and one engine."""

    recoverable_errors: tuple[type[BaseException], ...] = ()  # nothing to reopen in-process

    def __init__(self, model_host: ModelHost, spec: SessionSpec | None = None) -> None:
        self.host, self.spec = model_host, spec
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="workbench-session")
        self._sampler_pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="workbench-sampler") \
            if model_host.engine.samples_own_weights else self._pool
        self.training_client = TrainingClient(self)
        self._launched: deque = deque()  # (future, launched call): read back on the lane only

    @property
    def workdir(self) -> Path:
        return self.host.workdir

    @property
    def overlaps_sampling(self) -> bool:
        """Whether sampling calls run beside the trainer's (a lane of their own)."""
        return self._sampler_pool is not self._pool

    def submit(self, fn: Call, *args: Any) -> Future:
        """Queue fn(host, *args) behind the trainer's calls submitted before it (and every
        sampling call too, unless the session `overlaps_sampling`)."""
        return self._pool.submit(fn, self.host, *args)

    def submit_all(self, fn: Call, *args: Any) -> Future:
        """One replica: `submit`."""
        return self.submit(fn, *args)

    def submit_batch(self, fn: Call, datums: list[Datum], *args: Any) -> Future:
        """One replica: fn(host, datums, *args) on the trainer's lane; `host.forward` pipelined
        (the module docstring)."""
        if fn is not host.forward:
            return self.submit(fn, datums, *args)
        done: Future = Future()
        self._pool.submit(self._launch, done, datums, *args)
        return done

    def _launch(self, done: Future, datums: list[Datum], *args: Any) -> None:
        """On the trainer's lane: queue a forward call's device work, then read back the calls
        launched before it; its own results wait for the next call, or for the read-back queued
        behind everything submitted so far."""
        try:
            launched = host.launch_forward(self.host, datums, *args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through its future
            self._read_back()
            done.set_exception(exc)
            return
        self._read_back()
        self._launched.append((done, launched))
        try:
            self._pool.submit(self._read_back)
        except RuntimeError:  # the session is closing: no call comes after this one
            self._read_back()

    def _read_back(self) -> None:
        """Resolve the launched calls' futures, oldest first (on the trainer's lane)."""
        while self._launched:
            done, launched = self._launched.popleft()
            try:
                done.set_result(host.read_back(launched))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)

    def submit_sampling(self, fn: Call, *args: Any, model: bool = False) -> Future:
        """Queue a sampling call fn(host, *args): behind the sampling calls before it, and
        beside the trainer's when the session `overlaps_sampling` (else behind every call).
        model: fn runs the model's own forward, so it goes on the trainer's lane."""
        return (self._pool if model else self._sampler_pool).submit(fn, self.host, *args)

    def submit_spread(self, fn: Call, items: list[Any], *args: Any, seed: int) -> Future:
        """One engine: fn(host, items, *args, seed) on the sampler's lane."""
        return self.submit_sampling(fn, items, *args, seed)

    def sync_weights(self) -> int:
        """Snapshot the trainer's weights as a sampler version (on the trainer's lane)."""
        return self.submit(host.save_version).result()

    def close(self) -> None:
        """Finish the queued calls, then free the sampler engine (vLLM's process and GPU share)."""
        self._sampler_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        host.close(self.host)

    def report_metrics(self, row: dict[str, Any], run: str) -> Future:
        """Nothing to report to in-process (on Ray: Ray's metrics) -> Future[0]."""
        done: Future = Future()
        done.set_result(0)
        return done

    def speed_metrics(self) -> Future:
        """`speed/*` of the host: 1.0 per fast path running, 0.0 per one that fell back
        -> Future[dict[str, float]]."""
        return self.submit_sampling(host.speed_metrics)  # in order with the rollouts

    def describe(self) -> dict[str, Any]:
        """Model source, base hash, LoRA settings (for manifests)."""
        return host.describe_host(self.host)


def create_session(spec: SessionSpec = SessionSpec()) -> Session:
    """Build the host of `spec` in this process (load the base, hash it, wrap it in LoRA, the
    sampler engine, the fast paths) and start its worker thread. `workbench.opener.open_session`
    picks this or the Ray backend from the spec's cluster."""
    return Session(host.make_host(spec), spec)


def create_session_from_state(path: str | Path, with_optimizer: bool = True,
                              spec: SessionSpec = SessionSpec()) -> Session:
    """A session resumed from a saved state (weights and, by default, optimiser): its model and
    LoRA settings come from the state, the rest from `spec`."""
    meta = json.loads((Path(path) / checkpoint.SESSION_FILE).read_text())
    lora = LoraSettings.from_dict(meta["lora"])
    session = create_session(replace(spec, model=meta["model"], lora=lora))
    session.training_client.load_state(path, with_optimizer).result()
    return session
