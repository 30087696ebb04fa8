"""PrefillLane: a step's prompt chunks computed beside the decode steps that follow, not inside them (issue 43).

Chunked prefill puts a prompt's chunk into every decode step until the prompt is done, so each running stream's
step grows by the chunk's cost (an 8B 2,048-token chunk: ~50 ms on an H200). With a lane, the engine hands the
step's prompt chunks to `start`, which hands their whole forward to the lane's own thread and returns at once; that
thread queues it on the prefill lane's stream (the GPU's SMs left over from the decode lane: engine.runner.sm_lanes),
so the few hundred eager launches of a long prompt's forward never delay the engine thread's next decode step. The
decode rows, and the decode-only steps after them while the prompt runs, replay decode graphs captured on the decode
lane's stream. Decode kernels then
never wait behind queued prefill kernels for SMs (measured in benchmarks/sm_split.py). When `ready()`, `finish`
computes the prompt's logits and samples on the engine's stream; the engine then applies it like any step.

With a table of splits (engine.lane_splits) the lane holds one split per SM count in it, each with its green
contexts and its decode graphs; a job takes the split its decode batch asks for when it starts, and keeps it.

Owns the splits, the two streams' ordering (each lane waits for the engine's stream before its work, the engine's
stream waits for the decode lane after each decode step), the launching thread and the one job in flight; the
scheduler (Scheduler.held) keeps the job's requests out of other steps and out of preemption until `finish`. On the
CPU there are no lanes: `start` computes the forward at once (same order, same results), which lets CPU tests cover
the engine's lane logic and the choice of split.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import SchedulerOutput
from engine.lane_splits import SplitTable, decode_sms_for
from engine.runner.cuda_graphs import DecodeGraphs
from engine.runner.model_runner import LaunchedStep, ModelRunner
from engine.runner.rank_setup import FIRST_DECODE_BUCKETS
from engine.runner.sm_lanes import SmLanes
from engine.runner.step_inputs import StepInputs, build_step_inputs

RATE_MIN_TOKENS = 256  # shorter jobs time mostly the step that notices them done
RATE_EWMA = 0.3
log = logging.getLogger(__name__)


@dataclass
class LaneSplit:
    """One split of the GPU's SMs: the decode lane's size asked for, its green contexts and its decode graphs."""

    decode_sms: int
    lanes: SmLanes | None          # None on the CPU (no split)
    graphs: DecodeGraphs | None    # decode graphs captured on lanes.decode (None: on the CPU, or without graphs)
    jobs: int = 0                  # jobs run on this split since start


@dataclass
class LaneForward:
    """A job's forward as queued on the prefill lane."""

    step: StepInputs
    hidden: torch.Tensor                # [T, hidden], written by the lane
    done: torch.cuda.Event | None       # recorded after the forward (None: computed already, on the CPU)
    launch_s: float                     # host seconds its launches took (on the lane's thread on CUDA)


@dataclass
class LaneJob:
    """Prompt chunks whose forward is queued, or being queued, on the prefill lane."""

    sched: SchedulerOutput
    split: LaneSplit                    # the SMs it and the decode steps beside it run on
    started: float                      # time.perf_counter() when it was handed over
    tokens: int                         # prompt tokens it computes
    launching: Future | None = None     # CUDA: the lane thread's launch (its result: the LaneForward)
    forward: LaneForward | None = None  # once launched


class PrefillLane:
    def __init__(self, runner: ModelRunner, table: SplitTable, make_lanes: Callable[[int], SmLanes] | None,
                 max_batch: int, max_blocks_per_seq: int) -> None:
        """`table`: the splits by decode batch (engine.lane_splits); `make_lanes(decode_sms)` splits the device (None:
        the CPU's in-order lane, no graphs, no streams)."""
        self.runner, self.table = runner, table
        self.splits: dict[int, LaneSplit] = {}
        for sms in sorted({sms for _, sms in table if sms}):  # (a row of 0: chunked beside those rows, no split)
            lanes = make_lanes(sms) if make_lanes is not None else None
            graphs = None
            if lanes is not None and runner.graphs is not None:  # the decode lane's own graphs: they keep its SMs
                first = FIRST_DECODE_BUCKETS if runner.graphs.deferred.pending else None  # deferred as the runner's
                graphs = DecodeGraphs(runner.model, runner.kv_cache, max_batch, max_blocks_per_seq, lanes.decode,
                                      first_buckets=first)
            self.splits[sms] = LaneSplit(sms, lanes, graphs)
        # the job's launches run here on CUDA, off the engine thread (one thread: one job at a time)
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="prefill-lane") if make_lanes is not None else None
        self.job: LaneJob | None = None
        self.launch_s = 0.0  # host seconds the last job's launches took
        self.jobs = 0  # prompt steps the lane ran since start
        # seconds per prompt token on the lane, from queueing a job to finding it done (a running average; 0 until
        # a job of at least RATE_MIN_TOKENS): what the placement model prices a local prefill at
        self.token_s = 0.0
        self.step_s = 0.0  # a decode step's time while a job runs beside it (a running average; 0 until one)
        self.step_at = 0.0  # time.perf_counter() when step_s was last measured

    @property
    def graph_sets(self) -> list[DecodeGraphs]:
        """Every split's decode graphs (for the captures deferred past start)."""
        return [split.graphs for split in self.splits.values() if split.graphs is not None]

    def observe_step(self, seconds: float) -> None:
        """A decode step that ran while a job was on the lane (not the one that queued the job) took `seconds`."""
        self.step_s = seconds if not self.step_s else (1 - RATE_EWMA) * self.step_s + RATE_EWMA * seconds
        self.step_at = time.perf_counter()

    def takes(self, decode_rows: int) -> bool:
        """Whether a job beside `decode_rows` decoding rows runs on the lane (a table row of 0 SMs: chunked)."""
        return decode_sms_for(self.table, decode_rows) > 0

    @property
    def busy(self) -> bool:
        return self.job is not None

    def ready(self) -> bool:
        job = self.job
        if job is None or (job.launching is not None and not job.launching.done()):
            return False
        done = self._forward(job).done
        return done is None or done.query()

    def wait(self) -> None:
        """Block until the job's forward is done (before its blocks may be freed)."""
        if self.job is not None:
            done = self._forward(self.job).done
            if done is not None:
                done.synchronize()

    def start(self, sched: SchedulerOutput, decode_rows: int) -> None:
        """Hand the forward of `sched` (prompt chunks only), beside `decode_rows` decoding rows, to the prefill
        lane of the split those rows ask for: on CUDA the lane's thread queues it on that lane's stream after what
        the engine's stream has queued so far (the step's KV copies); on the CPU it is computed here and now."""
        if self.job is not None:
            raise RuntimeError("the prefill lane runs one job at a time")
        if not self.takes(decode_rows):
            raise RuntimeError(f"the split table {self.table} gives no lane beside {decode_rows} decoding rows")
        split = self.splits[decode_sms_for(self.table, decode_rows)]
        if not split.jobs and len(self.splits) > 1:
            log.info("prefill lane: first job on the split of %d decode SMs (beside %d decoding rows)",
                     split.decode_sms, decode_rows)
        job = LaneJob(sched, split, time.perf_counter(), sched.num_tokens)
        if self._launcher is None:
            job.forward = self._launch(sched, None, None, None)
        else:
            main = torch.cuda.current_stream(self.runner.device)
            gate = torch.cuda.Event()
            gate.record(main)
            job.launching = self._launcher.submit(self._launch, sched, gate, main, split.lanes.prefill)
        self.job = job
        self.jobs += 1
        split.jobs += 1

    def close(self) -> None:
        """Stop the launching thread (after any job it is launching)."""
        if self._launcher is not None:
            self._launcher.shutdown(wait=True)

    def _forward(self, job: LaneJob) -> LaneForward:
        """The job's queued forward, waiting for its launch if the lane's thread is still at it (its error raises
        here)."""
        if job.forward is None:
            job.forward = job.launching.result()
            self.launch_s = job.forward.launch_s
        return job.forward

    @torch.inference_mode()
    def _launch(self, sched: SchedulerOutput, gate: torch.cuda.Event | None, main: torch.cuda.Stream | None,
                stream: torch.cuda.Stream | None) -> LaneForward:
        """Queue the forward on the prefill lane's `stream` after `gate` (None: the CPU, computed in place). Runs on
        the lane's thread on CUDA, where `main` is the engine's stream, which reads the results (finish)."""
        began = time.perf_counter()
        runner = self.runner
        with contextlib.ExitStack() as scope:
            if stream is not None:
                scope.enter_context(torch.cuda.device(runner.device))
                stream.wait_event(gate)
                scope.enter_context(torch.cuda.stream(stream))
            step = build_step_inputs(sched, runner.block_size, runner.device, runner.model.config.sliding_window)
            hidden = runner.model(step.input_ids, step.positions, runner.kv_cache, step.meta)  # [T, h]
            done = None
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
                hidden.record_stream(main)  # read there by finish()
                step.sample_index.record_stream(main)
        return LaneForward(step, hidden, done, time.perf_counter() - began)

    @torch.inference_mode()
    def finish(self, params: dict[str, SamplingParams]) -> LaunchedStep:
        """The job's sampling, queued on the engine's stream after the lane's forward; the job ends."""
        job = self.job
        forward = self._forward(job)
        self.job = None
        if job.tokens >= RATE_MIN_TOKENS:
            seconds = (time.perf_counter() - job.started) / job.tokens
            self.token_s = seconds if not self.token_s else (1 - RATE_EWMA) * self.token_s + RATE_EWMA * seconds
        if forward.done is not None:
            torch.cuda.current_stream(self.runner.device).wait_event(forward.done)
        if not forward.step.sampling:
            return LaunchedStep(job.sched, [], None)
        logits = self.runner.model.compute_logits(forward.hidden[forward.step.sample_index])  # [S, V]
        return self.runner.sample(job.sched, forward.step.sampling, logits, params)

    def launch_decode(self, sched: SchedulerOutput, params: dict[str, SamplingParams]) -> LaunchedStep:
        """A decode step (no prompt chunks) on the decode lane of the job's split, with its graphs."""
        split = self.job.split
        with self._on(split.lanes.decode if split.lanes else None):
            launched = self.runner.launch(sched, params, graphs=split.graphs)
        if split.lanes is not None:
            torch.cuda.current_stream(self.runner.device).wait_stream(split.lanes.decode)
        return launched

    @contextlib.contextmanager
    def _on(self, stream: torch.cuda.Stream | None):
        """Run the block's work on `stream`, after what the engine's stream has queued (None: in place)."""
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):
            yield
