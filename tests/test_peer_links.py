"""coordinator.backend.peer_links: which agents connect to which in each mode, and the two start waves (no pair
connects both ways at once). Pools' start, connect (a replacement) and disconnect (a death) all follow these links;
the serving tests exercise them on real workers."""

from dataclasses import dataclass

import pytest

from coordinator.backend.peer_links import peer_links, waves


@dataclass(eq=False)
class Info:
    role: str


@dataclass(eq=False)
class W:
    name: str
    info: Info


def _workers(prefill: int, decode: int) -> list[W]:
    return [W(f"prefill-{i}", Info("prefill")) for i in range(prefill)] + \
        [W(f"decode-{i}", Info("decode")) for i in range(decode)]


def _names(links) -> set[tuple[str, str]]:
    return {(a.name, b.name) for a, b in links}


def test_disaggregated_decode_pulls_from_prefill_and_pushes_and_fetches_add_their_directions():
    ws = _workers(2, 2)
    pulls = {(f"decode-{d}", f"prefill-{p}") for d in range(2) for p in range(2)}
    assert _names(peer_links(ws, "disaggregated", False, False)) == pulls
    pushes = {(b, a) for a, b in pulls}
    assert _names(peer_links(ws, "disaggregated", True, False)) == pulls | pushes
    fetches = {("prefill-0", "prefill-1"), ("prefill-1", "prefill-0")}
    assert _names(peer_links(ws, "disaggregated", True, True)) == pulls | pushes | fetches
    assert _names(peer_links(ws, "disaggregated", False, True)) == pulls | fetches


def test_adaptive_links_every_pair_both_ways_and_collocated_none():
    ws = _workers(1, 2)
    assert _names(peer_links(ws, "adaptive", True, True)) == {(a.name, b.name) for a in ws for b in ws if a is not b}
    assert peer_links(ws, "collocated", True, True) == []


@pytest.mark.parametrize("mode, pushes, fetch", [("disaggregated", True, True), ("disaggregated", False, False),
                                                 ("adaptive", False, False)])
def test_waves_hold_every_link_once_and_never_both_directions_of_a_pair(mode, pushes, fetch):
    links = peer_links(_workers(2, 3), mode, pushes, fetch)
    first, second = waves(links)
    assert sorted(_names(first) | _names(second)) == sorted(_names(links)) and len(first) + len(second) == len(links)
    for wave in (first, second):
        assert not any((b, a) in _names(wave) for a, b in _names(wave))
    if mode == "disaggregated":  # decode to prefill first: what a handoff needs
        assert all(a.info.role == "decode" for a, b in first if a.info.role != b.info.role)
