"""Real values of the GPU tensors that were copied from the host, for what the program asks of them.

A fake CUDA tensor holds no data, so each value the program takes out of one gets a stand-in
(`xmem.trace.child.standins`). But many of a training program's GPU tensors are host tensors copied over: the data
loader's labels, masks and index tensors, whose values the program reads to size what it allocates next (chemprop
pools a graph batch into `torch.zeros(batch.max() + 1, ...)`). Their values are known: this table keeps them, and
the stand-ins ask it first.

The rules:
- kept: the results (at most PER_TENSOR_BYTES each, TOTAL_BYTES alive in all) of a copy from a host tensor
  (`.to("cuda")`, `.cuda()`, `copy_` of a host tensor into a GPU one), of a factory whose values its arguments fix
  (`arange`, `linspace`, `logspace`, `eye` on the GPU: position ids, RoPE frequencies), and of any op whose tensor arguments all
  have known values or are host tensors, one at least known (`batch.max().int() + 1`, `mask.sum()`, a view,
  `torch.cat(batches)`, `mask.cpu()`): the op runs again on the host copies, on the CPU. An op on a host
  parameter or a tensor that requires grad (a model's weights) only with grad mode off, as `.cuda()`,
  load_state_dict and an adapter's init under no_grad read them (WEIGHT_BYTES of them at most): in training,
  following them would run it on the host, and the values a program reads from a model there, losses and metrics,
  stay stand-ins (its optimizer's step writes the weights, which forgets them). Never an op that draws random
  numbers (on the host it would draw from the program's own generator, which a GPU's draws leave alone);
- forgotten: once the tensor's storage (through any view of it) is written in place by a dispatched op (`add_`,
  `index_put_`, `copy_`, an `out=` argument), unless that op's own result is kept again;
- held in a side table keyed by the fake tensor's identity and dropped when it dies (an attribute on the tensor
  would travel into the program's checkpoints), as a private copy (the program may reuse its host buffer).

Upstream FakeTensor's `constant` cannot serve: it is kept only for tensors of at most one element
(`CONSTANT_NUMEL_LIMIT`), dropped by a copy to another device, so a GPU tensor copied from the host never has one;
and where it folds ops, it runs them on those host constants and hands back results that live on the CPU.
Import only in the tracing child.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

PER_TENSOR_BYTES = 4 << 20
TOTAL_BYTES = 64 << 20
WEIGHT_BYTES = 16 << 20  # of TOTAL_BYTES, at most this made from weights: the data's values keep the rest
# `to` arrives whole under inference_mode (the recorder decomposes it below itself, out of this table's sight)
_COPIES = frozenset({"_to_copy", "to", "copy_", "_copy_from"})
_NO_DATA_WRITES = frozenset({"record_stream", "detach_", "requires_grad_"})  # "write" flags, not values
# Factories whose values follow from their arguments alone (no draw, no uninitialised memory): a range made on the
# GPU (position ids, RoPE frequencies: torch.arange(0, dim, 2, device="cuda")) holds what the host's would
_FACTORIES = frozenset({"arange", "linspace", "logspace", "eye"})
_CPU = torch.device("cpu")
_UNKNOWN = object()


class _Entry:
    """A kept value: the host copy, its fake tensor's storage and that storage's write count when it was taken."""

    __slots__ = ("host", "key", "writes", "nbytes", "weights")

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.key = self.writes = self.nbytes = 0
        self.weights = False  # made from a model's weights (counted in WEIGHT_BYTES too)


class Plan:
    """An op whose result can be known: its arguments on the host, run at most once."""

    def __init__(self, func: Any, args: tuple, kwargs: dict, from_program: bool, weights: bool = False) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.from_program = from_program  # a host argument is the program's own tensor: results may alias it
        self.weights = weights  # an argument is a model's weight (or made from one), read with grad mode off
        self._result: Any = _UNKNOWN

    def result(self) -> Any:
        """The op's result computed on the host; None where the host run fails."""
        if self._result is _UNKNOWN:
            try:
                with unset_fake_temporarily():
                    self._result = self.func(*self.args, **self.kwargs)
            except Exception:  # noqa: BLE001 - an op the CPU lacks: the values stay unknown
                self._result = None
        return self._result


class KnownValues:
    """The side table: `plan` before a fake op runs, `keep` after it; `value` for the stand-ins."""

    def __init__(self) -> None:
        self.alive_bytes = 0
        self.weight_bytes = 0  # of alive_bytes, those made from weights
        self._entries: dict[int, _Entry] = {}  # id(fake tensor) -> entry, dropped as the tensor dies
        self._watched: dict[int, int] = {}  # storage key -> kept tensors on it
        self._writes: dict[int, int] = {}  # storage key -> in-place writes to it since it was first watched
        self._written_args: dict[Any, tuple] = {}  # op -> (position, name) of each argument it writes

    def value(self, tensor: Any) -> torch.Tensor | None:
        """The real value of a fake tensor, if known and not written since."""
        entry = self._entries.get(id(tensor)) if isinstance(tensor, FakeTensor) else None
        if entry is None or self._writes.get(entry.key, 0) != entry.writes or _storage_key(tensor) != entry.key:
            return None
        return entry.host

    # ---- around each fake op --------------------------------------------------------------------------------
    def plan(self, func: Any, args: tuple, kwargs: dict) -> Plan | None:
        """Before a fake op: count its in-place writes to kept storages, and return its host form if its result can
        be known. Cheap when it cannot: most ops meet an unknown fake tensor at their first argument."""
        name = func._opname
        if not self._watched and name not in _COPIES and name not in _FACTORIES:
            return None
        plan = self._host_form(func, name, args, kwargs)
        if self._watched and func._schema.is_mutable and name not in _NO_DATA_WRITES:
            for value in self._written(func, args, kwargs):
                for tensor in value if isinstance(value, (list, tuple)) else (value,):
                    key = _storage_key(tensor) if isinstance(tensor, FakeTensor) else None
                    if key in self._watched:
                        self._writes[key] = self._writes.get(key, 0) + 1
        return plan

    def keep(self, plan: Plan | None, out: Any) -> None:
        """After the fake op: keep the values of its small integer/boolean results, computed on the host."""
        if plan is None:
            return
        fakes = _tensors(out)
        if not fakes or not all(type(t) is FakeTensor and _keepable(t) for t in fakes):
            return
        real = _tensors(plan.result())
        if len(real) != len(fakes):
            return
        for fake, host in zip(fakes, real):
            if host.shape == fake.shape and host.dtype == fake.dtype:
                self._keep(fake, _host_clone(host) if plan.from_program else host, plan.weights)

    def made_on_host(self, plan: Plan | None, device: torch.device) -> Any:
        """For an op whose output size depends on data (nonzero, unique, masked selection): fake outputs of the
        sizes its host run gives, on `device`; None where it cannot be run."""
        real = plan.result() if plan is not None else None
        if real is None or not _tensors(real):
            return None

        def fake_like(host: torch.Tensor) -> torch.Tensor:
            return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        return tuple(fake_like(t) for t in real) if isinstance(real, (tuple, list)) else fake_like(real)

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _host_form(self, func: Any, name: str, args: tuple, kwargs: dict) -> Plan | None:
        # [a kept value among the arguments, a program's host tensor among them, a weight among them]
        known = [False, False, False]
        written = {id(v) for v in self._written(func, args, kwargs) if isinstance(v, torch.Tensor)} \
            if func._schema.is_mutable else set()
        copy_into = name == "copy_"
        host_args = []
        for index, value in enumerate(args):
            host = self._on_host(value, known, written, fresh=copy_into and index == 0)
            if host is _UNKNOWN:
                return None
            host_args.append(host)
        host_kwargs = {}
        for key, value in kwargs.items():
            host = False if key == "pin_memory" else self._on_host(value, known, written, fresh=False)
            if host is _UNKNOWN:
                return None
            host_kwargs[key] = host
        copied = name in _COPIES and known[1]
        made = name in _FACTORIES and not any(isinstance(value, torch.Tensor) for value in (*args, *kwargs.values()))
        if not (known[0] or copied or made) or torch.Tag.nondeterministic_seeded in func.tags:
            return None
        return Plan(func, tuple(host_args), host_kwargs, from_program=known[1], weights=known[2])

    def _on_host(self, value: Any, known: list, written: set, fresh: bool) -> Any:
        if isinstance(value, FakeTensor):
            if value.requires_grad:  # a parameter (loaded by copy_ into it), or computed from one
                if torch.is_grad_enabled():
                    return _UNKNOWN
                known[2] = True
            if fresh:  # copy_'s destination: every element is overwritten, its old values never matter
                with unset_fake_temporarily():
                    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=_CPU)
            host = self.value(value)
            if host is None:
                return _UNKNOWN
            known[0] = True
            return _host_clone(host) if id(value) in written else host  # kept values are never written
        if isinstance(value, torch.Tensor):
            weight = type(value) is torch.nn.Parameter or value.requires_grad
            if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.device.type != "cpu" or \
                    weight and torch.is_grad_enabled():
                return _UNKNOWN  # another subclass, a meta tensor, a weight being trained
            known[1] = True
            known[2] = known[2] or weight
            return value
        if isinstance(value, torch.device):
            return _CPU if value.type == "cuda" else value
        if isinstance(value, (list, tuple)) and value and any(isinstance(v, torch.Tensor) for v in value):
            items = []
            for item in value:
                host = self._on_host(item, known, written, fresh=False)
                if host is _UNKNOWN:
                    return _UNKNOWN
                items.append(host)
            return type(value)(items)
        return value

    def _written(self, func: Any, args: tuple, kwargs: dict) -> list:
        """The values of the arguments that `func` writes in place (its schema's `Tensor(a!)` ones)."""
        where = self._written_args.get(func)
        if where is None:
            where = self._written_args[func] = tuple(
                (i, a.name) for i, a in enumerate(func._schema.arguments) if a.alias_info and a.alias_info.is_write)
        return [args[i] if i < len(args) else kwargs.get(name) for i, name in where]

    def _keep(self, fake: torch.Tensor, host: torch.Tensor, weights: bool = False) -> None:
        nbytes = host.untyped_storage().nbytes()
        entry = self._entries.get(id(fake))
        held = entry.nbytes if entry is not None else 0
        held_weights = held if entry is not None and entry.weights else 0
        if nbytes > PER_TENSOR_BYTES or self.alive_bytes - held + nbytes > TOTAL_BYTES or \
                weights and self.weight_bytes - held_weights + nbytes > WEIGHT_BYTES:
            return
        if entry is None:
            entry = self._entries[id(fake)] = _Entry()
            weakref.finalize(fake, self._forget, id(fake)).atexit = False
        else:
            self._unwatch(entry.key)
        key = _storage_key(fake)
        self._watched[key] = self._watched.get(key, 0) + 1
        entry.host, entry.key, entry.writes, entry.nbytes = host, key, self._writes.get(key, 0), nbytes
        self.alive_bytes += nbytes - held
        self.weight_bytes += (nbytes if weights else 0) - held_weights
        entry.weights = weights

    def _forget(self, ident: int) -> None:
        entry = self._entries.pop(ident, None)
        if entry is not None:
            self.alive_bytes -= entry.nbytes
            self.weight_bytes -= entry.nbytes if entry.weights else 0
            self._unwatch(entry.key)

    def _unwatch(self, key: int) -> None:
        count = self._watched.get(key, 0) - 1
        if count > 0:
            self._watched[key] = count
        else:
            self._watched.pop(key, None)
            self._writes.pop(key, None)


def _host_clone(tensor: torch.Tensor) -> torch.Tensor:
    with unset_fake_temporarily():  # called from the recorder's dispatch, above the fake mode
        return tensor.clone()


def _keepable(tensor: torch.Tensor) -> bool:
    return tensor.numel() * tensor.element_size() <= PER_TENSOR_BYTES


def _tensors(out: Any) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None
