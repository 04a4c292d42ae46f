"""The model-zoo oracle (scripts/zoo_check.py): a fast subset of the zoo traced on fake CUDA against a real CPU run,
and the bookkeeping that keeps several models' events apart in one trace."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from xmem.trace.events import MemEvent

ROOT = Path(__file__).resolve().parent.parent


def _zoo():
    spec = importlib.util.spec_from_file_location("zoo_check", ROOT / "scripts" / "zoo_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["zoo_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


zoo = _zoo()


def _alloc(block, nbytes, iteration, phase, category, op="op", module=""):
    return MemEvent("alloc", block, nbytes, op=op, module=module, phase=phase, iteration=iteration, category=category)


def _free(block, nbytes, iteration, phase="other"):
    return MemEvent("free", block, nbytes, phase=phase, iteration=iteration)


def test_each_model_gets_its_own_iteration_and_a_raising_model_is_marked():
    events = [
        _alloc(0, 100, -1, "other", "parameter"),  # setup before the first forward belongs to the first model
        _alloc(1, 40, 0, "forward", "activation", op="relu"),
        _alloc(2, 8, 0, "forward", "activation", op="mul"),
        _free(2, 8, 0, "forward"),  # died in forward: not live when backward starts
        _alloc(3, 100, 0, "backward", "gradient"),
        _free(1, 40, 0, "backward"),
        _alloc(4, 200, 0, "optimizer", "optimizer_state"),
        _free(0, 100, 1), _free(3, 100, 1), _free(4, 200, 1),  # the first model deleted as the second starts
        _alloc(5, 4, 1, "forward", "activation", module=zoo.MARKER_MODULE),
        _alloc(6, 4, 1, "other", "parameter"),
        _alloc(7, 60, 2, "other", "parameter"),
        _alloc(8, 16, 2, "forward", "activation", op="_scaled_dot_product_efficient_attention",
               module=zoo.ATTENTION_SCOPE),
        _alloc(9, 60, 2, "backward", "gradient"),
    ]
    first, second, third = zoo.trace_figures(events, 3)
    assert (first.parameter, first.gradient, first.optimizer_state) == (100, 100, 200)
    assert first.activation_by_op == {"relu": 40}
    assert second is None
    assert (third.parameter, third.gradient, third.optimizer_state) == (60, 60, 0)
    assert third.activation_by_op == {"attention:_scaled_dot_product_efficient_attention": 16}


def test_compare_explains_only_kernel_families_with_a_documented_reason():
    cpu = zoo.Figures(10, 0, 10, 20, 30, {"native_batch_norm": 20, "relu": 10})
    same_after_rename = zoo.Figures(10, 0, 10, 20, 30, {"cudnn_batch_norm": 20, "relu": 10})
    bigger_bn = zoo.Figures(10, 0, 10, 20, 34, {"cudnn_batch_norm": 24, "relu": 10})
    bigger_relu = zoo.Figures(10, 0, 10, 20, 34, {"cudnn_batch_norm": 20, "relu": 14})
    wrong_state = zoo.Figures(10, 0, 10, 21, 30, {"native_batch_norm": 20, "relu": 10})
    assert zoo.compare(cpu, same_after_rename)["activation"] == "exact"
    assert zoo.compare(cpu, bigger_bn)["activation"] == "explained"
    verdict = zoo.compare(cpu, bigger_relu)
    assert (verdict["activation"], verdict["match"], verdict["activation_delta_by_family"]) == \
        ("deviates", False, {"relu": 4})
    assert zoo.compare(cpu, wrong_state)["exact_mismatches"] == ["optimizer_state"]


def test_the_oracle_counts_what_the_graph_holds_when_backward_starts_not_a_dropped_branch():
    import torch
    trunk, head, aux = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)
    batch = {"x": torch.randn(4, 8)}
    oracle = zoo.CpuOracle()
    with oracle.instrumented(torch.nn.ModuleList([trunk, head, aux]), batch):
        hidden = torch.relu(trunk(batch["x"]))  # saved by relu's and the head's backward
        scaled = hidden * 3  # saved only by the auxiliary head, which the loss leaves out (GoogLeNet's aux logits)
        dropped = aux(scaled)
        scaled_key, hidden_key = scaled.untyped_storage()._cdata, hidden.untyped_storage()._cdata
        del dropped, scaled
        loss = head(hidden).sum()
    assert {scaled_key, hidden_key} <= set(oracle.saved)
    assert hidden_key in oracle.held_at_backward and scaled_key not in oracle.held_at_backward
    loss.backward()


def test_multihead_attention_runs_in_the_attention_scope_as_a_whole():
    # its SDPA output's reshape copies on CUDA only (kernel layouts): every op inside it is the attention family's
    import torch
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    batch = {"x": torch.randn(2, 5, 16)}
    oracle, original = zoo.CpuOracle(), torch.nn.MultiheadAttention.forward
    with oracle.instrumented(mha, batch), zoo.attention_in_scope():
        out, _ = mha(batch["x"], batch["x"], batch["x"], need_weights=False)
    assert torch.nn.MultiheadAttention.forward is original
    made = {oracle.producers[key][0] for key in oracle.saved if key in oracle.producers}
    assert made and all(zoo.family_of(name) == "attention" for name in made), made
    out.sum().backward()


FAST_SUBSET = ["tv:squeezenet1_1@64", "hf:gpt2@16", "hf:bert@16"]  # plain CNN with dropout; fused attention


@pytest.mark.parametrize("family", ["torchvision", "transformers"])
def test_libraries_present(family):
    pytest.importorskip(family)


def test_fast_subset_matches_the_cpu_run_per_category():
    pytest.importorskip("torchvision")
    pytest.importorskip("transformers")
    rows, left = zoo.check(FAST_SUBSET, zoo.MAX_PARAMS, per_trace=8, budget_s=float("inf"), timeout=900,
                           report=lambda row, rows: None)
    assert not left
    by_spec = {row.spec: row for row in rows}
    for spec, row in by_spec.items():
        assert row.status == "checked", (spec, row.status)
        assert row.verdict["exact_mismatches"] == [], (spec, row.cpu, row.trace)
        assert row.verdict["match"], (spec, row.verdict)
        assert row.cpu.parameter > 0 and row.cpu.optimizer_state == 2 * row.cpu.parameter
    assert by_spec["tv:squeezenet1_1@64"].verdict["activation"] == "exact"  # dropout: CUDA's bool mask both sides
    for spec in ("hf:gpt2@16", "hf:bert@16"):  # fused attention: only its documented family differs
        assert set(by_spec[spec].verdict["activation_delta_by_family"]) <= {"attention"}
