"""Model-zoo oracle (issue 10 item 3): the tracer against a real CPU run of the same training step, per category.

    .venv/bin/python scripts/zoo_check.py [--family tv timm hf] [--models SPEC ...] [--max-params N]
                                          [--per-trace N] [--budget-s S] [--out DIR]

A model is a spec `family:name@size` (`tv:resnet18@64`: torchvision at 64x64 images; `hf:gpt2@16`: a small config of
that transformers architecture at 16 tokens). For each model, one training step (batch BATCH, AdamW, no zero_grad)
runs twice from the same code (`train_step`):

- for real on the CPU in this process, which gives the oracle: the unique storages of the parameters, buffers and
  gradients, the AdamW state a GPU would hold, and the storages autograd saves for backward
  (`torch.autograd.graph.saved_tensors_hooks`) that are neither parameters, buffers nor the batch and that the graph
  still holds when backward starts (a branch the loss leaves out dies with the forward), plus the loss;
  each storage is named by the ATen op that made it (a dispatch mode sees the same ops the tracer's recorder sees);
- on fake CUDA under `xmem.trace.run_trace`, several models per traced process (`--step SPEC...`, one optimizer
  step per model, so a model's events are those of its iteration): the live bytes per category after its step, and
  the forward-born storages live when its backward starts, per producing op.

Parameters, buffers, gradients and optimizer state must match exactly. Activations may differ only where the CUDA
kernels save other tensors than the CPU ones (KERNEL_FAMILIES: each family's ops are compared as one sum, and a
family with a documented reason may differ). The table goes to OUT/zoo.txt, one JSON line per model to
OUT/zoo.jsonl. A model too large for the host (`--max-params`) or one that fails on the CPU is listed, not checked.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "benchmarks" / "results" / "zoo"
BATCH = 2  # 1 would break batch norm over a 1x1 feature map (one value per channel) in several CNNs
CLASSES = 10
VOCAB = 1000
SEED = 0
MAX_PARAMS = 210_000_000  # the CPU oracle holds parameters, gradients and 2 AdamW moments: 16 bytes per parameter
MARKER_MODULE = "ZooModelFailed"  # a traced model that raised leaves one forward of this module in its iteration
# AdamW (not fused, not capturable, as torch defaults on CUDA) keeps `step` as a host scalar: not GPU state.
HOST_STATE_KEYS = ("step",)

# Ops whose CUDA kernels save other tensors than their CPU counterparts; a family's ops are summed before comparing.
KERNEL_FAMILIES: dict[str, tuple[frozenset[str], str]] = {
    "batch_norm": (frozenset({"native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
                              "_batch_norm_with_update", "cudnn_batch_norm", "miopen_batch_norm"}),
                   "cuDNN batch norm (cudnn_batch_norm) keeps save_mean, save_var and a reserve space where the CPU's "
                   "native_batch_norm keeps save_mean and save_invstd"),
    "attention": (frozenset({"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                             "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
                             "_efficient_attention_forward"}),
                  "fused attention: the CPU flash kernel saves out and a [B,H,T] fp32 logsumexp; on sm90 the GPU runs "
                  "cuDNN or memory-efficient attention (logsumexp padded to 32 queries, philox seed/offset, a bool "
                  "mask converted to a float bias) or flash (rng state); the CPU kernel's output is (B,H,T,D)-major, "
                  "so a model's out.transpose(1, 2).contiguous() copies it, a no-op on the CUDA kernels' layout"),
    "convolution": (frozenset({"convolution", "_convolution", "mkldnn_convolution", "cudnn_convolution",
                               "_slow_conv2d_forward", "thnn_conv2d", "slow_conv_dilated2d",
                               "_nnpack_spatial_convolution", "cudnn_convolution_transpose",
                               "slow_conv_transpose2d"}),
                    ""),  # the same output either way: only the op's name differs
    # a constant made from Python data: lifted on the CPU, copied to the GPU from the host in a trace
    "host_data": (frozenset({"lift_fresh", "lift_fresh_copy", "_to_copy", "copy_"}), ""),
}


@dataclass
class Figures:
    """Bytes per category of one model's training step, and its activations per producing op."""

    parameter: int = 0
    buffer: int = 0
    gradient: int = 0
    optimizer_state: int = 0
    activation: int = 0
    activation_by_op: dict[str, int] = field(default_factory=dict)


EXACT = ("parameter", "buffer", "gradient", "optimizer_state")


# ---- the models ---------------------------------------------------------------------------------------------------
def parse_spec(spec: str) -> tuple[str, str, int]:
    family, rest = spec.split(":", 1)
    name, _, size = rest.partition("@")
    return family, name, int(size or (16 if family == "hf" else 64))


def build(spec: str) -> tuple[Any, Callable[[], dict], Callable[[Any, dict], Any]]:
    """The model (on the CPU, seeded), a maker of its batch (CPU tensors) and its loss."""
    import torch
    torch.manual_seed(SEED)
    family, name, size = parse_spec(spec)
    if family == "hf":
        return _hf_model(name), lambda: _token_batch(size), lambda model, batch: model(**batch).loss
    model = _tv_model(name, size) if family == "tv" else _timm_model(name, size)
    return model, lambda: _image_batch(size), _image_loss


def _tv_model(name: str, size: int) -> Any:
    import torchvision
    kwargs: dict[str, Any] = {"weights": None, "num_classes": CLASSES}
    if name.startswith("vit_"):
        kwargs["image_size"] = size  # torchvision's ViT has position embeddings for one image size
    if name == "maxvit_t":
        kwargs["input_size"] = (size, size)
    return torchvision.models.get_model(name, **kwargs)


def _timm_model(name: str, size: int) -> Any:
    import timm
    try:  # transformers of fixed image size take it as img_size; CNNs do not know the argument
        return timm.create_model(name, pretrained=False, num_classes=CLASSES, img_size=size)
    except TypeError:
        return timm.create_model(name, pretrained=False, num_classes=CLASSES)


def _image_batch(size: int) -> dict:
    import torch
    generator = torch.Generator().manual_seed(SEED)
    return {"x": torch.randn(BATCH, 3, size, size, generator=generator),
            "y": torch.randint(0, CLASSES, (BATCH,), generator=generator)}


def _image_loss(model: Any, batch: dict) -> Any:
    import torch.nn.functional as F
    out = model(batch["x"])
    logits = getattr(out, "logits", out)
    if isinstance(logits, (tuple, list)):  # Inception/GoogLeNet in training: (logits, aux logits...)
        logits = logits[0]
    return F.cross_entropy(logits, batch["y"])


# Small configs: the size fields under their common names (configs map them to their own through attribute_map).
HF_SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 64, "head_dim": 16,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # special tokens inside the small vocabulary
HF_NOT_SETTABLE = {"falcon": ("head_dim", "num_key_value_heads")}  # derived properties of these configs
# No dropout on the attention probabilities: the CPU has no fused attention kernel with dropout, so its math path
# would save B*H*T*T probabilities and masks that the GPU's fused kernels (which take dropout) never hold. Dropout
# elsewhere stays (see cuda_dropout).
HF_NO_ATTENTION_DROPOUT = {"attention_probs_dropout_prob": 0.0, "attn_pdrop": 0.0, "attention_dropout": 0.0}
HF_EXTRA = {  # architectures whose config names a size field differently or needs one more
    # T5 has one dropout_rate, also for its attention probabilities (see HF_NO_ATTENTION_DROPOUT): none at all
    "t5": {"dropout_rate": 0.0, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4,
           "num_decoder_layers": 2, "decoder_start_token_id": 0},
    "bart": {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
             "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128},
    "albert": {"embedding_size": 32},
    "mobilebert": {"embedding_size": 32, "intra_bottleneck_size": 32, "true_hidden_size": 32},
    "funnel": {"block_sizes": [1, 1], "d_model": 64, "n_head": 4, "d_head": 16, "d_inner": 128},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2, "window_size": 8},
    "phi": {"partial_rotary_factor": 0.5},
    "gptj": {"rotary_dim": 8},
    "codegen": {"rotary_dim": 8},
}
HF_HEADS = {"masked": ("bert", "roberta", "distilbert", "albert", "electra", "deberta-v2", "xlm-roberta",
                       "mobilebert", "funnel", "camembert", "mpnet", "megatron-bert"),
            "seq2seq": ("t5", "bart")}


def _hf_model(model_type: str) -> Any:
    import transformers
    sizes = {key: value for key, value in HF_SIZES.items() if key not in HF_NOT_SETTABLE.get(model_type, ())}
    config = transformers.AutoConfig.for_model(model_type, **sizes, **HF_NO_ATTENTION_DROPOUT,
                                               **HF_EXTRA.get(model_type, {}))
    config.use_cache = False
    if model_type in HF_HEADS["masked"]:
        return transformers.AutoModelForMaskedLM.from_config(config)
    if model_type in HF_HEADS["seq2seq"]:
        return transformers.AutoModelForSeq2SeqLM.from_config(config)
    return transformers.AutoModelForCausalLM.from_config(config)


def _token_batch(size: int) -> dict:
    import torch
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(3, VOCAB, (BATCH, size), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def train_step(spec: str, device: str, around_forward: Callable[[Any, dict], Any] | None = None) -> tuple:
    """One training step on `device` as a training script writes it; `around_forward(model, batch)` is a context
    manager around the forward and the loss."""
    import contextlib
    import torch
    model, make_batch, loss_of = build(spec)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = {key: value.to(device) for key, value in make_batch().items()}
    with around_forward(model, batch) if around_forward else contextlib.nullcontext(), attention_in_scope():
        loss = loss_of(model, batch)
    loss.backward()
    optimizer.step()
    return model, optimizer, batch, loss


ATTENTION_SCOPE = "ZooAttentionScope"  # a module around each SDPA call: its name marks what the call made
_scope: list = []


def attention_scope() -> Any:
    """The scope module (one per process). The tracer names the storages an op makes by the innermost module running,
    so whatever F.scaled_dot_product_attention makes (its fused op's outputs, a converted mask) carries this name in
    the trace; the CPU oracle sees the same module's hooks. It holds nothing and changes no memory."""
    import torch
    if not _scope:
        _scope.append(type(ATTENTION_SCOPE, (torch.nn.Module,), {"forward": lambda self, fn, *a, **k: fn(*a, **k)})())
    return _scope[0]


@contextlib.contextmanager
def attention_in_scope():
    """Every F.scaled_dot_product_attention call (by attribute, as models and nn.MultiheadAttention make it) runs
    inside the scope module; the function in place (the tracer's backend choice on fake CUDA) is the one called.

    nn.MultiheadAttention runs inside it as a whole: it reshapes the SDPA output from (B, H, T, D) to (T*B, H*D),
    which copies on CUDA (the fused kernels return a (B, T, H, D)-major output) and not on the CPU (whose flash
    kernel returns the query's own (T, B, H, D) layout), so that copy is the attention family's too."""
    import torch
    import torch.nn.functional as F
    inner, inner_mha = F.scaled_dot_product_attention, torch.nn.MultiheadAttention.forward
    F.scaled_dot_product_attention = lambda *args, **kwargs: attention_scope()(inner, *args, **kwargs)
    torch.nn.MultiheadAttention.forward = lambda self, *args, **kwargs: attention_scope()(inner_mha, self, *args,
                                                                                          **kwargs)
    try:
        yield
    finally:
        F.scaled_dot_product_attention, torch.nn.MultiheadAttention.forward = inner, inner_mha


@contextlib.contextmanager
def cuda_dropout():
    """ATen's dropout (Dropout.cpp) runs the fused native_dropout (a bool mask) when the input is on CUDA, p is in
    (0, 1) and the call is not in place; on the CPU it saves a float noise tensor instead. The oracle takes
    CUDA's kernel, which the CPU also has, so that its saved bytes are the GPU's."""
    import torch
    import torch.nn.functional as F
    inner = F.dropout

    def dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if training and not inplace and 0 < p < 1 and input.numel() > 0:
            return torch.native_dropout(input, p, True)[0]
        return inner(input, p, training, inplace)

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = inner


# ---- the traced program -----------------------------------------------------------------------------------------
def traced_steps(specs: list[str]) -> None:
    """Run under the tracer: one step per model on cuda. A model that raises leaves a marker forward and one SGD
    step, so that the next model's events stay in the next iteration."""
    import torch
    for spec in specs:
        try:
            train_step(spec, "cuda")
        except Exception as error:  # noqa: BLE001 - the parent reruns this model alone to see the error
            print(f"zoo: {spec} failed: {type(error).__name__}: {error}", file=sys.stderr)
            marker = type(MARKER_MODULE, (torch.nn.Module,), {"forward": lambda self, x: x + 1})()
            marker(torch.zeros(1, device="cuda"))
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(1, device="cuda"))]).step()
        gc.collect()


# ---- the CPU oracle ---------------------------------------------------------------------------------------------
def cpu_figures(spec: str, max_params: int = 0) -> tuple[Figures, int]:
    """The real CPU run's figures (see the module docstring) and the parameter count; TooLarge past `max_params`."""
    import torch
    oracle = CpuOracle(max_params)
    model, optimizer, batch, loss = train_step(spec, "cpu", oracle.instrumented)
    leaves = _storages(model.parameters()) | _storages(model.buffers()) | _storages(batch.values())
    loss_key = loss.untyped_storage()._cdata
    oracle.saved[loss_key] = loss.untyped_storage().nbytes()
    by_op: dict[str, int] = defaultdict(int)
    for key, nbytes in oracle.saved.items():
        if key not in leaves and key in oracle.on_gpu and (key in oracle.held_at_backward or key == loss_key):
            by_op[oracle.producers[key][0] if key in oracle.producers else "(made outside an op)"] += nbytes
    state = [value for per_param in optimizer.state.values() for key, value in per_param.items()
             if isinstance(value, torch.Tensor) and key not in HOST_STATE_KEYS]
    return Figures(parameter=sum(_storages(model.parameters()).values()),
                   buffer=sum(_storages(model.buffers()).values()),
                   gradient=sum(_storages(p.grad for p in model.parameters() if p.grad is not None).values()),
                   optimizer_state=sum(_storages(state).values()), activation=sum(by_op.values()),
                   activation_by_op=dict(by_op)), oracle.params


class CpuOracle:
    """What the forward of a CPU run saves for backward, which op made each storage, and which storages a GPU run
    would hold (the rest stay on the host there: a `torch.tensor(...)` constant, a scale made on the CPU).

    A storage is on the GPU if the model's parameters, buffers or the batch lead to it (an op with such an input),
    or a factory call named a device (`torch.arange(n, device=x.device)`); a factory without one makes host tensors.
    """

    def __init__(self, max_params: int = 0) -> None:
        self.max_params = max_params  # 0: any size
        self.params = 0
        # storage key -> (op that first wrote it, the storage: kept so that its key is not reused; not the tensor,
        # whose autograd graph would keep what a dropped branch saved)
        self.producers: dict[int, tuple[str, Any]] = {}
        self.saved: dict[int, int] = {}  # storage key -> bytes
        self.packed: dict[int, list] = defaultdict(list)  # storage key -> weak references to what the graph holds
        self.held_at_backward: set[int] = set()  # keys the graph still holds when the forward's scope ends
        self.on_gpu: set[int] = set()
        self.scopes: list[str] = []

    def instrumented(self, model: Any, batch: dict) -> contextlib.ExitStack:
        import torch
        self.params = sum(p.numel() for p in model.parameters())
        if self.max_params and self.params > self.max_params:
            raise TooLarge(self.params)  # before the step's gradients and AdamW moments take 3 more copies
        self.on_gpu |= set(_storages(model.parameters()) | _storages(model.buffers()) | _storages(batch.values()))
        stack = contextlib.ExitStack()
        stack.callback(self._note_held)  # runs last, after the loss: what backward will find
        scope = attention_scope()
        stack.callback(scope.register_forward_pre_hook(lambda module, args: self.scopes.append(SCOPED_PREFIX)).remove)
        stack.callback(scope.register_forward_hook(lambda module, args, out: self._leave_scope(),
                                                   always_call=True).remove)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor))
        stack.enter_context(cuda_dropout())
        stack.enter_context(self._placement_mode())
        stack.enter_context(self._producer_mode())
        return stack

    def _leave_scope(self) -> None:  # a forward hook: returning None keeps the module's output
        self.scopes.pop()

    def _pack(self, tensor: Any) -> Any:
        """The graph keeps a fresh alias (the model may keep the tensor itself), so the alias's weak reference dies
        with the graph node that saved it."""
        storage = tensor.untyped_storage()
        self.saved[storage._cdata] = storage.nbytes()
        alias = tensor.detach()
        self.packed[storage._cdata].append(weakref.ref(alias))
        return alias

    def _note_held(self) -> None:
        self.held_at_backward = {key for key, refs in self.packed.items() if any(ref() is not None for ref in refs)}

    def _producer_mode(self) -> Any:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        oracle = self

        class ProducerOps(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = oracle._name(func._opname, args)
                from_gpu = oracle._any_on_gpu((args, kwargs))
                for item in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(item, torch.Tensor) and item.layout == torch.strided:
                        key = item.untyped_storage()._cdata
                        oracle.producers.setdefault(key, (name, item.untyped_storage()))
                        if from_gpu:
                            oracle.on_gpu.add(key)
                return out
        return ProducerOps()

    def _name(self, op: str, args: tuple) -> str:
        """The op's name, in the attention scope's family if it runs inside F.scaled_dot_product_attention, or if it
        copies that call's output into another layout: the CPU kernel returns (B, H, T, D) where CUDA's return a
        (B, T, H, D) layout, so a model's `out.transpose(1, 2).contiguous()` copies here and not on the GPU."""
        if op == "clone" and args and hasattr(args[0], "untyped_storage"):
            source = self.producers.get(args[0].untyped_storage()._cdata)
            if source and source[0].startswith(SCOPED_PREFIX):
                return SCOPED_PREFIX + "clone of the output"
        return scoped(op, self.scopes)

    def _any_on_gpu(self, values: Any) -> bool:
        import torch
        from torch.utils._pytree import tree_leaves
        return any(isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided
                   and leaf.untyped_storage()._cdata in self.on_gpu for leaf in tree_leaves(values))

    def _placement_mode(self) -> Any:
        """Factory calls that name a device and host tensors moved to one (ATen sees a device in every factory call,
        so this is read a level up)."""
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._pytree import tree_leaves
        on_gpu = self.on_gpu

        class Placement(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if kwargs.get("device") is not None or _moves_to_a_device(func, args):
                    for leaf in tree_leaves(out):
                        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
                            on_gpu.add(leaf.untyped_storage()._cdata)
                return out
        return Placement()


def _moves_to_a_device(func: Any, args: tuple) -> bool:
    """`t.cuda()`, `t.to(x.device)`, `t.to("cuda")`, `t.to(other)`: a host tensor moved where the model is (not
    `t.to(dtype=...)`, which stays where it is)."""
    import torch
    name = getattr(func, "__name__", "")
    return name == "cuda" or name == "to" and any(isinstance(arg, (torch.device, str, int, torch.Tensor))
                                                  and not isinstance(arg, bool) for arg in args[1:])


def _storages(tensors: Any) -> dict[int, int]:
    """Unique storages (key -> bytes) of some tensors."""
    found = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        found[storage._cdata] = storage.nbytes()
    return found


class TooLarge(Exception):
    """The model has more parameters than the oracle may hold in host memory."""

    def __init__(self, params: int) -> None:
        super().__init__(f"{params} parameters")
        self.params = params


# ---- the trace side -------------------------------------------------------------------------------------------
def trace_figures(events: list, count: int) -> list[Figures | None]:
    """Per model (iteration), its figures from the trace; None for a model that raised (its marker is there).

    Setup before the first forward (iteration -1) belongs to the first model. A model's storages are those allocated
    in its iteration; the categories are read after its step (the last event of its iteration), the activations
    when its backward starts (its first backward event)."""
    windows: list[dict] = [{"blocks": {}, "live": set(), "backward_live": None, "failed": False, "end_live": None}
                           for _ in range(count)]
    live_blocks: dict[int, tuple[int, Any]] = {}  # block -> (window, alloc event)
    current = 0
    for event in events:
        window = min(max(event.iteration, 0), count - 1)
        while current < window:  # the previous model's step ended: read its categories
            windows[current]["end_live"] = [e for w, e in live_blocks.values() if w == current]
            current += 1
        if event.phase == "backward" and windows[window]["backward_live"] is None:
            windows[window]["backward_live"] = [e for w, e in live_blocks.values() if w == window]
        if event.module == MARKER_MODULE:
            windows[window]["failed"] = True
        if event.action == "alloc":
            live_blocks[event.block] = (window, event)
        elif event.action == "free":
            live_blocks.pop(event.block, None)
    windows[current]["end_live"] = [e for w, e in live_blocks.values() if w == current]
    return [None if w["failed"] or w["backward_live"] is None else _figures_of(w) for w in windows]


def _figures_of(window: dict) -> Figures:
    figures = Figures()
    for event in window["end_live"] or []:
        if event.category in EXACT:
            setattr(figures, event.category, getattr(figures, event.category) + event.nbytes)
    by_op: dict[str, int] = defaultdict(int)
    for event in window["backward_live"]:
        if event.category == "activation":
            by_op[scoped(event.op, [SCOPED_PREFIX] if event.module == ATTENTION_SCOPE else [])] += event.nbytes
    figures.activation, figures.activation_by_op = sum(by_op.values()), dict(by_op)
    return figures


def trace_specs(specs: list[str], timeout: float) -> dict[str, Figures | str]:
    """Trace the models in one process; a model that failed there (or a process that failed) is traced alone, so
    that its own error is what the table shows."""
    sys.path.insert(0, str(ROOT))
    from xmem.trace import TraceError, run_trace
    command = ["python", str(Path(__file__).resolve()), "--step", *specs]
    try:
        trace = run_trace(command, iterations=len(specs), cwd=str(ROOT), timeout=timeout)
    except TraceError as error:
        if len(specs) == 1:
            return {specs[0]: f"trace {error.kind}: {error}"}
        return {spec: result for spec in specs for result in trace_specs([spec], timeout).values()}
    results: dict[str, Figures | str] = {}
    for spec, figures in zip(specs, trace_figures(trace.events, len(specs))):
        if figures is None and len(specs) > 1:
            figures = trace_specs([spec], timeout)[spec]
        results[spec] = figures if figures is not None else "the traced step raised (see the program's output)"
    return results


# ---- the comparison ---------------------------------------------------------------------------------------------
SCOPED_PREFIX = "attention:"  # an op run inside F.scaled_dot_product_attention, named so on both sides


def scoped(op: str, scopes: list[str]) -> str:
    return scopes[-1] + op if scopes else op


def family_of(op: str) -> str:
    if op.startswith(SCOPED_PREFIX):
        return "attention"
    for family, (ops, _) in KERNEL_FAMILIES.items():
        if op in ops:
            return family
    return op


def compare(cpu: Figures, traced: Figures) -> dict:
    """Exact categories, and activations per kernel family: 'exact', 'explained' (only families with a documented
    reason differ) or 'deviates' (naming the ops)."""
    wrong = [name for name in EXACT if getattr(cpu, name) != getattr(traced, name)]
    by_family: dict[str, int] = defaultdict(int)
    for op, nbytes in traced.activation_by_op.items():
        by_family[family_of(op)] += nbytes
    for op, nbytes in cpu.activation_by_op.items():
        by_family[family_of(op)] -= nbytes
    differing = {family: delta for family, delta in by_family.items() if delta}
    unexplained = {f: d for f, d in differing.items() if not (f in KERNEL_FAMILIES and KERNEL_FAMILIES[f][1])}
    activation = "exact" if not differing else "deviates" if unexplained else "explained"
    reasons = [KERNEL_FAMILIES[f][1] for f in differing if f not in unexplained]
    return {"exact_mismatches": wrong, "activation": activation, "activation_delta_by_family": differing,
            "reasons": reasons, "match": not wrong and activation != "deviates"}


# ---- the zoo ----------------------------------------------------------------------------------------------------
def torchvision_specs() -> list[str]:
    import torchvision
    # Inception v3's auxiliary head (built in training) pools 5x5 windows of its 17x17 map at 299 px, the least
    # input its 5x5 conv fits; ViT-H has 14 px patches; MaxViT's window partitions need 224
    sizes = {"inception_v3": 299, "vit_h_14": 56, "maxvit_t": 224}
    return [f"tv:{name}@{sizes.get(name, 64)}" for name in torchvision.models.list_models(module=torchvision.models)]


SMALL_TOKENS = ("atto", "femto", "pico", "nano", "micro", "tiny", "xxs", "xs", "small", "mobile", "lite", "b0",
                "18", "s")


# The least inputs these accept (64 px is too small): Inception's stem and reduction blocks leave no 3x3 window
# below 75 px; CrossViT's two patch grids (12 and 16 px) must line up with its position embeddings at 240
TIMM_SIZES = {"inception_v3": 75, "inception_v4": 75, "crossvit_tiny_240": 240}


def timm_specs(count: int = 64) -> list[str]:
    """One model per timm module (architecture family), in module order: the first name carrying the smallest size
    token, else the first name."""
    import timm
    picked = []
    for module in sorted(timm.list_modules()):
        names = sorted(timm.list_models(module=module))
        if not names:
            continue
        by_token = [n for token in SMALL_TOKENS for n in names if token in n.replace("_", " ").split()
                    or f"_{token}" in n]
        name = (by_token or names)[0]
        picked.append(f"timm:{name}@{TIMM_SIZES.get(name, 64)}")
    if len(picked) <= count:
        return picked
    return [picked[index * len(picked) // count] for index in range(count)]  # evenly spread over the modules


HF_TYPES = ("gpt2", "gpt_neo", "gptj", "opt", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi",
            "phi3", "falcon", "bloom", "gpt_neox", "codegen", "stablelm", "olmo", "granite", "starcoder2",
            "bert", "roberta", "distilbert", "albert", "electra", "deberta-v2", "mobilebert", "t5", "bart")


def hf_specs() -> list[str]:
    return [f"hf:{name}@16" for name in HF_TYPES]


def zoo_specs(families: list[str]) -> list[str]:
    makers = {"tv": torchvision_specs, "timm": timm_specs, "hf": hf_specs}
    return [spec for family in families for spec in makers[family]()]


@dataclass
class Row:
    spec: str
    params: int = 0
    status: str = ""  # "checked", or why not
    cpu: Figures | None = None
    trace: Figures | None = None
    verdict: dict = field(default_factory=dict)
    seconds: float = 0.0


def check(specs: list[str], max_params: int, per_trace: int, budget_s: float, timeout: float,
          report: Callable[[Row, list[Row]], None]) -> tuple[list[Row], list[str]]:
    """CPU oracle for each model, then traces in groups of `per_trace` models of one family; models whose group
    would start after `budget_s` are returned as not run. `report(row, rows so far)` as each row is done."""
    started = time.monotonic()
    rows: list[Row] = []
    pending: list[Row] = []
    left: list[str] = []
    for index, spec in enumerate(specs):
        if time.monotonic() - started > budget_s:
            left = specs[index:]
            break
        row = _cpu_row(spec, max_params)
        rows.append(row)
        if row.cpu is None:
            report(row, rows)
        else:
            pending.append(row)
        last = index == len(specs) - 1
        if pending and (len(pending) >= per_trace or last or parse_spec(specs[index + 1])[0] != parse_spec(spec)[0]):
            _trace_rows(pending, timeout)
            for done in pending:
                report(done, rows)
            pending = []
    return rows, left


def _cpu_row(spec: str, max_params: int) -> Row:
    row = Row(spec)
    began = time.monotonic()
    try:
        row.cpu, row.params = cpu_figures(spec, max_params)
    except TooLarge as error:
        row.params = error.params
        row.status = f"not checked: {row.params / 1e6:.0f}M parameters > --max-params {max_params / 1e6:.0f}M"
    except Exception as error:  # noqa: BLE001 - a model that does not run on the CPU is listed with why
        row.status = f"not checked: CPU run failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    finally:
        row.seconds = time.monotonic() - began
        gc.collect()
    return row


def _trace_rows(rows: list[Row], timeout: float) -> None:
    began = time.monotonic()
    results = trace_specs([row.spec for row in rows], timeout)
    for row in rows:
        row.seconds += (time.monotonic() - began) / len(rows)
        result = results[row.spec]
        if isinstance(result, str):
            row.status = result
            continue
        row.trace, row.status = result, "checked"
        row.verdict = compare(row.cpu, result)


# ---- output -----------------------------------------------------------------------------------------------------
def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3f}"


def table_line(row: Row) -> str:
    if row.status != "checked":
        return f"{row.spec:<40} {row.params / 1e6:>7.1f}  {row.status}"
    cpu, trace, verdict = row.cpu, row.trace, row.verdict
    exact = "exact" if not verdict["exact_mismatches"] else "DIFF " + ",".join(verdict["exact_mismatches"])
    delta = trace.activation - cpu.activation
    pct = 100 * delta / cpu.activation if cpu.activation else 0.0
    return (f"{row.spec:<40} {row.params / 1e6:>7.1f} {mib(cpu.parameter):>9} {mib(cpu.optimizer_state):>9} "
            f"{exact:<10} {mib(cpu.activation):>9} {mib(trace.activation):>9} {pct:>+7.2f}% "
            f"{verdict['activation']:<9} {'yes' if verdict['match'] else 'NO'}")


HEADER = (f"{'model':<40} {'Mparam':>7} {'param MiB':>9} {'adam MiB':>9} {'p/b/g/s':<10} {'saved MiB':>9} "
          f"{'trace MiB':>9} {'act dev':>8} {'activation':<9} match")


def summary(rows: list[Row], left: list[str], total: int) -> list[str]:
    checked = [row for row in rows if row.status == "checked"]
    matched = [row for row in checked if row.verdict["match"]]
    lines = [f"models in the zoo: {total}; checked: {len(checked)}; match: {len(matched)}; "
             f"not checked: {len(rows) - len(checked)}; not run (time budget): {len(left)}"]
    if checked:
        worst = max(checked, key=lambda r: abs(r.trace.activation - r.cpu.activation) / max(1, r.cpu.activation))
        delta = worst.trace.activation - worst.cpu.activation
        lines.append(f"largest activation deviation: {worst.spec}: {delta:+d} bytes "
                     f"({100 * delta / max(1, worst.cpu.activation):+.2f} %), by kernel family (trace - CPU): "
                     f"{worst.verdict['activation_delta_by_family']}")
    deviating = [row for row in checked if row.verdict["activation"] == "deviates" or row.verdict["exact_mismatches"]]
    lines += [f"deviates: {row.spec}: {row.verdict['exact_mismatches'] or ''} "
              f"{row.verdict['activation_delta_by_family']}" for row in deviating]
    families = {f: reason for f, (_, reason) in KERNEL_FAMILIES.items() if reason}
    lines += [f"reason {family}: {reason}" for family, reason in families.items()]
    too_large = [row.spec for row in rows if "> --max-params" in row.status]
    if too_large:
        lines.append("larger than --max-params (run with --max-params 0 on a host with 16 bytes per parameter free): "
                     "--update --models " + " ".join(too_large))
    if left:
        lines.append(f"PARTIAL ({len(left)} not run): the rest runs with: .venv/bin/python scripts/zoo_check.py "
                     "--update --models " + " ".join(left))
    return lines


def write_results(rows: list[Row], left: list[str], total: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [HEADER, *map(table_line, rows), "", *summary(rows, left, total)]
    (out / "zoo.txt").write_text("\n".join(lines) + "\n")
    with open(out / "zoo.jsonl", "w") as jsonl:
        for row in rows:
            jsonl.write(json.dumps(asdict(row)) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", nargs="+", help=argparse.SUPPRESS)  # the traced program's own entry
    parser.add_argument("--family", nargs="+", default=["tv", "timm", "hf"], choices=["tv", "timm", "hf"])
    parser.add_argument("--models", nargs="+", help="specs (family:name@size) instead of the zoo")
    parser.add_argument("--max-params", type=int, default=MAX_PARAMS, help="larger models are listed (0: no limit)")
    parser.add_argument("--per-trace", type=int, default=8, help="models per traced process")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="start no trace group after this")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per traced process")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--update", action="store_true",
                        help="keep the rows of OUT/zoo.jsonl for models not run now (fill in a partial table)")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSONL",
                        help="run nothing: write OUT's table from these rows (a later file's row of a model wins)")
    args = parser.parse_args(argv)
    if args.step:
        traced_steps(args.step)
        return 0
    if args.merge:
        return merge(args.merge, zoo_specs(args.family), args.out)
    specs = args.models or zoo_specs(args.family)
    print(HEADER, flush=True)

    earlier = read_rows(args.out / "zoo.jsonl") if args.update else []
    total = len({row.spec for row in earlier} | set(specs))

    def merged(rows: list[Row]) -> list[Row]:
        now = {row.spec for row in rows}
        return [row for row in earlier if row.spec not in now] + rows

    def report(row: Row, rows: list[Row]) -> None:
        print(table_line(row), flush=True)
        # so far: a stopped run leaves a partial table
        write_results(merged(rows), specs[len(rows):], total, args.out)

    rows, left = check(specs, args.max_params, args.per_trace, args.budget_s, args.timeout, report)
    write_results(merged(rows), left, total, args.out)
    print("\n".join(summary(merged(rows), left, total)))
    return 0


def merge(paths: list[Path], zoo: list[str], out: Path) -> int:
    """One table from the rows of several runs (parallel or partial ones); zoo models with no row are not run."""
    by_spec = {row.spec: row for path in paths for row in read_rows(path)}
    order = {spec: index for index, spec in enumerate(zoo)}
    rows = sorted(by_spec.values(), key=lambda row: order.get(row.spec, len(order)))
    left = [spec for spec in zoo if spec not in by_spec]
    write_results(rows, left, len(set(zoo) | set(by_spec)), out)
    print("\n".join(summary(rows, left, len(set(zoo) | set(by_spec)))))
    return 0


def read_rows(path: Path) -> list[Row]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        data = json.loads(line)
        for side in ("cpu", "trace"):
            data[side] = Figures(**data[side]) if data[side] else None
        rows.append(Row(**data))
    return rows


if __name__ == "__main__":
    sys.exit(main())
