"""Ranks that can run differently (issue 34 item 4), from tests/scripts/rank_tests.py under torchrun (4 ranks): a
program that tests its rank has its last rank traced besides rank 0, and the answer is the fuller, named; one that
reads its rank and never tests it is traced once. The per-rank difference is derived by hand: a buffer one rank
alone keeps for the whole run, of 32 or 64 MiB (a multiple of 2 MiB over 10 MiB: its own segment, exactly its
size, which no other block can share while it lives), so the fuller rank's peak is the other's plus that buffer."""

import os
import pickle
import sys

import pytest
import torch

from tests.torch_builds import SCRIPTS
from tests.trace.child.live_storages import by_category, walk
from xmem.estimate import estimate
from xmem.launchers import TRACED_RANK_ENV
from xmem.trace import run_trace
from xmem.trace.child import rank_reads
from xmem.trace.child.rank_reads import RankNumber

pytestmark = pytest.mark.usefixtures("warm_tracer")

SCRIPT = str(SCRIPTS / "rank_tests.py")
MIB = 2**20


def command(mode: str) -> list[str]:
    return ["torchrun", "--nproc_per_node=4", SCRIPT, "--mode", mode]


def line_of(text: str, path=SCRIPT) -> int:
    """The script's line that holds `text`."""
    with open(path) as script:
        return next(number for number, line in enumerate(script, 1) if text in line)


def test_a_rank_only_picked_a_device_and_dealt_batches_with_costs_one_trace():
    """The rank goes to torch.cuda.set_device and DistributedSampler, whose own tests of it (its range check) are
    torch's, not the program's."""
    trace = run_trace(command("device-only"), iterations=2, python=sys.executable)
    assert (trace.world_size, trace.rank_tests) == (4, [])
    said: list[str] = []
    answer = estimate(command("device-only"), gpus=["H100"], iterations=2, python=sys.executable,
                      on_progress=said.append)
    assert answer.fullest_rank is None and answer.rank_peaks == {}
    assert not any(line.startswith("tracing rank") for line in said)


def test_the_last_rank_keeping_a_remainder_is_traced_and_is_the_answer():
    """`if rank == world - 1:` on torch.distributed.get_rank(): rank 3 holds 32 MiB more than rank 0."""
    said: list[str] = []
    answer = estimate(command("last-extra"), gpus=["H100"], iterations=2, python=sys.executable,
                      on_progress=said.append)
    tested = f"rank_tests.py:{line_of('if rank == world - 1:')}"
    assert f"tracing rank 3 too: the program tests its rank ({tested})" in said
    assert sorted(answer.rank_peaks) == [0, 3]
    assert answer.rank_peaks[3] - answer.rank_peaks[0] == 32 * MIB
    assert answer.fullest_rank == 3 and answer.gpus["H100-SXM5-80GB"].peak_bytes == answer.rank_peaks[3]
    assert answer.warnings[0] == (f"ranks can differ: the program tests its rank ({tested}); ranks 0, 3 of 4 "
                                  "traced; the figures are rank 3's, the fullest on H100-SXM5-80GB")


def test_rank_zero_only_work_on_the_rank_read_from_the_environment_makes_rank_zero_the_answer():
    """`rank = int(os.environ["RANK"])`, then an EMA copy of the 4096 x 4096 fp32 weights (64 MiB) on rank 0 alone,
    the others at a barrier: the reading file's tests of `rank` are found in its source (both of them: by name)."""
    trace = run_trace(command("rank0-ema"), iterations=2, python=sys.executable)
    assert [test.rsplit(":", 1)[1] for test in trace.rank_tests] == [
        str(line_of("if rank == world - 1:")), str(line_of("if rank == 0 else []"))]
    answer = estimate(command("rank0-ema"), gpus=["H100"], iterations=2, python=sys.executable)
    assert answer.rank_peaks[0] - answer.rank_peaks[3] == 64 * MIB
    assert answer.fullest_rank == 0


def test_a_main_process_flag_read_by_the_program_traces_the_last_rank_of_lightnings_own_launch():
    """`fabric.is_global_zero` in the program's file; Fabric launches its ranks itself (`python script.py`), the
    traced process becoming rank 3 as Lightning's launcher would start it. Rank 0's EMA copy of the 2048 x 2048
    fp32 weights is 16 MiB, in a segment of its own (over 10 MiB, a multiple of 2 MiB), held all along."""
    script = SCRIPTS / "fabric_rank_zero.py"
    answer = estimate([sys.executable, str(script)], gpus=["H100"], iterations=2, python=sys.executable,
                      gpus_per_node=4)
    assert sorted(answer.rank_peaks) == [0, 3]
    assert answer.rank_peaks[0] - answer.rank_peaks[3] == 16 * MIB
    assert answer.fullest_rank == 0
    assert f"fabric_rank_zero.py:{line_of('if fabric.is_global_zero', script)}" in answer.warnings[0]


def held_at_end(trace) -> dict[str, list[int]]:
    live: dict = {}
    for _, live in walk(trace):
        pass
    return by_category(live)


def test_uneven_fsdp2_shards_leave_rank_zero_the_fullest_so_it_is_traced_alone():
    """fully_shard over Linear(512, 1021) on 4 ranks: torch.chunk gives ranks 0-2 256 rows and rank 3 253. Upstream
    pads each rank's sharded parameter (and its reduce-scattered gradient) to the full chunk, so those are alike:
    256 x 512 x 4 B of weight, 256 x 4 B of bias. AdamW's two states follow the unpadded local shard: rank 0 holds
    2 x (256 x 513) x 4 B, rank 3 2 x (253 x 513) x 4 B, 12312 B less. Rank 0 is the fullest; no second trace."""
    script = ["torchrun", "--nproc_per_node=4", str(SCRIPTS / "uneven_shards.py")]
    first = run_trace(script, iterations=2, python=sys.executable)
    last = run_trace(script, iterations=2, python=sys.executable, env={**os.environ, TRACED_RANK_ENV: "3"})
    assert (first.world_size, first.rank_tests) == (4, [])
    held = {0: held_at_end(first), 3: held_at_end(last)}
    for rank in (0, 3):
        assert held[rank]["parameter"] == [256 * 4, 256 * 512 * 4]
        assert sum(held[rank]["gradient"]) == 256 * 513 * 4
    assert held[0]["optimizer_state"] == sorted([256 * 4, 256 * 512 * 4] * 2)
    assert held[3]["optimizer_state"] == sorted([253 * 4, 253 * 512 * 4] * 2)


def test_a_rank_number_notes_the_programs_tests_and_stays_a_plain_int_elsewhere():
    """This file is the program here (not torch's, not xmem's): its comparisons and truth tests are noted, also
    of numbers computed from the rank; pickling gives a plain int."""
    rank = RankNumber(3)
    assert (rank * 2) % 4 == 2 and type(rank * 2) is RankNumber
    here = f"{__file__}:{sys._getframe().f_lineno - 1}"
    assert here in rank_reads.tested_at()
    assert type(pickle.loads(pickle.dumps(rank))) is int and hash(rank) == hash(3)
    assert f"{rank}" == "3" and list(range(5))[rank] == 3


class Framework:
    """A training framework's rank answers, as accelerate's Accelerator and Lightning's Fabric have them."""

    @property
    def process_index(self) -> int:
        return 3

    @property
    def is_main_process(self) -> bool:
        return False


rank_reads.note_property_reads(Framework)


def test_a_frameworks_rank_answers_read_by_the_program_are_noted_and_by_a_library_are_not():
    framework = Framework()
    flag_read = f"{__file__}:{sys._getframe().f_lineno + 1}"
    assert framework.is_main_process is False
    assert flag_read in rank_reads.tested_at()
    assert type(framework.process_index) is RankNumber and framework.process_index == 3
    library_file = os.path.join(os.path.dirname(torch.__file__), "library_code.py")  # never run: only its name
    read_by_library = {}
    exec(compile("rank = framework.process_index\nflag = framework.is_main_process", library_file, "exec"),
         {"framework": framework}, read_by_library)
    assert type(read_by_library["rank"]) is int
    assert not any(test.startswith(library_file) for test in rank_reads.tested_at())


def test_a_read_rank_counts_as_tested_only_where_its_name_is_tested(tmp_path):
    program = tmp_path / "train.py"
    program.write_text("import os\n"
                       "local_rank = int(os.environ['LOCAL_RANK'])\n"
                       "self_rank = int(os.environ['RANK'])\n"
                       "args.rank = int(os.environ['RANK'])\n"
                       "if not args.rank:\n"
                       "    pass\n"
                       "torch.cuda.set_device(local_rank)\n"
                       "x = 1 if self.training else 2\n")
    assert rank_reads._tests_of_names_read_at(str(program), 2) == []
    assert rank_reads._tests_of_names_read_at(str(program), 3) == []
    assert rank_reads._tests_of_names_read_at(str(program), 4) == [5]
