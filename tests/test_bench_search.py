"""The ``long_context`` benchmark's search (``scripts/bench.py``'s ``longest_fitting``), on a given ``fits``: doubling
from the start length, then bisection to the stated resolution; no launch."""

from __future__ import annotations

import importlib.util

from conftest import REPO

_spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _search(limit: int, **kw):
    return bench.longest_fitting(lambda n: n <= limit, **kw)


def test_doubles_then_bisects_to_the_resolution():
    longest, tried = _search(14000, start=2048, fraction=4)
    assert list(tried) == [2048, 4096, 8192, 16384, 12288, 14336]
    assert longest == 12288 and [tried[n] for n in tried] == [True, True, True, False, True, False]
    # the bracket left (12288 fits, 14336 does not) is at most a quarter of the longest fitting length
    assert 14336 - longest <= longest // 4


def test_finer_resolution_and_multiples_of_the_step():
    longest, tried = _search(14000, start=2048, fraction=8)
    assert longest == 13312 and list(tried)[-1] == 13312 and 14336 - longest <= longest // 8
    assert all(n % 256 == 0 for n in tried)
    longest, _ = _search(1000, start=256, fraction=1000)  # down to the step: 256-token resolution
    assert longest == 768


def test_halves_when_the_start_does_not_fit_and_reports_nothing_below_the_step():
    longest, tried = _search(700, start=2048, fraction=8)
    assert list(tried)[:3] == [2048, 1024, 512] and longest == 512  # bracket 512-768: one step wide
    assert _search(100, start=1024) == (0, {1024: False, 512: False, 256: False})


def test_cap_stops_doubling():
    longest, tried = _search(10**9, start=1024, cap=8192)
    assert longest == 8192 and list(tried) == [1024, 2048, 4096, 8192]
