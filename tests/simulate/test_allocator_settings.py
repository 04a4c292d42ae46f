"""Parsing the allocator settings as torch does (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF)."""

import json
import subprocess
import sys

import pytest

from xmem.simulate import AllocatorConfig
from xmem.simulate.allocator_settings import MiB


def test_defaults_are_upstreams():
    config = AllocatorConfig.parse("")
    assert config == AllocatorConfig()
    assert (config.expandable_segments, config.max_split_size, config.max_non_split_rounding) == (False, None, 20 * MiB)
    assert (config.roundup_power2_divisions, config.garbage_collection_threshold) == ((), 0.0)
    assert (config.memory_fraction, config.large_segment_size) == (None, 20 * MiB)


def test_parse_reads_every_modelled_key_in_mib_and_ignores_whitespace():
    config = AllocatorConfig.parse(
        " expandable_segments : True , max_split_size_mb:128,max_non_split_rounding_mb:64,"
        "garbage_collection_threshold:0.6,per_process_memory_fraction:0.5,large_segment_size_mb:32,backend:native,"
    )
    assert config == AllocatorConfig(expandable_segments=True, max_split_size=128 * MiB,
                                     max_non_split_rounding=64 * MiB, garbage_collection_threshold=0.6,
                                     memory_fraction=0.5, large_segment_size=32 * MiB)


def test_roundup_power2_divisions_single_value_applies_to_every_interval():
    assert AllocatorConfig.parse("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16


def test_roundup_power2_divisions_list_sets_intervals_by_their_start_in_mb():
    # 256 MB = 2**8 -> interval 8 and, being the first entry, every interval below it: 1 division;
    # 512 MB -> interval 9: 2; '>' -> every interval after the last one named (10..15): 8
    divisions = AllocatorConfig.parse("roundup_power2_divisions:[256:1,512:2,>:8]").roundup_power2_divisions
    assert divisions == (1,) * 9 + (2,) + (8,) * 6


def test_roundup_power2_divisions_greater_than_alone_leaves_the_first_interval():
    # last index starts at 0, so '>' fills intervals 1..15 only (as upstream)
    assert AllocatorConfig.parse("roundup_power2_divisions:[>:4]").roundup_power2_divisions == (0,) + (4,) * 15


def test_roundup_power2_divisions_of_zero_everywhere_is_off():
    assert AllocatorConfig.parse("roundup_power2_divisions:[1:0,>:0]").roundup_power2_divisions == ()


def test_pinned_and_locking_keys_are_accepted_and_change_nothing():
    text = "pinned_use_background_threads:True,release_lock_on_cudamalloc:True,pinned_num_register_threads:8"
    assert AllocatorConfig.parse(text) == AllocatorConfig()


@pytest.mark.parametrize("text, words", [
    ("foo:1", "unknown key 'foo'"),
    ("expandable_segments:true", "True or False"),
    ("expandable_segments", "ends early"),
    ("max_split_size_mb:19", "max_split_size_mb must be >= 20"),
    ("max_split_size_mb:-5", "non-negative whole number"),
    ("max_split_size_mb:20.5", "non-negative whole number"),
    ("max_non_split_rounding_mb:19", "max_non_split_rounding_mb must be >= 20"),
    ("large_segment_size_mb:10", "large_segment_size_mb must be >= 11"),
    ("large_segment_size_mb:32,max_split_size_mb:30", "max_split_size_mb must be >= 32"),
    ("max_non_split_rounding_mb:30,large_segment_size_mb:32", "max_non_split_rounding_mb must be >= 32"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:[256:1,512:3]", "power of 2 or 0"),
    ("roundup_power2_divisions:[300:1]", "interval starts must be powers of 2"),
    ("roundup_power2_divisions:[256:1,512:2,>:8", "']' closing"),
    ("garbage_collection_threshold:1.0", "(0.0, 1.0)"),
    ("garbage_collection_threshold:abc", "expects a number"),
    ("per_process_memory_fraction:1.5", "[0.0, 1.0]"),
    ("backend:foo", "unknown backend 'foo'"),
    ("backend:cudaMallocAsync", "not modelled"),
    ("expandable_segments:True,,max_split_size_mb:128", "expected a key, got ','"),
])
def test_bad_settings_raise_one_clear_line(text, words):
    with pytest.raises(ValueError) as raised:
        AllocatorConfig.parse(text)
    message = str(raised.value)
    assert words in message
    assert repr(text) in message and "\n" not in message


def test_from_environ_prefers_pytorch_cuda_alloc_conf_even_when_empty():
    both = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:100", "PYTORCH_ALLOC_CONF": "max_split_size_mb:200"}
    assert AllocatorConfig.from_environ(both).max_split_size == 100 * MiB
    assert AllocatorConfig.from_environ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}).expandable_segments
    empty_first = {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "max_split_size_mb:200"}
    assert AllocatorConfig.from_environ(empty_first) == AllocatorConfig()
    assert AllocatorConfig.from_environ({}) == AllocatorConfig()


def test_from_environ_names_the_variable_in_its_error():
    with pytest.raises(ValueError, match=r"^PYTORCH_ALLOC_CONF: .*unknown key 'bogus'"):
        AllocatorConfig.from_environ({"PYTORCH_ALLOC_CONF": "bogus:1"})


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match="16 buckets"):
        AllocatorConfig(roundup_power2_divisions=(4, 4))
    with pytest.raises(ValueError, match="max_split_size"):
        AllocatorConfig(max_split_size=1 * MiB)


# Strings on which our parser and torch's agree; our stricter number checks and cudaMallocAsync are left out.
PARITY = [
    "", "expandable_segments:True", " expandable_segments : True ", "expandable_segments:True,",
    "max_split_size_mb:20", "max_split_size_mb:128,max_non_split_rounding_mb:64", "roundup_power2_divisions:4",
    "roundup_power2_divisions:1", "roundup_power2_divisions:[256:1,512:2,>:8]", "roundup_power2_divisions:[>:0]",
    "roundup_power2_divisions:[1:4,2:8]", "garbage_collection_threshold:0.6,per_process_memory_fraction:0.5",
    "per_process_memory_fraction:0", "large_segment_size_mb:11", "backend:native",
    "pinned_use_background_threads:True", "release_lock_on_cudamalloc:True", "throw_on_cudamalloc_oom:True",
    "foo:1", "expandable_segments:true", "expandable_segments", "max_split_size_mb:19",
    "max_non_split_rounding_mb:19", "large_segment_size_mb:10", "roundup_power2_divisions:3",
    "roundup_power2_divisions:0", "roundup_power2_divisions:[256:1,512:3]", "roundup_power2_divisions:[300:1]",
    "roundup_power2_divisions:[256:1,512:2,>:8", "garbage_collection_threshold:1.0",
    "garbage_collection_threshold:abc", "per_process_memory_fraction:1.5", "backend:foo",
    "expandable_segments:True,,max_split_size_mb:128", "large_segment_size_mb:32,max_split_size_mb:30",
    "max_split_size_mb:30,large_segment_size_mb:32", "large_segment_size_mb:32,max_split_size_mb:32",
]

_TORCH_VERDICTS = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
if torch.version.cuda is None or not hasattr(torch._C, "_accelerator_setAllocatorSettings"):
    print(json.dumps(None)); sys.exit()
verdicts = []
for text in json.loads(sys.argv[1]):
    torch._C._accelerator_setAllocatorSettings("large_segment_size_mb:20")  # it outlives a parse: reset it
    try:
        torch._C._accelerator_setAllocatorSettings(text); verdicts.append(True)
    except Exception:
        verdicts.append(False)
print(json.dumps(verdicts))
"""


def accepts(text):
    try:
        AllocatorConfig.parse(text)
        return True
    except ValueError:
        return False


def test_accepts_and_rejects_what_torchs_own_parser_does():
    # torch's CUDA build parses allocator settings without a GPU; the CPU build skips unknown keys, so it is no
    # reference. A subprocess keeps the settings out of this test process.
    out = subprocess.run([sys.executable, "-c", _TORCH_VERDICTS, json.dumps(PARITY)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    verdicts = json.loads(out.strip().splitlines()[-1])
    if verdicts is None:
        pytest.skip("needs torch's CUDA build")
    assert {text: accepts(text) for text in PARITY} == dict(zip(PARITY, verdicts))
