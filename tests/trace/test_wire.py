"""`xmem.trace.wire`: the request the estimator hands the traced side reads back as it was made, and the GPU it
carries is all the program is shown, as the catalog has it; the notes the traced program's side sends back are typed records (a kind with its words for
people, the maker's own words, the values that fill them), carried through the result JSON, so the estimator shows
them by kind and never parses their words."""

import copy
import json
import pickle
import sys
import textwrap

import pytest

from xmem.gpus import load_catalog
from xmem.trace import run_trace
from xmem.trace.runner import DEFAULT_GPU, fake_gpu
from xmem.trace.wire import FakeGpu, Note, NoteKind, TraceRequest, WarmReply, WarmRequest, as_note, notes_from_json, \
    notes_json, with_option

CATALOG = load_catalog(calibration_path=None)

LOOP = Note(NoteKind.LOOP_ENDED, "a condition on tensor data was answered True 100 times at one place; answered "
                                 "False from then on, to end the loop", 100)


def test_a_note_is_its_makers_words_wherever_words_are_kept():
    assert LOOP == "a condition on tensor data was answered True 100 times at one place; answered False from then " \
                   "on, to end the loop"
    assert json.dumps([LOOP]) == json.dumps([str(LOOP)])  # the records' `warnings` are unchanged
    assert list(dict.fromkeys([LOOP, str(LOOP)])) == [LOOP]  # said once, as the recorder dedups them


def test_a_note_keeps_its_kind_and_values_through_the_result_json():
    plain = "cuFFT's work area and copies were left out of an FFT call"
    payload = json.loads(json.dumps({"warnings": [LOOP, plain], "notes": notes_json([LOOP, plain])}))
    back = notes_from_json(payload, payload["warnings"])
    assert back == [LOOP, plain]
    assert (back[0].kind, back[0].args) == (NoteKind.LOOP_ENDED, ("100",))
    assert back[1].kind is None and back[1].for_people() == plain


def test_a_result_without_notes_gives_its_warnings_untyped():
    """A trace saved before notes were typed: its words are shown as made."""
    assert notes_from_json({"warnings": ["said"]}, ["said"]) == ["said"]
    assert as_note("said").kind is None and not as_note("said").quiet


def test_a_kind_this_side_does_not_know_is_shown_as_made():
    note = Note.from_json({"kind": "from_a_newer_child", "text": "said", "args": ["1"]})
    assert note.kind is None and note.for_people() == "said"


def test_copies_and_pickles_keep_the_kind():
    for copied in (copy.deepcopy(LOOP), pickle.loads(pickle.dumps(LOOP))):
        assert (copied, copied.kind, copied.args) == (LOOP, LOOP.kind, LOOP.args)


def test_every_kind_has_a_stable_id_and_words_that_take_its_values():
    ids = [kind.value for kind in NoteKind]
    assert len(ids) == len(set(ids)) and all(i.isidentifier() and i.islower() for i in ids)
    for kind in NoteKind:
        assert not (kind.quiet and kind.plain), kind  # a quiet note is shown in its maker's words, with --verbose
        if kind.plain:
            kind.plain.format(*["x"] * kind.plain.count("{}"))


PROGRAM = """
    import torch
    model = torch.nn.Linear(8, 8).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    budget = torch.cuda.get_device_properties(0).total_memory  # sizes its work by the GPU: a note with the size
    for step in range(3):
        loss = model(torch.randn(4, 8, device="cuda")).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(loss.item(), model.weight[0, :2].tolist())
"""


def test_the_childs_notes_reach_the_estimator_typed(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(PROGRAM))
    trace = run_trace([sys.executable, str(tmp_path / "train.py")], iterations=2, cwd=str(tmp_path))
    kinds = {note.kind: note for note in map(as_note, trace.warnings)}
    assert {NoteKind.MEMORY_SIZE_READ, NoteKind.SCALAR_STAND_IN, NoteKind.VALUES_READ_AS_ONES} <= set(kinds)
    shown = f"{CATALOG[DEFAULT_GPU].total_bytes / 2**30:.1f} GiB"
    assert kinds[NoteKind.MEMORY_SIZE_READ].args == (shown,)  # the pretended H100's, shown to the program
    assert kinds[NoteKind.VALUES_READ_AS_ONES].args == ("tolist",)
    assert kinds[NoteKind.SCALAR_STAND_IN].quiet


A10 = FakeGpu("NVIDIA A10", 24 << 30, (8, 6), 72, 6 << 20, 1536, 101376, 65536)


def test_a_request_reads_back_as_it_was_made():
    full = TraceRequest(("-m", "pkg.train", "--lr", "0.1", "--out", "theirs"), "/scratch/trace.json", A10,
                        iterations=2, device_count=4, deadline=1234.5, progress_fd=-1)
    assert TraceRequest.from_argv(full.argv()) == full
    bare = TraceRequest(("train.py",), "/scratch/trace.json", A10)
    assert TraceRequest.from_argv(bare.argv()) == bare
    gpu = ('{"name":"NVIDIA A10","total_bytes":25769803776,"capability":[8,6],"multi_processor_count":72,'
           '"l2_cache_bytes":6291456,"max_threads_per_multi_processor":1536,"shared_memory_per_block_optin":101376,'
           '"registers_per_block":65536,"warp_size":32}')
    assert bare.argv() == ["--out", "/scratch/trace.json", "--iterations", "3", "--gpu", gpu, "--device-count", "1",
                           "--", "train.py"]


def test_the_fake_gpu_is_the_catalog_type_whole():
    for gpu in CATALOG.values():
        shown = fake_gpu(gpu)
        assert (shown.name, shown.total_bytes, shown.capability) == (gpu.device_name, gpu.total_bytes, gpu.capability)
        assert shown.multi_processor_count > 0 and shown.l2_cache_bytes > 0 and shown.shared_memory_per_block_optin
    assert fake_gpu(CATALOG["RTX-3060-12GB"]).multi_processor_count == 28  # its own, not its capability's typical
    assert fake_gpu() == fake_gpu(CATALOG[DEFAULT_GPU])


SHOWN = """
    import torch
    props = torch.cuda.get_device_properties(0)
    shown = (torch.cuda.get_device_name(), props.total_memory, (props.major, props.minor), props.multi_processor_count,
             props.L2_cache_size, props.max_threads_per_multi_processor, props.warp_size,
             torch.cuda.get_device_capability())
    assert shown == {expected!r}, shown
    model = torch.nn.Linear(8, 8).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        model(torch.randn(4, 8, device="cuda")).sum().backward()
        optimizer.step()
"""


def test_the_program_is_shown_every_fact_of_the_gpu_the_request_carries(tmp_path):
    """Asked in the traced program itself: a fact it is shown otherwise fails the trace (the program's assert)."""
    t4 = CATALOG["T4"]
    expected = (t4.device_name, t4.total_bytes, (7, 5), 40, 4 << 20, 1024, 32, (7, 5))
    (tmp_path / "train.py").write_text(textwrap.dedent(SHOWN).format(expected=expected))
    trace = run_trace([sys.executable, str(tmp_path / "train.py")], iterations=2, cwd=str(tmp_path), gpu=t4)
    assert trace.iterations == 2 and trace.capability == (7, 5)


def test_a_request_without_a_program_is_refused():
    with pytest.raises(SystemExit):
        TraceRequest.from_argv(["--out", "/scratch/trace.json", "--"])


def test_a_warm_request_and_the_servers_replies_read_back_as_they_were_made():
    request = WarmRequest(("python", "-I", "sandbox.py", "--progress-fd", "-1", "--"), {"HOME": "/home/u"}, "/work",
                          0o027, {"RLIMIT_NOFILE": (1024, 4096)}, A10)
    assert WarmRequest.decode(request.encode()) == request
    assert WarmRequest.decode(request.encode()).gpu.capability == (8, 6)  # a tuple again, as the server compares it
    for reply in (WarmReply(started=41), WarmReply(declined="a user site-packages exists"), WarmReply(status=-9)):
        line = reply.line()
        assert line.endswith(b"\n") and line.count(b"\n") == 1 and WarmReply.from_line(line) == reply
    assert WarmReply(status=0).line() == b'{"status": 0}\n'  # exactly one field on the line


def test_an_option_of_the_request_is_replaced_before_the_programs_own():
    argv = ["--progress-fd", "-1", "--", "train.py", "--progress-fd", "7"]
    assert with_option(argv, "--progress-fd", "5") == ["--progress-fd", "5", "--", "train.py", "--progress-fd", "7"]
