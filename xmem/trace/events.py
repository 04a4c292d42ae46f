"""The trace's output record: what crosses from `trace` to `orchestrate`.

Owns only the data types (no torch import here, so the simulator and the CLI load fast), and the names of memory
categories and training phases (`Category`, `Phase`, once each, as torch's `mem_tracker.py` names its categories).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Literal

try:
    from enum import StrEnum
except ImportError:  # Python 3.10: the same, by hand (members are their strings, in JSON and comparisons alike)
    class StrEnum(str, Enum):  # type: ignore[no-redef]
        def __str__(self) -> str:
            return self.value


class Category(StrEnum):
    """What a GPU storage holds: the breakdown's, the pictures' and the audit's words."""

    PARAMETER = "parameter"
    UNSHARDED_PARAMETER = "unsharded_parameter"  # FSDP's all-gathered parameters (FSDPMemTracker's "Unsharded Param")
    BUFFER = "buffer"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"
    TEMPORARY = "temporary"
    INPUT = "input"  # copied from the host or drawn at random outside forward/backward/optimizer: the batch
    WORKSPACE = "workspace"  # cuBLAS/cuDNN workspaces the orchestrator adds
    OTHER = "other"


class Phase(StrEnum):
    """Where the training loop was when a storage was allocated."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class MemEvent:
    """One GPU storage allocation or free, a `torch.cuda.empty_cache()` call, or a CUDA graph's pool action, in
    program order.

    `block` identifies the storage: an alloc and its free share it. `nbytes` is the storage's requested size
    (unrounded: rounding is the simulator's job). A free repeats the alloc's size, stream and device. An
    `empty_cache` event has block -1 and 0 bytes. The pool actions (POOL_ACTIONS) have 0 bytes and name a CUDA
    graph's private memory pool by `block` (its own numbering, not a storage's): `begin_pool` (a capture starts:
    the allocations on `stream` come from that pool), `end_pool` (the capture ended), `release_pool` (a graph that
    used the pool was reset or deleted).
    """

    action: Literal["alloc", "free", "empty_cache", "begin_pool", "end_pool", "release_pool"]
    block: int
    nbytes: int
    device: int = 0
    stream: int = 0
    op: str = ""
    module: str = ""
    phase: str = Phase.OTHER
    iteration: int = -1  # -1: before the first optimizer step's iteration started (model load, setup)
    category: str = Category.OTHER
    site: int = -1  # an alloc's line of the program behind it: an index into Trace.sites (-1: none found)


EVENT_FIELDS = tuple(f.name for f in dataclasses.fields(MemEvent))
POOL_ACTIONS = ("begin_pool", "end_pool", "release_pool")
# An alloc (and its free) on this stream is CUDA managed memory (cudaMallocManaged: bitsandbytes' paged optimizer
# state), which the caching allocator never sees: the simulator counts it beside the allocator (its MANAGED, the
# same number); its op is MANAGED_OP.
MANAGED_STREAM = -1
MANAGED_OP = "cudaMallocManaged"

# ATen ops that run a cuBLAS (or cuBLASLt) GEMM/GEMV on CUDA and so acquire the thread's cuBLAS handle and workspace:
# the tracer counts them as loading cuBLAS, the orchestrator gives their thread and stream a workspace.
CUBLAS_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "matmul", "linear", "addr", "dot", "vdot",
    "_addmm_activation", "_scaled_mm", "_int_mm",
})


@dataclass(frozen=True, slots=True)
class Fact:
    """Something the run's own objects say the trace must hold, taken by `xmem.trace.child.facts` (not from the alloc
    stream): `storages` distinct non-empty CUDA storages (0: not counted) of at least `nbytes` on `device`, live
    under one of `categories` once the trace's first `at_event` events have happened (no categories: a fact
    that contradicts any trace, FACT_HOST_STAND_IN). `what` names it for the
    audit's reason (FACT_* below), `source` says where the figure comes from ("param_groups of
    SGD", "AdamW rule: 2 x stepped parameter bytes")."""

    what: str
    categories: tuple[str, ...]
    device: int
    storages: int
    nbytes: int
    at_event: int
    source: str = ""


# What the facts are about (`Fact.what`), as the audit's reasons name them.
# The tracer's progress line when the program first takes a choice that depends on the GPU generation (an attention
# kernel, a bf16 convolution): the estimate may start the other capability classes' traces beside it then.
ARCH_SENSITIVE_PROGRESS = "the program's memory depends on the GPU generation"

FACT_BATCH = "the first batch given to the model"
FACT_MODEL_STATE = "the model's parameters and buffers on the GPU"
FACT_STEPPED = "the parameters the optimizers step"
FACT_GRADIENTS = "the gradients of the stepped parameters after the first backward"
FACT_STATE = "the optimizer state after the first step"
FACT_STATE_BY_RULE = "the optimizer state its kind requires"
# A fact no trace can hold (no categories): a value the GPU would not hold was made up, so the traced program may
# not be the one the GPU would run (a model sized from CPU tensor values).
FACT_HOST_STAND_IN = "a value of a tensor outside the GPU was a stand-in"
# DTensor parameters (tensor parallelism, fully_shard's shards), by upstream's placement rule from their global
# shapes and meshes (xmem.trace.child.facts.dtensor_local_numel)
FACT_DTENSOR_PARAMETERS = "the DTensor parameters' local shards on this rank, by their placements"
# FSDP1 units, by upstream's rules from their FlatParamHandles (xmem.trace.child.facts.fsdp1_*)
FACT_FSDP_PARAMETERS = "the FSDP units' sharded flat parameters"
FACT_FSDP_GRADIENTS = "the FSDP units' sharded gradients, frozen elements included"
FACT_FULLEST_RANK_STATE = "the optimizer state of the rank whose FSDP shards hold the most trainable elements"
# DeepSpeed ZeRO's optimizers, by its partition rules from the trainable parameters (xmem.trace.child.facts.zero_*)
FACT_ZERO_STATE = "the optimizer state of the rank whose ZeRO partitions are the largest"
# Parameters an optimizer steps on the host because FSDP's or ZeRO's CPU offload keeps them there (0 bytes of the
# GPU's by upstream's rules: a fact that any trace holds, which tells the audit that a step without a GPU parameter
# is right)
FACT_OFFLOADED = "the parameters the optimizers step on the host, offloaded there by their wrapper"


@dataclass(frozen=True, slots=True)
class ActivationMeta:
    """One tensor a pipeline stage passes to the next (torch.distributed.pipelining's `_TensorMeta`): `dtype` by its
    torch name ("float32")."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool

    def to_json(self) -> list:
        return [list(self.shape), list(self.stride), self.dtype, self.requires_grad]

    @classmethod
    def from_json(cls, row: list) -> "ActivationMeta":
        return cls(tuple(row[0]), tuple(row[1]), row[2], bool(row[3]))


@dataclass(frozen=True, slots=True)
class PipelineRun:
    """What a traced rank learned of the pipeline schedule it ran (xmem.trace.child.pipelining): by stage index, the
    global rank holding each stage (`stage_ranks`, in this rank's pipeline group), the stages this rank holds, what
    its stages sent on (by receiving stage: the activations' metadata, which the estimate hands to that stage's
    rank), and the input metadata it assumed for its own stages where none was handed down."""

    schedule: str
    stage_ranks: tuple[int, ...]
    own_stages: tuple[int, ...]
    sent: dict[int, tuple[ActivationMeta, ...]]
    assumed: dict[int, tuple[ActivationMeta, ...]]

    def to_json(self) -> dict:
        return {"schedule": self.schedule, "stage_ranks": list(self.stage_ranks), "own_stages": list(self.own_stages),
                "sent": _metas_json(self.sent), "assumed": _metas_json(self.assumed)}

    @classmethod
    def from_json(cls, d: dict) -> "PipelineRun":
        return cls(d["schedule"], tuple(d["stage_ranks"]), tuple(d["own_stages"]), _metas_from_json(d["sent"]),
                   _metas_from_json(d["assumed"]))


def _metas_json(by_stage: dict[int, tuple[ActivationMeta, ...]]) -> dict[str, list]:
    return {str(stage): [meta.to_json() for meta in metas] for stage, metas in by_stage.items()}


def _metas_from_json(by_stage: dict[str, list]) -> dict[int, tuple[ActivationMeta, ...]]:
    return {int(stage): tuple(ActivationMeta.from_json(row) for row in rows) for stage, rows in by_stage.items()}


@dataclass(slots=True)
class Trace:
    """Everything the tracer learned about one run of the user's program under fake CUDA."""

    events: list[MemEvent] = field(default_factory=list)
    iterations: int = 0  # optimizer steps completed
    warnings: list[str] = field(default_factory=list)  # stand-ins used (loss.item() etc.), said once each
    libraries: list[str] = field(default_factory=list)  # GPU libraries the job would load: "cublas", "cudnn", ...
    op_counts: dict[str, int] = field(default_factory=dict)
    capability: tuple[int, int] = (9, 0)  # compute capability the trace pretended to have
    arch_sensitive: bool = False  # True if a capability-dependent choice was taken (SDPA backend, bf16 check...)
    used_cuda: bool = False
    alloc_conf: str = ""  # PYTORCH_(CUDA_)ALLOC_CONF seen in the job's environment
    seconds: float = 0.0
    torch_version: str = ""
    interpreter: str = ""  # the job's Python interpreter the program ran on (the runner's choice)
    sandbox: str = ""  # what kept the program's writes out of the user's files (xmem.trace.sandbox)
    facts: list[Fact] | None = None  # for the self-audit (xmem.audit); None: not collected
    # no training iteration: the peak of the forward passes (top-level module forwards on the GPU) and whatever else
    # the program ran before it ended or the tracer ended it (xmem.trace.child.recorder.TrainingState)
    forward_only: bool = False
    forward_passes: int = 0
    unstepped_optimizers: int = 0  # optimizers the program made but never stepped, in a forward-only trace
    peak_rising: bool = False  # a forward-only trace ended by its time limit while the GPU's peak still rose
    # diagnostics, no figure depends on them: why ops went FakeTensorMode's own way, not the tracer's quick key
    # (xmem.trace.child.shortcuts), counted by reason
    quick_key_misses: dict[str, int] = field(default_factory=dict)
    # The program's lines that allocated (MemEvent.site indexes them), once each: (file, line, function) of the
    # innermost frame outside torch, xmem and the standard library (xmem.trace.child.recorder.UserSites)
    sites: list[tuple[str, int, str]] = field(default_factory=list)
    pipeline: PipelineRun | None = None  # a pipeline schedule ran (torch.distributed.pipelining): its stages
    # the job's world size as the traced rank saw it, and where the program's own files tested the rank they read
    # ("file:line", xmem.trace.child.rank_reads): there its ranks can run differently (xmem.rank_traces)
    world_size: int = 1
    rank_tests: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("events", "facts", "pipeline")}
        # events as compact rows: they dominate the size (and asdict/astuple would copy each one twice)
        d["events"] = [tuple(map(e.__getattribute__, EVENT_FIELDS)) for e in self.events]
        d["facts"] = None if self.facts is None else [dataclasses.asdict(f) for f in self.facts]
        d["pipeline"] = None if self.pipeline is None else self.pipeline.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Trace":
        d = {k: v for k, v in d.items() if k in _TRACE_FIELDS}  # a field a saved trace has but Trace no longer does
        d["events"] = [MemEvent(*row) for row in d.get("events", [])]
        d["capability"] = tuple(d.get("capability", (9, 0)))
        d["sites"] = [tuple(site) for site in d.get("sites", [])]
        facts = d.get("facts")
        d["facts"] = None if facts is None else [Fact(**{**f, "categories": tuple(f["categories"])}) for f in facts]
        d["pipeline"] = None if d.get("pipeline") is None else PipelineRun.from_json(d["pipeline"])
        return cls(**d)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: Path) -> "Trace":
        return cls.from_json(json.loads(path.read_text()))


_TRACE_FIELDS = frozenset(f.name for f in dataclasses.fields(Trace))
