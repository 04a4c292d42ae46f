"""`xmem.rank_traces.fullest`: the answer of a job whose ranks were traced apart is the fullest rank's, and its line
saying so is a typed note (its kind and the rank and GPU type it names travel with the record's notes)."""

from tests.estimates import GIB, estimate, gpu_estimate
from xmem.estimate_record import Estimate
from xmem.rank_traces import fullest
from xmem.trace.events import Trace
from xmem.trace.wire import NoteKind, as_note

H100 = "H100-SXM5-80GB"


def traces(rank_tests: list[str]) -> dict[str, Trace]:
    return {"sm80+": Trace(used_cuda=True, iterations=3, torch_version="test", world_size=4, rank_tests=rank_tests)}


def test_the_ranks_line_is_a_typed_note_naming_the_fullest_rank():
    estimates = {0: estimate({H100: gpu_estimate(10 * GIB, name=H100)}),
                 3: estimate({H100: gpu_estimate(12 * GIB, name=H100)})}
    traced = {0: traces(["/job/train.py:41"]), 3: traces(["/job/train.py:41"])}
    answer = fullest(estimates, traced)
    note = as_note(answer.warnings[0])
    assert (answer.fullest_rank, note.kind, note.args) == (3, NoteKind.RANKS_TRACED, ("3", H100))
    assert note == ("ranks can differ: the program tests its rank (train.py:41); ranks 0, 3 of 4 traced; the "
                    f"figures are rank 3's, the fullest on {H100}")
    back = Estimate.from_json(answer.to_json()).warnings[0]  # kept by kind in the record
    assert (back, as_note(back).kind) == (note, NoteKind.RANKS_TRACED)
