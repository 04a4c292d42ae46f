"""`storage.resize_(n)` happens outside the dispatcher; FSDP frees and re-allocates its unsharded parameters so.
The recorder counts each resize as a free of the old block and an allocation of the new size
(AllocationRecorder._resized)."""

from tests.torch_builds import SCRIPTS
from xmem.trace import run_trace

FLAT_PARAMETER = 4 * (256 * 256 * 4 + 256 * 4)  # the unsharded flat parameter of fsdp1_train.py's 4 layers


def test_fsdp_unsharded_parameter_is_allocated_and_freed_by_resize_each_iteration():
    result = run_trace(["torchrun", "--nproc_per_node=4", str(SCRIPTS / "fsdp1_train.py")], iterations=2)
    resized = [e for e in result.events if e.action == "alloc" and e.op == "resize_"]
    assert [(e.nbytes, e.iteration) for e in resized] == [(FLAT_PARAMETER, 0), (FLAT_PARAMETER, 1)]
    freed = {e.block for e in result.events if e.action == "free"}
    assert resized[0].block in freed  # freed again (resize_(0)) before the next iteration gathers it
