"""The recorder (xmem/trace/child/recorder.py): ops that autograd would have decomposed arrive whole under
`torch.inference_mode` and are decomposed back through the recorder, as a GPU runs them."""

import sys

import pytest

from xmem.trace import run_trace

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces fork from a warm server: tests/conftest.py

# A validation step as ultralytics' assigner and validator do it: data-dependent selections and a loss under
# inference_mode. Training uses none of the ops below, so what they allocate shows the validation's ops were seen.
VALIDATED = """import torch
import torchvision
model = torch.nn.Linear(8, 4).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    with torch.inference_mode():
        logits = model(torch.randn(6, 8, device="cuda"))
        rows, cols = torch.nonzero(logits > 0, as_tuple=True)
        loss = torch.nn.functional.cross_entropy(logits, torch.zeros(6, dtype=torch.long, device="cuda"))
        boxes = torch.cat([logits[:, :2], logits[:, :2] + 1], 1)
        kept = torchvision.ops.nms(boxes, logits[:, 2], 0.5)
        print("validation", rows.shape, cols.shape, loss.shape, kept.shape)
    model(torch.randn(6, 8, device="cuda")).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    script = tmp_path_factory.mktemp("recorder") / "validated.py"
    script.write_text(VALIDATED)
    return run_trace([sys.executable, str(script)], iterations=2, timeout=300)


def allocs(trace, op):
    return [e.nbytes for e in trace.events if e.action == "alloc" and e.op == op]


def test_nonzero_as_tuple_under_inference_mode_gets_its_stand_in(validated):
    """nonzero(as_tuple=True) is nonzero_numpy, which the fake mode decomposed out of our sight and raised on (exit
    11 for ultralytics' detection training): now every element is taken as selected, as for plain nonzero()."""
    assert validated.iterations == 2
    assert allocs(validated, "nonzero") == [6 * 4 * 2 * 8] * 2  # 24 elements, 2 dims, int64, once per iteration
    assert "nonzero()/boolean-mask selections assumed every element selected (no real data under fake CUDA)" \
        in validated.warnings


def test_a_composite_ops_temporaries_under_inference_mode_are_recorded(validated):
    """cross_entropy's log_softmax (6 x 4 fp32) lives only inside the composite: recorded, not hidden."""
    assert allocs(validated, "_log_softmax") == [6 * 4 * 4] * 2
    assert "cublas" in validated.libraries  # linear → addmm under inference_mode as well


def test_non_maximum_suppression_keeps_every_box(validated):
    """torchvision's nms (ultralytics' validator) has a data-dependent size: an upper bound, every box kept."""
    assert allocs(validated, "nms") == [6 * 8] * 2
    assert "nms() assumed every box kept (no real data under fake CUDA)" in validated.warnings
