"""A fine-tune from a local checkpoint under accelerate's FSDP2, rank 0 of 2 under torchrun
(tests/scripts/accelerate_fsdp2_checkpoint.py): the checkpoint's tensors load as fake host tensors, and
`Accelerator.prepare` maps each optimizer parameter to its sharded one by `data_ptr()`
(accelerate.utils.modeling._get_parameter_id). Fake tensors all had the address 0, so every parameter became the
last one: the optimizer stepped one parameter and the audit expected 2 x 21 of it. Expected figures by hand from
the shapes: fully_shard splits each parameter's dim 0 over the 2 ranks (torch.chunk; every dim 0 here is even), the
fp32 master weights accelerate upcasts to, and AdamW's exp_avg and exp_avg_sq per parameter."""

import json
import struct

import pytest

from tests.torch_builds import SCRIPTS
from tests.trace.child.live_storages import live_before
from xmem.audit import audit
from xmem.trace import run_trace

pytestmark = pytest.mark.usefixtures("warm_tracer")

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 512, 1024, 2, 70000  # the embeddings past the host budget: born fake
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
          "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": 8,
          "num_key_value_heads": 8, "vocab_size": VOCAB, "max_position_embeddings": 128, "tie_word_embeddings": False,
          "dtype": "bfloat16", "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 0}
WORLD, FP32 = 2, 4


def parameter_shapes() -> dict[str, list[int]]:
    """LlamaForCausalLM's parameters for CONFIG, by name (as its state dict lists them)."""
    shapes = {"model.embed_tokens.weight": [VOCAB, HIDDEN]}
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        shapes.update({layer + f"self_attn.{p}_proj.weight": [HIDDEN, HIDDEN] for p in "qkvo"})
        shapes.update({layer + "mlp.gate_proj.weight": [INTERMEDIATE, HIDDEN],
                       layer + "mlp.up_proj.weight": [INTERMEDIATE, HIDDEN],
                       layer + "mlp.down_proj.weight": [HIDDEN, INTERMEDIATE],
                       layer + "input_layernorm.weight": [HIDDEN], layer + "post_attention_layernorm.weight": [HIDDEN]})
    shapes.update({"model.norm.weight": [HIDDEN], "lm_head.weight": [VOCAB, HIDDEN]})
    return shapes


def write_sparse_checkpoint(folder) -> None:
    """config.json and a bf16 model.safetensors whose data part is a hole (the trace reads only the header)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    header, offset = {}, 0
    for name, shape in parameter_shapes().items():
        size = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(folder / "model.safetensors", "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text)
        file.truncate(8 + len(text) + offset)


def rank_zero_shard_bytes() -> list[int]:
    """Each parameter's fp32 shard on rank 0: dim 0 halved."""
    sizes = []
    for shape in parameter_shapes().values():
        rest = shape[1] if len(shape) > 1 else 1
        sizes.append(shape[0] // WORLD * rest * FP32)
    return sizes


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp2") / "llama"
    write_sparse_checkpoint(folder)
    return run_trace(["torchrun", f"--nproc_per_node={WORLD}", str(SCRIPTS / "accelerate_fsdp2_checkpoint.py"),
                      str(folder)], iterations=2)


def held_after_first_step(trace, category: str) -> list[int]:
    live = live_before(trace, lambda e: e.iteration >= 1)
    return sorted(a.nbytes for a in live.values() if a.category == category)


def test_the_optimizer_keeps_state_for_every_sharded_parameter(trace):
    shards = rank_zero_shard_bytes()
    assert sum(shards) == 153_850_880  # 38,462,720 fp32 elements: half of the model's 76,925,440
    assert held_after_first_step(trace, "optimizer_state") == sorted(shards * 2)  # exp_avg, exp_avg_sq each


def test_the_master_weights_are_the_fp32_shards(trace):
    assert held_after_first_step(trace, "parameter") == sorted(rank_zero_shard_bytes())


def test_the_self_audit_finds_nothing_missing(trace):
    assert audit(trace) == ()


def test_a_fake_tensor_has_an_address_of_its_own_shared_by_its_views():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from xmem.trace.child.standins import fake_data_ptr

    with FakeTensorMode():
        a, b = torch.empty(10, 4), torch.empty(10, 4)
        empty = torch.empty(0)
    assert fake_data_ptr(a) != fake_data_ptr(b) and 0 not in (fake_data_ptr(a), fake_data_ptr(b))
    assert fake_data_ptr(a[2]) - fake_data_ptr(a) == 2 * 4 * 4  # a view: its offset from the storage's base
    assert fake_data_ptr(a.view(-1)) == fake_data_ptr(a)
    assert fake_data_ptr(empty) == 0  # no storage bytes, no address (a freed or empty one's is null on a GPU)
