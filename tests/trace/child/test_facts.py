"""The run's facts (xmem.trace.child.facts) taken from real small models and optimizers training on CPU: the figures are
derived by hand from the shapes, and must be what the objects hold after a real step."""

import pytest
import torch
from torch import nn

from xmem.trace.events import (FACT_BATCH, FACT_GRADIENTS, FACT_MODEL_STATE, FACT_STATE, FACT_STATE_BY_RULE,
                               FACT_STEPPED)
from xmem.trace.child.facts import FactCollector, state_copies, storages

# nn.Sequential(Linear(16, 32), ReLU(), Linear(32, 4)) in fp32
MLP_PARAM_BYTES = (16 * 32 + 32 + 32 * 4 + 4) * 4
BATCH = 8


@pytest.fixture
def collector():
    events = [0]  # a stand-in event counter: the number of steps taken so far, to see where facts were taken
    collector = FactCollector(lambda: events[0], device_type="cpu")
    collector.install()
    yield collector, events
    collector._stop_watching_modules()


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def train(model, optimizer, events, steps=2, dtype=torch.float32):
    for _ in range(steps):
        x, y = torch.randn(BATCH, 16, dtype=dtype), torch.randn(BATCH, 4, dtype=dtype)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        events[0] += 1


def by_what(collector):
    facts = collector.result()
    assert facts is not None, collector.broken
    out = {}
    for fact in facts:
        out.setdefault(fact.what, []).append(fact)
    return out


def only(facts):
    assert len(facts) == 1, facts
    return facts[0]


def test_sgd_momentum_keeps_one_buffer_per_parameter(collector):
    collector, events = collector
    model = mlp()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), events)
    facts = by_what(collector)
    assert (only(facts[FACT_STEPPED]).storages, only(facts[FACT_STEPPED]).nbytes) == (4, MLP_PARAM_BYTES)
    assert (only(facts[FACT_GRADIENTS]).storages, only(facts[FACT_GRADIENTS]).nbytes) == (4, MLP_PARAM_BYTES)
    assert (only(facts[FACT_STATE]).storages, only(facts[FACT_STATE]).nbytes) == (4, MLP_PARAM_BYTES)
    rule = only(facts[FACT_STATE_BY_RULE])
    assert rule.nbytes == MLP_PARAM_BYTES and rule.storages == 0 and rule.source.startswith("SGD rule: 1 x")
    # taken in the first iteration only, before any event of the stand-in counter
    assert {f.at_event for fs in facts.values() for f in fs} == {0}


def test_the_batch_is_the_first_model_call_s_arguments(collector):
    collector, events = collector
    model = mlp()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), events)
    batch = only(by_what(collector)[FACT_BATCH])
    assert (batch.storages, batch.nbytes) == (1, BATCH * 16 * 4)  # x only: the target goes to mse_loss, not a module


def test_only_the_first_model_call_gives_the_batch_even_without_a_tensor(collector):
    collector, events = collector
    nn.Identity()(3)  # a first call with no tensor: no batch fact, and no later call's arguments in its place
    model = mlp()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), events)
    assert FACT_BATCH not in by_what(collector)


def test_the_model_state_counts_buffers_and_tied_weights_once(collector):
    collector, events = collector
    embedding = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = embedding.weight  # tied: one storage
    model = nn.Sequential(embedding, nn.BatchNorm1d(3), head)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 10, (4, 3))
    model(tokens).sum().backward()
    optimizer.step()
    state = only(by_what(collector)[FACT_MODEL_STATE])
    # embedding 10x8 fp32, BatchNorm weight/bias/running_mean/running_var (3 fp32 each) and num_batches_tracked
    assert state.storages == 1 + 4 + 1
    assert state.nbytes == 10 * 8 * 4 + 4 * 3 * 4 + 8
    assert only(by_what(collector)[FACT_STEPPED]).nbytes == 10 * 8 * 4 + 2 * 3 * 4


@pytest.mark.parametrize("make, copies, scalars", [
    (lambda p: torch.optim.AdamW(p, lr=1e-3), 2, 1),  # exp_avg, exp_avg_sq; step is a CPU scalar (not fused)
    (lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True), 3, 1),
    (lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True), 2, 1),
    (lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True), 3, 1),
    (lambda p: torch.optim.SGD(p, lr=1e-3), 0, 0),
], ids=["adamw", "adam-amsgrad", "adamw-foreach", "rmsprop-centered-momentum", "sgd-plain"])
def test_optimizer_state_matches_its_kind_s_rule(collector, make, copies, scalars):
    collector, events = collector
    model = mlp()
    train(model, make(model.parameters()), events)
    facts = by_what(collector)
    # on CPU the step counters are CPU tensors, so they count here (one fp32 scalar per parameter)
    held = facts.get(FACT_STATE, [])
    assert sum(f.nbytes for f in held) == copies * MLP_PARAM_BYTES + scalars * 4 * 4
    assert sum(f.nbytes for f in facts.get(FACT_STATE_BY_RULE, [])) == copies * MLP_PARAM_BYTES


def test_bf16_parameters_get_bf16_state(collector):
    collector, events = collector
    model = mlp().to(torch.bfloat16)
    train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), events, dtype=torch.bfloat16)
    facts = by_what(collector)
    assert only(facts[FACT_STEPPED]).nbytes == MLP_PARAM_BYTES // 2
    assert only(facts[FACT_STATE_BY_RULE]).nbytes == MLP_PARAM_BYTES  # 2 x the bf16 bytes
    assert only(facts[FACT_STATE]).nbytes == MLP_PARAM_BYTES + 4 * 4


def test_parameters_without_a_gradient_get_no_state_by_rule(collector):
    collector, events = collector
    model = nn.ModuleDict({"used": nn.Linear(16, 4), "unused": nn.Linear(16, 100)})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model["used"](torch.randn(2, 16)).sum().backward()
    optimizer.step()
    facts = by_what(collector)
    used = (16 * 4 + 4) * 4
    assert only(facts[FACT_STEPPED]).nbytes == used + (16 * 100 + 100) * 4
    assert only(facts[FACT_GRADIENTS]).nbytes == used
    assert only(facts[FACT_STATE_BY_RULE]).nbytes == 2 * used


def test_lora_steps_only_the_adapters(collector):
    peft = pytest.importorskip("peft")
    collector, events = collector

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.v, self.out = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)

        def forward(self, x):
            return self.out(self.q(x) + self.v(x))

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"], lora_dropout=0.0)
    model = peft.get_peft_model(Block(), config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    facts = by_what(collector)
    adapters = 2 * (4 * 64 + 64 * 4) * 4  # lora_A (4x64) and lora_B (64x4) on q and v, fp32
    base = (2 * 64 * 64 + 2 * 64 + 64 * 8 + 8) * 4  # q, v and out weights and biases, frozen
    assert (only(facts[FACT_STEPPED]).storages, only(facts[FACT_STEPPED]).nbytes) == (4, adapters)
    assert only(facts[FACT_GRADIENTS]).nbytes == adapters
    assert only(facts[FACT_STATE_BY_RULE]).nbytes == 2 * adapters
    assert only(facts[FACT_MODEL_STATE]).nbytes == base + adapters


def test_a_second_optimizer_s_facts_include_the_first_s(collector):
    collector, events = collector
    generator, critic = nn.Linear(8, 16), nn.Linear(16, 1)
    g_opt = torch.optim.Adam(generator.parameters(), lr=1e-3)
    c_opt = torch.optim.SGD(critic.parameters(), lr=1e-3, momentum=0.9)
    for _ in range(2):
        critic(generator(torch.randn(4, 8)).detach()).mean().backward()
        c_opt.step()
        events[0] += 1
        critic(generator(torch.randn(4, 8))).mean().backward()
        g_opt.step()
        events[0] += 1
    rules = by_what(collector)[FACT_STATE_BY_RULE]
    c_bytes, g_bytes = (16 + 1) * 4, (8 * 16 + 16) * 4
    assert [(f.nbytes, f.at_event) for f in rules] == [(c_bytes, 0), (c_bytes + 2 * g_bytes, 1)]
    assert rules[1].source == "SGD rule: 1 x stepped parameter bytes; Adam rule: 2 x stepped parameter bytes"


def test_unknown_optimizer_kinds_have_no_rule():
    class Custom(torch.optim.AdamW):
        pass

    params = [nn.Parameter(torch.zeros(3))]
    assert state_copies(Custom(params), {"amsgrad": False}) is None
    assert state_copies(torch.optim.AdamW(params), {"amsgrad": False}) == 2


def test_storages_are_counted_once_and_views_by_their_storage():
    flat = torch.zeros(100)
    views = [flat[:10], flat[10:], flat]
    assert storages(views, "cpu") == {0: {flat.untyped_storage()._cdata: 400}}
    assert storages([torch.zeros(0), None, 3], "cpu") == {}


def test_a_fault_while_taking_facts_gives_up_without_raising(collector):
    collector, events = collector
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.param_groups[0]["params"].append("not a tensor")  # the optimizer would fail; the collector first
    model(torch.randn(2, 16)).sum().backward()
    collector.on_step_begin(optimizer)
    assert collector.result() is None and "AttributeError" in collector.broken


def test_a_model_call_that_raises_keeps_the_call_depth(collector):
    collector, events = collector

    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("caught by the program")

    model, fails = mlp(), Fails()
    try:
        fails(torch.randn(2, 16))
    except ValueError:
        pass
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    facts = by_what(collector)
    assert only(facts[FACT_STEPPED]).nbytes == MLP_PARAM_BYTES
    assert only(facts[FACT_MODEL_STATE]).nbytes == MLP_PARAM_BYTES  # the model was a root call: depth back at 0


def test_a_stand_in_value_of_a_tensor_off_the_gpu_is_a_fact_no_trace_holds(collector):
    from xmem.audit import audit
    from xmem.trace.events import FACT_HOST_STAND_IN, Trace

    collector, events = collector
    collector.device_type = "cuda"  # as in a trace: CPU tensors are off the GPU
    collector.on_stand_in(torch.zeros(3, device="meta"), "tensor.tolist()")
    collector.on_stand_in(torch.zeros(()), "tensor.item()")  # only the first is kept
    (fact,) = collector.result()
    assert (fact.what, fact.categories, fact.source) == (FACT_HOST_STAND_IN, (), "tensor.tolist() of a meta "
                                                                                "tensor of shape (3,)")
    (reason,) = audit(Trace(facts=[fact]))
    assert reason.endswith("the traced program may have built another model or batch than the GPU would run")
