"""Host-side random draws that decide control flow (LayerDrop): the traced run must take the branch a GPU run
takes. The `facebook/opt-125m` failure of issue 10 (transformers 4.51.3: "'NoneType' object has no attribute
'to_legacy_cache'", modeling_opt.py:969) was this: `torch.rand([]) < config.layerdrop` (0.0) was a fake CPU tensor
with no value; the stand-in answer True skipped every decoder layer, so no layer returned a cache (and with
transformers 5, which guards the draw with `layerdrop > 0.0`, a model with LayerDrop would have been traced with
no layers). Host ops now run for real below the fake mode (only what the GPU holds is fake), so the draw has its
real value."""

import os
from pathlib import Path

import pytest

from tests.torch_builds import PYTHONS, SCRIPTS
from xmem.trace import run_trace

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces fork from a warm server: tests/conftest.py

ROOT = Path(__file__).resolve().parents[3]
REFERENCE_STACK = Path(os.environ.get("XMEM_TEST_REFERENCE_STACK", ROOT / "bench-out" / "reference-stack"))


@pytest.mark.parametrize("python", PYTHONS)
def test_layerdrop_with_probability_zero_runs_every_layer(python):
    result = run_trace(["python", str(SCRIPTS / "layerdrop.py")], python=python, iterations=2)
    gradients = [e.nbytes for e in result.events if e.action == "alloc" and e.category == "gradient"
                 and e.iteration == 1]
    assert sorted(gradients) == sorted([64 * 64 * 4, 64 * 4] * 4)  # every Linear of the 4 layers was used


@pytest.mark.skipif(not (REFERENCE_STACK / "transformers").is_dir(),
                    reason=f"no reference stack at {REFERENCE_STACK} (scripts/bench_accuracy.py installs it)")
def test_opt_trains_with_the_reference_stack():
    job = ROOT / "benchmarks" / "jobs" / "transformer.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REFERENCE_STACK),
                                                                      os.environ.get("PYTHONPATH")]))}
    result = run_trace(["python", str(job), "--model", "facebook/opt-125m", "--optimizer", "AdamW",
                        "--batch-size", "2"], iterations=1, env=env, timeout=600)
    assert result.iterations == 1
