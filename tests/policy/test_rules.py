"""Policy decisions on the dev cluster's offers. Sizes from the shipped catalog:
a100 = A100-SXM4-40GB, 42,474,471,424 B (39.56 GiB); h100 = H100-SXM5-80GB, 85,520,809,984 B (79.65 GiB);
its MIG 1g.10gb = 9.75 GiB = 10,468,982,784 B. A shard of an h100 = 85,520,809,984 / 4 = 21,380,202,496 B."""

import os

import pytest

from tests import estimates
from tests.estimates import gpu_estimate
from xmem.config import config_from_dict
from xmem.gpus import load_catalog
from xmem.jobscript import parse_jobscript
from xmem.policy import decide

GIB = 2**30
CATALOG = load_catalog()
A100_BYTES, H100_BYTES, MIG_1G10GB_BYTES = 42_474_471_424, 85_520_809_984, 10_468_982_784


def site(**sections):
    base = {
        "partitions": {"default": "debug", "from_cluster": False,
                       "gpu_types": {"debug": ["a100", "h100", "1g.10gb"], "old": ["a100"]}},
        "mig": {"h100": ["1g.10gb"]},
        "mps": {"enabled": True, "count_per_gpu": 100, "gpu_types": ["a100"]},
        "shard": {"enabled": True, "per_gpu": 4, "gpu_types": ["h100", "1g.10gb"]},
        "margin": {"relative": 0.10},
    }
    for name, table in sections.items():
        base[name] = {**base.get(name, {}), **table}
    return config_from_dict(base)


def request(directives: str):
    return parse_jobscript(directives + "\npython t.py\n", env={}).directives


def peaks(gib: float) -> dict[str, int]:
    return {"a100": int(gib * GIB), "h100": int(gib * GIB)}


def run(gib: float, directives: str = "#SBATCH --gres=gpu:1", config=None, **kw):
    return decide(peaks(gib), request(directives), config or site(), catalog=CATALOG, **kw)


def test_no_gpu_requested_means_no_action():
    d = run(5, "#SBATCH -p debug")
    assert (d.action, d.gres) == ("none", None)


def test_small_job_gets_the_mig_slice_first_in_preference():
    d = run(7)
    assert (d.action, d.gres, d.kind, d.gpu_type) == ("rewrite", "gpu:1g.10gb:1", "mig", "1g.10gb")
    assert d.needed_bytes == 8_267_812_045  # ceil(7 GiB * 1.1) = 7,516,192,768 * 1.1 = 8,267,812,044.8, rounded up
    assert d.granted_bytes == MIG_1G10GB_BYTES
    assert d.reason == "needs 7.7 GiB with 10 % margin: MIG 1g.10gb (9.75 GiB) is the smallest fit"


def test_when_mig_is_too_small_the_next_kind_in_preference_is_used():
    d = run(12)  # needs 13.2 GiB: more than the 9.75 GiB slice; one h100 shard is 19.91 GiB
    assert (d.gres, d.kind) == ("shard:h100:1", "shard")
    assert d.granted_bytes == H100_BYTES // 4
    assert d.reason.endswith("(no MIG fits)")


def test_mps_share_is_the_smallest_count_that_holds_the_need():
    d = run(12, config=site(policy={"preference": ["mps", "gpu"]}))
    # need 14,173,392,077 B; 14,173,392,077 * 100 / 42,474,471,424 = 33.37 -> 34 of 100
    assert d.gres == "mps:a100:34"
    assert d.granted_bytes == A100_BYTES * 34 // 100


def test_shard_count_grows_with_the_need():
    d = run(30, config=site(policy={"preference": ["shard", "gpu"]}))
    # need 33 GiB = 35,433,480,192 B > one shard (21,380,202,496 B), <= two (42,760,404,992 B)
    assert d.gres == "shard:h100:2"


def test_whole_gpu_preference_takes_the_smallest_gpu_that_fits():
    assert run(12, config=site(policy={"preference": ["gpu"]})).gres == "gpu:a100:1"
    assert run(50, config=site(policy={"preference": ["gpu"]})).gres == "gpu:h100:1"


def test_preference_order_decides_between_kinds_that_both_fit():
    assert run(3, config=site(policy={"preference": ["gpu", "mig"]})).gres == "gpu:a100:1"
    assert run(3, config=site(policy={"preference": ["mps", "mig"]})).gres.startswith("mps:a100:")


def test_nothing_fits():
    d = run(90)
    assert (d.action, d.gres) == ("no_fit", None)
    assert "more than the largest offer, a whole h100 (79.65 GiB)" in d.reason


def test_absolute_margin_is_added_to_the_relative_one():
    tight = site(margin={"relative": 0.0, "absolute_mib": 1024})
    assert run(9, config=tight).kind == "shard"  # 9 + 1 = 10 GiB > 9.75 GiB
    loose = site(margin={"relative": 0.0, "absolute_mib": 512})
    d = run(9, config=loose)
    assert d.kind == "mig" and d.needed_bytes == 9 * GIB + 512 * 2**20
    assert "with 512 MiB margin" in d.reason


def test_fill_generic_keeps_a_typed_request():
    d = run(50, "#SBATCH --gres=gpu:a100:1")
    assert (d.action, d.gres) == ("keep", None)
    assert d.reason.startswith("an explicit request, kept by site policy; needs 55 GiB with 10 % margin")
    assert "more than the 39.56 GiB it asks for: it may run out of memory" in d.reason


def test_fill_generic_keeps_an_explicit_mps_share():
    assert run(3, "#SBATCH --gres=mps:50").action == "keep"


def test_rewrite_mode_rewrites_a_typed_request():
    d = run(7, "#SBATCH --gres=gpu:a100:1", config=site(policy={"explicit_request": "rewrite"}))
    assert (d.action, d.gres) == ("rewrite", "gpu:1g.10gb:1")


def test_keep_mode_keeps_even_a_generic_request():
    d = run(7, config=site(policy={"explicit_request": "keep"}))
    assert (d.action, d.gres) == ("keep", None)
    assert d.needed_bytes == 8_267_812_045


@pytest.mark.parametrize("directives, kw, what", [
    ("#SBATCH --gres=gpu:1", {"user": "alice"}, "user alice"),
    ("#SBATCH --gres=gpu:1 -A physics", {}, "account physics"),
    ("#SBATCH --gres=gpu:1 -p old", {}, "partition old"),
])
def test_exclusions(directives, kw, what):
    config = site(exclude={"users": ["alice"], "accounts": ["physics"], "partitions": ["old"]})
    d = run(7, directives, config=config, **kw)
    assert d.action == "excluded" and what in d.reason


def test_gpus_option_is_answered_in_the_same_form_and_never_with_a_share():
    d = run(7, "#SBATCH -G 1")
    assert (d.option, d.gpus, d.gres) == ("gpus", "1g.10gb:1", None)
    d = run(12, "#SBATCH --gpus=1", config=site(policy={"preference": ["shard", "mps", "gpu"]}))
    assert d.gpus == "a100:1"  # --gpus cannot ask for MPS or shards


def test_multi_gpu_jobs_get_whole_gpus_or_slices_of_the_same_count():
    assert run(12, "#SBATCH --gres=gpu:2").gres == "gpu:a100:2"
    assert run(7, "#SBATCH --gres=gpu:2").gres == "gpu:1g.10gb:2"


def test_other_gres_items_are_kept_as_written():
    assert run(7, "#SBATCH --gres=gpu:1,tmpfs:10G").gres == "gpu:1g.10gb:1,tmpfs:10G"


def test_job_may_land_in_any_listed_partition_so_only_common_types_are_offered():
    d = run(7, "#SBATCH --gres=gpu:1 -p debug,old")
    assert d.gres == "mps:a100:20"  # only a100 is in both: 7.7 GiB of 39.56 GiB -> 19.47 % -> 20


def test_partition_the_config_does_not_know():
    d = run(7, "#SBATCH --gres=gpu:1 -p elsewhere")
    assert d.action == "no_fit" and "partition elsewhere" in d.reason


def test_peaks_keyed_by_catalog_names_are_found():
    d = decide({"A100-SXM4-40GB": 12 * GIB, "H100-SXM5-80GB": 12 * GIB}, request("#SBATCH --gres=gpu:1"),
               site(policy={"preference": ["gpu"]}), catalog=CATALOG)
    assert d.gres == "gpu:a100:1"


def test_types_without_a_peak_are_not_offered():
    d = decide({"a100": 12 * GIB}, request("#SBATCH --gres=gpu:1"), site(), catalog=CATALOG)
    assert d.gres == "mps:a100:34"  # no h100 peak: no MIG, no shard offers


def test_a_rewrite_carries_the_figures_the_job_stamp_is_made_of():
    d = run(7)
    assert (d.peak_bytes, d.needed_bytes, d.gpu_type, d.gres, d.granted_bytes) == (
        7 * GIB, 8267812045, "1g.10gb", "gpu:1g.10gb:1", MIG_1G10GB_BYTES)


def test_offers_needing_more_gpus_than_a_node_has_are_left_out():
    d = decide(peaks(7), request("#SBATCH --gres=gpu:2"), site(), catalog=CATALOG,
               available={"a100": 2, "h100": 1, "1g.10gb": 1})
    assert d.gres == "gpu:a100:2"
    d = decide(peaks(7), request("#SBATCH --gres=gpu:3"), site(), catalog=CATALOG,
               available={"a100": 2, "h100": 1, "1g.10gb": 1})
    assert d.action == "no_fit" and d.reason == "no node of partition debug has 3 GPUs of one type"


def test_considered_offers_follow_preference_then_size():
    from xmem.policy import considered_offers

    offers = considered_offers(peaks(12), request("#SBATCH --gres=gpu:1"), site(), catalog=CATALOG)
    # need 13.2 GiB: the slice (9.75 GiB) and even all 4 of its shards are too small
    assert [(value, fits) for _, value, fits in offers] == [
        ("gpu:1g.10gb:1", False), ("shard:1g.10gb:4", False), ("shard:h100:1", True), ("mps:a100:34", True),
        ("gpu:a100:1", True), ("gpu:h100:1", True)]


# --- what a request must never become (issue 14: W1, W2, W4; issue 10: suspect estimates) ----------------------

def test_a_replay_that_ran_out_of_memory_never_sizes_a_small_request():
    from xmem.analyze import combined_peaks

    # 39.7 GiB needed: the A100 replay stops at an OOM after 0.51 GiB; the H100 replay runs to the end.
    estimate = estimates.estimate({"A100-SXM4-40GB": gpu_estimate(int(0.51 * GIB), A100_BYTES, fits=False),
                                   "H100-SXM5-80GB": gpu_estimate(int(39.7 * GIB), H100_BYTES)})
    config = site()
    job_peaks = combined_peaks([estimate], ["a100", "h100", "1g.10gb"], config, CATALOG)
    assert job_peaks["a100"] > A100_BYTES and job_peaks["1g.10gb"] == int(39.7 * GIB)
    d = decide(job_peaks, request("#SBATCH --gres=gpu:1"), config, catalog=CATALOG)
    assert d.action == "rewrite" and d.gpu_type == "h100" and d.granted_bytes >= int(39.7 * GIB)


def test_out_of_memory_on_every_type_keeps_the_users_request():
    from xmem.policy import job_peak

    job_peaks = {"a100": job_peak(gpu_estimate(GIB, A100_BYTES, fits=False)),
                 "h100": job_peak(gpu_estimate(GIB, H100_BYTES, fits=False))}
    d = decide(job_peaks, request("#SBATCH --gres=gpu:1"), site(), catalog=CATALOG)
    assert d.action == "no_fit" and d.gres is None
    assert d.reason == "runs out of memory on every GPU type offered, the largest a whole h100 (79.65 GiB)"


@pytest.mark.parametrize("why", ["no command of the job used CUDA under the trace",
                                 "the estimate is suspect (optimizer steps 22 MB of parameters, the trace saw 12 KB)"])
def test_an_untrusted_estimate_keeps_the_request_as_written(why):
    d = decide({"a100": 0, "h100": 0}, request("#SBATCH --gres=gpu:1"), site(), catalog=CATALOG, untrusted=why)
    assert (d.action, d.reason, d.gres, d.peak_bytes) == ("keep", why, None, None)


def test_no_cuda_job_keeps_its_request_through_the_analysis(tmp_path):
    """The whole analysis with the real estimator: a GPU job whose program never touches CUDA (TensorFlow's
    place) was sized by its 0 bytes (the smallest slice)."""
    from xmem.analyze import analyze_job

    (tmp_path / "tf.py").write_text("print('tensorflow runs here, not torch')\n")
    (tmp_path / "job.sh").write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython tf.py\n")
    analysis = analyze_job(tmp_path / "job.sh", config=site(), submit_cwd=str(tmp_path), env=dict(os.environ))
    assert not analysis.errors
    assert analysis.decision.action == "keep" and "used CUDA" in analysis.decision.reason


def test_gpus_asked_through_two_options_are_kept_not_half_rewritten():
    d = run(7, "#SBATCH --gres=gpu:1 --gpus=1")
    assert (d.action, d.gres, d.gpus) == ("keep", None, None)
    assert "--gres and --gpus" in d.reason


def test_per_task_gpus_are_counted_per_node_against_what_a_node_has():
    available = {"a100": 2, "h100": 1, "1g.10gb": 1}
    d = decide(peaks(7), request("#SBATCH --ntasks=2 --gpus-per-task=1"), site(), catalog=CATALOG,
               available=available)
    assert (d.option, d.gpus) == ("gpus-per-task", "a100:1")  # two tasks: one slice per task cannot be placed
    d = decide(peaks(7), request("#SBATCH --ntasks=1 --gpus-per-task=1"), site(), catalog=CATALOG,
               available=available)
    assert d.gpus == "1g.10gb:1"


def test_gpus_per_node_counts_tasks_on_one_node():
    from xmem.policy import gpus_per_node

    assert gpus_per_node(request("#SBATCH --ntasks=4 --gpus-per-task=2")) == 8
    assert gpus_per_node(request("#SBATCH --ntasks=4 --nodes=2 --gpus-per-task=1")) == 2
    assert gpus_per_node(request("#SBATCH --ntasks-per-node=3 --gpus-per-task=1")) == 3
    assert gpus_per_node(request("#SBATCH --gres=gpu:2")) == 2


def test_a_suspect_estimate_is_untrusted_whatever_its_peak():
    from xmem.analyze import CommandEstimate, untrusted_estimate
    from xmem.jobscript import TrainCommand

    command = TrainCommand(argv=("python", "train.py"), cwd="/w", env={}, python=None, launcher="python", line_no=3)
    sound = estimates.estimate({})
    reason = "the optimizer steps 21.9 MB of parameters, the trace saw 12 KB"
    suspect = estimates.estimate({}, suspect_reasons=(reason,))
    assert untrusted_estimate([CommandEstimate(command, sound)]) is None
    why = untrusted_estimate([CommandEstimate(command, sound), CommandEstimate(command, suspect)])
    assert why == "the estimate is suspect (the optimizer steps 21.9 MB of parameters, the trace saw 12 KB)"


def test_a_kept_request_carries_no_figure_from_a_replay_that_ran_out_of_memory():
    from xmem.policy import job_peak

    job_peaks = {"a100": job_peak(gpu_estimate(GIB, A100_BYTES, fits=False)), "h100": 50 * GIB}
    d = decide(job_peaks, request("#SBATCH --gres=gpu:a100:1"), site(), catalog=CATALOG)
    assert (d.action, d.peak_bytes, d.needed_bytes) == ("keep", None, None)
    assert d.reason.endswith("runs out of memory on a whole a100: it may not be enough")
