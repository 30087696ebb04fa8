"""Rank 0's side of tensor parallelism: it owns the follower processes and sends them every step's plan.

Design: rank 0 holds the LLMEngine (scheduler, block manager, sampler) and its own model shard; ranks 1..N-1 are
child processes (torch.multiprocessing spawn, engine.runner.tp_follower) started at construction and stopped by
close() or when the TPFollowers object is collected. Each step, TPModelRunner sends the step's SchedulerOutput to
every follower before running it, so every rank runs the same plan over the same block tables (the one copy of
the block tables is rank 0's; followers never schedule). Logits are gathered on every rank; only rank 0 samples,
so seeded (and greedy) sampling is exactly TP=1's given the same logits. A decode step queued after one in flight
takes its input ids from rank 0's sampled tokens, broadcast on the device.
Failure: a follower that dies or raises fails the engine with TPError naming the rank (checked while it starts,
before rank 0 joins the group's rendezvous, before every step, while waiting for a step's tokens, and when a
collective errors); every wait is bounded (COLLECTIVE_TIMEOUT_S).
"""

from __future__ import annotations

import os
import signal
import time
import weakref
from pathlib import Path

import torch
import torch.multiprocessing as mp

from engine.config_error import ConfigError
from engine.engine_config import EngineConfig
from engine.model.model_config import ModelConfig
from engine.model.parallel import TPGroup
from engine.runner.model_runner import LaunchedStep, ModelRunner
from engine.runner.rank_service import RankCalls, RankServiceFactory
from engine.runner.step_extras import StepExtras
from engine.runner.step_inputs import StepInputs
from engine.runner.tp_follower import (
    COLLECTIVE_TIMEOUT_S,
    LAUNCHES,
    StepPlan,
    follower_main,
    host_store,
    open_group,
)

POLL_S = 0.05
STOP_TIMEOUT_S = 10.0


class TPError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot continue."""


def rank_devices(config: EngineConfig) -> list[torch.device]:
    """Rank r's device: the CPU for every rank, or cuda:device_ids[r] (default: consecutive from config.device)."""
    dev = torch.device(config.device)
    if dev.type != "cuda":
        return [dev] * config.tensor_parallel_size
    ids = config.device_ids or tuple(range(dev.index or 0, (dev.index or 0) + config.tensor_parallel_size))
    return [torch.device("cuda", i) for i in ids]


class TPFollowers:
    """The follower processes of one engine and their pipes; `tp` is rank 0's TPGroup; `calls` reaches the
    object `service` started in each follower (engine.runner.rank_service), None without one."""

    def __init__(self, config: EngineConfig, path: Path, mc: ModelConfig,
                 service: RankServiceFactory | None = None) -> None:
        size, devices = config.tensor_parallel_size, rank_devices(config)
        store, address = host_store(size)
        ctx = mp.get_context("spawn")
        self.procs, self.conns, call_conns = [], [], []
        self.failure: str | None = None
        self.launches = 0  # device work sent ("step", "copy", "warmup"): each follower launches it in this order
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            calls_parent, calls_child = ctx.Pipe() if service is not None else (None, None)
            proc = ctx.Process(target=follower_main, name=f"pdserve-tp-rank{rank}", daemon=True,
                               args=(rank, size, address, str(devices[rank]), config, str(path), mc, child,
                                     service, calls_child))
            proc.start()
            child.close()
            if calls_child is not None:
                calls_child.close()
                call_conns.append(calls_parent)
            self.procs.append(proc)
            self.conns.append(parent)
        self.calls = RankCalls(call_conns) if service is not None else None  # the followers' services
        groups: list[TPGroup] = []  # rank 0's group once open, torn down with the followers
        self._finalizer = weakref.finalize(self, _stop, list(self.procs), list(self.conns), call_conns, groups)
        # every follower says it is joining before rank 0 waits in the group's rendezvous, which would otherwise
        # sit out COLLECTIVE_TIMEOUT_S for a rank that died starting (an import, its device) and then not name it
        self._receive_all("joining")
        self.tp = open_group(address, 0, size, devices[0], config, store)
        groups.append(self.tp)

    def agree_blocks(self, mine: int) -> int:
        """Start-up: the fewest blocks any rank can hold; every rank allocates that many."""
        blocks = min([mine] + self._receive_all("ready"))
        self.send(("start", blocks))
        return blocks

    def wait_started(self) -> None:
        self._receive_all("started")

    def send(self, message: tuple) -> None:
        self.check()
        for conn in self.conns:
            conn.send(message)
        if message[0] in LAUNCHES:
            self.launches += 1

    def check(self, read_pipes: bool = True) -> None:
        """Raise TPError if a follower has died or (`read_pipes`: a step runs) reported an error, and from then on."""
        if self.failure is None:
            for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
                error = _pending_error(conn) if read_pipes else None
                if error is not None or not proc.is_alive():
                    self.failure = (f"tensor-parallel rank {rank} (pid {proc.pid}) "
                                    + (f"failed:\n{error}" if error else f"exited with code {proc.exitcode}")
                                    + "; the engine cannot continue")
                    break
        if self.failure is not None:
            raise TPError(self.failure)

    def kill(self, rank: int) -> int:
        """SIGKILL follower `rank` (operators' drills: a lost rank); returns its pid. The engine then fails at its
        next step or collective, as with any lost rank."""
        if not 1 <= rank <= len(self.procs):
            raise ValueError(f"no tensor-parallel rank {rank}: the followers are ranks 1..{len(self.procs)}")
        pid = self.procs[rank - 1].pid
        os.kill(pid, signal.SIGKILL)
        return pid

    def close(self) -> None:
        self._finalizer()

    def _receive_all(self, kind: str) -> list:
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        values = []
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll(POLL_S):
                self.check(read_pipes=False)
                if time.monotonic() > deadline:
                    raise TPError(f"tensor-parallel rank {rank} sent no {kind!r} within {COLLECTIVE_TIMEOUT_S} s")
            try:
                got, value = conn.recv()
            except (EOFError, OSError):  # its end closed: the process is gone or going
                self.procs[rank - 1].join(STOP_TIMEOUT_S)
                self.check(read_pipes=False)
                self.failure = f"tensor-parallel rank {rank} closed its pipe; the engine cannot continue"
                raise TPError(self.failure) from None
            if got == "config_error":  # the refusal rank 0 gives for its own slice (engine.model.checkpoint_checks)
                self.failure = f"tensor-parallel rank {rank} failed: {value}"
                raise ConfigError(value)
            if got == "error":
                self.failure = f"tensor-parallel rank {rank} failed:\n{value}"
                raise TPError(self.failure)
            values.append(value)
        return values


class _GuardedEvent:
    """A CUDA event whose synchronize() polls, checking the followers, so a dead rank cannot hang rank 0."""

    def __init__(self, event: torch.cuda.Event, followers: TPFollowers) -> None:
        self.event, self.followers = event, followers

    def synchronize(self) -> None:
        while not self.event.query():
            self.followers.check()
            time.sleep(50e-6)


class TPModelRunner(ModelRunner):
    """Rank 0's ModelRunner: sends each step's plan to the followers, then runs its own shard of it."""

    stages_pending_tokens = False  # the pending input tokens are gathered first, and broadcast (_ids_after)

    def __init__(self, *args, followers: TPFollowers, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.followers = followers

    def launch(self, sched, params, after: LaunchedStep | None = None, on_layer_done=None,
               extras: StepExtras | None = None) -> LaunchedStep:
        if sched.chunks:
            prompt = {rid: len(t.targets) for rid, t in extras.prompt.items() if t.targets} if extras else {}
            eager = bool(extras) or on_layer_done is not None
            pending = after is not None and self._take(after, sched) is not None  # then _ids_after broadcasts
            self.followers.send(("step", StepPlan(sched, pending, eager, prompt)))
        try:
            launched = super().launch(sched, params, after=after, on_layer_done=on_layer_done, extras=extras)
        except RuntimeError:
            self.followers.check()  # a collective failed because a rank died: say so
            raise
        if launched.sampled is not None and launched.sampled.copied is not None:
            launched.sampled.copied = _GuardedEvent(launched.sampled.copied, self.followers)
        return launched

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.followers.send(("copy", pairs))
        super().copy_blocks(pairs)

    def _ids_after(self, step: StepInputs, prev: torch.Tensor) -> torch.Tensor:
        return self.followers.tp.broadcast(super()._ids_after(step, prev))


def _pending_error(conn) -> str | None:
    try:
        if conn.poll():
            kind, value = conn.recv()
            return value if kind in ("error", "config_error") else f"unexpected message {kind!r}"
    except (EOFError, OSError):
        return None
    return None


def _stop(procs: list, conns: list, call_conns: list, groups: list[TPGroup]) -> None:
    """Ask each follower to stop and tear rank 0's side of the group down meanwhile (NCCL's teardown may wait for
    every rank's, and each follower tears its own down on "close"); then wait for the followers, terminating (and
    killing) those that do not exit within STOP_TIMEOUT_S, and close every pipe (the rank-service pipes only
    close: their threads end at EOF). With a follower already dead, rank 0's group is left to the process's exit:
    its teardown could wait for that rank forever."""
    for conn in conns:
        try:
            conn.send(("close", None))
        except (OSError, ValueError):
            pass
    if all(proc.is_alive() for proc in procs):
        for group in groups:
            group.close()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
            proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns + call_conns:
        conn.close()
