"""Training libraries' own handling of a model's tensors, traced from one program (tests/scripts/library_rebuilds.py)
that checks each answer itself: accelerate's empty-weights loading rebuilds every parameter as `type(param)(...)`,
a 4-rank world's object collectives, torch.save / torch.load of host data and of GPU tensors (issue 20)."""

import sys

import pytest

from tests.trace.child.test_scripts import allocs, trace

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces of what a program allocates: forked warm

LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A tiny Llama saved as transformers saves it (config.json, model.safetensors), and its parameter bytes."""
    pytest.importorskip("accelerate")
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    model.save_pretrained(folder)
    return folder, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def rebuilds(llama_checkpoint):
    folder, _ = llama_checkpoint
    return trace(sys.executable, "library_rebuilds.py", str(folder), iterations=2, cwd=str(folder))


def test_accelerate_empty_weights_load_onto_the_gpu_as_parameters(rebuilds, llama_checkpoint):
    head = (32 * 64 + 64 + 64 * 8 + 8) * 4
    assert rebuilds.iterations == 2  # the program checked every answer (it exits 7 on a wrong one)
    assert sum(e.nbytes for e in allocs(rebuilds, "parameter")) == llama_checkpoint[1] + head
    assert not (llama_checkpoint[0] / "tokens.pt").exists()  # saved into the sandbox, not the user's folder
