"""The whole pipeline with the real tracer and simulator: a plain user training script, no GPU."""

import json
import os
import sys
import textwrap

import pytest

from xmem.estimate import estimate

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces fork from a warm server: tests/conftest.py

SCRIPT = """
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(1000, 2000), torch.nn.ReLU(), torch.nn.Linear(2000, 500)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(4):
        opt.zero_grad()
        x = torch.randn(32, 1000, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
"""
PARAM_BYTES = 4 * (1000 * 2000 + 2000 + 2000 * 500 + 500)


def test_mlp_adamw_breakdown_has_parameters_gradients_and_adam_states(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    result = estimate([sys.executable, str(script)], gpus=["a100", "h100"], cwd=tmp_path)
    data = json.loads(json.dumps(result.to_json()))
    assert data["used_cuda"] and data["iterations"] == 3
    assert set(data["gpus"]) == {"A100-SXM4-40GB", "H100-SXM5-80GB"}
    b = data["breakdown"]
    assert b["parameter"] == PARAM_BYTES
    assert b["gradient"] == PARAM_BYTES
    assert b["optimizer_state"] >= 2 * PARAM_BYTES  # exp_avg and exp_avg_sq (+ step counters)
    assert data["breakdown_gpu"] == "A100-SXM4-40GB"  # the first asked for that the job fits
    assert b == data["breakdowns"]["A100-SXM4-40GB"]
    b = data["breakdowns"]["H100-SXM5-80GB"]
    assert b["workspace"] == 2 * 32 * 2**20  # Hopper cuBLAS workspaces: forward thread and autograd thread
    assert sum(b.values()) == data["gpus"]["H100-SXM5-80GB"]["peak_bytes"]
    a100 = data["gpus"]["A100-SXM4-40GB"]
    assert a100["peak_reserved_bytes"] >= a100["peak_allocated_bytes"] >= 4 * PARAM_BYTES
    # Hopper's cuBLAS workspaces are 32 MiB instead of 8.125 MiB: never less memory than on the A100.
    assert data["gpus"]["H100-SXM5-80GB"]["peak_reserved_bytes"] >= a100["peak_reserved_bytes"]


@pytest.mark.skipif(not os.environ.get("XMEM_TEST_CPU_PYTHON"), reason="XMEM_TEST_CPU_PYTHON (CPU torch) not set")
def test_cpu_build_of_torch_gives_the_same_estimate(tmp_path):
    # A login node may have either build; the job's GPU memory does not depend on which one estimates it.
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    cpu_python = os.environ["XMEM_TEST_CPU_PYTHON"]
    on_cuda_build = estimate([sys.executable, str(script)], gpus=["a100"], cwd=tmp_path)
    on_cpu_build = estimate([cpu_python, str(script)], gpus=["a100"], cwd=tmp_path, python=cpu_python)
    assert on_cpu_build.torch_version != on_cuda_build.torch_version
    assert on_cpu_build.gpus["A100-SXM4-40GB"].peak_bytes == on_cuda_build.gpus["A100-SXM4-40GB"].peak_bytes
    assert on_cpu_build.breakdown == on_cuda_build.breakdown
