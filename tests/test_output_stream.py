"""A decode worker's output stream (decode_pool.output_stream) on real sockets: batches in order from two sending
threads, a backlog kept until the coordinator connects, a wrong token refused, a new connection replacing the old,
and the reader's end when the worker closes it. That served requests stream through it is every serving test's."""

import asyncio
import threading

from decode_pool.output_stream import OutputStream, read_batches


def _batch(i: int) -> tuple:
    return ([(f"r{i}", [i], [], None, None)], None, {})


async def _read(stream: OutputStream, count: int, token: bytes | None = None) -> list:
    got = []
    async for batch in read_batches(*stream.address, token or stream.token):
        got.append(batch)
        if len(got) == count:
            break
    return got


def test_backlog_then_live_batches_arrive_in_order():
    stream = OutputStream("127.0.0.1")
    try:
        for i in range(3):  # before the coordinator is there
            stream.send(_batch(i))

        async def main():
            reader = asyncio.create_task(_read(stream, 203))
            await asyncio.sleep(0.2)

            def sender(lo: int) -> None:
                for i in range(lo, lo + 100):
                    stream.send(_batch(i))
            threads = [threading.Thread(target=sender, args=(lo,)) for lo in (3, 103)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return await asyncio.wait_for(reader, 20)
        got = asyncio.run(main())
        ids = [b[0][0][1][0] for b in got]
        assert ids[:3] == [0, 1, 2] and sorted(ids) == list(range(203))
        for lo in (3, 103):  # each thread's batches in its order
            mine = [i for i in ids if lo <= i < lo + 100]
            assert mine == sorted(mine)
    finally:
        stream.close()


def test_a_wrong_token_gets_nothing_and_the_right_one_gets_the_backlog():
    stream = OutputStream("127.0.0.1")
    try:
        stream.send(_batch(7))
        assert asyncio.run(asyncio.wait_for(_read(stream, 1, token=b"x" * len(stream.token)), 10)) == []
        assert asyncio.run(asyncio.wait_for(_read(stream, 1), 10)) == [_batch(7)]
    finally:
        stream.close()


def test_a_new_connection_replaces_the_old_and_close_ends_the_stream():
    stream = OutputStream("127.0.0.1")

    async def main():
        first = asyncio.create_task(_read(stream, 10))
        await asyncio.sleep(0.2)
        stream.send(_batch(1))
        second = asyncio.create_task(_read(stream, 10))
        await asyncio.sleep(0.2)
        stream.send(_batch(2))
        await asyncio.sleep(0.2)
        stream.close()
        return await asyncio.wait_for(first, 10), await asyncio.wait_for(second, 10)
    first, second = asyncio.run(main())
    assert first == [_batch(1)] and second == [_batch(2)]
