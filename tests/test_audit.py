"""The self-audit (xmem.audit) on hand-built traces and facts: a trace that holds what its run's objects say is
sound; one that misses any of it is suspect, with a reason that says what is missing (in the estimate's JSON and
table too)."""

import json

from xmem.audit import audit, held_at
from xmem.trace.events import (FACT_FSDP_GRADIENTS, FACT_GRADIENTS, FACT_MODEL_STATE, FACT_STATE, FACT_STATE_BY_RULE,
                               FACT_STEPPED, Fact, MemEvent, Trace)

# torchvision regnet_x_400mf as a CPU build of torchvision makes it: 215 parameter tensors, 21,983,904 bytes (fp32)
REGNET_PARAMS, REGNET_PARAM_BYTES = 215, 21_983_904


def alloc(block, nbytes, category, device=0):
    return MemEvent("alloc", block, nbytes, device=device, category=category)


def free(block, nbytes, category, device=0):
    return MemEvent("free", block, nbytes, device=device, category=category)


def fact(what, categories, storages, nbytes, at_event, device=0, source="hand-built"):
    return Fact(what, categories, device, storages, nbytes, at_event, source)


def model_and_step(param_sizes, state_copies=2):
    """Events of a model moved to the GPU, one backward and one Adam step, and the points between them."""
    events = [alloc(i, n, "parameter") for i, n in enumerate(param_sizes)]
    step_begin = len(events) + len(param_sizes)
    events += [alloc(100 + i, n, "gradient") for i, n in enumerate(param_sizes)]
    events += [alloc(200 + i * state_copies + k, n, "optimizer_state")
               for i, n in enumerate(param_sizes) for k in range(state_copies)]
    return events, step_begin, len(events)


def test_a_trace_that_holds_every_fact_is_sound():
    sizes = [4000, 40, 800]
    events, begin, end = model_and_step(sizes)
    total = sum(sizes)
    trace = Trace(events=events, iterations=1, used_cuda=True, facts=[
        fact(FACT_STEPPED, ("parameter",), 3, total, begin),
        fact(FACT_GRADIENTS, ("gradient",), 3, total, begin),
        fact(FACT_STATE, ("optimizer_state",), 6, 2 * total, end),
        fact(FACT_STATE_BY_RULE, ("optimizer_state",), 0, 2 * total, end, source="Adam rule"),
    ])
    assert audit(trace) == ()


def test_the_regnet_trace_that_saw_17_of_215_parameters_is_suspect():
    # The case: torchvision computed RegNet's widths from stand-in values, so the traced model was a tiny
    # one; its optimizer steps the real model's 22 MB, the trace holds 17 storages of 12 KB as parameters.
    events = [alloc(i, 720, "parameter") for i in range(17)]
    events += [alloc(100 + i, 720, "gradient") for i in range(17)]
    begin = len(events)
    events += [alloc(200 + i, 720, "optimizer_state") for i in range(17)]
    trace = Trace(events=events, iterations=3, used_cuda=True, facts=[
        fact(FACT_STEPPED, ("parameter",), REGNET_PARAMS, REGNET_PARAM_BYTES, begin, source="param_groups of SGD"),
        fact(FACT_GRADIENTS, ("gradient",), REGNET_PARAMS, REGNET_PARAM_BYTES, begin),
        fact(FACT_STATE_BY_RULE, ("optimizer_state",), 0, REGNET_PARAM_BYTES, len(events), source="SGD rule: 1 x"),
    ])
    reasons = audit(trace)
    assert len(reasons) == 3
    assert reasons[0] == ("the parameters the optimizers step on GPU 0: 21.0 MiB in 215 storage(s) (param_groups "
                          "of SGD), but the trace holds 12.0 KiB in 17 storage(s) as parameter at that point")
    assert reasons[2].startswith("the optimizer state its kind requires on GPU 0: 21.0 MiB (SGD rule: 1 x), but "
                                 "the trace holds 12.0 KiB as optimizer state")


def test_gradients_freed_before_the_step_are_missing():
    sizes = [1000, 1000]
    events, begin, end = model_and_step(sizes)
    events.insert(begin, free(101, 1000, "gradient"))  # a gradient dropped before the step began
    trace = Trace(events=events, iterations=1, used_cuda=True,
                  facts=[fact(FACT_STEPPED, ("parameter",), 2, 2000, begin + 1),
                         fact(FACT_GRADIENTS, ("gradient",), 2, 2000, begin + 1)])
    assert audit(trace) == ("the gradients of the stepped parameters after the first backward on GPU 0: 2.0 KiB in "
                            "2 storage(s) (hand-built), but the trace holds 1000 B in 1 storage(s) as gradient at "
                            "that point",)


def test_fewer_storages_are_suspect_even_when_the_bytes_add_up():
    # one storage labelled parameter where the optimizer steps three: two were never seen (the bytes of a
    # bigger unrelated storage make up for them)
    events = [alloc(0, 3000, "parameter")]
    trace = Trace(events=events, iterations=1, used_cuda=True,
                  facts=[fact(FACT_STEPPED, ("parameter",), 3, 3000, 1)])
    assert len(audit(trace)) == 1


def test_bytes_in_another_category_do_not_count():
    events = [alloc(0, 5000, "temporary")]  # the moments exist, but as temporaries: not kept as state
    trace = Trace(events=events, iterations=1, used_cuda=True,
                  facts=[fact(FACT_STATE_BY_RULE, ("optimizer_state",), 0, 5000, 1)])
    assert audit(trace)[0].endswith("but the trace holds 0 B as optimizer state at that point")


def test_a_fact_is_checked_on_its_own_device():
    events = [alloc(0, 800, "parameter", device=0), alloc(1, 800, "parameter", device=1)]
    facts = [fact(FACT_STEPPED, ("parameter",), 1, 800, 2, device=1),
             fact(FACT_STEPPED, ("parameter",), 2, 1600, 2, device=0)]
    assert audit(Trace(events=events, iterations=1, used_cuda=True, facts=facts[:1])) == ()
    (reason,) = audit(Trace(events=events, iterations=1, used_cuda=True, facts=facts))
    assert reason.startswith("the parameters the optimizers step on GPU 0: 1.6 KiB in 2 storage(s)")


def test_more_than_the_facts_is_not_suspect():
    # an EMA copy or a second model: parameters the optimizers do not step
    events = [alloc(0, 800, "parameter"), alloc(1, 800, "parameter"), alloc(2, 64, "buffer")]
    trace = Trace(events=events, iterations=1, used_cuda=True, facts=[
        fact(FACT_STEPPED, ("parameter",), 1, 800, 3),
        fact(FACT_MODEL_STATE, ("parameter", "buffer"), 2, 864, 3),
    ])
    assert audit(trace) == ()


def test_a_shortfall_within_the_tolerance_is_not_suspect():
    events = [alloc(0, 50_000, "parameter"), alloc(1, 99_500, "optimizer_state")]  # 0.5 % short of the rule
    trace = Trace(events=events, iterations=1, used_cuda=True,
                  facts=[fact(FACT_STEPPED, ("parameter",), 1, 50_000, 2),
                         fact(FACT_STATE_BY_RULE, ("optimizer_state",), 0, 100_000, 2)])
    assert audit(trace) == ()


def test_a_trace_without_facts_is_not_audited_and_one_with_no_stepped_parameter_is_suspect():
    events = [alloc(0, 800, "parameter")]
    assert audit(Trace(events=events, iterations=2, used_cuda=True, facts=None)) == ()
    (reason,) = audit(Trace(events=events, iterations=2, used_cuda=True, facts=[]))
    assert reason.startswith("no parameter on the GPU was stepped by an optimizer")
    assert audit(Trace(events=[], iterations=0, used_cuda=False, facts=[])) == ()


def test_forward_passes_only_are_suspect_when_the_program_made_an_optimizer_it_never_stepped():
    events = [alloc(0, 800, "parameter"), alloc(1, 64, "activation")]
    inference = Trace(events=events, used_cuda=True, facts=[], forward_only=True, forward_passes=1)
    assert audit(inference) == ()  # an inference job: the peak of what it ran is its peak
    (reason,) = audit(Trace(events=events, used_cuda=True, facts=[], forward_only=True, forward_passes=1,
                            unstepped_optimizers=1))
    assert reason.startswith("the program made an optimizer but the trace holds none of its steps")
    (reason,) = audit(Trace(events=events, used_cuda=True, facts=[], forward_only=True, forward_passes=9,
                            peak_rising=True))
    assert reason.startswith("the GPU's peak still rose in the last forward passes")


def test_held_at_answers_points_in_any_order():
    events = [alloc(0, 10, "parameter"), alloc(1, 20, "activation"), free(1, 20, "activation"),
              alloc(2, 0, "temporary"), MemEvent("empty_cache", -1, 0)]
    at_3, at_0, at_2, at_5 = held_at(events, [3, 0, 2, 5])
    assert at_0 == {}
    assert at_2 == {(0, "parameter"): (1, 10), (0, "activation"): (1, 20)}
    assert at_3 == at_5 == {(0, "parameter"): (1, 10)}  # the 0-byte storage is no storage


def test_facts_survive_the_trace_json():
    facts = [fact(FACT_STEPPED, ("parameter", "buffer"), 2, 1600, 2, device=1)]
    trace = Trace(events=[alloc(0, 800, "parameter")], facts=facts)
    assert Trace.from_json(trace.to_json()).facts == facts
    assert Trace.from_json({**trace.to_json(), "facts": None}).facts is None
    legacy = trace.to_json()
    del legacy["facts"]
    assert Trace.from_json(legacy).facts is None


# ---- the audit in the estimate and what people see ------------------------------------------------------------
def regnet_like_trace():
    events = [MemEvent("alloc", i, 720, op="_to_copy", category="parameter") for i in range(17)]
    return Trace(events=events, iterations=1, used_cuda=True, torch_version="2.14.1",
                 facts=[fact(FACT_STEPPED, ("parameter",), REGNET_PARAMS, REGNET_PARAM_BYTES, 17,
                             source="param_groups of SGD")])


def estimate_of(monkeypatch, trace):
    import xmem.estimate as estimate_module
    monkeypatch.setattr(estimate_module, "run_trace", lambda command, **options: trace)
    return estimate_module.estimate(["python", "train.py"], gpus=["a100"])


def test_an_estimate_whose_trace_misses_its_parameters_is_suspect_in_its_json(monkeypatch):
    from xmem.estimate import Estimate

    result = estimate_of(monkeypatch, regnet_like_trace())
    assert result.suspect and len(result.suspect_reasons) == 1
    data = json.loads(json.dumps(result.to_json()))
    assert data["suspect"] is True and data["suspect_reasons"] == list(result.suspect_reasons)
    assert Estimate.from_json(data).suspect_reasons == result.suspect_reasons
    sound = estimate_of(monkeypatch, Trace(events=regnet_like_trace().events, iterations=1, used_cuda=True,
                                           facts=[fact(FACT_STEPPED, ("parameter",), 17, 17 * 720, 17)]))
    assert not sound.suspect and sound.to_json()["suspect_reasons"] == []
    legacy = sound.to_json()
    del legacy["suspect"], legacy["suspect_reasons"]  # an estimate cached before the audit existed
    assert Estimate.from_json(legacy).suspect_reasons == ()


def test_the_estimate_table_says_why_it_is_suspect(monkeypatch):
    from rich.console import Console

    from xmem.cli.estimate import show_estimate

    console = Console(record=True, width=200)
    show_estimate(console, estimate_of(monkeypatch, regnet_like_trace()))
    text = console.export_text()
    assert "suspect: the parameters the optimizers step on GPU 0: 21.0 MiB in 215 storage(s)" in text
    assert "these figures may be far too low" in text


def test_check_shows_why_and_keeps_the_user_s_request(monkeypatch, tmp_path):
    from rich.console import Console

    import xmem.estimate as estimate_module
    from xmem.analyze import analyze_job
    from xmem.cli.check import show_analysis
    from xmem.config import config_from_dict

    monkeypatch.setattr(estimate_module, "run_trace", lambda command, **options: regnet_like_trace())
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH -p debug\n#SBATCH --gres=gpu:a100:1\npython train.py\n")
    site = config_from_dict({"partitions": {"default": "debug", "from_cluster": False,
                                            "gpu_types": {"debug": ["a100"]}}})
    analysis = analyze_job(script, config=site, env={"PATH": "/usr/bin", "HOME": str(tmp_path), "USER": "u"})
    assert analysis.estimates[0].estimate.suspect is True
    console = Console(record=True, width=300)
    show_analysis(console, analysis, site)
    text = console.export_text()
    assert "suspect: the parameters the optimizers step on GPU 0: 21.0 MiB in 215 storage(s)" in text
    assert analysis.decision.action == "keep"


def test_an_fsdp_units_sharded_gradient_held_as_something_else_is_missing():
    # an FSDP1 unit whose shard holds only frozen weights: its whole sharded gradient is due, whatever the optimizer
    events = [alloc(0, 4096, "parameter"), alloc(1, 4096, "temporary")]
    reasons = audit(Trace(events=events, iterations=1, facts=[fact(FACT_FSDP_GRADIENTS, ("gradient",), 1, 4096, 2)]))
    assert len(reasons) == 1 and reasons[0].startswith(f"{FACT_FSDP_GRADIENTS} on GPU 0: 4.0 KiB in 1 storage(s)")
