"""GPU tensors copied from the host keep their real values (xmem/trace/child/known_values.py): what the program
reads from them, and what it sizes from them, is what a GPU run reads and sizes."""

import sys

import pytest

from tests.torch_builds import PYTHONS, SCRIPTS
from xmem.trace import run_trace
from xmem.trace.child.standins import SCALAR_WARNING, SELECTION_WARNING

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces fork from a warm server: tests/conftest.py

FLOAT = 4


@pytest.fixture(scope="module", params=PYTHONS)
def pooled(request):
    # the script exits non-zero (a user error) where a value it reads is not the real one
    return run_trace([sys.executable, str(SCRIPTS / "host_copied_values.py")], python=request.param, iterations=2)


def sizes(trace):
    return [e.nbytes for e in trace.events if e.action == "alloc"]


def test_an_index_copied_to_the_gpu_sizes_the_pooled_tensor_by_its_real_max(pooled):
    # batch.max() + 1 == 6 graphs; a stand-in (1) would have made 2 rows
    assert sizes(pooled).count(6 * 1000 * FLOAT) == 2  # once per traced iteration


def test_a_tensor_written_from_gpu_data_is_no_longer_known(pooled):
    # int(shifted.max()) after `shifted[0] = nodes.argmax()`: the stand-in 1, so 2 rows of 777
    assert sizes(pooled).count(2 * 777 * FLOAT) == 2
    assert SCALAR_WARNING in pooled.warnings


def test_a_known_mask_selects_its_real_count(pooled):
    # nodes[index > 3]: 2 of the 10 rows (a stand-in takes all 10), once per iteration; nothing else has 2 rows
    assert sizes(pooled).count(2 * 1000 * FLOAT) == 2


def test_float_copies_are_known_but_parameters_are_not_followed(pooled):
    # the script checked allclose on float copies (it exits non-zero on a wrong answer); nonzero() of the weights'
    # sign is the stand-in's every element, 2 int64 indices each, once per iteration
    assert sizes(pooled).count(1000 * 1000 * 2 * 8) == 2
    assert SELECTION_WARNING in pooled.warnings
