"""A decode worker's stream (decode_pool.worker_stream) on real sockets: batches in order from two sending threads,
a backlog kept until the coordinator connects, a wrong token refused, a new connection replacing the old, the
reader's end when the worker closes it; commands reaching the worker's handler in the coordinator's order, and a
handler that fails ending the stream. That served requests start and stream through it is every serving test's."""

import asyncio
import threading
import time

from decode_pool.worker_stream import StreamLink, WorkerStream


def _batch(i: int) -> tuple:
    return ([(f"r{i}", [i], [], None, None)], None, {}, {})


async def _read(stream: WorkerStream, count: int, token: bytes | None = None) -> list:
    got = []
    async for batch in StreamLink(*stream.address, token or stream.token).batches():
        got.append(batch)
        if len(got) == count:
            break
    return got


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_backlog_then_live_batches_arrive_in_order():
    stream = WorkerStream("127.0.0.1")
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
    stream = WorkerStream("127.0.0.1")
    try:
        stream.send(_batch(7))
        assert asyncio.run(asyncio.wait_for(_read(stream, 1, token=b"x" * len(stream.token)), 10)) == []
        assert asyncio.run(asyncio.wait_for(_read(stream, 1), 10)) == [_batch(7)]
    finally:
        stream.close()


def test_a_new_connection_replaces_the_old_and_close_ends_the_stream():
    stream = WorkerStream("127.0.0.1")

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


def test_commands_reach_the_handler_in_order_while_batches_flow_back():
    commands: list[tuple] = []
    stream = WorkerStream("127.0.0.1", commands.append)
    link = StreamLink(*stream.address, stream.token)

    async def main():
        got = []

        async def read():
            async for batch in link.batches():
                got.append(batch)
                if len(got) == 50:
                    return
        reader = asyncio.create_task(read())
        while not link.connected:
            await asyncio.sleep(0.01)
        for i in range(500):  # commands one way while batches come the other
            link.send(("generate", f"r{i}", list(range(i % 7))))
            if i % 10 == 0:
                stream.send(_batch(i))
        await asyncio.to_thread(_wait_for, lambda: len(commands) == 500)
        await asyncio.wait_for(reader, 10)
        return got
    try:
        got = asyncio.run(main())
        assert [c[1] for c in commands] == [f"r{i}" for i in range(500)]
        assert commands[13] == ("generate", "r13", list(range(6)))
        assert [b[0][0][1][0] for b in got] == list(range(0, 500, 10))
    finally:
        stream.close()
    try:
        link.send(("abort", "r0"))
        raise AssertionError("a link whose stream ended took a command")
    except ConnectionError:
        pass


def test_a_failing_command_handler_ends_the_stream():
    def handler(command: tuple) -> None:
        if command[0] == "bad":
            raise RuntimeError("a bug")
    stream = WorkerStream("127.0.0.1", handler)
    link = StreamLink(*stream.address, stream.token)

    async def main():
        async def read():
            return [batch async for batch in link.batches()]
        reader = asyncio.create_task(read())
        while not link.connected:
            await asyncio.sleep(0.01)
        link.send(("good", "r1"))
        link.send(("bad", "r2"))
        return await asyncio.wait_for(reader, 10)  # ends: the worker dropped the connection
    try:
        assert asyncio.run(main()) == []
    finally:
        stream.close()
