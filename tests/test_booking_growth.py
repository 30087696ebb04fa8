"""Growing decode bookings (issue 38), without workers: what Admission books at placement with
`admission.reserve_output: null` (the default) against a number, how BookingGrowth grows a booking as tokens come
and stops at max_tokens, that the grown booking is given back by the reservation's release (and never grows after
it), and the config keys' checks."""

import asyncio

import pytest

from coordinator.admission.growth import BookingGrowth
from coordinator.admission.reservation import Ledger
from coordinator.config.serve_config import load_serve_config
from coordinator.contract import RequestTooLarge
from engine.config_error import ConfigError
from tests.test_admission import _request, _setup


def test_growing_bookings_book_the_prompt_and_the_reserve_ahead_not_max_tokens():
    grow, _, _ = _setup()  # the default: reserve_output null, 64 tokens ahead
    assert grow.kv_blocks(_request(100, 131_000), num_prior=0) == 12      # ceil((100 + 64) / 16) + 1
    assert grow.kv_blocks(_request(100, 20), num_prior=0) == 9            # never more than max_tokens
    assert grow.kv_blocks(_request(100, 131_000), num_prior=50) == 15     # prior outputs are held: ceil(214 / 16) + 1
    upfront, _, _ = _setup(reserve_output=1.0)  # the behaviour before: all of max_tokens, never preempted
    assert upfront.kv_blocks(_request(100, 1000), num_prior=0) == 70      # ceil(1100 / 16) + 1
    ahead, _, _ = _setup(reserve_ahead_tokens=200)
    assert ahead.kv_blocks(_request(100, 1000), num_prior=0) == 20        # ceil(300 / 16) + 1


def test_a_request_whose_whole_length_cannot_fit_is_still_refused_at_once():
    admission, ledger, _ = _setup(decode_blocks=(20,))  # 320 tokens

    async def run():
        with pytest.raises(RequestTooLarge, match="needs 21 KV blocks"):  # it books 12 blocks, but may need 21
            await admission.place(_request(100, 220), 0, ledger.open("long"))
        placement = await admission.place(_request(100, 200), 0, ledger.open("fits"))
        assert placement.kv_blocks == 12
    asyncio.run(run())


def test_a_booking_grows_with_the_tokens_received_up_to_max_tokens_and_is_released_whole():
    ledger = Ledger()
    growth = BookingGrowth(block_size=16, ahead_tokens=64)
    r = ledger.open("r")
    r.book("decode-0#0", "kv_blocks", growth.blocks_for(100, 64))  # 12, as Admission books it
    growth.track("r", r, "decode-0#0", base_tokens=100, remaining=300, blocks=12)
    assert growth.advance("r", 1) == 0             # 100 + 1 + 64 = 165 tokens: 11 + 1 blocks, booked already
    assert growth.advance("r", 10) == 0            # 175 tokens: still 11 + 1
    assert growth.advance("r", 100) == 7           # 275 tokens: 18 + 1
    assert ledger.booked("decode-0#0", "kv_blocks") == 19
    assert growth.advance("r", 500) == 7           # capped at max_tokens: 400 tokens, 25 + 1
    assert growth.advance("r", 50) == 0
    assert ledger.check_integrity() == {"decode-0#0": {"kv_blocks": 26, "prompt_tokens": 0}}
    assert growth.grown_blocks == 14 and growth.advance("unknown", 5) == 0
    r.release()
    assert growth.advance("r", 1) == 0             # a released reservation never grows
    growth.drop("r")
    assert ledger.check_integrity() == {"decode-0#0": {"kv_blocks": 0, "prompt_tokens": 0}} and len(growth) == 0


@pytest.mark.parametrize(("key", "value", "message"), [
    ("reserve_output", 0, "reserve_output must be null"),
    ("reserve_output", 1.5, "reserve_output must be null"),
    ("reserve_ahead_tokens", 0, "reserve_ahead_tokens must be an integer >= 1"),
    ("reserve_ahead_tokens", 2.5, "'admission.reserve_ahead_tokens' must be int"),
])
def test_bad_booking_keys_are_config_errors_naming_the_key(tmp_path, key, value, message):
    path = tmp_path / "serve.yaml"
    path.write_text(f"admission:\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=message):
        load_serve_config(path)
    path.write_text("admission:\n  reserve_output: null\n  reserve_ahead_tokens: 32\n")
    assert load_serve_config(path).admission.reserve_output is None
