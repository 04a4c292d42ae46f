"""The trace runs as a compute node without network (issue 31 item 4): the Hugging Face libraries are told so
(HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE; transformers' hub kernels off: USE_HUB_KERNELS=NO)
unless the job sets them itself, and the sandbox gives the program only the loopback interface. A download attempt
then ends at once with the library's own offline error instead of waiting on a connection."""

import os
import time

from xmem.launchers import Target
from xmem.trace import TraceError, run_trace
from xmem.trace.runner import OFFLINE_NODE, _child_env

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "USE_HUB_KERNELS": "NO"}


def test_the_program_is_told_it_is_offline():
    assert OFFLINE_NODE == OFFLINE
    env = _child_env({"PATH": "/usr/bin"}, Target("train.py", None, ()), gpus=1)
    assert {name: env[name] for name in OFFLINE} == OFFLINE


def test_the_jobs_own_setting_stays():
    env = _child_env({"HF_HUB_OFFLINE": "0", "USE_HUB_KERNELS": "1"}, Target("train.py", None, ()), gpus=1)
    assert (env["HF_HUB_OFFLINE"], env["USE_HUB_KERNELS"]) == ("0", "1")


DOWNLOAD = ("import torch\nfrom huggingface_hub import hf_hub_download\n"
            "torch.zeros(1, device='cuda')\n"
            "hf_hub_download('xmem-tests/not-on-this-machine', 'config.json')\n")


def _download_fails(tmp_path, env=None) -> TraceError:
    script = tmp_path / "download.py"
    script.write_text(DOWNLOAD)
    try:
        run_trace(["python", str(script)], iterations=1, timeout=300, env=env)
    except TraceError as error:
        return error
    raise AssertionError("a download on an offline node cannot succeed")


def test_a_hub_download_ends_at_once_as_the_traces_lack_of_network(tmp_path):
    """The trace made the node offline: the download's failure is ours (exit 11), with huggingface_hub's own
    error and what to do, never the program's; and it ends at once."""
    started = time.monotonic()
    error = _download_fails(tmp_path)
    assert time.monotonic() - started < 120  # the trace's start-up only: no connection waited on
    assert error.kind == "not_modelled", error.message
    assert "the trace has no network" in error.message and "LocalEntryNotFoundError" in error.message
    assert "hf download" in error.message


def test_a_job_that_is_offline_itself_gets_its_own_error(tmp_path):
    """HF_HUB_OFFLINE=1 is the job's own (its nodes have no network): the same failure is the program's (exit 5),
    as it would be on the node."""
    error = _download_fails(tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert error.kind == "user_error" and error.message.startswith("LocalEntryNotFoundError"), error.message
