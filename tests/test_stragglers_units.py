"""The straggler watch's verdicts (coordinator.backend.stragglers) on reported engine counters: a worker whose
steps take over `factor` times its same-role peers' at the same batch shape is found once per incarnation; a
slower step at a much larger batch is not a straggler, nor a worker with no peer or too few steps; a replacement
starts with an empty window. The end-to-end path (an injected slow worker drained and replaced) is in
tests/test_stragglers.py."""

from dataclasses import replace

from coordinator.admission.router import WorkerState
from coordinator.backend.stragglers import MIN_HANDOFFS, StragglerWatch
from coordinator.config.straggler_config import StragglerConfig
from engine.load import EngineLoad, WorkerInfo

CONFIG = StragglerConfig(factor=3.0, window_s=10.0, min_steps=10)


def _worker(name: str, role: str = "decode", incarnation: int = 0) -> WorkerState:
    """A live worker with no step yet."""
    info = WorkerInfo(name, role, 100, 16, 4096, 1000, None, ())
    worker = WorkerState(info, handle=None, incarnation=incarnation, load=EngineLoad(0, 0, 0, 0, 100, 100))
    worker.state = "live"
    return worker


def _step(w: WorkerState, steps: int, step_s: float, batch: int) -> None:
    """`steps` more steps of `step_s` each at `batch` tokens per step."""
    load = w.load
    w.load = replace(load, steps=load.steps + steps, step_time_total_s=load.step_time_total_s + steps * step_s,
                     scheduled_tokens_total=load.scheduled_tokens_total + steps * batch)


def _run(watch: StragglerWatch, workers: list[WorkerState], rounds: int, shapes: dict[str, tuple[float, int]],
         start: float = 0.0) -> list[str]:
    found = []
    for i in range(rounds):
        for w in workers:
            step_s, batch = shapes[w.name]
            _step(w, 5, step_s, batch)
        found += [w.name for w, _ in watch.observe(workers, start + i)]
    return found


def test_a_worker_several_times_slower_at_the_same_batch_is_found_once():
    watch = StragglerWatch(CONFIG)
    workers = [_worker("decode-0"), _worker("decode-1"), _worker("decode-2"), _worker("prefill-0", "prefill")]
    watch.observe(workers, -1.0)  # the first report of each: nothing to compare yet
    shapes = {"decode-0": (0.01, 4), "decode-1": (0.05, 5), "decode-2": (0.012, 6), "prefill-0": (0.5, 512)}
    assert _run(watch, workers, 6, shapes) == ["decode-1"]  # once, though it stays slow
    assert watch.detected == 1 and watch.slow_now("decode-1") and not watch.slow_now("decode-0")
    assert 4.0 < watch.ratios["decode-1"] < 5.0 and watch.ratios["decode-0"] < 1.0
    assert watch.ratios["prefill-0"] == 0.0  # no peer of its role

    fresh = _worker("decode-1", incarnation=1)  # its replacement: a new window, not flagged for its predecessor
    workers[1] = fresh
    assert _run(watch, workers, 6, {**shapes, "decode-1": (0.01, 4)}, start=6.0) == []
    assert not watch.slow_now("decode-1") and watch.detected == 1


def test_a_slower_step_at_a_much_larger_batch_or_with_too_few_steps_is_no_straggler():
    watch = StragglerWatch(CONFIG)
    workers = [_worker("decode-0"), _worker("decode-1")]
    watch.observe(workers, -1.0)
    assert _run(watch, workers, 8, {"decode-0": (0.01, 2), "decode-1": (0.05, 64)}) == []
    assert watch.ratios["decode-1"] == 0.0  # no shared batch shape: nothing compared

    few = StragglerWatch(StragglerConfig(factor=3.0, window_s=10.0, min_steps=100))
    few.observe(workers, 20.0)
    assert _run(few, workers, 8, {"decode-0": (0.01, 4), "decode-1": (0.09, 4)}, start=21.0) == []


def test_a_decode_worker_whose_handoffs_are_several_times_slower_is_found():
    """Same steps, but decode-1's KV handoffs take 5x its peers' per prompt token (a link fallen back to TCP)."""
    watch = StragglerWatch(CONFIG)
    workers = [_worker("decode-0"), _worker("decode-1"), _worker("decode-2")]
    watch.observe(workers, -1.0)
    shapes = {w.name: (0.01, 4) for w in workers}
    for i in range(3):  # too few handoffs yet (MIN_HANDOFFS): nothing to compare
        for w, per_token in zip(workers, (1e-5, 5e-5, 1.2e-5), strict=True):
            watch.handoff(w, 1000, 1000 * per_token, float(i))
    assert _run(watch, workers, 2, shapes) == []
    for i in range(3, 8):
        for w, per_token in zip(workers, (1e-5, 5e-5, 1.2e-5), strict=True):
            watch.handoff(w, 1000, 1000 * per_token, float(i))
    assert _run(watch, workers, 1, shapes, start=8.0) == ["decode-1"]
    assert 4.0 < watch.ratios["decode-1"] < 5.0 and watch.ratios["decode-0"] == 1.0  # (its steps: its peers' pace)
    # handoffs older than the window no longer count: decode-1 is compared on its recent ones only
    for w in workers:
        for i in range(MIN_HANDOFFS):
            watch.handoff(w, 1000, 0.01, 30.0 + i)
    _run(watch, workers, 1, shapes, start=40.0)
    assert watch.ratios["decode-1"] == 1.0 and watch.detected == 1


def test_a_peer_that_carried_a_replaced_workers_load_is_judged_only_on_what_followed():
    """decode-1 is replaced; while its replacement starts, decode-0 takes all the load and its steps and handoffs
    slow down 10x. The replacement then runs at the old pace: decode-0 is compared with it only on what both did
    after the replacement was first seen, and is not a straggler (CI once saw it flagged and replaced in turn;
    over its whole window, slow part included, it would read ~4.6x)."""
    watch = StragglerWatch(CONFIG)
    workers = [_worker("decode-0"), _worker("decode-1")]
    watch.observe(workers, -1.0)
    assert _run(watch, workers, 3, {"decode-0": (0.01, 4), "decode-1": (0.01, 4)}) == []
    alone = [workers[0]]  # decode-1 restarting: decode-0 alone, slower with twice the streams
    for i in range(3, 7):
        _step(workers[0], 5, 0.1, 4)
        watch.handoff(workers[0], 1000, 0.1, float(i))
        assert watch.observe(alone, float(i)) == []  # no peer to compare with
    fresh = _worker("decode-1", incarnation=1)
    workers = [workers[0], fresh]
    watch.observe(workers, 7.0)  # the replacement's first report
    for i in range(8, 14):
        for w in workers:
            _step(w, 5, 0.01, 4)
            watch.handoff(w, 1000, 0.01, float(i))
        assert watch.observe(workers, float(i)) == []
    assert watch.ratios["decode-0"] < 1.5 and watch.detected == 0
