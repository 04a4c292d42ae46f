"""Only what the GPU would hold is fake: host tensors and the program's own control flow run for real, in every
thread, and every way of reading a value out of a cuda tensor gets a stand-in (xmem/trace/child/standins.py)."""

import sys

import pytest

from tests.torch_builds import PYTHONS, SCRIPTS
from xmem.trace import TraceError, run_trace

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces fork from a warm server: tests/conftest.py


def trace_source(tmp_path, name: str, source: str, *argv: str, iterations: int = 2, timeout: float = 300):
    """Trace a program written here: `source` saved as tmp_path/name, run with `argv`."""
    script = tmp_path / name
    script.write_text(source)
    return run_trace([sys.executable, str(script), *argv], iterations=iterations, timeout=timeout)


def allocs(trace, category):
    return [e for e in trace.events if e.action == "alloc" and e.category == category]


@pytest.fixture(scope="module", params=PYTHONS)
def host(request):
    lines = []
    result = run_trace(["python", str(SCRIPTS / "host_and_values.py")], python=request.param, iterations=3,
                       on_progress=lines.append)
    return result


def test_host_values_are_real_and_shape_the_model(host):
    # width 40 comes from a real CPU norm: Linear(16, 40) + Linear(40, 4), fp32; LSTM(16, 32): 4 tensors
    mlp = [16 * 40 * 4, 40 * 4, 40 * 4 * 4, 4 * 4]
    lstm = [4 * 32 * 16 * 4, 4 * 32 * 32 * 4, 4 * 32 * 4, 4 * 32 * 4]
    assert sorted(e.nbytes for e in allocs(host, "parameter")) == sorted(mlp + lstm)
    assert host.iterations == 3


def test_adam_state_and_gradients_match_the_parameters(host):
    params = sorted(e.nbytes for e in allocs(host, "parameter"))
    states = [e.nbytes for e in allocs(host, "optimizer_state") if e.nbytes > 512]
    assert sorted(states) == sorted(n for n in params for _ in range(2) if n > 512)


def test_every_way_of_reading_a_cuda_value_warns_once_per_kind(host):
    warnings = set(host.warnings)
    assert {"tensor.item()/float()/bool() returned a stand-in value (no real data under fake CUDA)",
            "tensor.tolist() returned ones (no real data under fake CUDA)",
            "torch.equal() on fake CUDA tensors answered True (no real data under fake CUDA)",
            # argmax's indices: as many bins as the range of its values (xmem.trace.child.value_bounds)
            "bincount() counted bins up to the highest value its input's range allows (no real data under fake "
            "CUDA)"} <= warnings
    assert not any("CUDA graph" in warning for warning in warnings)  # a graph made, never captured: nothing to say
    assert len(host.warnings) == len(warnings)


ROLLOUT = """import torch
policy = torch.nn.Linear(8, 4).cuda()
optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
while True:  # only the tracer's stop ends this loop
    log_probs = []
    for _ in range(110):  # each distribution validates its logits; more answers than MAX_TRUE_STAND_INS
        action = torch.distributions.Categorical(logits=policy(torch.randn(1, 8, device="cuda")))
        log_probs.append(action.log_prob(action.sample()))
    alive = torch.ones(16, dtype=torch.bool, device="cuda")
    while alive.any():  # ends only when a stand-in answers False
        alive = alive & (torch.rand(16, device="cuda") > 0.5)
    loss = -torch.stack(log_probs).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


def test_validation_checks_keep_their_answer_while_data_dependent_while_loops_end(tmp_path):
    """torch.distributions checks its arguments and samples on every construction (`constraint.check(value)`):
    however often, they stay valid (they were told False after 100 and raised: the fake GPU's fault, not the
    program's); the `while alive.any():` loop in the same iteration still ends."""
    result = trace_source(tmp_path, "rollout.py", ROLLOUT, iterations=1)
    assert result.iterations == 1
    assert any(w.startswith("a condition on tensor data was answered True 100 times") for w in result.warnings)


def test_cpu_only_program_runs_for_real(tmp_path):
    """A CPU-only loop that stops on a real value ends by itself (a stand-in would never reach the threshold)."""
    source = ("import torch\nw = torch.zeros(1, requires_grad=True)\nopt = torch.optim.SGD([w], lr=0.1)\n"
              "for i in range(10000):\n    loss = (w - 3).pow(2).sum()\n    if loss.item() < 1e-6: break\n"
              "    loss.backward(); opt.step(); opt.zero_grad()\nassert 20 < i < 200, i\n")
    with pytest.raises(TraceError) as raised:  # it never used the GPU: no 0-byte answer
        trace_source(tmp_path, "cpu_only.py", source, iterations=3, timeout=120)
    assert raised.value.kind == "no_cuda"  # not user_error: the loop ended where real values say, and so did the run


def test_regnet_widths_come_from_real_host_values():
    """torchvision computes RegNet's block widths from CPU tensors: the traced model is the real one."""
    torchvision = pytest.importorskip("torchvision")
    expected = sum(p.numel() * p.element_size() for p in torchvision.models.regnet_x_400mf().parameters())
    result = run_trace([sys.executable, str(SCRIPTS / "regnet_sgd.py")], iterations=2)
    traced = sum(e.nbytes for e in allocs(result, "parameter"))
    assert traced == expected


def test_a_gpu_program_that_reaches_something_unmodelled_says_so(tmp_path):
    # what torch.cuda._lazy_init calls: the real runtime, which has no device here
    source = "import torch\nx = torch.zeros(4, device='cuda')\ntorch._C._cuda_init()\n"
    with pytest.raises(TraceError) as raised:
        trace_source(tmp_path, "driver.py", source, iterations=3, timeout=120)
    assert raised.value.kind == "not_modelled"
    assert raised.value.message.startswith("not modelled: this reached the real CUDA runtime")


def test_tensorboard_tqdm_and_logging_take_cuda_values(tmp_path):
    result = run_trace([sys.executable, str(SCRIPTS / "logging_habits.py")], iterations=3, cwd=str(tmp_path))
    assert result.iterations == 3
    assert "tensor.numpy() returned ones (no real data under fake CUDA)" in result.warnings  # SummaryWriter's
    assert list(tmp_path.iterdir()) == []  # its runs/ directory went to the sandbox, not the user's directory


def test_weights_tied_after_the_host_budget_stay_tied(tmp_path):
    """An output layer tied to the input embedding once the model is past the 64 MiB of real host tensors
    (transformers' `_tie_or_clone_weights` assigns the embedding's Parameter): one parameter, counted once."""
    source = (
        "import torch, torch.nn as nn\n"
        "class LM(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.embed = nn.Embedding(16384, 1024)\n"  # 64 MiB fp32: the whole budget
        "        self.body = nn.Linear(1024, 1024)\n"  # born fake
        "        self.head = nn.Linear(1024, 16384, bias=False)\n"
        "        self.head.weight = self.embed.weight\n"
        "    def forward(self, ids):\n"
        "        return self.head(self.body(self.embed(ids)))\n"
        "model = LM()\n"
        "assert model.head.weight is model.embed.weight\n"
        "model = model.cuda()\n"
        "assert model.head.weight is model.embed.weight\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "for _ in range(2):\n"
        "    model(torch.randint(0, 16384, (2, 8), device='cuda')).sum().backward(); opt.step(); opt.zero_grad()\n")
    trace = trace_source(tmp_path, "tied.py", source)
    embed, body = 16384 * 1024 * 4, (1024 * 1024 + 1024) * 4
    assert sorted(e.nbytes for e in allocs(trace, "parameter")) == sorted([embed, body - 1024 * 4, 1024 * 4])
    assert sum(e.nbytes for e in allocs(trace, "optimizer_state") if e.nbytes > 512) == 2 * (embed + body)


def test_a_model_past_the_host_budget_is_born_fake_however_its_tensors_are_made():
    """A 10 GB nn.Linear made by torch.empty in its constructor (before registration), and a frozen layer whose
    weight is swapped for torchao's NF4Tensor (swap_tensors refuses a tensor with a weak reference), on the host then
    moved to the GPU, and on the GPU: the program checks its host memory itself (tests/scripts/host_built_big.py)."""
    torchao = pytest.importorskip("torchao.quantization")
    import torch
    nf4 = torchao.to_nf4(torch.zeros(512, 512, dtype=torch.bfloat16))
    nf4_bytes = sum(getattr(nf4, name).nbytes for name in nf4.__tensor_flatten__()[0])
    trace = run_trace([sys.executable, str(SCRIPTS / "host_built_big.py")], iterations=2, timeout=300)
    dense = (512 * 50_000 + 50_000) + 50_000 * 50_000 + (50_000 * 8 + 8)
    assert sum(e.nbytes for e in allocs(trace, "parameter")) == dense * 4 + 2 * nf4_bytes


def test_a_sparse_tensor_on_the_gpu_is_named_not_modelled(tmp_path):
    """A graph's sparse adjacency moved to the GPU: the fake mode makes no index and value tensors for it, which
    ended as "Cannot access storage of SparseTensorImpl" (the user's error); now the gap is named."""
    source = ("import torch\nedges = torch.randint(0, 100, (2, 400))\n"
              "adjacency = torch.sparse_coo_tensor(edges, torch.ones(400), (100, 100)).coalesce()\n"
              "features = torch.randn(100, 8, device='cuda')\n"
              "hidden = torch.sparse.mm(adjacency.cuda(), features)\n")
    with pytest.raises(TraceError) as raised:
        trace_source(tmp_path, "sparse_graph.py", source, iterations=3, timeout=120)
    assert raised.value.kind == "not_modelled"
    assert raised.value.message.startswith("not modelled: sparse tensors on the GPU") and "sparse_graph.py:5" in \
        raised.value.message


SCRIPTED = """import torch
@torch.jit.script
def scale_and_pad(x: torch.Tensor, pad: int) -> torch.Tensor:
    # TorchScript compiles torch.zeros / torch.full / torch.tensor to their aten ops; an element-wise chain it would
    # fuse on a GPU (x * 2 + 1).relu()
    out = torch.zeros(x.shape[0], x.shape[1] + pad, device=x.device)
    out[:, :x.shape[1]] = ((x * 2 + 1).relu() + torch.tensor(0.5, device=x.device)) * torch.full([1], 3.0)[0]
    return out
model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):  # the profiling executor specializes and fuses from the second call on
    scale_and_pad(model(torch.randn(32, 64, device="cuda")), 8).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_scripted_functions_run_on_the_fake_gpu_unfused(tmp_path):
    from xmem.trace.child.fakecuda import SCRIPTED_WARNING
    """A program that scripts its code: TorchScript resolved our wrapped factories (torch.zeros, torch.tensor) as
    Python functions to compile and refused them ("variable number of arguments", blamed on the program); and its
    GPU fuser compiles kernels through the CUDA driver. Now the factories are the same aten ops to TorchScript, and
    scripted code runs op by op, said in a warning."""
    result = trace_source(tmp_path, "scripted.py", SCRIPTED, iterations=3)
    assert result.iterations == 3
    assert SCRIPTED_WARNING in result.warnings
    # the scripted zeros: 32 x (64 + 8) fp32 on the GPU, once per iteration
    padded = [e for e in result.events if e.action == "alloc" and e.op == "zeros" and e.nbytes == 32 * 72 * 4]
    assert len(padded) == 3


METRICS = """import sys
import torch, torch.nn as nn
model = nn.Linear(16, 4).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if sys.argv[1:] == ["host"]:  # a model past the 64 MiB of real host tensors: its weights are born fake on the host
    big = nn.Linear(4096, 4200)
    print(big.weight.sum().item())  # a host value a real run computes from real host data
total = torch.zeros((), device="cuda")
for _ in range(3):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    total += loss.detach()
    print((total / 3).cpu().detach().numpy(), loss.detach().cpu().tolist())  # GPU values, through host copies
"""


@pytest.mark.parametrize("read", ["gpu", "host"])
def test_only_a_stand_in_for_a_host_value_makes_the_trace_suspect(tmp_path, read):
    """`.cpu().numpy()` of a GPU metric (MACE's to_numpy, torchmetrics' states) stands for GPU data, as `.item()`
    does: a warning only. A stand-in for a value the host computes from its own data is a fact no trace holds."""
    from xmem.audit import audit
    result = trace_source(tmp_path, "metrics.py", METRICS, read, iterations=3)
    assert "tensor.numpy() returned ones (no real data under fake CUDA)" in result.warnings
    reasons = audit(result)
    if read == "gpu":
        assert reasons == ()
    else:
        assert len(reasons) == 1 and "tensor.item() of a cpu tensor of shape ()" in reasons[0]


ANNOTATED = """import torch, torch.nn as nn
with torch.device("meta"):  # built on meta, annotated, then moved (torchtitan: parallelize, then to_empty)
    model = nn.Linear(8, 8)
model.weight._local_type = {"dp": "S(0)"}  # spmd_types' annotation, which fully_shard reads
model.bias.no_decay = True
model.to_empty(device="cuda")
assert model.weight._local_type == {"dp": "S(0)"} and model.bias.no_decay, "attributes lost by the move"
host = nn.Linear(8, 8)
host.weight.tag = "kept"
host.cuda()
assert host.weight.tag == "kept", "attribute lost by .cuda()"
opt = torch.optim.SGD([*model.parameters(), *host.parameters()], lr=0.1)
for _ in range(2):
    host(model(torch.randn(4, 8, device="cuda"))).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_moved_parameters_keep_the_attributes_libraries_set_on_them(tmp_path):
    """A fake GPU move replaces a parameter where stock `_apply` keeps the object; the attributes libraries put on
    it (spmd_types' annotations that torchtitan's fully_shard turns into DTensors) come along, or the program
    fails on our move (torchtitan over 2 GPUs did: "all parameters must be DTensors", blamed on it)."""
    result = trace_source(tmp_path, "annotated.py", ANNOTATED)
    assert result.iterations == 2


SUBCLASSED = """import torch, torch.nn as nn
class Image(torch.Tensor):  # a plain-data subclass, as torchvision's tv_tensors.Image is
    pass
model = nn.Conv2d(3, 8, 3).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    batch = torch.rand(4, 3, 16, 16).as_subclass(Image).to("cuda")  # Image's __torch_function__ re-wraps the copy
    model(batch).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_batch_of_a_plain_data_tensor_subclass_goes_to_the_gpu(tmp_path):
    """FakeTensorMode declines a tensor subclass it does not know, and a fake tensor cannot take a subclass type:
    anomalib's tv_tensors.Image batches ended on our error. The copy is made from the plain data, and stays a plain
    fake tensor."""
    result = trace_source(tmp_path, "subclassed.py", SUBCLASSED)
    assert result.iterations == 2
    batch = 4 * 3 * 16 * 16 * 4
    copies = [e for e in result.events if e.action == "alloc" and e.op == "_to_copy" and e.nbytes == batch]
    assert len(copies) == 2  # the batch of each iteration
