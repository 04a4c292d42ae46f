"""What real programs hit on the fake GPU, traced through the real tracer (issue 31, item 5): each program checks
what a GPU run would give it, so a gap ends the trace with the program's own error."""

import signal
import sys

import pytest

from tests.trace.child.test_host import trace_source
from xmem.trace import TraceError
from xmem.trace.runner import ChildRun, _no_result, run_trace

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces fork from a warm server: tests/conftest.py

TRAIN = """
model = torch.nn.Linear(4, 3).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(2, 4, device="cuda")).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""

RNG = """import torch
torch.cuda.manual_seed(7)
state = torch.cuda.random.get_rng_state(device=torch.cuda.current_device())
assert state.dtype == torch.uint8 and state.numel() == 16, state.shape  # CUDA's Philox seed and offset
assert torch.cuda.initial_seed() == 7
torch.cuda.manual_seed(9)  # a Megatron tracker: seed a fork, keep its state, restore the original
fork = torch.cuda.get_rng_state("cuda:0")
torch.cuda.random.set_rng_state(state, device=0)
assert torch.cuda.initial_seed() == 7 and torch.cuda.default_generators[0].initial_seed() == 7
torch.cuda.set_rng_state(fork, torch.device("cuda"))
assert torch.cuda.random.initial_seed() == 9
states = torch.cuda.random.get_rng_state_all()
assert len(states) == torch.cuda.device_count()
torch.cuda.random.set_rng_state_all(states)
torch.cuda.random.manual_seed_all(11)
assert torch.cuda.default_generators[0].device == torch.device("cuda", 0)
with torch.random.fork_rng(devices=[0], device_type="cuda"):
    torch.cuda.manual_seed(13)
assert torch.cuda.initial_seed() == 11  # restored
try:
    torch.cuda.set_rng_state(torch.zeros(5, dtype=torch.uint8))
except RuntimeError as error:
    assert "wrong size" in str(error)
else:
    raise AssertionError("a state of the wrong size was taken")
generator = torch.Generator(device="cuda")
assert generator.get_state().numel() == 16
torch.randn(3, device="cuda", generator=generator)
""" + TRAIN


def test_gpu_random_states_are_kept_and_restored_as_on_a_gpu(tmp_path):
    """torch.cuda.random's get/set/seed with device arguments, default_generators and fork_rng (every Megatron
    tensor-parallel RNG tracker): upstream's functions over the fake GPU's generators."""
    assert trace_source(tmp_path, "rng.py", RNG, iterations=1).iterations == 1

PACK = """import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
rnn = torch.nn.LSTM(8, 16, batch_first=True).cuda()
optimizer = torch.optim.SGD(rnn.parameters(), lr=0.1)
for _ in range(3):
    padded = torch.randn(4, 10, 8, device="cuda")
    packed = pack_padded_sequence(padded, torch.tensor([10, 7, 5, 2]), batch_first=True)
    assert packed.data.shape == (24, 8) and packed.data.is_cuda, packed.data.shape
    assert packed.batch_sizes.device.type == "cpu"  # counted on the host from the real lengths, as upstream does
    assert packed.batch_sizes.tolist() == [4, 4, 3, 3, 3, 2, 2, 1, 1, 1], packed.batch_sizes
    output, _ = rnn(packed)
    unpacked, lengths = pad_packed_sequence(output, batch_first=True)
    assert unpacked.shape == (4, 10, 16) and lengths.tolist() == [10, 7, 5, 2]
    unsorted = pack_padded_sequence(padded.transpose(0, 1), [3, 9, 4, 1], enforce_sorted=False)
    assert unsorted.data.shape == (17, 8) and unsorted.batch_sizes.tolist()[:2] == [4, 3]
    loss = unpacked.sum() + rnn(unsorted)[0].data.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


def test_pack_padded_sequence_counts_its_batch_sizes_from_the_host_lengths(tmp_path):
    """The lengths are a real host tensor: the packed size and batch sizes are upstream's, and an LSTM trains on
    the packed batch (forward, backward through the packing, pad_packed_sequence)."""
    assert trace_source(tmp_path, "pack.py", PACK, iterations=1).iterations == 1


def test_pack_padded_sequence_refuses_unsorted_lengths_as_upstream_does(tmp_path):
    """upstream's check on the real lengths is the program's error (exit 5), with upstream's words."""
    source = PACK.replace("torch.tensor([10, 7, 5, 2])", "torch.tensor([7, 10, 5, 2])")
    with pytest.raises(TraceError) as raised:
        trace_source(tmp_path, "pack.py", source, iterations=1)
    assert raised.value.kind == "user_error" and "sorted in decreasing order" in raised.value.message


def test_pack_padded_sequence_refuses_lengths_on_the_gpu_as_upstream_does(tmp_path):
    source = PACK.replace("torch.tensor([10, 7, 5, 2])", "torch.tensor([10, 7, 5, 2], device='cuda')")
    with pytest.raises(TraceError) as raised:
        trace_source(tmp_path, "pack.py", source, iterations=1)
    assert raised.value.kind == "user_error" and "1D CPU int64 tensor" in raised.value.message

SYNC_BATCH_NORM = """import os
import torch
import torch.distributed as dist
dist.init_process_group("nccl", rank=0, world_size=2)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
assert isinstance(model[1], torch.nn.SyncBatchNorm)
ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
for _ in range(3):
    images = torch.randn(4, 3, 16, 16, device="cuda")
    output = ddp(images)
    assert output.shape == (4, 8, 14, 14) and output.is_cuda
    optimizer.zero_grad()
    output.sum().backward()
    optimizer.step()
    assert model[1].weight.grad.shape == (8,) and model[0].weight.grad.shape == (8, 3, 3, 3)
half = torch.randn(4, 8, 5, 5, device="cuda", dtype=torch.half)
mean, invstd = torch.batch_norm_stats(half, 1e-5)
assert mean.dtype == invstd.dtype == torch.float32 and mean.shape == (8,)  # upstream's accumulation type
"""


def test_sync_batch_norm_trains_with_the_fake_process_group(tmp_path):
    """SyncBatchNorm's CUDA-only ops (batch_norm_stats, batch_norm_gather_stats_with_counts, batch_norm_elemt and
    their backward) are sized by meta kernels; before, the fake mode ran them on the real device (exit 11)."""
    trace = trace_source(tmp_path, "sync_bn.py", SYNC_BATCH_NORM, iterations=2)
    assert trace.iterations == 2
    assert {"batch_norm_stats", "batch_norm_gather_stats_with_counts", "batch_norm_elemt",
            "batch_norm_backward_reduce", "batch_norm_backward_elemt"} <= set(trace.op_counts)


def test_an_op_without_a_fake_kernel_is_named(tmp_path):
    """An op on GPU tensors that has no fake kernel (the reparameterised Gamma sample's gradient): the fake mode
    would run it on the real device; the trace ends naming the op (exit 11), not the missing driver."""
    source = """import torch
concentration = torch.full((3,), 2.0, device="cuda", requires_grad=True)
sample = torch.distributions.Gamma(concentration, torch.ones(3, device="cuda")).rsample()
sample.sum().backward()
"""
    with pytest.raises(TraceError) as raised:
        trace_source(tmp_path, "gamma.py", source, iterations=1)
    assert raised.value.kind == "not_modelled"
    assert "an op with no fake kernel (aten._standard_gamma_grad.default)" in raised.value.message

BINCOUNT = """import torch
model = torch.nn.Linear(4, 3).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    logits = model(torch.randn(64, 4, device="cuda"))
    preds, target = logits.argmax(-1), torch.randint(0, 3, (64,), device="cuda")  # values 0..2, 64 of them
    assert len(torch.unique(preds)) <= 3 and len(target.unique()) <= 3  # torchmetrics' argument check
    matrix = torch.bincount(target * 3 + preds, minlength=9).reshape(3, 3)  # a confusion matrix
    weighted = (target * 3 + preds).bincount(weights=logits[:, 0].detach(), minlength=9)
    assert weighted.shape == (9,) and weighted.dtype == torch.float32, weighted.shape
    assert torch.ops.aten.bincount(preds, None, 5).shape == (5,)
    counts = (logits > 0).sum(-1)  # no range known: the program's minlength is the count of bins
    assert torch.bincount(counts, minlength=4).shape == (4,)
    assert torch.bincount(preds[:0], minlength=7).shape == (7,)
    shifted = target.clone()
    shifted += 10  # written in place: its range moves with it (10..12)
    assert 11 <= len(torch.bincount(shifted, minlength=3)) <= 13
    optimizer.zero_grad()
    (logits.sum() + matrix.float().sum()).backward()
    optimizer.step()
"""


def test_bincount_and_unique_follow_the_range_of_their_values_and_minlength(tmp_path):
    """upstream bincount gives max(x) + 1 bins, at least minlength: a confusion matrix of class indices (argmax,
    randint) has the minlength bins it reshapes to (one per element before: 64), and unique finds at most the
    range's values."""
    trace = trace_source(tmp_path, "bincount.py", BINCOUNT, iterations=1)
    assert "bincount() took its minlength bins, as if every value were below it (no real data)" in trace.warnings


def test_torchmetrics_confusion_matrix_keeps_its_shape(tmp_path):
    pytest.importorskip("torchmetrics")
    source = """import torch, torchmetrics
model = torch.nn.Linear(4, 3).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
matrix = torchmetrics.classification.MulticlassConfusionMatrix(num_classes=3).cuda()
for _ in range(3):
    logits = model(torch.randn(64, 4, device="cuda"))
    matrix.update(logits.argmax(-1), torch.randint(0, 3, (64,), device="cuda"))
    assert matrix.compute().shape == (3, 3)
    optimizer.zero_grad()
    logits.sum().backward()
    optimizer.step()
"""
    assert trace_source(tmp_path, "confusion.py", source, iterations=1).iterations == 1


def test_a_segfault_under_the_fake_gpu_is_named_as_ours_with_the_programs_line(tmp_path):
    """A fatal signal of the traced process's own native code (a library handed a GPU tensor's missing data, a
    fault of the tracer's): exit 11, naming the signal and the program's line from the Python stack the crash
    dumped; never the program's error, never a bare "crashed"."""
    source = """import ctypes
import torch
weights = torch.nn.Linear(4, 3).cuda().weight
ctypes.string_at(weights.data_ptr())  # what a native extension does with a GPU tensor's pointer
"""
    with pytest.raises(TraceError) as raised:
        trace_source(tmp_path, "segfault.py", source, iterations=1)
    error = raised.value
    assert error.kind == "not_modelled" and "signal 11 (SIGSEGV)" in error.message, error.message
    assert "(at segfault.py:4)" in error.message and "a gap of xmem's, not the program's error" in error.message


def test_a_silent_fault_still_names_its_signal_and_whose_it_is():
    """No output at all (the stack dump lost): the line still says which signal and that it is the product's."""
    error = _no_result({"signal": signal.SIGSEGV}, ChildRun("", -signal.SIGSEGV, "running the program"), 1 << 30)
    assert error.kind == "not_modelled"
    assert error.message == ("not modelled: the traced program crashed on signal 11 (SIGSEGV) before the trace "
                             "ended (last progress: running the program), in native code running under the fake "
                             "GPU: a gap of xmem's, not the program's error")
    assert _no_result({"signal": signal.SIGTERM}, ChildRun("", -15), 0).kind == "crashed"  # sent from outside


CURRENT_DEVICE = """import torch
torch.cuda.set_device(3)  # a rank's own GPU, as torchrun programs pick it
assert torch.empty(4).cuda().device == torch.device("cuda", 3)
assert torch.empty(4).to("cuda").device == torch.device("cuda", 3)
assert torch.empty(4).to(device="cuda", dtype=torch.half).device == torch.device("cuda", 3)
assert torch.empty(4).cuda(1).device == torch.device("cuda", 1) and torch.empty(4).to("cuda:2").device.index == 2
with torch.cuda.device(2):
    assert torch.empty(4).cuda().device.index == 2
""" + TRAIN  # its Module.cuda() and device="cuda" batches, on cuda:3


def test_a_bare_cuda_move_lands_on_the_current_device_as_factories_do(tmp_path):
    """After torch.cuda.set_device(3), `.cuda()`, `.to("cuda")` and Module.cuda() land on cuda:3, as `device="cuda"`
    factories do (before: on cuda:0, so every traced rank but 0 failed on a device mismatch, blamed on the user)."""
    script = tmp_path / "current.py"
    script.write_text(CURRENT_DEVICE)
    trace = run_trace([sys.executable, str(script)], iterations=2, device_count=4)
    assert {e.device for e in trace.events if e.action == "alloc" and e.category == "parameter"} == {3}
