"""RayBackend's coalescing of step outputs queued behind each other: a stream that fell behind gets them as one
delta, tokens in order, logprobs aligned, the finish reason of the last, and an error only after the tokens
before it; and HeldQueue (coordinator.backend.held_queue), which holds them back until a chunk's worth is in."""

import asyncio

from coordinator.backend.output_intake import coalesced as _coalesced
from engine.core.request import TokenLogprob
from engine.core.scheduler import StepOutput


def _queue(*items):
    q = asyncio.Queue()
    for item in items:
        q.put_nowait(item)
    return q


def _out(tokens, finish=None):
    return StepOutput("r", list(tokens), [TokenLogprob(t, -0.5, {}) for t in tokens], finish)


def test_queued_outputs_become_one_delta_in_order():
    q = _queue(_out([5]), _out([6, 7]), _out([8], "length"), _out([99]))
    delta, error = _coalesced(_out([4]), q)
    assert error is None
    assert delta.token_ids == [4, 5, 6, 7, 8] and delta.finish_reason == "length"
    assert [lp.token_id for lp in delta.logprobs] == [4, 5, 6, 7, 8]
    assert q.qsize() == 1  # nothing after the finish is taken


def test_an_error_comes_after_the_tokens_queued_before_it():
    boom = RuntimeError("worker lost")
    q = _queue(_out([2]), boom, _out([3]))
    delta, error = _coalesced(_out([1]), q)
    assert delta.token_ids == [1, 2] and delta.finish_reason is None and error is boom
    assert _coalesced(boom, _queue()) == (None, boom)


def test_alone_it_is_the_output_itself():
    delta, error = _coalesced(_out([1]), _queue())
    assert (delta.token_ids, delta.finish_reason, error) == ([1], None, None)


def _drain(q):
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


def test_a_held_queue_releases_the_first_output_then_a_chunk_at_a_time():
    from coordinator.backend.held_queue import HeldQueue

    async def main():
        q = HeldQueue(4)
        q.put_nowait(_out([1]))                      # the first: at once (a collocated request's TTFT)
        assert [o.new_token_ids for o in _drain(q)] == [[1]]
        for t in (2, 3, 4):
            q.put_nowait(_out([t]))
        assert q.empty()                             # 3 tokens held: the reader is not woken
        q.put_nowait(_out([5, 6]))                   # 5 >= 4: released together, in order
        delta, error = _coalesced(q.get_nowait(), q)
        assert delta.token_ids == [2, 3, 4, 5, 6] and error is None
        q.put_nowait(_out([7]))
        q.put_nowait(_out([8], "length"))            # the end is never held, nor what came before it
        assert [o.new_token_ids for o in _drain(q)] == [[7], [8]]
    asyncio.run(main())


def test_a_held_queue_releases_held_tokens_before_an_error():
    from coordinator.backend.held_queue import HeldQueue

    async def main():
        q = HeldQueue(8)
        boom = RuntimeError("worker lost")
        for item in (_out([1]), _out([2]), _out([3])):
            q.put_nowait(item)
        assert [o.new_token_ids for o in _drain(q)] == [[1]]  # 2 and 3 held
        q.put_nowait(boom)
        delta, error = _coalesced(q.get_nowait(), q)
        assert delta.token_ids == [2, 3] and error is boom and q.empty()
    asyncio.run(main())
