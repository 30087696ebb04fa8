"""KVPushes: the prefill side of a pushed KV handoff: the request's KV written into the blocks its decode worker
booked, layer group by layer group while the prompt's forward runs, instead of pulled by decode after it.

Owns the pushes (request id -> Push: the decode worker's agent and booked block ids once named, the writes queued)
and their write handles. Three threads meet here, each with its own part:
- the engine thread: `expect` (an engine call, as the prompt is added) opens a push, and `hook(sched)`
  (LLMEngine.step's layer_hook) returns, for a step holding chunks of expected pushes, a callback that after each
  layer group queues one write per request whose target is known by then, of every layer not yet written (on CUDA
  the copies wait on the device for the layers just launched; the host never waits);
- the engine thread again, at the step's end: `sampled` has the agent notify the decode worker of each request
  whose first token it sampled, once its writes have landed;
- the event loop: `target` names the blocks (any time: a target that comes while the forward is being launched
  still catches it), `finish` awaits a done request's writes (True only if every block landed), `settle` waits out
  an aborted one's;
- the transfer agent's threads move the data.
Blocks the decode worker's prefix cache held at its booking (the target's `skip`: the leading ones) are not written
at all. Each other block is written exactly once (two writes of one block could land in either order): full blocks
once their chunk's forward is launched, the last, partial block with the prompt's last chunk. A target that comes
after the last layer of the last chunk was launched is too late: that request is pulled (`finish` False), as is one
whose push failed or that was preempted (its blocks change). Prompts short enough for a prefill CUDA graph are not
pushed (a layer hook makes a step eager; their KV is small). The decode worker's notification leaves from the agent's
thread once the writes have landed (`sampled`: the engine thread hands it over at the step's end). The first token
leaves as soon as it is sampled (prefill_pool.prefills): it no longer waits for the last layer group's copy (on a
link slower than the forward, the part of the transfer the forward did not hide); the decode worker joins on the
notification once the writes have landed. Block ownership: the local blocks stay the request's (pinned after its
prefill) until release or abort, which the worker applies only after `finish` or `settle`: no copy reads a block
after it is reused.
"""

from __future__ import annotations

import asyncio
import math
import pickle
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.request import RequestStatus, TokenLogprob
from kvtransfer.errors import TransferError

if TYPE_CHECKING:
    from engine.core.scheduler import SchedulerOutput, StepOutput
    from engine.llm_engine import LLMEngine
    from kvtransfer.agent import KVAgent
    from kvtransfer.handle import TransferHandle

WRITES_PER_FORWARD = 16  # layer groups per step: the last group's copy is what remains after the last layer
MAX_EARLY = 4096  # targets kept for prefills not yet added (one whose prefill never comes is dropped in time)
SPIN_S = 0.005  # finish() polls the last copies' events this long on the loop, then leaves them to a thread


@dataclass
class Push:
    num_tokens: int              # tokens of the KV pushed (prompt + prior outputs)
    num_blocks: int              # the blocks they fill
    remote_ids: list[int] = field(default_factory=list)  # the decode worker's booked blocks (set before `remote`)
    remote: str | None = None    # its agent, once named
    skip: int = 0                # blocks [0, skip) are not written: the decode worker's prefix cache holds them
    written: int = 0             # blocks [0, written) are written (their writes queued), every layer
    closed: bool = False         # no more writes: the last chunk was launched, or the request ended here
    error: BaseException | None = None
    handles: list[TransferHandle] = field(default_factory=list)
    noticed: bool = False        # the decode worker's notification is on its way (sampled)


@dataclass
class _Plan:
    """One request's blocks [lo, hi) in one step, and the layers [0, sent) of them queued so far."""

    push: Push
    table: list[int]
    lo: int
    hi: int
    last: bool  # the prompt's last chunk
    sent: int = 0


class KVPushes:
    def __init__(self, agent: KVAgent, block_size: int, num_layers: int, timeout_s: float) -> None:
        self.agent, self.block_size, self.num_layers, self.timeout_s = agent, block_size, num_layers, timeout_s
        step = math.ceil(num_layers / min(WRITES_PER_FORWARD, num_layers))
        self.group_ends = {min(end, num_layers) for end in range(step, num_layers + step, step)}
        self._pushes: dict[str, Push] = {}
        self._early: OrderedDict[str, tuple[str, list[int], int]] = OrderedDict()  # targets before `expect`
        self.pushed = self.failed = self.late = 0  # outcomes, for /metrics (counters)

    def expect(self, e: LLMEngine, request_id: str) -> bool:
        """Engine call, right after the prompt was added: open its push (a target may come); False where it would
        not pay (a prompt that fits a prefill CUDA graph) or cannot be pushed (a group, prompt logprobs)."""
        req = e.scheduler.requests.get(request_id)
        graphs = getattr(e.runner, "prefill_graphs", None)
        if req is None or req.status != RequestStatus.WAITING or req.fork_params \
                or req.params.prompt_logprobs is not None \
                or (graphs is not None and req.num_tokens <= max(graphs.buckets.tokens, default=0)):
            return False
        push = self._pushes[request_id] = Push(req.num_tokens, math.ceil(req.num_tokens / self.block_size))
        early = self._early.pop(request_id, None)
        if early is not None and len(early[1]) >= push.num_blocks and early[2] < push.num_blocks:
            push.remote_ids, push.skip, push.remote = early[1], early[2], early[0]
        return True

    def target(self, request_id: str, remote: str, remote_ids: list[int], skip: int = 0) -> bool:
        """Name the blocks of agent `remote` to write `request_id`'s KV into (any thread), but for the first `skip`
        (that agent's worker holds their KV already: its prefix cache); False if it has no open push here (not
        expected, or ended) or `skip` leaves no block to write. Whether it came in time, `finish` says."""
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise ValueError(f"request {request_id!r}: skip must be a non-negative int, got {skip!r}")
        push = self._pushes.get(request_id)
        if push is None:  # its prefill call may not have reached the engine yet
            self._early[request_id] = (remote, list(remote_ids), skip)
            while len(self._early) > MAX_EARLY:
                self._early.popitem(last=False)
            return True
        if push.closed or push.remote is not None or len(remote_ids) < push.num_blocks or skip >= push.num_blocks:
            return False
        push.remote_ids = list(remote_ids)
        push.skip = skip
        push.remote = remote  # last: the engine thread writes once it sees this
        return True

    def counters(self) -> dict[str, int]:
        """Pushes landed whole; pushes that failed (the request was pulled instead); targets that came too late."""
        return {"push_completed_total": self.pushed, "push_fallbacks_total": self.failed,
                "push_late_total": self.late}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pushes

    def pending(self) -> bool:
        """Engine thread: whether a push is open (the next step may need `hook`; without one it may overlap)."""
        return bool(self._pushes)

    def forget(self, request_id: str) -> None:
        """The request's prefill ended without a push (not expected): drop a target that came for it."""
        self._early.pop(request_id, None)

    def hook(self, sched: SchedulerOutput) -> Callable[[int], None] | None:
        """LLMEngine.step's layer_hook (engine thread): the step's writes, queued layer group by layer group."""
        for rid in sched.preempted:
            push = self._pushes.get(rid)
            if push is not None and not push.closed:
                push.closed, push.error = True, TransferError(f"request {rid} was preempted during its push")
        plans = []
        for c in sched.chunks:
            push = self._pushes.get(c.request_id)
            if push is None or push.closed:
                continue
            end = c.start_pos + len(c.token_ids)
            last = end >= push.num_tokens
            hi = push.num_blocks if last else end // self.block_size
            plans.append(_Plan(push, c.block_table, push.written, hi, last))
        if not plans:
            return None

        def on_layer_done(layer: int) -> None:
            if layer + 1 not in self.group_ends:
                return
            for plan in plans:
                self._write(plan, layer + 1)
            if layer + 1 == self.num_layers:
                for plan in plans:
                    if plan.sent == self.num_layers:
                        plan.push.written = max(plan.push.written, plan.hi)
                    plan.push.closed = plan.push.closed or plan.last
        return on_layer_done

    def _write(self, plan: _Plan, upto: int) -> None:
        """Queue the write of layers [plan.sent, upto) of the plan's blocks (those past the target's skip), once
        the target is known."""
        push = plan.push
        if push.remote is None or push.error is not None:
            return
        lo = max(plan.lo, push.skip)  # skip is set before remote (target): seen here whenever remote is
        if plan.hi <= lo:
            return
        try:
            push.handles.append(self.agent.write(push.remote, plan.table[lo:plan.hi], push.remote_ids[lo:plan.hi],
                                                 layers=(plan.sent, upto), timeout=self.timeout_s))
            plan.sent = upto
        except TransferError as e:  # refused at once (the peer is lost): the request is pulled instead
            push.error = e

    def sampled(self, outputs: list[StepOutput], load: object = None) -> None:  # None: every output goes on
        """AsyncEngine's step_hook (engine thread): for each request whose first token this step sampled and whose
        every block's write is queued, have the agent send its decode worker the notification (`pushed_message`)
        once those writes have landed, from the agent's own thread (notify_after: not sent if one fails). This
        spares the hops through the worker's event loop between the last copy and the message."""
        for out in outputs:
            push = self._pushes.get(out.request_id)
            if push is None or push.noticed or push.remote is None or push.error is not None \
                    or push.written < push.num_blocks or out.finish_reason is not None or not out.new_token_ids:
                continue
            msg = pushed_message(out.request_id, out.new_token_ids[0],
                                 out.new_logprobs[0] if out.new_logprobs else None)
            try:
                self.agent.notify_after(push.remote, msg, list(push.handles), timeout=self.timeout_s)
                push.noticed = True
            except TransferError:  # refused at once (the peer is lost): decode() fails over as for any handoff
                pass

    async def finish(self, request_id: str) -> tuple[bool, float, str | None]:
        """The request's first token is out: wait for its writes; (every block pushed and landed, seconds waited,
        the decode agent still to notify: None if none was written to, or `sampled` sent it the notification
        already). Nothing of it is in flight afterwards, whatever the outcome."""
        push = self._pushes.get(request_id)
        if push is None:
            return False, 0.0, None
        t0 = time.monotonic()
        landed = await _landed(push.handles, t0 + self.timeout_s)
        ok = landed and push.error is None and push.written >= push.num_blocks
        self._pushes.pop(request_id, None)
        if ok:
            self.pushed += 1
        elif push.remote is None or (push.error is None and landed):
            self.late += 1
        else:
            self.failed += 1
        return ok, time.monotonic() - t0, None if push.noticed else push.remote

    async def settle(self, loop_call: Callable, request_id: str) -> None:
        """The request ends here (abort): stop its writes (an engine call, so no step queues more) and wait until
        those queued have ended (a finish() under way waits for the same writes)."""
        self._early.pop(request_id, None)
        if request_id not in self._pushes:
            return
        await loop_call(lambda e: self._close(request_id))
        push = self._pushes.get(request_id)
        if push is not None:
            await _landed(push.handles, time.monotonic() + self.timeout_s)
            self._pushes.pop(request_id, None)

    def _close(self, request_id: str) -> None:
        push = self._pushes.get(request_id)
        if push is not None:
            push.closed = True
            push.error = push.error or TransferError(f"request {request_id} ended during its push")


def pushed_message(request_id: str, first_token_id: int, first_logprob: TokenLogprob | None) -> bytes:
    """The notification a decode worker joins a pushed request on (decode_pool.decodes reads it)."""
    return pickle.dumps(("pushed", request_id, first_token_id, first_logprob))


async def _landed(handles: list[TransferHandle], deadline: float) -> bool:
    """Wait until every write has ended (each ends by its own deadline: the agent's); True if all landed. A
    cuda_ipc write's copy events are polled here (their end is the write's), sparing the hop through the agent's
    loop thread."""
    ok = True
    for h in handles:
        if h.gpu_done is not None:
            from kvtransfer.cache import event_done  # torch: only where a GPU copy runs

            try:
                await event_done(h.gpu_done, deadline, spin_s=SPIN_S)
                continue
            except TransferError:
                pass
        try:
            await asyncio.wrap_future(h.future)
        except Exception:  # noqa: BLE001 - a failed write (copies that ended all the same have landed)
            ok = ok and h.gpu_done is not None and h.gpu_done.query()
    return ok
