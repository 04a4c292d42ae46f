"""Every offer of a site side by side (`xmem.policy.options`), on a hand-built GPU type and site.

lab16: 16 GiB (17,179,869,184 B), MIG 1g.4gb (4 GiB) and 2g.8gb (8 GiB), 4 shards of 4 GiB, MPS 100 shares.
Margin 10 %: a 5 GiB peak needs 5.5 GiB (5,905,580,032 B)."""

import pytest

from xmem.config import config_from_dict
from xmem.gpus import load_catalog
from xmem.jobscript import parse_jobscript
from xmem.policy import decide
from xmem.policy.options import fixed_options, option_table, site_option_table

GIB = 2**30
OVERRIDES = {"gpus": {"lab16": {"total_bytes": 16 * GIB, "capability": [8, 0],
                                "mig": {"1g.4gb": 4.0, "2g.8gb": 8.0}}}}
CATALOG = load_catalog(OVERRIDES)


def site(**policy):
    return config_from_dict({
        "partitions": {"default": "p", "from_cluster": False, "gpu_types": {"p": ["lab16", "1g.4gb", "2g.8gb"]}},
        "mig": {"lab16": ["1g.4gb", "2g.8gb"]},
        "mps": {"enabled": True, "count_per_gpu": 100, "gpu_types": ["lab16"]},
        "shard": {"enabled": True, "per_gpu": 4, "gpu_types": ["lab16"]},
        "margin": {"relative": 0.10},
        "policy": {"preference": ["mig", "shard", "mps", "gpu"], **policy},
        "catalog": OVERRIDES,
    })


def table_for(peak_gib: float, directives: str = "#SBATCH --gres=gpu:1", config=None):
    config = config or site()
    request = parse_jobscript(directives + "\npython t.py\n", env={}).directives
    peaks = {"lab16": int(peak_gib * GIB)}
    return option_table(peaks, request, config, decide(peaks, request, config, catalog=CATALOG), catalog=CATALOG)


def test_every_offer_in_preference_order_with_usable_need_and_slack():
    table = table_for(5)
    needed = 5_905_580_032  # 5 GiB * 1.1, rounded up
    rows = [(r.kind, r.request, r.usable_bytes, r.needed_bytes, r.fits) for r in table.rows]
    assert rows == [
        ("mig", "gpu:1g.4gb:1", 4 * GIB, needed, False),
        ("mig", "gpu:2g.8gb:1", 8 * GIB, needed, True),
        ("shard", "shard:lab16:2", 8 * GIB, needed, True),  # 2 of 4 shards: the fewest that hold 5.5 GiB
        ("mps", "mps:lab16:35", 16 * GIB * 35 // 100, needed, True),  # 34 shares give 5.44 GiB: short
        ("gpu", "gpu:lab16:1", 16 * GIB, needed, True),
    ]
    assert table.rows[0].slack_bytes == 4 * GIB - needed  # how far off: 1.5 GiB short
    assert all(r.gpu_type == "lab16" and r.peak_bytes == 5 * GIB for r in table.rows)


def test_the_pick_is_the_policys_and_the_near_miss_is_the_cheaper_offer_that_did_not_fit():
    table = table_for(5)
    assert table.action == "rewrite" and table.chosen.request == "gpu:2g.8gb:1"
    assert [r.chosen for r in table.rows] == [False, True, False, False, False]
    assert table.reason.endswith("MIG 2g.8gb (8 GiB) is the smallest fit")
    assert table.closest_miss.request == "gpu:1g.4gb:1"
    assert table.to_json()["closest_miss"]["slack_bytes"] == 4 * GIB - 5_905_580_032


def test_a_later_kind_is_picked_when_no_slice_fits_and_the_miss_is_the_larger_slice():
    table = table_for(7.5)  # needs 8.25 GiB: neither slice; 3 of 4 shards (12 GiB)
    assert table.chosen.request == "shard:lab16:3"
    assert table.closest_miss.request == "gpu:2g.8gb:1"
    assert table.closest_miss.slack_bytes == 8 * GIB - int(-(-int(7.5 * GIB) * 1.1 // 1))


def test_nothing_fits_then_no_pick_and_the_largest_offer_is_the_closest():
    table = table_for(20)  # needs 22 GiB, more than the whole 16 GiB GPU
    assert table.action == "no_fit" and table.chosen is None
    assert not any(r.fits for r in table.rows)
    assert table.closest_miss.usable_bytes == 16 * GIB
    assert table.closest_miss.slack_bytes == 16 * GIB - 22 * GIB


def test_a_kind_left_out_of_the_preference_is_not_offered():
    table = table_for(5, config=site(preference=["mig", "gpu"]))
    assert {r.kind for r in table.rows} == {"mig", "gpu"}


def test_a_kept_request_shows_the_offers_with_no_pick():
    table = table_for(5, "#SBATCH --gres=gpu:lab16:1", config=site(explicit_request="keep"))
    assert table.action == "keep" and table.chosen is None and len(table.rows) == 5


def test_site_table_for_a_plain_one_gpu_job_in_the_default_partition():
    table = site_option_table({"lab16": 5 * GIB}, site(), CATALOG)
    assert table.chosen.request == "gpu:2g.8gb:1"
    assert [r.request for r in table.rows] == [r.request for r in table_for(5).rows]


def test_fixed_options_are_the_policys_sizes_largest_first():
    options = {(o.name, o.usable_bytes) for o in fixed_options(site(), "lab16", CATALOG)}
    assert options == {("whole", 16 * GIB), ("2g.8gb", 8 * GIB), ("1g.4gb", 4 * GIB),
                       ("shard:3", 12 * GIB), ("shard:2", 8 * GIB), ("shard:1", 4 * GIB),
                       ("mps:50", 8 * GIB), ("mps:25", 4 * GIB)}
    sizes = [o.usable_bytes for o in fixed_options(site(), "lab16", CATALOG)]
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("name", ["lab16", "LAB16"])
def test_fixed_options_of_an_unknown_type_are_none_and_names_match_any_case(name):
    assert fixed_options(site(), "nosuchgpu", CATALOG) == []
    assert len(fixed_options(site(), name, CATALOG)) == 8
