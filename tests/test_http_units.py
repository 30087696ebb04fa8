"""Units of the HTTP layer without a server: stop strings and hold-back in TextOutput, ServerSettings validation,
Lifecycle drain, a stream cut at its deadline, stream chunks past the middleware stack, and text chunks built from a
template equal to the JSON of the chunk (the Prometheus exposition: tests/test_metrics.py)."""

import asyncio
import json
import random
import time

import httpx
import pytest

from coordinator.api.drain import Lifecycle
from coordinator.api.lifecycle import Piece
from coordinator.api.sse import DONE, DirectStreamAPI, Formatter, SSEResponse, event
from coordinator.api.text_output import TextOutput
from coordinator.config.settings import ServerSettings
from engine.text.tokenizer import Tokenizer

TEXT = "The old lighthouse stood at the edge of the harbor, and every evening the keeper climbed"


@pytest.fixture(scope="module")
def tok(checkpoints):
    return Tokenizer.from_folder(checkpoints.tiny())


def feed(out: TextOutput, ids):
    deltas = []
    for i in ids:
        deltas.append(out.add_token(i))
        if out.stopped:
            break
    if not out.stopped:
        deltas.append(out.finish())
    return deltas


def test_without_stop_strings_the_text_is_the_full_decode(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    out = TextOutput(tok, [], [])
    assert "".join(feed(out, ids)) == tok.decode(ids) == out.text
    assert out.num_tokens == len(ids) and not out.stopped


@pytest.mark.parametrize("stop", ["lighthouse stood", "e edge of", "harbor, and", "d", "keeper climbed"])
def test_stop_string_ends_the_text_right_before_it_even_across_tokens(tok, stop):
    ids = tok.encode(TEXT, add_special_tokens=False)
    out = TextOutput(tok, [], ["never-there", stop])
    deltas = feed(out, ids)
    assert out.stopped and out.text == "".join(deltas) == TEXT[:TEXT.index(stop)]
    # it stopped at the first token whose text completes the stop string
    assert stop in tok.decode(ids[:out.num_tokens]) and stop not in tok.decode(ids[:out.num_tokens - 1])


def test_stop_strings_against_a_brute_force_reference(tok):
    """Seeded random texts and stop strings (pieces of the text, or near misses): the output is always the text up
    to the earliest occurrence of any stop string, or all of it."""
    from engine.tiny import CORPUS
    rng = random.Random(7)
    for _ in range(60):
        start = rng.randrange(len(CORPUS) - 200)
        text = CORPUS[start:start + rng.randrange(20, 200)]
        stops = []
        for _ in range(rng.randrange(1, 4)):
            a = rng.randrange(len(text))
            piece = text[a:a + rng.randrange(1, 12)]
            stops.append(piece if rng.random() < 0.6 else piece + "\u2603")  # a near miss never matches
        ids = tok.encode(text, add_special_tokens=False)
        out = TextOutput(tok, [], stops)
        got = "".join(feed(out, ids))
        hits = [text.find(s) for s in stops if s in text]
        want = text[:min(hits)] if hits else text
        assert got == want == out.text and out.stopped == bool(hits), (text, stops)


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    out = TextOutput(tok, [], ["harbor", "old"])
    feed(out, ids)
    assert out.text == "The "


def test_text_that_may_start_a_stop_string_is_held_back_then_released(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    out = TextOutput(tok, [], ["lighthouse keeper"])  # "lighthouse" matches a prefix, then it diverges
    emitted = ""
    for i in ids:
        emitted += out.add_token(i)
        assert not emitted.endswith("lighthouse"), "a possible stop-string start was sent"
    assert not out.stopped
    emitted += out.finish()
    assert emitted == TEXT


def test_a_partial_utf8_character_is_never_emitted(tok):
    text = "naïve café → 東京 🙂 end"
    ids = tok.encode(text, add_special_tokens=False)
    out = TextOutput(tok, [], [])
    deltas = feed(out, ids)
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == text


def test_logprob_token_bytes_rebuild_the_text_even_for_partial_characters(tok):
    text = "東京 café 🙂"
    ids = tok.encode(text, add_special_tokens=False)
    out = TextOutput(tok, [], [])
    pieces = [out.token_text(i) for i in ids]
    assert any(t.startswith("bytes:\\x") for t, _ in pieces)  # some token is part of a character
    assert bytes(b for _, raw in pieces for b in raw).decode() == text


def test_settings_validation_names_the_field():
    assert ServerSettings().port == 8000
    for kwargs, field in [({"port": 70000}, "port"), ({"port": True}, "port"), ({"api_key": ""}, "api_key"),
                          ({"max_body_bytes": 0}, "max_body_bytes"), ({"request_timeout_s": 0}, "request_timeout_s"),
                          ({"request_timeout_s": float("nan")}, "request_timeout_s"),
                          ({"drain_timeout_s": -1}, "drain_timeout_s"), ({"host": ""}, "host"),
                          ({"served_model_name": ""}, "served_model_name"),
                          ({"keep_alive_timeout_s": 0}, "keep_alive_timeout_s"),
                          ({"header_timeout_s": float("inf")}, "header_timeout_s"),
                          ({"body_read_timeout_s": -1}, "body_read_timeout_s"),
                          ({"allow_special_tokens_in_content": 1}, "allow_special_tokens_in_content"),
                          ({"stall_timeout_s": 0}, "stall_timeout_s"),
                          ({"stall_timeout_s": float("nan")}, "stall_timeout_s"),
                          ({"stall_timeout_s": float("inf")}, "stall_timeout_s"),
                          ({"stall_timeout_s": 3601}, "stall_timeout_s"),
                          ({"stall_timeout_s": True}, "stall_timeout_s")]:
        with pytest.raises(ValueError, match=rf"^ServerSettings\.{field} "):
            ServerSettings(**kwargs)


def test_lifecycle_drain_refuses_new_requests_and_waits_for_in_flight_ones():
    async def main():
        lc = Lifecycle()
        ticket = lc.admit()
        lc.begin_drain()
        with pytest.raises(Exception) as e:
            lc.admit()
        assert e.value.status == 503 and "Retry-After" in e.value.headers
        assert lc.in_flight == 1 and not await lc.wait_idle(0.01)
        asyncio.get_running_loop().call_soon(ticket.release)
        assert await lc.wait_idle(5)
        ticket.release()  # idempotent
        assert lc.in_flight == 0
    asyncio.run(main())


def test_a_stream_blocked_on_a_reader_that_never_reads_is_cut_at_its_deadline():
    """SSEResponse under an ASGI server whose send() never returns (flow control: the client stopped reading)."""
    closed = []

    async def events():
        try:
            while True:
                yield b"data: {}\n\n"
        finally:
            closed.append(True)  # where the app closes the backend stream (abort)

    async def main():
        sent = []
        never = asyncio.Event()

        async def receive():
            await never.wait()

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body":
                await never.wait()

        response = SSEResponse(events(), deadline=time.monotonic() + 0.2)
        await asyncio.wait_for(response({"type": "http"}, receive, send), 10)
        return sent

    sent = asyncio.run(main())
    assert closed == [True] and sent[0]["status"] == 200 and len(sent) == 2


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_text_chunk_from_the_template_is_the_chunk_json_byte_for_byte(chat, include_usage):
    texts = ["Hello", " world", 'say "hi"\n', "back\\slash", "tab\there", "\x00\x1f control", "é ü 漢字 🙂",
             "\u2028\u2029", "\ufdd0pdserve-text\ufdd0", "</script>", "{}[],:"]
    for model, rid in (("tiny", "abc"), ('m"\ufdd0pdserve-text\ufdd0', "chatcmpl-x"), ("/models/Llama-3", None)):
        fmt = Formatter(chat, model, include_usage, rid)
        for text in texts:
            expected = event(fmt.chunk(Piece(text), False))
            assert fmt.text_event(text) == fmt.chunk_event(Piece(text), False) == expected
            assert json.loads(expected[6:])["choices"][0]["delta" if chat else "text"] == (
                {"content": text} if chat else text)
        for piece, first in ((Piece("a"), True), (Piece("", [], None), False), (Piece("end", [], "length"), False)):
            assert fmt.chunk_event(piece, False, first) == event(fmt.chunk(piece, False, first))


def test_stream_chunks_skip_the_middleware_stack_which_still_sees_the_start_and_the_end():
    seen = []

    class Spy:  # a pure ASGI middleware that records what passes its send
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            async def spy(message):
                seen.append((message["type"], message.get("more_body")))
                await send(message)
            await self.app(scope, receive, spy)

    app = DirectStreamAPI()
    app.add_middleware(Spy)

    async def events():
        for i in range(3):
            yield event({"i": i})
        yield DONE

    app.add_api_route("/s", lambda: SSEResponse(events()), methods=["GET"])

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.get("/s")

    r = asyncio.run(main())
    assert r.status_code == 200 and r.content == b"".join(
        [b'data: {"i":0}\n\n', b'data: {"i":1}\n\n', b'data: {"i":2}\n\n', DONE])
    assert seen == [("http.response.start", None), ("http.response.body", False)]
