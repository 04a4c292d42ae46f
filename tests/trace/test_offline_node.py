"""The trace runs as a compute node without network (issue 31 item 4): the Hugging Face libraries are told so
(HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE; transformers' hub kernels off: USE_HUB_KERNELS=NO)
unless the job sets them itself, and the sandbox gives the program only the loopback interface. A download attempt
then ends at once with the library's own offline error instead of waiting on a connection."""

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


def test_a_hub_download_ends_at_once_with_the_librarys_own_error(tmp_path):
    script = tmp_path / "download.py"
    script.write_text("import torch\nfrom huggingface_hub import hf_hub_download\n"
                      "torch.zeros(1, device='cuda')\n"
                      "hf_hub_download('xmem-tests/not-on-this-machine', 'config.json')\n")
    started = time.monotonic()
    try:
        run_trace(["python", str(script)], iterations=1, timeout=300)
    except TraceError as error:
        message = error.message
    else:
        raise AssertionError("a download on an offline node cannot succeed")
    assert message.startswith("LocalEntryNotFoundError")  # huggingface_hub's own: neither cached nor fetched
    assert time.monotonic() - started < 120  # the trace's start-up only: no connection waited on
