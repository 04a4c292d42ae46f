"""The SDPA backend the fake GPU picks, per compute capability, dtype and call shape (flash / efficient / math),
and whether another GPU generation would pick differently (the trace's arch_sensitive)."""

import pytest
import torch

from xmem.trace.attention import choose_attention_backend


class Shape:
    """Just what the choice reads of a tensor: device type, rank, shape, dtype."""

    def __init__(self, *shape, dtype=torch.float16, device="cuda"):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device(device)

    def dim(self):
        return len(self.shape)


def choose(q, k=None, v=None, mask=None, gqa=False, capability=(9, 0), enabled=frozenset({"flash", "efficient"})):
    return choose_attention_backend(q, k or q, v or q, mask, gqa, capability, enabled)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_ampere_or_newer_takes_flash(dtype):
    assert choose(Shape(8, 12, 1024, 64, dtype=dtype)) == ("flash", True)
    assert choose(Shape(8, 12, 1024, 64, dtype=dtype), capability=(8, 0)) == ("flash", True)


def test_fp16_on_volta_and_turing_takes_memory_efficient():
    assert choose(Shape(2, 4, 16, 64), capability=(7, 0)) == ("efficient", True)
    assert choose(Shape(2, 4, 16, 64), capability=(7, 5)) == ("efficient", True)


def test_bf16_before_ampere_falls_back_to_math():
    assert choose(Shape(2, 4, 16, 64, dtype=torch.bfloat16), capability=(7, 0)) == ("math", True)


def test_fp32_takes_memory_efficient_on_every_generation():
    assert choose(Shape(2, 4, 16, 64, dtype=torch.float32)) == ("efficient", False)


def test_explicit_mask_rules_out_flash():
    q = Shape(2, 4, 16, 64)
    assert choose(q, mask=Shape(2, 1, 16, 16, dtype=torch.bool)) == ("efficient", False)


def test_head_dim_over_256_rules_out_flash():
    assert choose(Shape(2, 4, 16, 512)) == ("efficient", False)


def test_grouped_query_attention_and_odd_shapes_take_math():
    q, kv = Shape(2, 8, 16, 64), Shape(2, 2, 16, 64)
    assert choose(q, kv, kv, gqa=True) == ("math", False)
    assert choose(Shape(16, 64)) == ("math", False)  # not 4-D
    assert choose(Shape(2, 4, 16, 64, device="cpu")) == ("math", False)


def test_backends_disabled_by_the_program_are_skipped():
    q = Shape(2, 4, 16, 64)
    assert choose(q, enabled=frozenset({"efficient"})) == ("efficient", False)
    assert choose(q, enabled=frozenset()) == ("math", False)
