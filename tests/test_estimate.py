"""The estimate pipeline on hand-built traces: only the tracer is replaced; orchestrate, the real simulator and
the catalog run. Expected figures are derived by hand from the caching allocator's rules (torch-allocator.md A.3/A.4):
every request of 10 MiB or more gets its own segment rounded up to 2 MiB unless a cached free block of the same
stream fits; an 8,519,680-B cuBLAS workspace takes a 20 MiB segment and is split."""

import json
import threading

import pytest

import xmem.estimate as estimate_module
from xmem.config import EstimateSettings
from xmem.estimate import BadJobSettingError, Estimate, capability_class, estimate
from xmem.gpus import UnknownGpuError, find_gpu, load_catalog, overhead_bytes
from xmem.trace import TraceCancelled, TraceError
from xmem.trace.events import ARCH_SENSITIVE_PROGRESS, MemEvent, Trace

MIB = 1 << 20
WS_A100 = 8_519_680


def ev(action, block, mib, op="", phase="forward", iteration=0, category="activation"):
    return MemEvent(action, block, mib * MIB, 0, 0, op, "", phase, iteration, category)


def training_trace(capability=(8, 0), arch_sensitive=False) -> Trace:
    """One step of a one-layer model, sized so every block has its own segment (except the second workspace)."""
    return Trace(events=[
        ev("alloc", 1, 40, "empty", "other", -1, "parameter"),
        ev("alloc", 2, 16, "to", "other", 0, "input"),
        ev("alloc", 3, 24, "addmm", "forward", 0, "activation"),       # + cuBLAS workspace (main thread)
        ev("alloc", 4, 40, "mm", "backward", 0, "gradient"),           # + cuBLAS workspace (autograd thread)
        ev("free", 3, 24, "", "backward", 0, "activation"),
        ev("alloc", 5, 40, "zeros_like", "optimizer", 0, "optimizer_state"),
        ev("alloc", 6, 40, "zeros_like", "optimizer", 0, "optimizer_state"),
        ev("alloc", 7, 40, "_foreach_sqrt", "optimizer", 0, "temporary"),
        ev("free", 7, 40, "", "optimizer", 0, "temporary"),
    ], iterations=1, used_cuda=True, libraries=["cublas"], capability=capability, arch_sensitive=arch_sensitive,
        warnings=["loss.item() returned a stand-in value"], torch_version="2.14.1")


@pytest.fixture
def traced(monkeypatch):
    """Replace the tracer by a recorder of its calls that returns `traced.trace` (or one per capability)."""
    calls = []

    class Fake:
        trace = training_trace()
        by_capability: dict = {}

    def fake_run_trace(command, *, gpu, **kwargs):
        calls.append((list(command), tuple(gpu.capability), {**kwargs, "gpu": gpu}))
        return Fake.by_capability.get(tuple(gpu.capability), Fake.trace)

    monkeypatch.setattr(estimate_module, "run_trace", fake_run_trace)
    Fake.calls = calls
    return Fake


def test_the_replay_fit_reads_is_the_estimates_with_no_memory_limit(traced):
    """`keep_needed` (what xmem.fit's search reads): on a type the job fits, the estimate's own replay; on one it
    does not fit, what it would need there."""
    tiny = {"gpus": {"Tiny": {"total_bytes": 200 * MIB, "capability": [8, 0]}}}
    needed = {"A100-SXM4-40GB": None, "Tiny": None}
    result = estimate(["python", "train.py"], gpus=["a100", "tiny"], keep_needed=needed,
                      settings=EstimateSettings(load_catalog(tiny)))
    ops, sim = needed["A100-SXM4-40GB"]
    assert sim.oom is None and sim.peak_reserved == result.gpus["A100-SXM4-40GB"].peak_reserved_bytes == 260 * MIB
    assert ops.ops and ops.labels
    assert not result.gpus["Tiny"].fits and needed["Tiny"][1].peak_reserved == 260 * MIB


def test_peak_on_a100_is_reserved_plus_context_and_cublas(traced):
    result = estimate(["python", "train.py"], gpus=["a100"])
    a100 = result.gpus["A100-SXM4-40GB"]
    gpu = load_catalog()["A100-SXM4-40GB"]
    overhead = overhead_bytes(gpu, ["cublas"])
    # Segments: 40 + 16 + 24 + 20 (workspace, split; the second workspace reuses its remainder) + 40 + 40 + 40 + 40
    # (the freed 24 MiB activation segment is too small for any later request).
    assert a100.peak_reserved_bytes == 260 * MIB
    assert a100.peak_allocated_bytes == 216 * MIB + 2 * WS_A100
    assert a100.overhead_bytes == overhead
    assert a100.peak_bytes == 260 * MIB + overhead
    assert a100.capacity_bytes == gpu.total_bytes - overhead
    assert a100.fits and a100.oom is None
    assert a100.headroom_bytes == gpu.total_bytes - a100.peak_bytes


def test_hopper_workspaces_take_their_own_segments(traced):
    result = estimate(["python", "train.py"], gpus=["h100"])
    # Two 32 MiB workspaces, each its own segment: 40 + 16 + 24 + 32 + 40 + 32 + 40 + 40 + 40.
    assert result.gpus["H100-SXM5-80GB"].peak_reserved_bytes == 304 * MIB


def test_breakdown_at_the_peak_adds_up_to_the_peak(traced):
    result = estimate(["python", "train.py"], gpus=["a100", "rtx3060"])
    assert result.breakdown_gpu == "A100-SXM4-40GB"
    b = result.breakdown
    assert b["parameter"] == 40 * MIB
    assert b["input"] == 16 * MIB
    assert b["gradient"] == 40 * MIB
    assert b["optimizer_state"] == 80 * MIB
    assert b["temporary"] == 40 * MIB
    assert b["workspace"] == 2 * WS_A100
    assert "activation" not in b  # freed in backward, before the peak
    # The freed 24 MiB segment and the workspace segment's free 3,932,160-B remainder.
    assert b["allocator_slack"] == 24 * MIB + (20 * MIB - 2 * WS_A100)
    assert sum(b.values()) == result.gpus["A100-SXM4-40GB"].peak_bytes


def test_too_small_gpu_reports_the_oom(traced):
    overrides = {"gpus": {"Tiny": {"total_bytes": 200 * MIB, "capability": [8, 0]}},
                 "overhead": {"Tiny": {"context_bytes": 0, "library_bytes": {"cublas": 0}}}}
    result = estimate(["python", "train.py"], gpus=["tiny"], settings=EstimateSettings(load_catalog(overrides)))
    tiny = result.gpus["Tiny"]
    assert not tiny.fits
    assert tiny.oom is not None
    assert tiny.oom.requested == 40 * MIB
    assert tiny.capacity_bytes == 200 * MIB
    assert result.to_json()["gpus"]["Tiny"]["oom"]["requested"] == 40 * MIB
    # what it would need: the same replay with no limit (issue 23), as a GPU large enough for it reaches
    big = estimate(["python", "train.py"], gpus=["a100"]).gpus["A100-SXM4-40GB"]
    assert tiny.unlimited_peak_bytes == big.peak_reserved_bytes > tiny.total_bytes and big.unlimited_peak_bytes is None


def test_breakdown_on_a_type_it_does_not_fit_is_what_the_job_needs(traced):
    """Issue 32: the breakdown under "needs X" added up to the state at the failed allocation (less than the GPU);
    it is the peak of the run on a device large enough, and adds up to the need."""
    overrides = {"gpus": {"Tiny": {"total_bytes": 200 * MIB, "capability": [8, 0]}},
                 "overhead": {"Tiny": {"context_bytes": 0, "library_bytes": {"cublas": 0}}}}
    for shared in ([], ["a100"]):  # alone, and sharing its replay with a type it fits
        result = estimate(["python", "train.py"], gpus=["tiny", *shared], settings=EstimateSettings(load_catalog(overrides)))
        tiny, parts = result.gpus["Tiny"], result.breakdowns["Tiny"]
        assert not tiny.fits
        assert sum(parts.values()) == tiny.unlimited_peak_bytes > tiny.total_bytes
        assert parts["optimizer_state"] == 80 * MIB and parts["temporary"] == 40 * MIB  # the step's peak, reached


def test_json_has_the_documented_keys_and_round_trips(traced):
    data = json.loads(json.dumps(estimate(["python", "train.py"], gpus=["a100"]).to_json()))
    assert {"command", "gpus", "breakdown", "iterations", "seconds", "warnings", "libraries", "used_cuda",
            "torch_version"} <= set(data)
    assert {"peak_bytes", "peak_reserved_bytes", "peak_allocated_bytes", "overhead_bytes", "capacity_bytes", "fits",
            "oom", "fragmentation"} <= set(data["gpus"]["A100-SXM4-40GB"])
    assert data["command"] == ["python", "train.py"]
    assert data["iterations"] == 1 and data["used_cuda"] is True and data["torch_version"] == "2.14.1"
    assert data["libraries"] == ["cublas"]
    assert "loss.item() returned a stand-in value" in data["warnings"]


def test_json_round_trip_gives_the_same_record(traced):
    overrides = {"gpus": {"Tiny": {"total_bytes": 200 * MIB, "capability": [8, 0]}}}
    result = estimate(["python", "train.py"], gpus=["a100", "tiny"], settings=EstimateSettings(load_catalog(overrides)))
    assert result.gpus["Tiny"].oom is not None
    again = Estimate.from_json(json.loads(json.dumps(result.to_json())))
    assert again.to_json() == result.to_json()
    assert again.gpus["Tiny"].oom == result.gpus["Tiny"].oom


def test_every_catalog_type_when_no_gpu_is_named(traced):
    result = estimate(["python", "train.py"])
    assert set(result.gpus) == set(load_catalog())


def test_unknown_gpu_fails_before_tracing(traced):
    with pytest.raises(UnknownGpuError, match="'X9000'"):
        estimate(["python", "train.py"], gpus=["a100", "X9000"])
    assert traced.calls == []


def test_one_trace_when_not_architecture_sensitive(traced):
    estimate(["python", "train.py"], gpus=["a100", "h100", "t4", "v100"])
    assert [c[1] for c in traced.calls] == [(9, 0)]


def test_one_trace_per_capability_class_when_architecture_sensitive(traced):
    traced.trace = training_trace(capability=(9, 0), arch_sensitive=True)
    traced.by_capability = {(7, 5): training_trace(capability=(7, 5), arch_sensitive=True)}
    result = estimate(["python", "train.py"], gpus=["a100", "h100", "t4", "v100"])
    # Each class traced at its highest capability among the requested types, newest class first.
    assert [c[1] for c in traced.calls] == [(9, 0), (7, 5)]
    assert result.gpus["V100-16GB"].traced_capability == (7, 5)
    assert result.gpus["A100-SXM4-40GB"].traced_capability == (9, 0)
    assert any("traced once per class" in w for w in result.warnings)


def test_other_classes_are_traced_beside_the_first_once_it_reports_an_architecture_choice(monkeypatch):
    """The pre-sm80 trace starts while the sm80+ one still runs (it waits here for the other to begin), and its
    progress lines name its class."""
    second_started, messages = threading.Event(), []

    def run_trace(command, *, gpu, on_progress, cancel=None, **kwargs):
        if gpu.capability == (9, 0):
            on_progress("iteration 1/3")
            on_progress(ARCH_SENSITIVE_PROGRESS)
            assert second_started.wait(30), "the other class's trace did not start beside this one"
        else:
            second_started.set()
            on_progress("iteration 1/3")
        return training_trace(capability=tuple(gpu.capability), arch_sensitive=True)

    monkeypatch.setattr(estimate_module, "run_trace", run_trace)
    result = estimate(["python", "train.py"], gpus=["h100", "t4"], on_progress=messages.append)
    assert result.gpus["T4"].traced_capability == (7, 5) and result.gpus["H100-SXM5-80GB"].traced_capability == (9, 0)
    assert "iteration 1/3" in messages and "pre-sm80: iteration 1/3" in messages
    assert ARCH_SENSITIVE_PROGRESS not in messages


def test_no_other_trace_runs_when_the_first_reports_no_architecture_choice(traced):
    estimate(["python", "train.py"], gpus=["h100", "t4"])
    assert [c[1] for c in traced.calls] == [(9, 0)]


def test_a_failing_first_trace_cancels_the_one_beside_it(monkeypatch):
    cancels = []

    def run_trace(command, *, gpu, on_progress, cancel=None, **kwargs):
        if gpu.capability == (9, 0):
            on_progress(ARCH_SENSITIVE_PROGRESS)
            raise TraceError("user_error", "ValueError: bad batch")
        cancels.append(cancel)
        assert cancel.wait(30), "never cancelled"
        raise TraceCancelled()

    monkeypatch.setattr(estimate_module, "run_trace", run_trace)
    with pytest.raises(TraceError, match="bad batch"):
        estimate(["python", "train.py"], gpus=["h100", "t4"])
    assert len(cancels) == 1 and cancels[0].is_set()


def test_capability_classes():
    assert capability_class((7, 5)) == capability_class((7, 0)) == "pre-sm80"
    assert capability_class((8, 0)) == capability_class((9, 0)) == "sm80+"


def test_tracer_gets_the_job_settings(traced):
    estimate(["python", "train.py", "--lr", "1"], gpus=["t4"], iterations=2, env={"A": "1"}, cwd="/tmp",
             timeout=30, python="/usr/bin/python3")
    command, capability, kwargs = traced.calls[0]
    assert command == ["python", "train.py", "--lr", "1"] and capability == (7, 5)
    assert kwargs["iterations"] == 2 and kwargs["env"]["A"] == "1" and kwargs["cwd"] == "/tmp"
    # the program sees the GPU type estimated, not a typical one of its capability
    assert kwargs["gpu"] == find_gpu("t4", load_catalog())
    assert kwargs["timeout"] == 30 and kwargs["python"] == "/usr/bin/python3"


def test_program_without_cuda_needs_no_gpu_memory(traced):
    traced.trace = Trace(used_cuda=False, iterations=3, torch_version="2.14.1")
    result = estimate(["python", "cpu_only.py"], gpus=["a100", "t4"])
    assert not result.used_cuda
    for g in result.gpus.values():
        assert g.peak_bytes == 0 and g.overhead_bytes == 0 and g.fits
    assert "the program never used CUDA" in result.warnings
    assert isinstance(result, Estimate)


def one_alloc_trace(alloc_conf=""):
    return Trace(events=[MemEvent("alloc", 1, 12_000_000, 0, 0, "empty", "", "other", -1, "parameter")],
                 iterations=1, used_cuda=True, alloc_conf=alloc_conf)


def test_allocator_settings_the_job_ran_with_are_honoured(traced):
    # 12,000,000 B rounds to 12,000,256: its own segment of 12,582,912 B (2 MiB rounding), while an expandable
    # segment maps whole 20 MiB pages for the large pool.
    traced.trace = one_alloc_trace()
    assert estimate(["python", "t.py"], gpus=["t4"], env={}).gpus["T4"].peak_reserved_bytes == 12_582_912
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert estimate(["python", "t.py"], gpus=["t4"], env=env).gpus["T4"].peak_reserved_bytes == 20 * MIB
    traced.trace = one_alloc_trace("expandable_segments:True")  # set by the script itself, seen by the tracer
    assert estimate(["python", "t.py"], gpus=["t4"], env={}).gpus["T4"].peak_reserved_bytes == 20 * MIB


def test_memory_fraction_is_a_fraction_of_the_total_not_of_what_is_left(traced):
    # Total 1000 MiB, 500 MiB of context: the allocator may reserve 500 MiB. A fraction of 0.45 allows
    # 0.45 x 1000 = 450 MiB (torch: fraction of the device total), so one 300 MiB tensor fits; 0.25 allows 250.
    traced.trace = Trace(events=[MemEvent("alloc", 1, 300 * MIB, 0, 0, "empty", "", "other", -1, "parameter")],
                         iterations=1, used_cuda=True)
    overrides = {"gpus": {"Half": {"total_bytes": 1000 * MIB, "capability": [8, 0]}},
                 "overhead": {"Half": {"context_bytes": 500 * MIB, "library_bytes": {}}}}

    def half_gpu(fraction):
        env = {"PYTORCH_CUDA_ALLOC_CONF": f"per_process_memory_fraction:{fraction}"}
        return estimate(["python", "t.py"], gpus=["half"], env=env, settings=EstimateSettings(load_catalog(overrides))).gpus["Half"]

    assert half_gpu(0.45).fits and half_gpu(0.45).peak_reserved_bytes == 300 * MIB
    assert half_gpu(0.25).oom is not None


def test_malformed_allocator_setting_is_a_clear_error(traced):
    traced.trace = one_alloc_trace()
    with pytest.raises(BadJobSettingError, match="PYTORCH_CUDA_ALLOC_CONF"):
        estimate(["python", "t.py"], gpus=["t4"], env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:abc"})


def test_progress_reaches_the_tracer_and_names_each_simulation(traced):
    messages = []
    estimate(["python", "train.py"], gpus=["a100", "t4"], on_progress=messages.append)
    assert messages == ["simulating the caching allocator on A100-SXM4-40GB",
                        "simulating the caching allocator on T4"]
    messages.clear()
    traced.calls[0][2]["on_progress"]("iteration 1/3")
    assert messages == ["iteration 1/3"]


@pytest.mark.parametrize("alloc_conf", ["", "max_split_size_mb:30", "expandable_segments:True"])
def test_shared_replays_give_what_one_replay_per_gpu_type_gives(traced, alloc_conf):
    # Two small types that share their ops with the catalog's A100s: one runs out, one fits.
    overrides = {"gpus": {name: {"total_bytes": total, "capability": [8, 0]} for name, total in
                          [("Tiny", 150 * MIB), ("Fits", 400 * MIB)]},
                 "overhead": {name: {"context_bytes": 0, "library_bytes": {"cublas": 0}} for name in ("Tiny", "Fits")}}
    env = {"PYTORCH_CUDA_ALLOC_CONF": alloc_conf}
    result = estimate(["python", "train.py"], env=env, settings=EstimateSettings(load_catalog(overrides)))
    catalog = load_catalog(overrides)
    config = estimate_module.AllocatorConfig.parse(alloc_conf)
    alone = {name: estimate_module.estimate_gpu(traced.trace, gpu, config, env)[0] for name, gpu in catalog.items()}
    assert result.gpus == alone
    assert alone["Tiny"].oom is not None and alone["Fits"].fits


def test_estimate_from_traces_answers_as_the_estimate_that_traced_them(traced):
    # bench_trace --phases times this part alone; it must be the estimate's own post-trace work, not a copy
    kept: dict = {}
    traced.trace = training_trace(arch_sensitive=True)
    result = estimate(["python", "train.py"], gpus=["a100-40gb", "t4"], env={}, keep_traces=kept)
    targets = [find_gpu(name, load_catalog()) for name in ("a100-40gb", "t4")]
    again = estimate_module.estimate_traces(["python", "train.py"], kept, targets, env={})
    assert set(kept) == {"sm80+", "pre-sm80"}  # one trace per class: each GPU type replays its own
    assert {**again.to_json(), "seconds": 0} == {**result.to_json(), "seconds": 0}
    assert again.gpus["T4"].peak_bytes > 0


def test_the_busiest_device_is_the_first_to_run_out_else_the_highest_peak():
    """The one rule the estimate, the pictures and `fit` pick a trace's device by (`busiest_replay`)."""
    from xmem.estimate import busiest_replay
    from xmem.simulate import ALLOC, simulate

    ops = {0: [(ALLOC, 1, 64 * MIB, 0)], 1: [(ALLOC, 1, 8 * MIB, 0)], 2: [(ALLOC, 1, 64 * MIB, 0)]}

    def replay(capacities):
        return lambda device: (ops[device], simulate(ops[device], capacity=capacities.get(device)))

    trace = Trace(events=[])
    assert busiest_replay(trace, replay({}), devices=[1, 0, 2])[2] == 0  # the highest peak; of equals, the first
    ran_out = busiest_replay(trace, replay({1: 4 * MIB}), devices=[0, 1, 2])
    assert ran_out[2] == 1 and ran_out[1].oom is not None  # a smaller peak that ran out counts
