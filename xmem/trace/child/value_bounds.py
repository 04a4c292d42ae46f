"""The range of the integer values of GPU tensors, where the ops that made them fix it, for the stand-ins of
data-dependent sizes (`xmem.trace.child.standins`).

A fake tensor has no values, but many integer ones are class indices or bin numbers whose range the op that made
them decides: `torch.randint(0, C)`, `logits.argmax(-1)` (0 to the size of the dimension less one), the indices of
`sort`/`topk`/`max(dim)`, a comparison's booleans, and what arithmetic with known ranges makes of them
(torchmetrics' confusion matrix bins `target * C + preds`). Upstream's `bincount` is as long as the largest value
plus one (or `minlength`), and `unique` finds at most one value per integer of the range: with the range known,
those sizes follow it instead of the input's length.

The rules: a range is kept per tensor (by identity, while it lives) for the ops in RULES, computed from the ranges
of their arguments (a Python number is its own range; a boolean tensor has its dtype's); an op that
writes a tensor in place forgets the ranges of every tensor on that storage, then keeps the op's own where it has a
rule (`x += 1`). Floating-point results are never followed. An 8- or 16-bit integer tensor has no range from its
dtype: such tensors are most often labels or pixels stored small, far inside the dtype's range (ludwig's int8 class
targets), and a range as wide as the dtype, carried through `target * C + preds`, made bincount's stand-in count
3 * 127 + 3 bins where the program asked for C * C and reshapes them so; without a range bincount takes the
program's `minlength`, and unique its upper bound of one value per element. Import only in the tracing child.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

Range = tuple[int, int]  # (lowest, highest), both included

_DTYPE_RANGES: dict[torch.dtype, Range] = {torch.bool: (0, 1)}  # (why not 8/16-bit integers: the docstring)
# ops whose values are some of their first argument's (copies, views, selections, reorderings)
_KEEP = frozenset({"_to_copy", "clone", "view", "reshape", "_unsafe_view", "expand", "squeeze", "unsqueeze",
                   "select", "slice", "t", "transpose", "permute", "contiguous", "detach", "alias", "flatten",
                   "index_select", "gather", "index", "flip", "roll", "repeat", "lift_fresh", "lift_fresh_copy",
                   "masked_select", "narrow", "unbind", "split", "split_with_sizes", "chunk", "as_strided", "take",
                   "view_copy", "expand_copy", "permute_copy", "squeeze_copy", "unsqueeze_copy"})
# index-returning ops: (position of `dim`, its default, which output holds the indices)
_INDICES = {"argmax": (1, None, None), "argmin": (1, None, None), "max": (1, None, 1), "min": (1, None, 1),
            "sort": (1, -1, 1), "topk": (2, -1, 1), "kthvalue": (2, -1, 1), "mode": (1, -1, 1),
            "median": (1, None, 1), "cummax": (1, None, 1), "cummin": (1, None, 1), "argsort": (1, -1, None)}


class ValueBounds:
    """The side table: `note` after each fake op, `of` for the stand-ins."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[int, int, int]] = {}  # id(tensor) -> (lowest, highest, storage key)
        self._written_args: dict[Any, tuple] = {}

    def of(self, value: Any) -> Range | None:
        """The range of a tensor's values (or a number's), if known."""
        if isinstance(value, (bool, int)):
            return int(value), int(value)
        if not isinstance(value, torch.Tensor):
            return None
        entry = self._entries.get(id(value))
        if entry is not None:
            return entry[0], entry[1]
        return _DTYPE_RANGES.get(value.dtype)

    def note(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        """After a fake op: keep the ranges it fixes; forget those of storages it wrote."""
        if isinstance(out, torch.Tensor) and (out.dtype.is_floating_point or out.dtype.is_complex):
            return  # nearly every op: floating-point results carry no range
        found = self._ranges(func, name.rstrip("_"), args, kwargs, out)
        if self._entries and func._schema.is_mutable:
            self._forget_written(func, args, kwargs)
        for tensor, bounds in found:
            self._keep(tensor, bounds)

    def _ranges(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> list[tuple[torch.Tensor, Range]]:
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, FakeTensor)]
        if name in _INDICES:
            return _indices(name, args, kwargs, out)
        rule = RULES.get(name)
        bounds = None if rule is None else rule(self.of, func._overloadname, args, kwargs)
        if bounds is None:
            return []
        return [(t, bounds) for t in outs if not t.dtype.is_floating_point and not t.dtype.is_complex]

    def _keep(self, tensor: torch.Tensor, bounds: Range) -> None:
        if _DTYPE_RANGES.get(tensor.dtype) == bounds:
            return  # a boolean's (or a byte's) whole range: its dtype says as much
        ident = id(tensor)
        if ident not in self._entries:
            weakref.finalize(tensor, self._entries.pop, ident, None).atexit = False
        self._entries[ident] = (bounds[0], bounds[1], _storage_key(tensor))

    def _forget_written(self, func: Any, args: tuple, kwargs: dict) -> None:
        where = self._written_args.get(func)
        if where is None:
            where = self._written_args[func] = tuple(
                (i, a.name) for i, a in enumerate(func._schema.arguments) if a.alias_info and a.alias_info.is_write)
        written = {_storage_key(value) for i, name in where  # (an optimizer's float parameters: none kept)
                   for value in _flat(args[i] if i < len(args) else kwargs.get(name))
                   if not value.dtype.is_floating_point}
        for ident in [i for i, entry in self._entries.items() if entry[2] in written]:
            del self._entries[ident]


def _flat(value: Any) -> list[torch.Tensor]:
    items = value if isinstance(value, (list, tuple)) else (value,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _indices(name: str, args: tuple, kwargs: dict, out: Any) -> list[tuple[torch.Tensor, Range]]:
    """The index outputs of argmax/sort/topk/max(dim)...: 0 to the size of the reduced dimension less one."""
    position, default, which = _INDICES[name]
    x = args[0]
    dim = kwargs.get("dim", args[position] if len(args) > position and not isinstance(args[position], bool)
                     else default)
    indices = out if which is None else (out[which] if isinstance(out, (tuple, list)) and len(out) > which else None)
    if not isinstance(indices, FakeTensor) or not isinstance(x, torch.Tensor) or indices.dtype != torch.long:
        return []
    size = x.numel() if dim is None else (x.shape[dim] if x.dim() else 1)
    return [(indices, (0, max(size - 1, 0)))]


# ---- the rules: (range of, overload name, args, kwargs) -> the range of every integer output, or None ----------
Of = Callable[[Any], "Range | None"]


def _keep_first(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
    return of(args[0]) if args else None


def _randint(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
    # randint(high, size) / randint.low(low, high, size); randint_like(self, high) / .low_dtype(self, low, high)
    numbers = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    low, high = (numbers[0], numbers[1]) if "low" in overload else (0, numbers[0] if numbers else None)
    return None if high is None else (low, high - 1)


def _arange(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
    numbers = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    start, end = (0, numbers[0]) if overload == "default" else (numbers[0], numbers[1])
    step = numbers[2] if overload == "start_step" and len(numbers) > 2 else 1
    if end == start:
        return None
    last = start + (int((end - start - (1 if step > 0 else -1)) // step)) * step
    return int(min(start, last)), int(max(start, last))


def _constant(value_at: int | None, value: int | None = None) -> Callable:
    def rule(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
        v = value if value_at is None else (args[value_at] if len(args) > value_at else kwargs.get("fill_value"))
        return (int(v), int(v)) if isinstance(v, (bool, int)) else None
    return rule


def _add(sign: int) -> Callable:
    def rule(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
        a, b = of(args[0]), of(args[1]) if len(args) > 1 else None
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        if a is None or b is None or not isinstance(alpha, int):
            return None
        scaled = sorted((sign * alpha * b[0], sign * alpha * b[1]))
        return a[0] + scaled[0], a[1] + scaled[1]
    return rule


def _mul(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
    a, b = of(args[0]), of(args[1])
    if a is None or b is None:
        return None
    products = [x * y for x in a for y in b]
    return min(products), max(products)


def _remainder(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
    divisor = of(args[1])  # Python's and torch's sign rule: the result takes the divisor's sign
    return (0, divisor[1] - 1) if divisor is not None and divisor[0] > 0 else None


def _floor_divide(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
    a, divisor = of(args[0]), of(args[1])
    if a is None or divisor is None or divisor[0] <= 0 or divisor[0] != divisor[1]:
        return None
    return a[0] // divisor[0], a[1] // divisor[0]


def _div(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
    return _floor_divide(of, overload, args, kwargs) if kwargs.get("rounding_mode") == "floor" else None


def _clamp(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
    a = of(args[0])
    low, high = (of(args[1]) if len(args) > 1 and args[1] is not None else None,
                 of(args[2]) if len(args) > 2 and args[2] is not None else None)
    if a is None:
        return (low[0], high[1]) if low is not None and high is not None else None
    lowest, highest = a
    if low is not None:
        lowest, highest = max(lowest, low[0]), max(highest, low[0])
    if high is not None:
        lowest, highest = min(lowest, high[1]), min(highest, high[1])
    return lowest, highest


def _union(ranges: list[Range | None]) -> Range | None:
    if not ranges or any(r is None for r in ranges):
        return None
    return min(r[0] for r in ranges), max(r[1] for r in ranges)  # type: ignore[index]


def _where(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
    return _union([of(args[1]), of(args[2])]) if len(args) > 2 else None


def _cat(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
    return _union([of(t) for t in args[0]])


def _extreme(pick: Callable) -> Callable:
    def rule(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
        a, b = of(args[0]), of(args[1])
        return None if a is None or b is None else (pick(a[0], b[0]), pick(a[1], b[1]))
    return rule


def _abs(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
    a = of(args[0])
    if a is None:
        return None
    return (0 if a[0] <= 0 <= a[1] else min(abs(a[0]), abs(a[1]))), max(abs(a[0]), abs(a[1]))


def _neg(of: Of, overload: str, args: tuple, kwargs: dict) -> Range | None:
    a = of(args[0])
    return None if a is None else (-a[1], -a[0])


RULES: dict[str, Callable] = {
    **{name: _keep_first for name in _KEEP},
    "copy": lambda of, overload, args, kwargs: of(args[1]),  # copy_(destination, source)
    "randint": _randint, "randint_like": _randint, "arange": _arange,
    "full": _constant(1), "full_like": _constant(1), "new_full": _constant(2), "fill": _constant(1),
    "zeros": _constant(None, 0), "zeros_like": _constant(None, 0), "new_zeros": _constant(None, 0),
    "zero": _constant(None, 0), "ones": _constant(None, 1), "ones_like": _constant(None, 1),
    "new_ones": _constant(None, 1),
    "add": _add(1), "sub": _add(-1), "mul": _mul, "remainder": _remainder, "floor_divide": _floor_divide,
    "div": _div, "clamp": _clamp, "clip": _clamp,
    "clamp_min": lambda of, o, args, kw: _clamp(of, o, (args[0], args[1]), kw),
    "clamp_max": lambda of, o, args, kw: _clamp(of, o, (args[0], None, args[1]), kw),
    "where": _where, "cat": _cat, "stack": _cat, "maximum": _extreme(max), "minimum": _extreme(min),
    "abs": _abs, "neg": _neg,
}
