"""DDP's gradient buckets, as the stand-in sizes them (upstream compute_bucket_assignment_by_size)."""

import torch

from xmem.trace.child.distributed import bucket_sizes

MiB = 1024 * 1024


def meta(elements, dtype=torch.float32):
    return torch.empty(elements, dtype=dtype, device="meta")


def test_small_model_fits_the_first_bucket():
    params = [meta(1000), meta(10)]
    assert bucket_sizes(params, 25 * MiB) == [(torch.float32, torch.device("meta"), 1010)]


def test_first_bucket_closes_at_one_mib_then_the_cap_applies():
    # reversed order: 512 Ki fp32 elements = 2 MiB closes the first bucket at once; then 5 x 1 MiB share one
    params = [meta(MiB // 4) for _ in range(5)] + [meta(MiB // 2)]
    buckets = [elements for _, _, elements in bucket_sizes(params, 25 * MiB)]
    assert buckets == [MiB // 2, 5 * MiB // 4]


def test_buckets_are_per_dtype():
    params = [meta(100, torch.float32), meta(100, torch.bfloat16), meta(50, torch.float32)]
    assert sorted((str(d), n) for d, _, n in bucket_sizes(params, 25 * MiB)) == [
        ("torch.bfloat16", 100), ("torch.float32", 150)]
