"""Gaps the real-program corpus met (issue 31, item 6), each as a small program of the libraries' own patterns,
traced through the real tracer: the program checks what a GPU run would give it."""

import pytest

from tests.trace.child.test_host import trace_source

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces fork from a warm server: tests/conftest.py

TRAIN = """
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    optimizer.zero_grad()
    model(torch.randn(4, 16, device="cuda")).sum().backward()
    optimizer.step()
"""

# stable-baselines3's save_to_zip_file: torch.save of the policy into a member of the zip archive, a stream that
# cannot seek; its load reads the member into a BytesIO and torch.loads it to the policy's device
ZIP_MEMBER = """import io, zipfile
import torch
model = torch.nn.Linear(16, 16).cuda()
with zipfile.ZipFile("policy.zip", "w") as archive:
    with archive.open("policy.pth", mode="w", force_zip64=True) as member:
        assert not member.seekable()
        torch.save({"model": model.state_dict(), "host": torch.arange(8.0)}, member)
with zipfile.ZipFile("policy.zip") as archive:
    saved = archive.read("policy.pth")
on_gpu = torch.load(io.BytesIO(saved), map_location="cuda")
assert on_gpu["model"]["weight"].shape == (16, 16) and on_gpu["model"]["weight"].device.type == "cuda"
on_host = torch.load(io.BytesIO(saved), map_location="cpu")
assert float(on_host["host"].sum()) == 28.0  # host data round-trips
assert float(on_host["model"]["weight"].abs().sum()) == 0.0  # the GPU's bytes, never known, are the hole's zeros
""" + TRAIN


def test_torch_save_into_a_stream_that_cannot_seek(tmp_path):
    """A fake tensor's record is metadata only: torch's writer steps over its bytes with a seek, which a zip member
    refuses (exit 11 before); such a stream gets the zeros the hole stands for, as torch.save writes it in order."""
    trace = trace_source(tmp_path, "zip_member.py", ZIP_MEMBER)
    assert trace.iterations == 2


# ludwig's category metrics: the targets are stored as int8 on the host, the predictions are argmax indices on the
# GPU, and torchmetrics' multiclass stat scores bin `target * C + preds` with minlength C * C and reshape to C x C
INT8_TARGETS = """import torch, torchmetrics
model = torch.nn.Linear(16, 3).cuda()
metric = torchmetrics.classification.MulticlassAccuracy(num_classes=3).cuda()
labels = torch.randint(0, 3, (64,), dtype=torch.int8)
for _ in range(2):
    metric.update(model(torch.randn(64, 16, device="cuda")).argmax(-1), labels.cuda().type(torch.long))
""" + TRAIN


def test_a_confusion_matrix_of_small_integer_targets_keeps_its_shape(tmp_path):
    """An int8 tensor's dtype range (to 127) carried through `target * 3 + preds` made bincount count 384 bins,
    which torchmetrics reshapes to 3 x 3 (exit 11 before); the program's minlength gives the 9 bins it asked."""
    pytest.importorskip("torchmetrics")
    trace = trace_source(tmp_path, "int8_targets.py", INT8_TARGETS)
    assert trace.iterations == 2
    assert "bincount() took its minlength bins, as if every value were below it (no real data)" in trace.warnings


# ludwig's trainer logs each device's memory counters every step, by upstream's key names
MEMORY_STATS = """import torch
model = torch.nn.Linear(16, 16).cuda()
""" + TRAIN + """
stats = torch.cuda.memory_stats(torch.device("cuda:0"))
for kind in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes"):
    assert stats[f"{kind}.all.allocated"] - stats[f"{kind}.all.freed"] == stats[f"{kind}.all.current"]
    assert stats[f"{kind}.all.peak"] >= stats[f"{kind}.all.current"] > 0
"""


def test_memory_stats_has_upstreams_cumulative_counters(tmp_path):
    """torch.cuda.memory_stats() lacked allocated_bytes.all.allocated and .freed: ludwig's KeyError was blamed on
    the program (exit 5)."""
    trace = trace_source(tmp_path, "memory_stats.py", MEMORY_STATS, iterations=3)
    assert trace.iterations == 2


# coqui-tts's VITS flows (rational-quadratic splines): the values inside the tail bound are selected by a mask, and
# the spline checks that the selection's extremes lie inside the bound before transforming them
SPLINE_DOMAIN_CHECK = """import torch
model = torch.nn.Linear(16, 16).cuda()

def spline(inputs, left=-1.0, right=1.0):
    if torch.min(inputs) < left or torch.max(inputs) > right:
        raise ValueError("Input to a transform is not within its domain")
    return inputs * 0.5

def assert_positive(scale):
    assert torch.all(scale > 0), "scale must be positive"
    return scale

for _ in range(2):
    x = model(torch.randn(8, 16, device="cuda"))
    inside = (x >= -1.0) & (x <= 1.0)
    out = torch.zeros_like(x)
    out[~inside] = x[~inside]
    out[inside] = spline(x[inside])
    assert_positive(x.exp())
    out.sum().backward()
"""


def test_a_check_that_guards_a_raise_passes_on_stand_in_values(tmp_path):
    """A test on GPU values whose True side raises at once (a transform's domain check on the values a mask
    selected) was answered True, the default stand-in, and the program raised where a real run cannot (exit 11
    before); it is answered the way that goes on, as the program's own data would pass its own check."""
    trace = trace_source(tmp_path, "spline_domain_check.py", SPLINE_DOMAIN_CHECK)
    assert trace.iterations == 2


# coqui-tts's VITS trains its decoder on random segments: a start drawn on the GPU for each sample, its end the start
# plus the segment's size, both read back as slice bounds
RANDOM_SEGMENTS = """import torch
model = torch.nn.Conv1d(8, 8, 3, padding=1).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
size = 32
for _ in range(2):
    x = model(torch.randn(4, 8, 100, device="cuda"))
    lengths = torch.full((4,), 100, device="cuda")
    starts = (torch.rand(4, device="cuda") * (lengths - size + 1)).long()
    segments = torch.zeros_like(x[:, :, :size])
    for i in range(4):
        start = starts[i]
        end = start + size
        segments[i] = x[i, :, start:end]
    optimizer.zero_grad()
    segments.sum().backward()
    optimizer.step()
"""


def test_a_slice_between_a_stand_in_start_and_its_end_keeps_its_size(tmp_path):
    """`end = start + size` of a start drawn on the GPU: both bounds were stand-ins of 1, the slice empty and its
    copy into the segment refused (exit 11 before); the end's stand-in is the start's plus the size."""
    trace = trace_source(tmp_path, "random_segments.py", RANDOM_SEGMENTS)
    assert trace.iterations == 2


# A counter kept on the GPU and stepped by a Python integer: each new value is remembered as the old one plus 1
COUNTER = """import torch
model = torch.nn.Linear(8, 8).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    seen = torch.zeros((), dtype=torch.long, device="cuda")
    for _ in range(200):
        seen = seen + 1
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    optimizer.step()
"""


def test_an_integer_remembered_as_another_plus_one_lets_the_other_be_freed(tmp_path):
    """The offset a stand-in keeps refers to its base weakly: a counter stepped 200 times holds one block at a
    time, as on a GPU, not a chain of 200 (each new value keeping the one it was made from alive)."""
    trace = trace_source(tmp_path, "counter.py", COUNTER)
    live = peak = 0
    for event in trace.events:
        live += {"alloc": 1, "free": -1}.get(event.action, 0)
        peak = max(peak, live)
    assert trace.iterations == 2 and peak < 30
