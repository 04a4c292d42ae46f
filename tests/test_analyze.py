"""analyze_job: parse -> estimate per command -> combined peaks -> decision. The estimator here is a hand-written
stand-in returning hand-made `Estimate` records (tests/estimates.py), so each figure below is chosen, not
measured; the real estimator runs end to end in tests/cli/test_check.py."""

from pathlib import Path

from tests.estimates import estimate_of_peaks
from xmem.analyze import AnalysisError, analyze_job, combined_peaks, first_command
from xmem.config import config_from_dict
from xmem.slurm.cluster import query_cluster
from xmem.trace import TraceError

GIB = 2**30
SITE_TABLES = {
    "partitions": {"default": "debug", "from_cluster": False,
                   "gpu_types": {"debug": ["a100", "h100", "1g.10gb"]}},
    "mig": {"h100": ["1g.10gb"]},
    "policy": {"preference": ["mig", "gpu"]},
    "margin": {"relative": 0.10},
}
SITE = config_from_dict(SITE_TABLES)


class FakeEstimator:
    """Peaks per catalog name per script (argv[1]); records every call."""

    def __init__(self, peaks_by_script, errors=None):
        self.peaks_by_script = peaks_by_script
        self.errors = errors or {}
        self.calls = []

    def __call__(self, command, **kw):
        self.calls.append((command, kw))
        script = command[1]
        if script in self.errors:
            raise self.errors[script]
        return estimate_of_peaks(self.peaks_by_script[script])


def job(tmp_path, body: str) -> Path:
    path = tmp_path / "job.sh"
    path.write_text("#!/bin/bash\n" + body)
    return path


def analyze(path, estimator, config=SITE, **kw):
    kw.setdefault("env", {"PATH": "/usr/bin", "HOME": "/home/u", "USER": "u", "PWD": str(path.parent)})
    return analyze_job(path, config=config, estimator=estimator, **kw)


def test_job_without_gpu_is_not_estimated(tmp_path):
    estimator = FakeEstimator({})
    result = analyze(job(tmp_path, "#SBATCH -p debug\npython t.py\n"), estimator)
    assert result.decision.action == "none"
    assert estimator.calls == []


def test_excluded_user_is_not_estimated(tmp_path):
    config = config_from_dict({"exclude": {"users": ["u"]}})
    estimator = FakeEstimator({})
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:1\npython t.py\n"), estimator, config=config)
    assert result.decision.action == "excluded"
    assert estimator.calls == []


def test_script_not_understood(tmp_path):
    """A script sbatch itself refuses (no #! line) is not run, whatever the static read found in it."""
    path = tmp_path / "job.sh"
    path.write_text("#SBATCH --gres=gpu:1\n\nfor i in 1 2; do python t.py; done\n")
    result = analyze(path, FakeEstimator({}))
    assert result.decision is None
    assert result.errors[0].kind == "not_understood" and "line 3" in result.errors[0].message


def test_a_script_the_static_read_cannot_name_is_estimated_run_whole(tmp_path):
    path = job(tmp_path, "#SBATCH --gres=gpu:1\nfor i in 1 2; do python t.py; done\n")
    estimator = FakeEstimator({str(path): {name: 10 << 30 for name in ("a100-40gb", "a100-80gb", "A100-SXM4-40GB",
                                                                         "A100-SXM4-80GB")}})
    result = analyze(path, estimator)
    assert [command for command, _ in estimator.calls] == [["/bin/bash", str(path)]]
    assert result.peaks and not result.errors


def test_peaks_are_the_max_over_commands_and_mig_slices_take_the_parents(tmp_path):
    estimator = FakeEstimator({
        "prep.py": {"A100-SXM4-40GB": 1 * GIB, "H100-SXM5-80GB": 8 * GIB},
        "train.py": {"A100-SXM4-40GB": 7 * GIB, "H100-SXM5-80GB": 6 * GIB},
    })
    path = job(tmp_path, "#SBATCH --gres=gpu:1\ncd /work\nexport A=1\npython prep.py\npython train.py $1\n")
    result = analyze(path, estimator, script_args=["--x"])
    assert result.peaks == {"a100": 7 * GIB, "h100": 8 * GIB, "1g.10gb": 8 * GIB}
    # 8 GiB * 1.1 = 8.8 GiB fits the 9.75 GiB slice
    assert (result.decision.action, result.decision.gres) == ("rewrite", "gpu:1g.10gb:1")
    # what was weighed: preference mig then gpu, smallest first; every one holds 8.8 GiB (a100: 7.7 GiB)
    assert [(row.request, row.fits) for row in result.options.rows] == [
        ("gpu:1g.10gb:1", True), ("gpu:a100:1", True), ("gpu:h100:1", True)]
    command, kw = estimator.calls[1]
    assert command == ["python", "train.py", "--x"]
    assert kw["gpus"] == ["a100", "h100"]  # the slice is estimated as its parent, once
    assert kw["cwd"] == "/work"
    assert kw["env"]["A"] == "1" and kw["env"]["SLURM_GPUS_ON_NODE"] == "1"
    assert kw["iterations"] == 3 and kw["timeout"] <= SITE.estimate.timeout_s


def test_the_first_command_is_read_as_the_analysis_estimates_it(tmp_path):
    """What `check JOB.sh --vary` searches: the command, GPU types and keywords analyze_job gives its estimator."""
    estimator = FakeEstimator({"prep.py": {"A100-SXM4-40GB": GIB, "H100-SXM5-80GB": GIB}})
    path = job(tmp_path, "#SBATCH --gres=gpu:1\ncd /work\nexport A=1\npython prep.py $1\npython train.py\n")
    env = {"PATH": "/usr/bin", "HOME": "/home/u", "USER": "u"}
    first = first_command(path, script_args=["--x"], config=SITE, env=env, submit_cwd=str(tmp_path))
    analyze(path, estimator, script_args=["--x"], env=env, submit_cwd=str(tmp_path))
    command, kw = estimator.calls[0]
    assert list(first.command.argv) == command == ["python", "prep.py", "--x"]
    assert list(first.targets) == kw["gpus"] == ["a100", "h100"]
    assert first.job == {name: kw[name] for name in ("iterations", "env", "cwd", "python")}
    assert first.job["env"]["SLURM_GPUS_ON_NODE"] == "1" and first.job["cwd"] == "/work"


def test_a_script_with_no_first_command_says_why(tmp_path):
    unreadable = first_command(tmp_path / "missing.sh", config=SITE)
    assert isinstance(unreadable, AnalysisError) and unreadable.kind == "bad_input"
    nothing = first_command(job(tmp_path, "#SBATCH --gres=gpu:1\necho hello\n"), config=SITE)
    assert isinstance(nothing, AnalysisError) and nothing.kind == "not_understood"


def test_the_gpu_catalog_is_read_once_per_analysis(tmp_path, monkeypatch):
    import xmem.gpus

    reads = []

    def counting(*args, **kw):
        reads.append(args)
        return real(*args, **kw)
    real = xmem.gpus.load_catalog
    monkeypatch.setattr(xmem.gpus, "load_catalog", counting)
    estimator = FakeEstimator({"train.py": {"A100-SXM4-40GB": 7 * GIB, "H100-SXM5-80GB": 6 * GIB}})
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:1\npython train.py\n"), estimator)
    assert result.decision is not None and result.options.rows  # the types, the peaks and the policy all used it
    assert len(reads) == 1


def test_the_offers_are_computed_once_per_analysis(tmp_path, monkeypatch):
    import importlib

    rules = importlib.import_module("xmem.policy.rules")
    calls = []

    def counting(*args, **kw):
        calls.append(args)
        return real(*args, **kw)
    real = rules.site_offers
    monkeypatch.setattr(rules, "site_offers", counting)
    estimator = FakeEstimator({"train.py": {"A100-SXM4-40GB": 7 * GIB, "H100-SXM5-80GB": 6 * GIB}})
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:1\npython train.py\n"), estimator)
    assert result.decision.action == "rewrite" and result.options.chosen is not None  # both used them
    assert len(calls) == 1


def test_estimator_error_is_reported_with_its_kind_and_line(tmp_path):
    error = TraceError("user_error", "ValueError: bad lr", user_traceback="Traceback ...")
    estimator = FakeEstimator({}, errors={"train.py": error})
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:1\npython train.py\n"), estimator)
    assert result.decision is None
    [err] = result.errors
    assert (err.kind, err.line_no, err.user_traceback) == ("user_error", 3, "Traceback ...")
    assert "line 3 (python train.py): ValueError: bad lr" == err.message


def test_a_command_that_reached_no_step_in_time_is_an_error_not_skipped(tmp_path):
    """no_optimizer_step: a training program the trace's time limit cut before its first step, whose peak is
    unknown (an evaluation-only command gets an estimate of its forward passes and counts like any other)."""
    estimator = FakeEstimator({"train.py": {"A100-SXM4-40GB": 20 * GIB, "H100-SXM5-80GB": 20 * GIB}},
                              errors={"eval.py": TraceError("no_optimizer_step", "no optimizer step")})
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:1\npython eval.py\npython train.py\n"), estimator)
    assert result.decision is None and [e.kind for e in result.errors] == ["no_optimizer_step"]
    assert not result.estimates[0].skipped and result.estimates[1].estimate


def captured_cluster():
    """The dev cluster as Slurm 22.05 described it (tests/data/slurm): partitions debug (default) and big, one
    node with gpu:a100:2, gpu:h100:1, gpu:1g.10gb:1."""
    data = Path(__file__).parent / "data" / "slurm"
    files = {"sinfo -V": "sinfo-V.txt", "sinfo --json": "sinfo.json",
             "scontrol show -o partition": "scontrol-partition.txt", "scontrol show -o node": "scontrol-node.txt"}
    return query_cluster("cli", run=lambda argv: (data / files[" ".join(argv)]).read_text())


class CountingCluster:
    def __init__(self):
        self.asked = 0

    def __call__(self):
        self.asked += 1
        return captured_cluster()


def test_partition_missing_from_config_is_read_from_the_cluster_once(tmp_path):
    config = config_from_dict({"partitions": {"from_cluster": True}, "policy": {"preference": ["gpu"]}})
    estimator = FakeEstimator({"t.py": {"H100-SXM5-80GB": 50 * GIB, "A100-SXM4-40GB": 50 * GIB}})
    cluster = CountingCluster()
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:1 -p big\npython t.py\n"), estimator, config=config,
                     cluster=cluster)
    assert result.gpu_types == ("a100", "h100")  # 1g.10gb: a slice of what? The config has no [mig] to say
    assert "'1g.10gb'" in result.notes[0]
    assert result.decision.gres == "gpu:h100:1"  # 55 GiB: more than an a100's 39.56 GiB
    assert cluster.asked == 1


def test_default_partition_comes_from_the_cluster_when_the_config_has_none(tmp_path):
    config = config_from_dict({"partitions": {"from_cluster": True}})
    estimator = FakeEstimator({"t.py": {"A100-SXM4-40GB": GIB}})
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:1\npython t.py\n"), estimator, config=config,
                     cluster=captured_cluster, gpus=["a100"])
    assert result.partitions == ("debug",)


def test_config_that_forbids_the_cluster_never_asks_it(tmp_path):
    cluster = CountingCluster()
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:2 -p big\npython t.py\n"), FakeEstimator({}),
                     config=config_from_dict({"partitions": {"from_cluster": False}}), cluster=cluster)
    assert result.errors[0].kind == "no_gpu_types" and cluster.asked == 0


def test_multi_gpu_request_is_not_given_more_gpus_than_a_node_has(tmp_path):
    # Two GPUs of 7 GiB each: two MIG slices would be cheapest, but the node has one 1g.10gb; it has two a100s.
    estimator = FakeEstimator({"t.py": {"A100-SXM4-40GB": 7 * GIB, "H100-SXM5-80GB": 7 * GIB}})
    config = config_from_dict({**SITE_TABLES, "partitions": {"default": "debug", "from_cluster": True,
                                                             "gpu_types": {"debug": ["a100", "h100", "1g.10gb"]}}})
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:2\npython t.py\n"), estimator, config=config,
                     cluster=captured_cluster)
    assert result.decision.gres == "gpu:a100:2"
    without_cluster = analyze(job(tmp_path, "#SBATCH --gres=gpu:2\npython t.py\n"), estimator, config=SITE)
    assert without_cluster.decision.gres == "gpu:1g.10gb:2"  # nothing says the node has only one


def test_no_known_gpu_types_is_an_error_saying_where_to_list_them(tmp_path):
    config = config_from_dict({"partitions": {"from_cluster": False}})
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:1 -p big\npython t.py\n"), FakeEstimator({}), config=config)
    assert result.errors[0].kind == "no_gpu_types" and "[partitions.gpu_types]" in result.errors[0].message


def test_without_the_partitions_types_the_type_the_job_asks_for_is_estimated_with_a_note(tmp_path):
    config = config_from_dict({"partitions": {"from_cluster": False}})  # a newcomer's machine: no site config
    estimator = FakeEstimator({"t.py": {"A100-SXM4-40GB": GIB}})
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:a100:1\npython t.py\n"), estimator, config=config)
    assert not result.errors and estimator.calls[0][1]["gpus"] == ["a100"] and result.peaks == {"a100": GIB}
    assert any("the type the job asks for (a100)" in note for note in result.notes)
    unknown = analyze(job(tmp_path, "#SBATCH --gres=gpu:x9000:1\npython t.py\n"), estimator, config=config)
    assert unknown.errors[0].kind == "no_gpu_types"  # a type the catalog cannot size is still the site's to list


def test_gpu_types_given_explicitly(tmp_path):
    estimator = FakeEstimator({"t.py": {"A100-SXM4-40GB": GIB}})
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:1\npython t.py\n"), estimator, gpus=["a100"])
    assert estimator.calls[0][1]["gpus"] == ["a100"]
    assert result.peaks == {"a100": GIB}


def test_unreadable_script(tmp_path):
    result = analyze(tmp_path / "absent.sh", FakeEstimator({}))
    assert result.job is None and result.errors[0].kind == "bad_input"


def test_command_line_options_override_the_script(tmp_path):
    estimator = FakeEstimator({})
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:1\npython t.py\n"), estimator,
                     cli_options={"gres": "none"})
    assert result.decision.action == "none" and estimator.calls == []


def test_combined_peaks_match_catalog_and_site_names():
    estimates = [estimate_of_peaks({"A100-SXM4-40GB": 5}), estimate_of_peaks({"a100": 9})]
    assert combined_peaks(estimates, ["a100", "h100"], SITE) == {"a100": 9}


def test_analysis_serialises(tmp_path):
    estimator = FakeEstimator({"t.py": {"A100-SXM4-40GB": GIB, "H100-SXM5-80GB": GIB}})
    data = analyze(job(tmp_path, "#SBATCH --gres=gpu:1\npython t.py\n"), estimator).to_json()
    assert data["decision"]["gres"] == "gpu:1g.10gb:1"
    assert data["job"]["commands"][0]["argv"] == ["python", "t.py"]


def test_cluster_gpu_types_the_catalog_lacks_are_left_out_with_a_note(tmp_path):
    from xmem.slurm.cluster import ClusterInfo, NodeInfo
    from xmem.jobscript import GresItem

    node = NodeInfo("n1", ("lab",), (GresItem("gpu", "a100", 1), GresItem("gpu", "quantum9000", 1)))
    info = ClusterInfo(nodes={"n1": node}, partitions=("lab",), default_partition="lab")
    estimator = FakeEstimator({"t.py": {"A100-SXM4-40GB": GIB}})
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:1\npython t.py\n"), estimator,
                     config=config_from_dict({"partitions": {"from_cluster": True}}), cluster=lambda: info)
    assert result.gpu_types == ("a100",)
    assert "quantum9000" in result.notes[0]
    assert result.decision.action == "rewrite"


class ArrayEstimator(FakeEstimator):
    """A program whose width follows its SLURM_ARRAY_TASK_ID: task t peaks at (t + 1) GiB."""

    def __call__(self, command, **kw):
        self.calls.append((command, kw))
        task = int(kw["env"]["SLURM_ARRAY_TASK_ID"])
        return estimate_of_peaks({"A100-SXM4-40GB": (task + 1) * GIB, "H100-SXM5-80GB": (task + 1) * GIB})


def test_a_job_array_is_sized_for_its_largest_traced_task(tmp_path):
    estimator = ArrayEstimator({})
    result = analyze(job(tmp_path, "#SBATCH --gres=gpu:1 --array=0-15:3%2\npython t.py $SLURM_ARRAY_TASK_ID\n"),
                     estimator)
    traced = [(kw["env"]["SLURM_ARRAY_TASK_ID"], command[2], kw["env"]["SLURM_ARRAY_TASK_COUNT"])
              for command, kw in estimator.calls]
    assert traced == [("0", "0", "6"), ("9", "9", "6"), ("15", "15", "6")]  # first, middle, last of 0,3,...,15
    assert result.peaks["a100"] == 16 * GIB and result.decision.gpu_type == "a100"  # 17.6 GiB: no 9.75 GiB slice
    assert [e.array_task for e in result.estimates] == [0, 9, 15]
    assert any("tasks 0, 9, 15 traced" in note for note in result.notes)


def test_a_short_array_traces_every_task_and_a_plain_job_once(tmp_path):
    estimator = ArrayEstimator({})
    analyze(job(tmp_path, "#SBATCH --gres=gpu:1\n#SBATCH -a 2,5\npython t.py\n"), estimator)
    assert [kw["env"]["SLURM_ARRAY_TASK_ID"] for _, kw in estimator.calls] == ["2", "5"]
    plain = FakeEstimator({"t.py": {"A100-SXM4-40GB": GIB}})
    analyze(job(tmp_path, "#SBATCH --gres=gpu:1\npython t.py\n"), plain)
    assert len(plain.calls) == 1 and "SLURM_ARRAY_TASK_ID" not in plain.calls[0][1]["env"]
