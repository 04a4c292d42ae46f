"""NVIDIA Transformer Engine under the trace (xmem/trace/child/transformer_engine_refusal.py): a program that imports
it ends as not modelled (exit 11), naming it; one that only asks whether it is installed trains as usual.

TE's torch part cannot be installed here (PyPI ships transformer-engine-torch as source that compiles against CUDA:
benchmarks/README.md, issue 34), so the program's own directory holds a package of that name, found first on its path
as any local package is. Its body raises: the trace must refuse before running any of it, as it would before TE's
extension took a fake tensor's device pointer."""

import subprocess
import sys
import textwrap

import pytest

from xmem.error_kinds import ErrorKind
from xmem.trace import TraceError, run_trace
from xmem.trace.child.transformer_engine_refusal import GAP

pytestmark = pytest.mark.usefixtures("warm_tracer")

TRAINING = """
    model = torch.nn.Linear(64, 64).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        model(torch.randn(8, 64, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
"""


def program(tmp_path, head: str) -> str:
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('transformer_engine was run under the trace')\n")
    (package / "pytorch.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(head) + textwrap.dedent(TRAINING))
    return str(script)


def test_a_program_importing_transformer_engine_ends_as_not_modelled_naming_it(tmp_path):
    script = program(tmp_path, """
        import torch
        import transformer_engine.pytorch as te
    """)
    with pytest.raises(TraceError) as refused:
        run_trace([sys.executable, script], iterations=2)
    assert refused.value.kind == "not_modelled"
    assert GAP in str(refused.value) and "train.py:3" in str(refused.value)


def test_a_probe_for_transformer_engine_finds_it_and_the_program_trains(tmp_path):
    script = program(tmp_path, """
        import importlib.util
        import torch
        assert importlib.util.find_spec("transformer_engine") is not None
    """)
    assert run_trace([sys.executable, script], iterations=2).iterations == 2


def test_the_command_line_exits_11(tmp_path):
    script = program(tmp_path, "import transformer_engine\nimport torch\n")
    done = subprocess.run([sys.executable, "-m", "xmem.cli", "estimate", "--gpu", "h100", "--", sys.executable,
                           script], capture_output=True, text=True, timeout=300)
    assert done.returncode == ErrorKind.NOT_MODELLED.exit_code == 11, done.stderr[-2000:]
    assert "Transformer Engine" in done.stdout + done.stderr
