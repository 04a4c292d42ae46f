"""Shapes that depend on the values of model weights (issue 34, item 7), traced through the real tracer: an adapter
whose size follows its base weights' magnitudes (a SHiRA-like sparse delta: the positions of the largest weights).
Where the values exist on the host (a model built there, a checkpoint loaded there, a mask copied from there) they
give the real shapes; where they exist only on the GPU, the stood-in size is named and the failure is the fake GPU's
(exit 11), never the program's (exit 5)."""

import pytest

from tests.trace.child.test_host import allocs, trace_source
from xmem.trace import TraceError

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces fork from a warm server: tests/conftest.py

N, RANK = 256, 8
K = RANK * (N + N)  # the adapter's entries: as many as a rank-8 LoRA of the 256 x 256 layer holds

ADAPTER = f"""import sys
import torch
import torch.nn as nn
where = sys.argv[1]
torch.manual_seed(0)
model = nn.Linear({N}, {N}, device="cuda" if where == "gpu" else "cpu")
weight = model.weight
if where == "checkpoint":  # saved and loaded on the host
    torch.save(model.state_dict(), "base.pt")
    weight = torch.load("base.pt", map_location="cpu")["weight"]
if where == "moved":  # built on the host, moved to the GPU before the adapter's init reads it there
    weight = model.cuda().weight
if where == "loaded":  # made on the GPU, then a host checkpoint loaded into it
    torch.save(model.state_dict(), "base.pt")
    model = nn.Linear({N}, {N}, device="cuda")
    model.load_state_dict(torch.load("base.pt", map_location="cpu"))
    weight = model.weight
with torch.no_grad():  # the positions of the K largest magnitudes
    _, top = torch.topk(weight.abs().flatten(), {K})
    mask = torch.zeros_like(weight).flatten()
    mask[top] = 1
    mask = mask.view_as(weight)
    if where == "copied":
        mask = mask.cuda()  # copied from the host: its values are known on the GPU
    indices = torch.nonzero(mask, as_tuple=True)
model.cuda()
indices = tuple(index.cuda() for index in indices)
values = nn.Parameter(torch.zeros({K}, device="cuda"))
optimizer = torch.optim.AdamW([values])
for _ in range(2):
    delta = torch.zeros_like(model.weight).index_put(indices, values)
    x = torch.randn(4, {N}, device="cuda")
    (x @ (model.weight + delta).T).sum().backward()
    optimizer.step()
"""


@pytest.mark.parametrize("where", ["host", "checkpoint", "copied", "moved", "loaded"])
def test_adapter_shapes_follow_weight_values_that_exist_on_the_host(tmp_path, where):
    """Host: the mask and its nonzero are real. Copied: the mask's values were copied to the GPU, so its nonzero
    there has the real count. Moved, loaded: the weights' values came from the host (.cuda() of the host model,
    load_state_dict of a host checkpoint), so the mask made from them on the GPU, under no_grad, has its real
    count too. Either way K positions (int64 indices on the GPU) and K adapter values."""
    trace = trace_source(tmp_path, "adapter.py", ADAPTER, where, iterations=2)
    assert trace.iterations == 2
    assert sorted(e.nbytes for e in allocs(trace, "parameter")) == sorted([K * 4, N * N * 4, N * 4])
    assert sorted(e.nbytes for e in allocs(trace, "optimizer_state") if e.nbytes > 8) == [K * 4, K * 4]
    # the row and the column of each of the K positions, int64 on the GPU: copied there as two tensors, or the
    # (K, 2) result of nonzero there
    copied = [e.nbytes for e in trace.events if e.action == "alloc" and e.op == "_to_copy" and e.nbytes == K * 8]
    found = [e.nbytes for e in trace.events if e.action == "alloc" and e.op == "nonzero"]
    assert (copied, found) == (([], [K * 2 * 8]) if where in ("copied", "moved", "loaded") else ([K * 8, K * 8], []))


def test_adapter_shapes_from_weights_only_on_the_gpu_are_the_fake_gpus_gap(tmp_path):
    """The weights were made on the GPU: their values are nowhere. nonzero's size is stood in for (every element),
    the adapter's K values then do not fit the 65536 positions, and upstream's check says so in backward: before,
    exit 5 blamed on the program; now exit 11, naming the stood-in size and where it was asked."""
    with pytest.raises(TraceError) as raised:
        trace_source(tmp_path, "adapter.py", ADAPTER, "gpu", iterations=2)
    assert raised.value.kind == "not_modelled", raised.value.message
    assert "the size of nonzero() at adapter.py:25" in raised.value.message


SELECTED = """import torch
import torch.nn as nn
model = nn.Linear(64, 64, device="cuda")
with torch.no_grad():
    chosen = model.weight[model.weight.abs() > 0.1]  # a boolean-mask selection of GPU-only values
    budget = torch.zeros(1000, device="cuda")
    budget.copy_(chosen[:1000] if chosen.numel() < 1000 else chosen)  # the program's own shape logic
"""


def test_an_op_refusing_a_stood_in_selection_is_the_fake_gpus_gap(tmp_path):
    with pytest.raises(TraceError) as raised:
        trace_source(tmp_path, "selected.py", SELECTED, iterations=1)
    assert raised.value.kind == "not_modelled", raised.value.message
    assert "a boolean-mask selection at selected.py:5" in raised.value.message


def test_a_shape_error_with_no_stood_in_size_stays_the_programs(tmp_path):
    source = SELECTED.replace("model.weight[model.weight.abs() > 0.1]", "model.weight.flatten()[:4096]")
    with pytest.raises(TraceError) as raised:
        trace_source(tmp_path, "selected.py", source, iterations=1)
    assert raised.value.kind == "user_error", raised.value.message
