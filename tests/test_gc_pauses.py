"""GcPauses: a worker's garbage-collector figures count the collections that ran while installed, full ones apart,
and stop counting once removed."""

import gc

from engine.gc_pauses import GcPauses


def test_counts_collections_while_installed():
    pauses = GcPauses()
    pauses.install()
    try:
        gc.collect(0)
        gc.collect(2)
        f = pauses.figures()
        assert f["gc_pauses_total"] >= 2 and f["gc_full_collections_total"] >= 1
        assert f["gc_pause_seconds_total"] >= f["gc_pause_max_s"] > 0
    finally:
        pauses.remove()
    before = pauses.figures()
    gc.collect()
    assert pauses.figures() == before and pauses._on_gc not in gc.callbacks
