"""Models built on the GPU (issue 34, item 2): modules constructed under `with torch.device("cuda")` or with
`device="cuda"` factories, buffers computed at construction (RoPE caches, rescaled frequencies), weight inits that
loop on GPU values. None may reach the real CUDA runtime; each is traced through the real tracer."""

import inspect

import pytest
import torch

from tests.trace.child.test_host import allocs, trace_source
from xmem.trace import TraceError

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces fork from a warm server: tests/conftest.py

DIM, SEQ, HEADS, WIDTH = 16, 64, 2, 32  # head dim, cache length, heads, model width

# A Llama-3-style scaled rotary embedding: frequencies from torch.arange on the device, each rescaled in a Python
# loop by its wavelength (a comparison of a GPU scalar per element), gathered back with torch.tensor(list of GPU
# scalars, device=...), then a cos/sin cache over the positions, all in __init__ under torch.device("cuda").
ROPE = f"""import math
import torch
import torch.nn as nn


class ScaledRoPE(nn.Module):
    def __init__(self, dim, max_seq_len, base=500000.0, scale_factor=8.0, low=1.0, high=4.0, old_context=8192):
        super().__init__()
        self.dim, self.scale_factor, self.low, self.high, self.old_context = dim, scale_factor, low, high, old_context
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        self.register_buffer("theta", self.rescale(freqs), persistent=False)
        positions = torch.arange(max_seq_len, dtype=self.theta.dtype, device=self.theta.device)
        angles = torch.outer(positions, self.theta).float()
        self.register_buffer("cache", torch.stack([angles.cos(), angles.sin()], dim=-1), persistent=False)

    @torch.no_grad()
    def rescale(self, freqs):
        low_wavelen, high_wavelen = self.old_context / self.low, self.old_context / self.high
        rescaled = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                rescaled.append(freq)
            elif wavelen > low_wavelen:
                rescaled.append(freq / self.scale_factor)
            else:
                smooth = (self.old_context / wavelen - self.low) / (self.high - self.low)
                rescaled.append((1 - smooth) * freq / self.scale_factor + smooth * freq)
        return torch.tensor(rescaled, dtype=freqs.dtype, device=freqs.device)

    def forward(self, x):  # x: (batch, seq, heads, dim)
        seq = x.shape[1]
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)
        cache = self.cache[:seq].view(1, seq, 1, pairs.size(3), 2)
        out = torch.stack([pairs[..., 0] * cache[..., 0] - pairs[..., 1] * cache[..., 1],
                           pairs[..., 1] * cache[..., 0] + pairs[..., 0] * cache[..., 1]], -1)
        return out.flatten(3).type_as(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear({WIDTH}, {HEADS * DIM}, bias=False)
        self.rope = ScaledRoPE({DIM}, {SEQ})

    def forward(self, x):
        q = self.q(x).view(x.shape[0], x.shape[1], {HEADS}, {DIM})
        return self.rope(q).sum()


with torch.device("cuda"):
    model = Block()
assert model.rope.cache.device.type == "cuda" and model.rope.theta.shape == ({DIM // 2},)
# made on the GPU from torch.arange, its values are known: the same as the host's, rescaled or not per frequency
on_host = ScaledRoPE({DIM}, {SEQ}, old_context=64)
with torch.device("cuda"):
    on_gpu = ScaledRoPE({DIM}, {SEQ}, old_context=64)
assert on_gpu.theta.tolist() == on_host.theta.tolist() != ScaledRoPE({DIM}, {SEQ}, old_context=10**9).theta.tolist()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(2, {SEQ}, {WIDTH}, device="cuda")).backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_llama3_scaled_rope_built_under_the_cuda_device_context_is_traced(tmp_path):
    """Before: exit 11, "reached the real CUDA runtime" at the torch.tensor of the rescaled frequencies (upstream
    reads each GPU scalar of the list in C++, below the fake mode). Now: the frequencies (DIM/2 fp32) and the cos/sin
    cache (SEQ x DIM/2 x 2 fp32) are the module's GPU buffers, the projection its only parameter."""
    trace = trace_source(tmp_path, "rope.py", ROPE, iterations=2)
    assert trace.iterations == 2
    assert sorted(e.nbytes for e in allocs(trace, "buffer")) == [DIM // 2 * 4, SEQ * DIM // 2 * 2 * 4]
    assert [e.nbytes for e in allocs(trace, "parameter")] == [WIDTH * HEADS * DIM * 4]


VALUES = """import torch
host = torch.tensor([1.5, 2.5], dtype=torch.float64)
gpu = host.cuda()  # copied from the host: its values are known
rebuilt = torch.tensor([gpu[0] * 2, gpu[1]], device="cuda")  # GPU scalars read as upstream reads them
assert rebuilt.dtype == torch.float64 and rebuilt.tolist() == [3.0, 2.5], (rebuilt.dtype, rebuilt.tolist())
on_host = torch.tensor([gpu[1], 4])  # no device: a host tensor, as upstream builds it
assert on_host.device.type == "cpu" and on_host.tolist() == [2.5, 4.0], on_host
nested = torch.as_tensor([[gpu[0]], [gpu[1]]], device="cuda")
assert nested.shape == (2, 1) and nested.tolist() == [[1.5], [2.5]]
made = gpu.new_tensor([gpu[1], gpu[0]])
assert made.device.type == "cuda" and made.tolist() == [2.5, 1.5]
model = torch.nn.Linear(2, 1).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.stack([rebuilt, made]).float()).sum().backward()
    optimizer.step()
"""


DEVICE_RANGES = """import math
import torch
def frequencies(device):  # a HF-style Llama 3 rescaling: torch.where on wavelengths, values read with .item()
    inv = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64, device=device).float() / 64))
    wavelen = 2 * math.pi / inv
    return int((wavelen > 8192).sum()), torch.where(wavelen > 8192, inv / 8, inv).max().item()
host, gpu = frequencies("cpu"), frequencies("cuda")
assert gpu == host and host[0] not in (0, 1), (gpu, host)
ids = torch.arange(10, device="cuda")
assert ids[ids > 6].shape == (3,)  # a selection from a known range: its real count
model = torch.nn.Linear(4, 1).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(2, 4, device="cuda")).sum().backward()
    optimizer.step()
"""


def test_ranges_made_on_the_gpu_have_their_values(tmp_path):
    """torch.arange (linspace, logspace, eye) on the GPU: values its arguments fix, kept as known values, so what
    the program reads from them (.item(), a count, a selection's size) is what a GPU run reads: no stand-in."""
    trace = trace_source(tmp_path, "ranges.py", DEVICE_RANGES, iterations=2)
    assert not [w for w in trace.warnings if "stand-in" in w or "no real data" in w], trace.warnings


def test_gpu_scalars_in_a_sequence_are_read_with_their_known_values_and_dtypes(tmp_path):
    """torch.tensor / as_tensor / Tensor.new_tensor of lists holding GPU scalars: each value is read above the fake
    mode (known here: copied from the host), the dtype inferred from the elements as upstream does (float64)."""
    assert trace_source(tmp_path, "values.py", VALUES, iterations=2).iterations == 2


def test_a_many_element_gpu_tensor_in_a_sequence_is_refused_as_upstream_does(tmp_path):
    source = "import torch\nrow = torch.ones(3, device='cuda')\ntorch.tensor([row, row])\n"
    with pytest.raises(TraceError) as raised:
        trace_source(tmp_path, "rows.py", source, iterations=1)
    assert raised.value.kind == "user_error" and "only one element tensors" in raised.value.message


TRUNC_NORMAL = """import torch
import torch.nn as nn
with torch.device("cuda"):
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    nn.init.trunc_normal_(model[0].weight, std=0.02)  # a rejection loop: `if not mask.any(): break`
    nn.init.trunc_normal_(model[2].weight, std=1.0)  # [-2, 2] is 2 std: 4.6 % of each draw lands outside
optimizer = torch.optim.AdamW(model.parameters())
for _ in range(2):
    model(torch.randn(4, 32, device="cuda")).sum().backward()
    optimizer.step()
"""


def test_a_weight_init_that_loops_on_gpu_values_ends_under_the_device_context(tmp_path):
    """nn.init.trunc_normal_ (torch 2.14) redraws until no value is out of bounds. Under torch.device("cuda") each
    `mask.any()` passed through DeviceContext.__torch_function__, taken for the asking code: no while loop there, so
    the stand-in answered True for ever (a hang). The loop's own frame is found now, and it redraws as often as the
    draws of a GPU need (without the device context it redrew 100 times, the stand-in's loop limit)."""
    trace = trace_source(tmp_path, "init.py", TRUNC_NORMAL, iterations=2, timeout=240)
    assert sorted(e.nbytes for e in allocs(trace, "parameter")) == sorted([32 * 64 * 4, 64 * 4, 64 * 8 * 4, 8 * 4])
    # redraws as many as a GPU's draws need: none for std 0.02 within [-2, 2]; for std 1, of the 512 elements
    # 512 * 0.0455 = 23.3 are expected out after the first draw, 1.06 after one redraw, 0.05 after two: two
    # redraws, each a fresh draw (empty_like) and the merged values (where) of that weight's size
    redrawn = [e.nbytes for e in trace.events if e.action == "alloc" and e.op in ("where", "empty_like")]
    assert redrawn == ([64 * 8 * 4] * 4 if REJECTION_LOOP else [])  # torch 2.13 draws once, by inverse CDF


REJECTION_LOOP = "mask.any()" in inspect.getsource(torch.nn.init._no_grad_trunc_normal_)


RNG_UNDER_DEVICE = """import torch
import torch.nn as nn
with torch.device("cuda"):  # the GPU's generator states, seeded and restored under the device context
    torch.cuda.manual_seed(3)
    state = torch.cuda.get_rng_state()
    assert state.device.type == "cpu" and state.numel() == 16  # as upstream: a host tensor (seed, offset)
    noise = torch.randn(3, generator=torch.Generator(device="cuda"))
    torch.cuda.set_rng_state(state)
    with torch.random.fork_rng(devices=[0], device_type="cuda"):
        torch.cuda.manual_seed(5)
    assert torch.cuda.initial_seed() == 3 and noise.device.type == "cuda"
    model = nn.Sequential(nn.Embedding(16, 8), nn.Dropout(0.1), nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randint(0, 16, (4,), device="cuda")).sum().backward()
    optimizer.step()
"""


def test_gpu_random_states_under_the_device_context_stay_off_the_real_runtime(tmp_path):
    assert trace_source(tmp_path, "rng.py", RNG_UNDER_DEVICE, iterations=2).iterations == 2
