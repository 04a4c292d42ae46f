"""Weights on disk are never read (xmem.trace.child.weights): checkpoints bound for the GPU load as fake tensors made from
their metadata, CPU-bound ones stay real and memory-mapped, and nothing of their data is read.

The cases of the selected tests run in one process per torch build, set up as the tracing child is (shim, fake CUDA,
the patches), each case a function of its own that reports what it loaded or its traceback, which its test asserts
on. What a case cost is the part of its weight files in the page cache after it (evicted just before it: fsync, then
posix_fadvise DONTNEED), which counts reads and memory-mapped pages alike."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.torch_builds import PYTHONS

MIB = 1 << 20
READ_ALLOWANCE = 16 * MIB  # headers, pickles, the kernel's readahead around them: far below two 64 MiB weights

SETUP = """
    import gc, json, os, sys, traceback
    os.environ.setdefault("XMEM_FAKE_DEVICE_COUNT", "1")
    from xmem.trace import shim
    shim.load_shim()
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from xmem.bench.page_cache import cached_bytes, evict
    from xmem.trace.child import fakecuda, weights
    from xmem.trace.runner import fake_gpu
    fakecuda.install(fakecuda.FakeCuda(fake_gpu(), 1))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    weights.install(lambda: mode)
    CASES = {}

    def describe(t):
        return {"fake": isinstance(t, FakeTensor), "device": str(t.device), "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch.")}
"""
RUN = """
    # One case after another, each after its weight files were evicted, and measured once its tensors are freed (a
    # mapping left alive would keep its pages cached through the next case's eviction: cached_before says so).
    for key, folder, files in json.loads(sys.argv[1]):
        evict(files)
        outcome = {"cached_before": cached_bytes(files)}
        try:
            outcome["result"] = CASES[key](folder)
        except BaseException:
            outcome["error"] = traceback.format_exc()
        gc.collect()
        outcome["cached_after"] = cached_bytes(files)
        print("RESULT " + json.dumps([key, outcome]), flush=True)
"""

# A test's case: the fixture that makes its weight folder ("pretrained/bin": one of that fixture's folders), the
# code run in the child with `folder` (a str) set, which sets `result`, and the values of further names it reads.
CASES: dict[str, tuple[str, str, dict]] = {}


def weight_files(folder):
    return [path for path in folder.iterdir() if path.suffix in (".safetensors", ".pt", ".bin")]


def case_key(item: pytest.Item) -> tuple[str, str]:
    """The Python a test runs its case in, and the case's key: the test's name, with its parameters other than the
    Python."""
    params = dict(getattr(item, "callspec", None).params) if hasattr(item, "callspec") else {}
    python = params.pop("python", sys.executable)
    return python, item.originalname + (f"[{'-'.join(map(str, params.values()))}]" if params else "")


def weight_folder(request: pytest.FixtureRequest, spec: str) -> Path:
    fixture, _, layout = spec.partition("/")
    value = request.getfixturevalue(fixture)
    return value[0][layout] if layout else value


def child_script(keys: list[str]) -> str:
    functions = []
    for key in keys:
        _folder, body, params = CASES[key]
        name = re.sub(r"\W", "_", key)
        arguments = "".join(f", {param}={value!r}" for param, value in params.items())
        functions.append(f"def {name}(folder{arguments}):\n{textwrap.indent(textwrap.dedent(body).lstrip(), '    ')}"
                         f"    return result\nCASES[{key!r}] = {name}\n\n")
    return textwrap.dedent(SETUP) + "\n\n" + "".join(functions) + textwrap.dedent(RUN)


@pytest.fixture(scope="module")
def loads(request, tmp_path_factory):
    """`loads(test_request)`: what the test's case loaded, checked (it ran, its files were out of the page cache
    before it and stayed below the allowance after it). A torch build's cases run on the first test that asks for
    one: those of all the selected tests of this module, in one process."""
    here = Path(__file__).resolve()
    outcomes: dict[str, dict] = {}
    crashes: dict[str, str] = {}

    def run(test_request: pytest.FixtureRequest) -> dict:
        python, key = case_key(test_request.node)
        if python not in outcomes:
            keys = [k for item in request.session.items if Path(item.path).resolve() == here
                    for p, k in [case_key(item)] if p == python and k in CASES]
            keys = list(dict.fromkeys(keys + [key]))
            plan = []
            for k in keys:
                folder = weight_folder(test_request, CASES[k][0])
                plan.append([k, str(folder), [str(path) for path in weight_files(folder)]])
            workdir = tmp_path_factory.mktemp("cases")
            (workdir / "cases.py").write_text(child_script(keys))
            done = subprocess.run([python, "cases.py", json.dumps(plan)], capture_output=True, text=True,
                                  cwd=workdir, timeout=600)
            outcomes[python] = dict(json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines()
                                    if line.startswith("RESULT "))
            crashes[python] = f"the child exited {done.returncode}:\n{done.stderr[-3000:]}"
        if key not in outcomes[python]:
            pytest.fail(f"no outcome for this case: {crashes[python]}", pytrace=False)
        outcome = outcomes[python][key]
        if "error" in outcome:
            pytest.fail(f"the case failed in the child process:\n{outcome['error']}", pytrace=False)
        assert outcome["cached_before"] < MIB, "the page cache kept the weight files: the measure would mean nothing"
        assert outcome["cached_after"] < READ_ALLOWANCE
        return outcome["result"]

    return run


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A 64 MiB weight (bf16) and a small one with known values, as safetensors and as a torch checkpoint."""
    import torch
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("checkpoints")
    tensors = {"big": torch.zeros(4096, 8192, dtype=torch.bfloat16), "small": torch.arange(6.0).reshape(2, 3)}
    save_file(tensors, str(folder / "weights.safetensors"))
    torch.save(tensors, folder / "weights.pt")
    return folder


CASES["test_safetensors_bound_for_cuda_are_fake_from_the_header"] = ("checkpoints", """
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(os.path.join(folder, "weights.safetensors"), framework="pt", device="cuda") as f:
        result = {"keys": list(f.keys()), "big": describe(f.get_tensor("big")),
                  "rows": describe(f.get_slice("big")[:1024]), "dtype": f.get_slice("big").get_dtype()}
    result["load_file"] = describe(load_file(os.path.join(folder, "weights.safetensors"), device=0)["big"])
""", {})


@pytest.mark.parametrize("python", PYTHONS)
def test_safetensors_bound_for_cuda_are_fake_from_the_header(python, loads, request):
    result = loads(request)
    assert result["keys"] == ["big", "small"] and result["dtype"] == "BF16"
    big = {"fake": True, "device": "cuda:0", "shape": [4096, 8192], "dtype": "bfloat16"}
    assert result["big"] == big and result["load_file"] == big
    assert result["rows"] == {**big, "shape": [1024, 8192]}


CASES["test_torch_load_to_cuda_reads_no_weight"] = ("checkpoints", """
    loaded = torch.load(os.path.join(folder, "weights.pt"), map_location="cuda")
    result = {name: describe(t) for name, t in loaded.items()}
""", {})


@pytest.mark.parametrize("python", PYTHONS)
def test_torch_load_to_cuda_reads_no_weight(python, loads, request):
    result = loads(request)
    assert result["big"] == {"fake": True, "device": "cuda:0", "shape": [4096, 8192], "dtype": "bfloat16"}
    assert result["small"]["fake"] and result["small"]["device"] == "cuda:0"


@pytest.fixture(scope="module")
def resumable(tmp_path_factory, monkeypatch_module):
    """A training checkpoint saved on a GPU: the model's weight at cuda:0, the step count and the CPU RNG state on
    the CPU. (No GPU here: the weight's saved location is written as cuda:0 by torch.save's location tag.)"""
    import torch
    import torch.serialization as serialization

    folder = tmp_path_factory.mktemp("resumable")
    weight = torch.zeros(4096, 8192, dtype=torch.bfloat16)
    tag = serialization.location_tag
    monkeypatch_module.setattr(serialization, "location_tag",
                               lambda storage: "cuda:0" if storage.data_ptr() == weight.data_ptr() else tag(storage))
    torch.save({"model": {"weight": weight}, "rng": torch.get_rng_state(), "step": 7}, folder / "last.pt")
    monkeypatch_module.undo()
    return folder


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


CASES["test_a_checkpoint_saved_on_the_gpu_resumes_with_fake_weights_and_real_cpu_state"] = ("resumable", """
    state = torch.load(os.path.join(folder, "last.pt"))  # no map_location: each tensor where it was saved
    torch.set_rng_state(state["rng"])  # needs the real bytes
    result = {"weight": describe(state["model"]["weight"]), "rng": describe(state["rng"]), "step": state["step"]}
""", {})


def test_a_checkpoint_saved_on_the_gpu_resumes_with_fake_weights_and_real_cpu_state(loads, request):
    result = loads(request)
    assert result["weight"] == {"fake": True, "device": "cuda:0", "shape": [4096, 8192], "dtype": "bfloat16"}
    assert result["rng"]["fake"] is False and result["rng"]["device"] == "cpu" and result["step"] == 7


CASES["test_cpu_loads_stay_real_and_mapped"] = ("checkpoints", """
    from safetensors import safe_open
    loaded = torch.load(os.path.join(folder, "weights.pt"), map_location="cpu")
    with safe_open(os.path.join(folder, "weights.safetensors"), framework="pt", device="cpu") as f:
        small = f.get_tensor("small")
    result = {"big": describe(loaded["big"]), "values": loaded["small"].tolist(), "st_values": small.tolist()}
""", {})


def test_cpu_loads_stay_real_and_mapped(loads, request):
    result = loads(request)
    assert result["big"] == {"fake": False, "device": "cpu", "shape": [4096, 8192], "dtype": "bfloat16"}
    assert result["values"] == result["st_values"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]  # read where used


CASES["test_load_state_dict_into_a_cpu_module_then_to_cuda_reads_nothing"] = ("checkpoints", """
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.big = torch.nn.Parameter(torch.empty(4096, 8192, dtype=torch.bfloat16))
            self.register_buffer("small", torch.empty(2, 3))
    net = Net()
    param = net.big
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)  # built before the load, as when resuming
    net.load_state_dict(torch.load(os.path.join(folder, "weights.pt")))
    result = {"same_parameter": net.big is param and optimizer.param_groups[0]["params"][0] is param,
              "values": net.small.tolist()}
    with mode:
        net.to("cuda")
    result["moved"] = describe(net.big)
""", {})


def test_load_state_dict_into_a_cpu_module_then_to_cuda_reads_nothing(loads, request):
    result = loads(request)
    assert result["same_parameter"] and result["values"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert result["moved"] == {"fake": True, "device": "cuda:0", "shape": [4096, 8192], "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A small Llama saved as Hugging Face does, in safetensors and in the older pytorch_model.bin."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=8)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    folders = {"safetensors": tmp_path_factory.mktemp("llama-st"), "bin": tmp_path_factory.mktemp("llama-bin")}
    model.save_pretrained(folders["safetensors"])
    config.save_pretrained(folders["bin"])
    torch.save(model.state_dict(), folders["bin"] / "pytorch_model.bin")
    return folders, sum(p.numel() for p in model.parameters())


LAYOUTS = [("safetensors", None), ("safetensors", "cuda"), ("bin", "cuda")]
for _layout, _device_map in LAYOUTS:
    CASES[f"test_from_pretrained_weights_are_fake[{_layout}-{_device_map}]"] = (f"pretrained/{_layout}", """
        from transformers import AutoModelForCausalLM
        with mode:  # as the program runs in the tracing child
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=device_map)
            model.to("cuda")
        params = list(model.parameters())
        result = {"fake": all(isinstance(p, FakeTensor) for p in params), "numel": sum(p.numel() for p in params),
                  "devices": sorted({str(p.device) for p in params})}
    """, {"device_map": _device_map})


@pytest.mark.parametrize("layout, device_map", LAYOUTS)
def test_from_pretrained_weights_are_fake(layout, device_map, loads, request, pretrained):
    _folders, parameters = pretrained
    result = loads(request)
    assert result["fake"] and result["devices"] == ["cuda:0"]
    assert result["numel"] == parameters


def test_a_host_load_past_the_trace_memory_limit_is_fake(tmp_path):
    """A recipe that loads a 12 GB state dict on the host first is mapped, never read: at the default limit it is a
    real (unread) host load, since the limit is on resident memory; where even the reservation passes the limit's
    backstop (RLIMIT_DATA, sandbox.DATA_BACKSTOP times the limit: 8 GiB for a 512 MiB limit here) the host tensors
    are fake, with a warning, not 'unable to mmap' as the program's own error. The checkpoint is torch.save's
    metadata-only layout: 12 GB of holes."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from xmem.trace import run_trace
    with FakeTensorMode():
        weight = torch.empty(3 << 30, dtype=torch.float32)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save({"w": weight}, tmp_path / "big.pt")
    script = tmp_path / "host_first.py"
    script.write_text("import torch\nstate = torch.load('big.pt', map_location='cpu')\n"
                      "assert state['w'].shape == (3 << 30,) and state['w'].device.type == 'cpu'\n"
                      "layer = torch.nn.Linear(8, 8).cuda()\noptimizer = torch.optim.SGD(layer.parameters())\n"
                      "for _ in range(2):\n"
                      "    layer(torch.randn(2, 8, device='cuda')).sum().backward(); optimizer.step()\n")
    faked = "checkpoint tensors loaded to the host past the trace's memory limit are fake"
    trace = run_trace([sys.executable, str(script)], iterations=2, cwd=str(tmp_path), timeout=300)
    assert trace.iterations == 2 and not any(w.startswith(faked) for w in trace.warnings)
    trace = run_trace([sys.executable, str(script)], iterations=2, cwd=str(tmp_path), timeout=300,
                      memory_limit_bytes=512 << 20)
    assert trace.iterations == 2 and any(w.startswith(faked) for w in trace.warnings)


RESAVED = """import torch
model = torch.nn.Linear(64, 64).cuda()
torch.save({"model": model.state_dict(), "host": torch.full((4096,), 2.0)}, "last.pt")
checkpoint = torch.load("last.pt", map_location="cpu")  # mapped
checkpoint["model"] = {name: value.half() for name, value in checkpoint["model"].items()}
torch.save(checkpoint, "last.pt")  # the file its live tensors are mapped from, saved over
assert float(checkpoint["host"].sum()) == 8192.0  # still readable: the mapped file lives on
assert float(torch.load("last.pt", map_location="cpu")["host"].sum()) == 8192.0  # the new file has the name
optimizer = torch.optim.SGD(model.parameters())
for _ in range(2):
    model(torch.randn(2, 64, device="cuda")).sum().backward(); optimizer.step()
"""


def test_a_mapped_checkpoint_saved_over_keeps_its_tensors(tmp_path):
    """ultralytics' strip_optimizer loads its checkpoint to the CPU and saves the result under the same name: a load
    maps the file, so truncating it there killed the program with SIGBUS at the next read of those tensors."""
    from xmem.trace import run_trace
    script = tmp_path / "resaved.py"
    script.write_text(RESAVED)
    trace = run_trace([sys.executable, str(script)], iterations=2, cwd=str(tmp_path), timeout=300)
    assert trace.iterations == 2
    assert not (tmp_path / "last.pt").exists()  # written in the sandbox only


HOLED_CHECKPOINT = """\
import json, os, struct, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
out = sys.argv[1]
config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=2, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000, torch_dtype="float16")
config.save_pretrained(out)
with torch.device("meta"):
    model = LlamaForCausalLM(config)
header, offset = {}, 0
for name, tensor in model.state_dict().items():
    header[name] = {"dtype": "F16", "shape": list(tensor.shape), "data_offsets": [offset, offset + 2 * tensor.numel()]}
    offset += 2 * tensor.numel()
raw = json.dumps(header).encode()
raw += b" " * (-len(raw) % 8)
with open(os.path.join(out, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    f.truncate(8 + len(raw) + offset)  # the weights a hole: 1.3 GB that take no disk
"""

LOADS_ON_THE_HOST_FIRST = """\
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32)  # 2.7 GB in fp32
model = model.cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    ids = torch.randint(0, 32000, (1, 16), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward(); optimizer.step(); optimizer.zero_grad()
"""


def test_a_checkpoint_loaded_on_the_host_first_costs_the_trace_no_host_memory(tmp_path):
    """Issue 31: fine-tunes load the checkpoint on the host in fp32 before moving or sharding it (a 7B one is 28 GB
    there); the trace holds none of it: a 2.7 GB fp32 load passes a 1 GiB resident limit, with every parameter on
    the fake GPU."""
    from xmem.trace import run_trace
    (tmp_path / "make.py").write_text(HOLED_CHECKPOINT)
    subprocess.run([sys.executable, str(tmp_path / "make.py"), str(tmp_path / "llama")], check=True,
                   capture_output=True)
    (tmp_path / "train.py").write_text(LOADS_ON_THE_HOST_FIRST)
    trace = run_trace(["python", "train.py", str(tmp_path / "llama")], iterations=2, cwd=str(tmp_path),
                      memory_limit_bytes=1 << 30, timeout=600)
    assert trace.iterations == 2
    parameters = sum(e.nbytes for e in trace.events if e.action == "alloc" and e.category == "parameter")
    assert parameters >= 4 * 660_000_000  # every fp32 parameter, made on the GPU by .cuda()
