"""The program's line behind an allocation (xmem.trace.child.recorder.UserSites, issue 32): the innermost frame
outside torch, xmem and the standard library, once per line, and the main thread's line for an allocation made on a
thread with no frame of the program (an autograd device thread)."""

from __future__ import annotations

import os
import threading

import torch

from xmem.trace.child import recorder
from xmem.trace.child.recorder import UserSites

TORCH_FILE = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "fake_module.py")
# Functions whose frames are torch's (their file is under torch/), as a module's forward or the autograd engine's are.
TORCH_SIDE: dict = {}
exec(compile("""
def call(function):
    return function()

def on_a_thread(function, found):
    import threading
    worker = threading.Thread(target=lambda: found.append(function()))
    worker.start()
    worker.join()
""", TORCH_FILE, "exec"), TORCH_SIDE)


def test_the_site_is_the_innermost_frame_of_the_program_once_per_line():
    sites = UserSites()
    first = TORCH_SIDE["call"](sites.current)  # this line is the program's
    again = [TORCH_SIDE["call"](sites.current) for _ in range(3)]  # one line, however often
    assert first == 0 and again == [1, 1, 1]
    (file0, line0, name0), (_, line1, _) = sites.table()
    assert file0 == __file__ and name0 == "test_the_site_is_the_innermost_frame_of_the_program_once_per_line"
    assert line1 == line0 + 1


def test_an_allocation_on_a_thread_without_the_programs_frames_takes_the_main_threads_line():
    sites, found = UserSites(), []
    TORCH_SIDE["on_a_thread"](sites.current, found)  # the main thread waits here, as it waits inside backward()
    ((filename, _, name),) = sites.table()
    assert found == [0] and filename == __file__ and name.startswith("test_an_allocation_on_a_thread")


def test_torch_xmem_the_standard_library_and_generated_code_are_skipped_site_packages_are_not():
    assert recorder._skipped_file(torch.nn.functional.__file__)
    assert recorder._skipped_file(recorder.__file__) and recorder._skipped_file(threading.__file__)
    assert recorder._skipped_file("<eval_with_key>.3") and not recorder._skipped_file(__file__)
    assert not recorder._skipped_file(os.path.join(os.path.dirname(os.__file__), "site-packages", "transformers",
                                                   "models", "gpt2", "modeling_gpt2.py"))
