"""CUDA graphs traced on fake CUDA (xmem.trace.child.cuda_graphs): a capture runs its ops once, into the graph's
private pool; replays allocate nothing; the simulator keeps the pool's segments for the graph's life.

tests/scripts/cuda_graph_step.py: nn.Sequential(Linear(256, 1024), ReLU(), Linear(1024, 256)), batch 64, fp32, SGD
without momentum, a whole step captured. Its captured step, by hand: forward addmm 64x1024 (262144 B), relu 262144,
addmm 64x256 (65536), sum (4); backward ones_like (4), mm 262144 (relu's input grad), mm 1024x256 (1048576, W2's
grad), sum 1024 (b2's grad), threshold_backward 262144, mm 256x1024 (1048576, W1's grad), sum 4096 (b1's grad); the
foreach SGD step allocates nothing. Every request is at most 1 MiB: the private pool's small blocks, in 2 MiB segments.
Best fit by hand: the forward and the first five backward blocks fill the first segment exactly (the first addmm's
262144 freed by relu takes the 65536, the 4s and the 1024; relu's input grad, W2's grad and threshold_backward fill
the rest); freeing relu's input grad and relu's output leaves 524288 and 194560 free, so W1's 1 MiB grad takes a
second segment: the pool holds 2 x 2 MiB for the graph's life.

The trace's iterations (xmem.trace.child.recorder.SIDE_STREAM_GRACE): a replay of a captured step is an iteration,
and iterations that reach the target on a side stream (a graph's warm-up) do not end the trace, for a bounded number.
"""

import sys

import pytest

from tests.torch_builds import PYTHONS
from tests.trace.child.test_scripts import allocs, sizes, trace
from xmem.trace import TraceError, run_trace
from xmem.trace.child.cuda_graphs import USER_POOL_GAP
from xmem.trace.child.recorder import SIDE_STREAM_GRACE
from xmem.trace.events import POOL_ACTIONS
from xmem.simulate import ALLOC, BEGIN_POOL, EMPTY_CACHE, END_POOL, FREE, RELEASE_POOL, simulate
from xmem.simulate.allocator_settings import MiB

pytestmark = pytest.mark.usefixtures("warm_tracer")

STEP = [262144, 262144, 65536, 4, 4, 262144, 1048576, 1024, 262144, 1048576, 4096]
BATCH = 64 * 256 * 4
PARAMETERS = [1024 * 256 * 4, 1024 * 4, 256 * 1024 * 4, 256 * 4]
_OPS = {"alloc": ALLOC, "free": FREE, "empty_cache": EMPTY_CACHE, "begin_pool": BEGIN_POOL, "end_pool": END_POOL,
        "release_pool": RELEASE_POOL}


def ops_of(result):
    """The trace's events as the simulator's ops (no workspaces: the pool's rules alone)."""
    return [(_OPS[e.action], e.block, e.nbytes, e.stream) for e in result.events
            if e.nbytes or e.action != "alloc" and e.action != "free"]


def index_of(result, action, nth=0):
    return [i for i, e in enumerate(result.events) if e.action == action][nth]


@pytest.fixture(scope="module", params=PYTHONS)
def whole_step(request):
    return trace(request.param, "cuda_graph_step.py", "--replays", "7", iterations=20)


def test_the_capture_runs_the_step_once_into_the_graphs_pool(whole_step):
    begin, end = index_of(whole_step, "begin_pool"), index_of(whole_step, "end_pool")
    captured = [e for e in whole_step.events[begin:end] if e.action == "alloc"]
    assert sizes(captured) == sorted(STEP)
    capture_stream = whole_step.events[begin].stream
    assert capture_stream != 0 and {e.stream for e in captured} == {capture_stream}
    # torch.cuda.graph empties the cache before it captures
    assert whole_step.events[begin - 1].action == "empty_cache"
    assert whole_step.iterations == 3 + 1 + 7  # warm-up steps, the captured one, and each replay of it


def test_replays_allocate_nothing_but_the_fresh_inputs(whole_step):
    after = whole_step.events[index_of(whole_step, "end_pool") + 1:]
    replayed = [e for e in after if e.action == "alloc"]
    assert sizes(replayed) == [BATCH] * 7 and {e.op for e in replayed} == {"randn"}


def test_the_graphs_pool_holds_two_small_segments_for_the_graphs_life(whole_step):
    ops = ops_of(whole_step)
    result = simulate(ops, timeline_points=len(ops) + 3)
    reserved = [r for _, _, r in result.timeline]
    begin = [i for i, op in enumerate(ops) if op[0] == BEGIN_POOL][0]
    end = [i for i, op in enumerate(ops) if op[0] == END_POOL][0]
    assert reserved[end] - reserved[begin] == 2 * 2 * MiB
    # the replays' inputs reuse one cached block of the device's own pool: nothing grows after the first
    first_input = [i for i, op in enumerate(ops) if i > end and op[0] == ALLOC][0]
    assert reserved[first_input:] == [reserved[first_input]] * (len(ops) - first_input)


def test_a_warm_up_on_a_side_stream_as_long_as_the_trace_goes_on_to_the_capture_and_its_first_replay():
    # three warm-up steps on a side stream, as many as the iterations asked: the trace does not end there
    result = trace(sys.executable, "cuda_graph_step.py", iterations=3)
    assert [e.action for e in result.events if e.action in POOL_ACTIONS] == ["begin_pool", "end_pool"]
    assert result.iterations == 5  # the captured step (4) on its capture stream, then the first replay on the default


SIDE_STREAM_TRAINING = """import torch
model = torch.nn.Linear(64, 64).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    while True:  # only the tracer's stop ends this loop
        model(torch.randn(8, 64, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
"""


def test_training_wholly_on_a_side_stream_ends_a_bounded_number_of_iterations_past_the_target(tmp_path):
    script = tmp_path / "side_stream.py"
    script.write_text(SIDE_STREAM_TRAINING)
    result = run_trace([sys.executable, str(script)], iterations=2)
    assert result.iterations == 2 + SIDE_STREAM_GRACE


def test_a_graph_never_replayed_still_captures_into_its_pool():
    # the same program with no replay still captures once: the pool is there whether or not it is replayed
    result = trace(sys.executable, "cuda_graph_step.py", "--replays", "0", iterations=10)
    assert [e.action for e in result.events].count("begin_pool") == 1


def test_graphed_callables_capture_forward_and_backward_into_one_shared_pool():
    result = trace(sys.executable, "graphed_callables.py", iterations=3)
    pools = [e for e in result.events if e.action in ("begin_pool", "end_pool")]
    assert [e.action for e in pools] == ["begin_pool", "end_pool"] * 4  # 2 forwards, then 2 backwards
    assert len({e.block for e in pools}) == 1
    captured, inside = [], False
    for e in result.events:
        inside = e.action == "begin_pool" or (inside and e.action != "end_pool")
        if inside and e.action == "alloc":
            captured.append(e)
    # forwards: first's output 64x1024, second's 64x256; backwards (second, then first): h's grad 64x1024, W2's and
    # b2's grads, then W1's and b1's (x needs none)
    assert sizes(captured) == sorted([262144, 65536, 262144, 1048576, 1024, 1048576, 4096])
    # the trained steps run only the relu between the graphs, besides their fresh inputs
    trained = [e for e in allocs(result) if e.iteration >= 1]
    assert {e.op for e in trained} <= {"randn", "relu", "sum", "ones_like", "threshold_backward"}


def test_a_user_memory_pool_is_not_modelled_and_named(tmp_path):
    script = tmp_path / "mem_pool.py"
    script.write_text("import torch\npool = torch.cuda.MemPool()\nwith torch.cuda.use_mem_pool(pool):\n"
                      "    x = torch.randn(1024, device='cuda')\n")
    with pytest.raises(TraceError) as failure:
        run_trace([sys.executable, str(script)], iterations=1)
    assert failure.value.kind == "not_modelled" and USER_POOL_GAP in failure.value.message
