"""Reservation and Ledger: every booking is owned by one live reservation and given back exactly once."""

import pytest

from coordinator.admission.reservation import Ledger


def test_release_gives_back_everything_once_and_integrity_holds_after_every_step():
    freed = []
    ledger = Ledger(on_release=lambda: freed.append(1))
    a, b = ledger.open("a"), ledger.open("b")
    a.book("decode-0#0", "kv_blocks", 10)
    a.book("prefill-0#0", "prompt_tokens", 100)
    b.book("decode-0#0", "kv_blocks", 5)
    assert ledger.check_integrity() == {"decode-0#0": {"kv_blocks": 15, "prompt_tokens": 0},
                                        "prefill-0#0": {"kv_blocks": 0, "prompt_tokens": 100}}
    assert a.unbook("prefill-0#0", "prompt_tokens") == 100
    assert a.unbook("prefill-0#0", "prompt_tokens") == 0  # twice gives back nothing more
    assert ledger.booked("prefill-0#0", "prompt_tokens") == 0
    ledger.check_integrity()
    a.release()
    a.release()  # idempotent
    assert ledger.booked("decode-0#0", "kv_blocks") == 5 and ledger.live_requests == 1
    ledger.check_integrity()
    b.release()
    assert ledger.booked("decode-0#0", "kv_blocks") == 0 and ledger.live_requests == 0
    assert ledger.check_integrity()["decode-0#0"] == {"kv_blocks": 0, "prompt_tokens": 0}
    assert len(freed) == 3  # one unbook and two first releases told the admission queue to look again
    with pytest.raises(RuntimeError, match="after release"):
        a.book("decode-0#0", "kv_blocks", 1)


def test_clear_keeps_the_reservation_open_for_the_next_placement():
    ledger = Ledger()
    r = ledger.open("moved")
    r.book("decode-0#0", "kv_blocks", 7)
    r.book("prefill-0#0", "prompt_tokens", 30)
    r.clear()
    assert not r.released and r.bookings == {} and ledger.live_requests == 1
    r.book("decode-1#0", "kv_blocks", 8)
    assert ledger.check_integrity()["decode-1#0"]["kv_blocks"] == 8
    assert ledger.booked("decode-0#0", "kv_blocks") == 0
    r.release()
    assert ledger.booked("decode-1#0", "kv_blocks") == 0


def test_integrity_catches_books_that_no_live_reservation_explains():
    ledger = Ledger()
    r = ledger.open("x")
    r.book("decode-0#0", "kv_blocks", 3)
    r.bookings.clear()  # a bug that forgets a booking without giving it back
    with pytest.raises(AssertionError, match="decode-0#0"):
        ledger.check_integrity()


def test_bad_bookings_are_refused():
    r = Ledger().open("x")
    with pytest.raises(ValueError):
        r.book("w", "kv_blocks", -1)
    with pytest.raises(ValueError):
        r.book("w", "gpus", 1)
