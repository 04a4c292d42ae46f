"""The inline path: the analysis cached, only when it succeeded and the files it read are unchanged."""

from tests.slurm.submissions import PEAKS, decision
from xmem.cache import AnalysisCache
from xmem.slurm.contract import FilterRequest, Verdict
from xmem.slurm.inline import cached_analysis


def test_cache_skips_the_second_analysis_and_never_caches_a_failure(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n")
    req = FilterRequest(script=str(script), argv=(str(script),), options={"gres": "gres:gpu:1"}, user="ann",
                        env={"PWD": str(tmp_path)})
    calls = []

    def analyzer(path, r, config):
        calls.append(path)
        return Verdict(decision(), PEAKS) if len(calls) != 1 else Verdict(None, errors=("timeout: 1 s",))

    cache = AnalysisCache(tmp_path / "cache")
    run = lambda: cached_analysis(str(script), req, None, cache=cache, config_digest="", analyzer=analyzer)
    assert run().errors == ("timeout: 1 s",)  # failed: not cached
    fresh = run()
    assert not fresh.cached and fresh.decision == decision()
    hit = run()
    assert hit.cached and hit.decision == decision() and hit.peaks == PEAKS
    assert len(calls) == 2
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py --more\n")
    assert not run().cached and len(calls) == 3


def test_a_damaged_cache_entry_is_computed_again(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n")
    req = FilterRequest(script=str(script), argv=(str(script),), options={"gres": "gres:gpu:1"}, user="ann")
    cache = AnalysisCache(tmp_path / "cache")
    calls = []

    def analyzer(path, r, config):
        calls.append(path)
        return Verdict(decision(), PEAKS)

    key = "k" * 64
    for damaged in ({"decision": "rewrite"}, {"decision": {"action": "rewrite", "gres": 7}, "peaks": {}},
                    {"decision": decision().to_json(), "peaks": {"a100": "big"}}, {"decision": None, "errors": []}):
        cache.put(key, damaged)
        got = cached_analysis(str(script), req, None, cache=cache, config_digest="", analyzer=analyzer, key=key)
        assert not got.cached and got.decision == decision()
    assert len(calls) == 4


def test_an_estimate_of_files_edited_during_the_trace_is_not_cached(tmp_path):
    """The cache key hashes train.py before the trace reads it: an edit meanwhile must not file the edited
    program's estimate under the original's key."""
    script, train = tmp_path / "job.sh", tmp_path / "train.py"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n")
    train.write_text("print('v1')\n")
    req = FilterRequest(script=str(script), argv=(str(script),), options={"gres": "gres:gpu:1"}, user="ann",
                        cwd=str(tmp_path))
    cache = AnalysisCache(tmp_path / "cache")

    def editing_analyzer(path, r, config):
        train.write_text("print('v2: a bigger model')\n")  # the user edits right after sbatch
        return Verdict(decision(), PEAKS)

    run = lambda analyzer: cached_analysis(str(script), req, None, cache=cache, config_digest="",
                                           files=[str(train)], analyzer=analyzer)
    assert run(editing_analyzer).decision == decision()  # the answer stands (it is what the job will run)
    train.write_text("print('v1')\n")
    assert not run(lambda *a: Verdict(decision(peak_bytes=1), PEAKS)).cached  # v1's key holds nothing
    assert run(editing_analyzer).decision == decision(peak_bytes=1)  # v1's own estimate, now cached
