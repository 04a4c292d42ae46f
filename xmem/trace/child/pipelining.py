"""Pipeline parallelism (torch.distributed.pipelining) on the traced rank, over the fake process group.

Owns what a pipeline schedule needs from the other ranks before its first step, answered without them, and the note
the trace ends with (`events.PipelineRun`): which stages the pipeline has, which rank holds each, and the activations
this rank's stages sent on, from which the estimate traces the other stages' ranks (`xmem.rank_traces`).

Upstream (schedules.py `_PipelineSchedule._warmup_p2p`, `_initialize_pp_stages`; stage.py `PipelineStage`): before
the first step the ranks vote on the metadata inference mode (a product of 0/1 tensors passed stage to stage), then,
when any stage lacks static shapes, each stage runs a real forward (and backward) of the first microbatch on tensors
made from the shapes the previous stage sends it (`_recv_meta`/`_send_meta`: `_StageForwardMeta` forward,
`_StageBackwardMeta` back), and allocates its receive buffers from them (one per microbatch and input,
`_setup_forward_recv_info`; one per microbatch and output gradient, `_create_grad_recv_info`). Upstream refuses the
dynamic mode over a fake group. Here:
- the vote is decided locally: static where every stage of this rank has complete shapes, else dynamic (the
  program's ranks run the same code, so they decide alike);
- a stage's input shapes come from what the estimate hands down (the previous stage's outputs, as its rank's trace
  recorded them sending: launchers.PIPELINE_INPUTS_ENV), else the program's own `input_args`, else the shapes this
  rank's previous stage sent on (a pipeline's stages pass one activation of one shape; the note says it was assumed,
  so that the estimate checks it against what the producing rank sends; where the stage's first forward fails on
  them, the trace ends in exit 11 naming the stage);
- the gradients' shapes sent back to a stage are its outputs' (upstream `_derive_grad_metas`: a gradient of a plain
  tensor has its shape, stride and dtype; what the next stage computes for an input that requires grad).
Everything else (the dynamic mode's forward and backward, the receive buffers, the microbatches in flight) is
upstream's own code running on the fake GPU. DTensor activations between stages are not modelled (their gradients'
placements are the next stage's to say).
Import only in the tracing child, after `xmem.trace.child.fakecuda`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from xmem.launchers import PIPELINE_INPUTS_ENV
from xmem.trace.child.on_import import patch_on_import
from xmem.trace.events import ActivationMeta, PipelineRun

DTENSOR_ACTIVATIONS_GAP = "DTensor activations passed between pipeline stages (their gradients' placements)"

_schedule = ""  # the schedule class that ran the warm-up
_stages: dict[int, int] = {}  # every stage of the pipeline -> the global rank holding it (this rank's PP group)
_own: list[int] = []  # the stages this rank holds
_sent: dict[int, tuple[ActivationMeta, ...]] = {}  # receiving stage -> what this rank's stage sent it
_assumed: dict[int, tuple[ActivationMeta, ...]] = {}  # this rank's stage -> input shapes it assumed


def install() -> None:
    patch_on_import("torch.distributed.pipelining.schedules", _patch_warmup)
    patch_on_import("torch.distributed.pipelining.stage", _patch_metadata_exchange)


def note() -> PipelineRun | None:
    """What the trace learned of the pipeline its rank is part of; None where no schedule started."""
    if not _stages:
        return None
    return PipelineRun(schedule=_schedule, stage_ranks=tuple(_stages[i] for i in sorted(_stages)),
                       own_stages=tuple(_own), sent=dict(_sent), assumed=dict(_assumed))


def _patch_warmup(schedules: Any) -> None:
    base = schedules._PipelineSchedule
    warmup = base._warmup_p2p

    def warmup_decided_here(self: Any, stages: list, has_backward: bool, p2p_done: bool) -> None:
        from torch.distributed.pipelining.stage import PipelineStage
        _remember(type(self).__name__, stages)
        if not all(isinstance(stage, PipelineStage) for stage in stages) or not _over_fake_group(stages):
            return warmup(self, stages, has_backward, p2p_done)
        from torch.distributed.pipelining._utils import InferenceMode
        dynamic = any(InferenceMode.needs_dynamic(stage._user_meta, has_backward) for stage in stages)
        for stage in stages:
            stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    base._warmup_p2p = warmup_decided_here


def _over_fake_group(stages: list) -> bool:
    import torch.distributed as dist
    return any(dist.get_backend(stage.group) == "fake" for stage in stages)


def _remember(schedule: str, stages: list) -> None:
    global _schedule
    _schedule = schedule
    for stage in stages:
        _stages.update({index: stage._resolve_peer_global_rank(index) for index in range(stage.num_stages)})
        if stage.stage_index not in _own:
            _own.append(stage.stage_index)


def _patch_metadata_exchange(stage_module: Any) -> None:
    from torch.distributed.pipelining._utils import (_StageBackwardMeta, _StageForwardMeta, _derive_grad_metas,
                                                     _DTensorMeta)
    stage_class = stage_module.PipelineStage
    recv_meta, send_meta = stage_class._recv_meta, stage_class._send_meta

    def recv_meta_here(self: Any, src_stage: int) -> Any:
        if not _over_fake_group([self]):
            return recv_meta(self, src_stage)
        if src_stage > self.stage_index:  # gradients coming back: the shapes of this stage's outputs
            outputs = self._stage_meta.outputs
            if any(isinstance(meta, _DTensorMeta) for meta in outputs):
                _not_modelled(DTENSOR_ACTIVATIONS_GAP)
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(outputs))
        return _StageForwardMeta(forward_metas=tuple(_upstream(meta) for meta in _inputs_of(self)))

    def send_meta_here(self: Any, meta: Any, dst_stage: int) -> None:
        if not _over_fake_group([self]):
            return send_meta(self, meta, dst_stage)
        if isinstance(meta, _StageForwardMeta):
            if any(isinstance(m, _DTensorMeta) for m in meta.forward_metas):
                _not_modelled(DTENSOR_ACTIVATIONS_GAP)
            _sent[dst_stage] = tuple(_ours(m) for m in meta.forward_metas)

    stage_class._recv_meta, stage_class._send_meta = recv_meta_here, send_meta_here
    _refuse_wrong_assumptions(stage_class)


def _refuse_wrong_assumptions(stage_class: Any) -> None:
    """A stage whose input shapes were assumed and whose first forward then fails on them: the assumption was wrong
    (its input stage sends another shape), which is the trace's gap, not the program's error."""
    infer = stage_class._forward_metadata_inference

    def infer_or_refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return infer(self, *args, **kwargs)
        except Exception as error:
            if self.stage_index not in _assumed:
                raise
            _not_modelled(f"the input shapes of pipeline stage {self.stage_index}, fed by a stage of another rank "
                          f"that runs after this one: assumed as this rank's stage before it sends them, they are "
                          f"not ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")

    stage_class._forward_metadata_inference = infer_or_refuse


def _inputs_of(stage: Any) -> tuple[ActivationMeta, ...]:
    """The input shapes of `stage` (not the first): handed down, the program's own, or assumed (module docstring)."""
    handed = _handed_inputs().get(stage.stage_index)
    if handed is not None:
        return handed
    if stage._user_meta.inputs is not None:
        return tuple(_ours(meta) for meta in stage._user_meta.inputs)
    if _sent:
        assumed = _sent[max(_sent)]
        _assumed[stage.stage_index] = assumed
        return assumed
    _not_modelled(f"the input shapes of pipeline stage {stage.stage_index} without the trace of stage "
                  f"{stage.stage_index - 1}'s rank (traced alone: estimate the job, which traces each stage)")


def _handed_inputs() -> dict[int, tuple[ActivationMeta, ...]]:
    text = os.environ.get(PIPELINE_INPUTS_ENV, "")
    if not text:
        return {}
    return {int(stage): tuple(ActivationMeta.from_json(meta) for meta in metas)
            for stage, metas in json.loads(text).items()}


def _ours(meta: Any) -> ActivationMeta:
    """Upstream's `_TensorMeta` as the trace records it."""
    return ActivationMeta(tuple(meta.shape), tuple(meta.stride), str(meta.dtype).removeprefix("torch."),
                          bool(meta.requires_grad))


def _upstream(meta: ActivationMeta) -> Any:
    import torch
    from torch.distributed.pipelining._utils import _TensorMeta
    return _TensorMeta(shape=torch.Size(meta.shape), stride=meta.stride, dtype=getattr(torch, meta.dtype),
                       requires_grad=meta.requires_grad)


def _not_modelled(what: str) -> Any:
    from xmem.trace.errors import NotModelled
    raise NotModelled(what)
