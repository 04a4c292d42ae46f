"""The benchmark's metrics on hand-made runs, with every expected figure derived by hand in the comments."""

from __future__ import annotations

import pytest

from xmem.bench.metrics import Outcome, accurate, percentile, score
from xmem.units import GIB

CAP = 10 * GIB
G = 4 * GIB  # measured peak of the runs that fit


def runs() -> list[Outcome]:
    return [
        Outcome(6 * GIB, False, G, False, CAP, seconds=1.0),  # A: error 0.5, over: accurate, saves 10-6 = 4 GiB
        Outcome(3 * GIB, False, G, False, CAP, seconds=2.0),  # B: error 0.25, under: fails, claims 3 GiB
        Outcome(4 * GIB, False, G, False, CAP, seconds=3.0),  # C: error 0, exact: accurate, saves 6 GiB
        Outcome(11 * GIB, True, 9 * GIB, True, CAP, seconds=4.0),  # D: real OOM predicted: accurate, saves 0
        Outcome(2 * GIB, False, 9 * GIB, True, CAP, seconds=5.0),  # E: real OOM missed: fails, claims 2 GiB
    ]


def test_mre_is_median_error_of_runs_without_any_oom():
    # errors of A, B, C: 0.5, 0.25, 0 -> median 0.25
    assert score(runs()).mre == pytest.approx(0.25)
    assert score(runs()).scored == 3


def test_p90_interpolates_between_ranks():
    # sorted 0, 0.25, 0.5; rank (3-1)*0.9 = 1.8 -> 0.25 + 0.8*(0.5-0.25) = 0.45
    assert score(runs()).p90 == pytest.approx(0.45)
    assert percentile([], 90) is None


def test_under_share_counts_runs_without_real_oom():
    # B is the only estimate below its measured peak among A, B, C
    assert score(runs()).under_share == pytest.approx(1 / 3)


def test_short_request_share_adds_the_site_margin_before_comparing():
    # B (3 GiB for 4) is short with no margin, covered by +1 GiB; the real OOMs D and E are not counted
    assert score(runs(), needed=lambda estimate: estimate).short_request_share == pytest.approx(1 / 3)
    assert score(runs(), needed=lambda estimate: estimate + GIB).short_request_share == 0
    assert score(runs()).short_request_share is None


def test_oom_recall_is_share_of_real_ooms_predicted():
    # D predicted, E missed
    assert score(runs()).oom_recall == pytest.approx(0.5)


def test_pef_counts_under_estimates_and_missed_ooms_as_failures():
    # B and E fail out of 5
    assert score(runs()).pef == pytest.approx(0.4)


def test_recorded_capped_run_overrides_the_estimate_below_ground_proxy():
    # B capped at 3 GiB really ran (the allocator freed its cache and retried): B is accurate, only E fails
    b_ok = Outcome(3 * GIB, False, G, False, CAP, capped_oom=False)
    assert accurate(b_ok)
    assert score([b_ok, runs()[4]]).pef == pytest.approx(0.5)


def test_predicted_oom_on_a_run_that_fits_is_a_failure():
    assert not accurate(Outcome(12 * GIB, True, G, False, CAP))


def test_mcp_is_saved_minus_claimed_per_run_in_gib():
    # saved A 4 + C 6 = 10 GiB; claimed B 3 + E 2 = 5 GiB; (10 - 5) / 5 runs = 1 GiB
    assert score(runs()).mcp_gib == pytest.approx(1.0)


def test_median_seconds():
    assert score(runs()).median_seconds == pytest.approx(3.0)


def test_empty_input_gives_no_figures():
    s = score([])
    assert (s.runs, s.mre, s.p90, s.pef, s.mcp_gib, s.oom_recall) == (0, None, None, None, None, None)


def test_bias_is_the_median_signed_error():
    # signed errors of A, B, C: +0.5, -0.25, 0 -> median 0
    assert score(runs()).bias == pytest.approx(0.0)
    assert score(runs()[:2]).bias == pytest.approx(0.125)  # median of +0.5 and -0.25
