"""Stand-in values for what fake CUDA tensors cannot give: their data.

Only tensors on cuda (and what is computed from them) are fake in a trace, so every way Python takes a value out of
one needs an answer: `.item()` and the number protocols (`int`, `float`, `bool`, `__index__`, `if t:`), `tolist`,
`numpy`/`__array__`, `__format__`, `torch.equal`, and ops whose output size depends on data. Each kind answers
plausibly and is reported once as a warning, so an estimate says which of the program's values were made up.

The rules, chosen so that a memory estimate errs on the large side and loops end:
- numbers: 1 (1.0 for floats), so `loss.item() < 1e-3` never stops a loop early and divisions stay finite; an
  integer made from another by adding or subtracting a Python integer (`end = start + size`) keeps that difference;
- truth: what the op that made the boolean most plausibly holds (`isnan` -> False, `isfinite` -> True, kept through
  `any`/`all`/views, flipped by `logical_not`); else, for a test whose one side raises at once (a library's check
  `if x.min() < left: raise ...` on values a mask selected, an `assert`), the other side: a program that runs on a
  GPU passes its own checks on its own data; otherwise True. A test asked inside a `while` loop of the function
  that asks it (the loop's condition, an `if ...: break` in its body) turns False after `MAX_TRUE_STAND_INS`
  answers at one place in one (iteration, phase), so `while mask.any():` ends; every other test (a library's
  argument validation, `constraint.check(value)` on every torch.distributions object, run anew in each call) keeps
  its answer however often it is asked;
- data-dependent sizes: every element selected (`nonzero`, `masked_select`, boolean-mask indexing), every value
  distinct (`unique`: at most as many as the values' range holds, where the ops that made them fix one:
  `xmem.trace.child.value_bounds`), `bincount` up to the highest value of that range (else `minlength` when given,
  else as long as its input; never shorter than `minlength`), tensor-valued
  `repeat_interleave` as `input.numel() * max(1, repeats.numel())` elements unless `output_size` says, every box
  kept by torchvision's `nms`.
A tensor whose real value is known (copied from the host: `xmem.trace.child.known_values`) is answered with it
instead, for every kind above; a boolean mask so known selects its real count even from a tensor that is not.
Import only in the tracing child, after `xmem.trace.child.fakecuda`.
"""

from __future__ import annotations

import dis
import functools
import os
import sys
import weakref
from types import CodeType, FrameType
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from xmem.trace.errors import as_on_a_gpu
from xmem.trace.wire import Note, NoteKind

aten = torch.ops.aten

SCALAR_WARNING = "tensor.item()/float()/bool() returned a stand-in value (no real data under fake CUDA)"
BINCOUNT_RANGE_WARNING = ("bincount() counted bins up to the highest value its input's range allows (no real "
                          "data under fake CUDA)")
BINCOUNT_MINLENGTH_WARNING = "bincount() took its minlength bins, as if every value were below it (no real data)"
SELECTION_WARNING = "nonzero()/boolean-mask selections assumed every element selected (no real data under fake CUDA)"
MAX_TRUE_STAND_INS = 100
_HANDLERS = frozenset({"__torch_function__", "__torch_dispatch__"})
# the function of nn.init.trunc_normal_ whose loop redraws until every value is in bounds (StandIns._redraw_truth)
_TRUNC_NORMAL_CODE = getattr(getattr(torch.nn.init, "_no_grad_trunc_normal_", None), "__code__", None)
_INTERNAL_FILES = (f"{os.sep}xmem{os.sep}trace{os.sep}", f"torch{os.sep}_", "_python_dispatch.py", "overrides.py")

# Boolean tensors whose stand-in truth is known from the op (training code asks "no NaN?", "all finite?").
_BOOL_TRUTH = {"isnan": False, "isinf": False, "isposinf": False, "isneginf": False, "isfinite": True}
_BOOL_KEEP = {"any", "all", "view", "reshape", "_unsafe_view", "squeeze", "unsqueeze", "clone", "_to_copy", "select",
              "expand", "alias", "detach", "lift_fresh"}
_BOOL_FLIP = {"logical_not", "bitwise_not"}
# (return_inverse, return_counts) argument positions of each unique op; None: the op has no such argument
_UNIQUE_OPS = {"_unique2": (2, 3), "_unique": (2, None), "unique_dim": (3, 4), "unique_consecutive": (1, 2)}


class StandIns:
    """The stand-in answers of one trace; `warn(message)` reports each kind once; `where()` names the trace's
    position (iteration, phase) for the loop-ending rule."""

    def __init__(self, warn: Callable[[str], None], where: Callable[[], tuple]) -> None:
        self.warn = warn
        self.where = where
        # told of each stand-in for a value that is not GPU data (the self-audit flags one for a host tensor:
        # xmem.trace.child.facts)
        self.on_stand_in: Callable[[torch.Tensor, str], None] = lambda tensor, what: None
        # host tensors holding GPU data (id -> the finalizer that forgets it): see note_host_results
        self._from_gpu: dict[int, weakref.finalize] = {}
        # the real value of a fake tensor where it is known, else None (the recorder's KnownValues.value)
        self.known_value: Callable[[Any], torch.Tensor | None] = lambda tensor: None
        # the (lowest, highest) of an integer tensor's values where the ops that made it fix them, else None (the
        # recorder's ValueBounds.of)
        self.value_range: Callable[[Any], tuple[int, int] | None] = lambda tensor: None
        self._true_answers: dict[tuple, int] = {}
        self._redraw_asks: dict[int, int] = {}  # trunc_normal_'s loop: checks so far per running call (its frame)
        # The code that was handed stand-in values: a check the program makes there may fail on them (whose fault
        # that is: xmem.trace.child.attribution).
        self.asked_in: set[CodeType] = set()
        # Where a size that depends on GPU values was stood in (the code that asked -> "op() at file:line"): shapes
        # made from it are not the program's (xmem.trace.child.attribution)
        self.sized_in: dict[CodeType, str] = {}

    def note_host_results(self, args: tuple, kwargs: dict, out: Any) -> None:
        """After a fake op: remember the host tensors it made from GPU data (an argument on the GPU, or a host tensor
        so made), e.g. `metric.cpu().detach()`. A program reads GPU values through such copies (`.numpy()` needs a
        host tensor), and a stand-in for them stands for GPU data, as `.item()` of a GPU tensor does; only the value
        of another host tensor is one a real run computes on the host. Cheap for most ops: their outputs are on the
        GPU."""
        if isinstance(out, FakeTensor) and out.fake_device.type != "cpu":
            return  # the usual op: one output, on the GPU
        outs = out if isinstance(out, (tuple, list)) else (out,)
        host = [t for t in outs if isinstance(t, FakeTensor) and t.fake_device.type == "cpu"]
        if not host or not any(isinstance(a, FakeTensor) and (a.fake_device.type != "cpu" or id(a) in self._from_gpu)
                               for a in pytree.tree_leaves((args, kwargs))):
            return
        for tensor in host:
            if id(tensor) not in self._from_gpu:
                self._from_gpu[id(tensor)] = weakref.finalize(tensor, self._from_gpu.pop, id(tensor), None)

    def _stood_in(self, tensor: torch.Tensor, what: str) -> None:
        if id(tensor) not in self._from_gpu:
            self.on_stand_in(tensor, what)

    def _note_asker(self) -> None:
        frame = _caller_frame()
        if frame is not None:
            self.asked_in.add(frame.f_code)

    def _note_sizer(self, what: str) -> None:
        frame = _caller_frame()
        if frame is not None and frame.f_code not in self.sized_in:
            what = what if what.startswith("a ") else f"{what}()"
            self.sized_in[frame.f_code] = f"{what} at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"

    # ---- scalars ------------------------------------------------------------------------------------------------
    def scalar(self, tensor: torch.Tensor) -> Any:
        value = self.known_value(tensor)
        if value is not None:
            with unset_fake_temporarily():
                return value.item()
        self._stood_in(tensor, "tensor.item()")
        self.warn(Note(NoteKind.SCALAR_STAND_IN, SCALAR_WARNING))
        self._note_asker()
        if tensor.dtype == torch.bool:
            truth = getattr(tensor, "_xmem_truth", None)
            return self.unknown_truth() if truth is None else truth
        if tensor.dtype.is_floating_point:
            return 1.0
        if tensor.dtype.is_complex:
            return complex(1.0)
        offset = getattr(tensor, "_xmem_offset", None)
        if offset is None:
            return 1
        base = offset[0]()
        return (1 if base is None else self.scalar(base)) + offset[1]

    def unknown_truth(self) -> bool:
        frame = _caller_frame()
        if frame is not None and frame.f_code is _TRUNC_NORMAL_CODE:
            return self._redraw_truth(frame)
        raising = None if frame is None else _truth_that_raises(frame.f_code, frame.f_lasti)
        if raising is not None:
            return not raising  # a program that runs on a GPU passes its own checks on its own data
        if frame is None or not _in_while_loop(frame.f_code, frame.f_lasti):
            return True  # no loop waits on it here: the same answer every time
        key = (frame.f_code.co_filename, frame.f_lineno, *self.where())
        self._true_answers[key] = count = self._true_answers.get(key, 0) + 1
        if count <= MAX_TRUE_STAND_INS:
            return True
        self.warn(Note(NoteKind.LOOP_ENDED, f"a condition on tensor data was answered True {MAX_TRUE_STAND_INS} "
                                            "times at one place; answered False from then on, to end the loop",
                       MAX_TRUE_STAND_INS))
        return False

    def _redraw_truth(self, frame: FrameType) -> bool:
        """Whether nn.init.trunc_normal_'s rejection loop (torch 2.14's _no_grad_trunc_normal_: redraw the values
        outside [a, b] until none is) goes on at this check. On a GPU it goes on while some element is still out of
        bounds: with p the chance that a draw lands inside (the function's own `p`) and n elements, n * (1 - p) ** j
        are expected out at the j-th check, so True while that is at least one. The usual init (std 0.02 in
        [-2, 2]) ends at its first check; 100 stand-in redraws of every weight were neither fast nor the GPU's."""
        key = id(frame)
        asks = self._redraw_asks[key] = self._redraw_asks.get(key, 0) + 1
        inside, tensor = frame.f_locals.get("p"), frame.f_locals.get("tensor")
        expected_out = tensor.numel() * (1.0 - inside) ** asks \
            if isinstance(inside, float) and isinstance(tensor, torch.Tensor) else 0.0
        if expected_out >= 1.0:
            return True
        del self._redraw_asks[key]
        return False

    def equal(self, op: str, args: tuple = ()) -> bool:
        values = [self.known_value(arg) for arg in args[:2]]
        if len(values) == 2 and all(value is not None for value in values):
            with unset_fake_temporarily():
                return getattr(torch, op)(*values, *args[2:])
        self.warn(Note(NoteKind.TENSORS_EQUAL, f"torch.{op}() on fake CUDA tensors answered True (no real data under "
                                               "fake CUDA)", op))
        self._note_asker()
        return True

    # ---- data-dependent output sizes --------------------------------------------------------------------------
    def dynamic_shape(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Outputs whose size depends on tensor data, at the sizes the module docstring states."""
        name = func._opname
        x = args[0]
        if name == "_pack_padded_sequence":
            return self._packed_from_host_lengths(func, args, kwargs)
        self._stood_in(x, f"the size of {name}()")
        if name not in ("index", "masked_select"):  # a mask's count may be known: _selected
            self._note_sizer(name)
        if name in _UNIQUE_OPS:
            self.warn(Note(NoteKind.UNIQUE_ASSUMED_DISTINCT,
                           "unique() assumed every value distinct (no real data under fake CUDA)"))
            return _unique_upper_bound(name, x, args, kwargs, self.value_range(x))
        if name == "bincount":
            return self._bincount(x, args, kwargs)
        if name == "repeat_interleave":
            self.warn(Note(NoteKind.REPEAT_INTERLEAVE_LARGEST,
                           "repeat_interleave() with tensor repeats assumed the largest output (no real data)"))
            repeats = x if len(args) == 1 or not isinstance(args[1], torch.Tensor) else args[1]
            size = kwargs.get("output_size") or x.numel() * max(1, repeats.numel())
            return torch.empty(size, dtype=torch.long if repeats is x else x.dtype, device=x.device)
        if name == "nms":  # torchvision's: the indices of the boxes (N x 4) that it keeps
            self.warn(Note(NoteKind.NMS_KEPT_ALL, "nms() assumed every box kept (no real data under fake CUDA)"))
            return torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        if name == "nonzero":
            self.warn(Note(NoteKind.SELECTION_ASSUMED_ALL, SELECTION_WARNING))
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        if name == "masked_select":
            return torch.empty(self._selected(args[1], torch.broadcast_shapes(x.shape, args[1].shape)),
                               dtype=x.dtype, device=x.device)
        if name == "index" and len(args) > 1:
            indices: list = []
            for index in args[1]:
                if index is not None and index.dtype in (torch.bool, torch.uint8):
                    selected = self._selected(index, index.shape)
                    indices.extend(torch.empty(selected, dtype=torch.long, device=index.device)
                                   for _ in range(index.dim()))
                else:
                    indices.append(index)
            return func(x, indices)
        return None  # no rule: the caller re-raises

    def _bincount(self, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """upstream: one bin per value up to the largest (max(x) + 1), at least `minlength`, none for an empty
        input. The largest value stood in for: the highest its range allows where the ops that made it fix one
        (exact whenever `minlength` covers the range), else the last of the bins the program asked for with
        `minlength` (a class count: torchmetrics' confusion matrix reshapes them), else one bin per element."""
        minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0) or 0
        weights = kwargs.get("weights", args[1] if len(args) > 1 else None)
        dtype = torch.long if weights is None else (torch.double if weights.dtype != torch.float else weights.dtype)
        bounds = self.value_range(x)
        if x.numel() == 0:
            largest = -1
        elif bounds is not None:
            largest = bounds[1]
            if largest >= minlength:
                self.warn(Note(NoteKind.BINCOUNT_TO_RANGE, BINCOUNT_RANGE_WARNING))
        elif minlength:
            largest = minlength - 1
            self.warn(Note(NoteKind.BINCOUNT_MINLENGTH, BINCOUNT_MINLENGTH_WARNING))
        else:
            largest = x.numel() - 1
            self.warn(Note(NoteKind.BINCOUNT_ASSUMED,
                           "bincount() assumed as many bins as input elements (no real data under fake CUDA)"))
        return torch.zeros(max(largest + 1, minlength), dtype=dtype, device=x.device)

    def _packed_from_host_lengths(self, func: Any, args: tuple, kwargs: dict) -> tuple | None:
        """pack_padded_sequence: upstream (`_pack_padded_sequence`, aten's PackedSequence.cpp) takes the lengths on
        the host, as a real tensor, and counts there how many sequences are still running at each time step
        (batch_sizes, a host tensor); the packed data holds one row per element of every sequence. So the host
        kernel runs on the real lengths and a placeholder of the padded input's time and batch sizes (one element a
        step), giving upstream's batch sizes and checks (sorted, positive, one per sequence); the data is a fake of
        the packed size. Lengths on the GPU are refused there as on a GPU; None where their values are unknown."""
        padded, lengths = args[0], args[1]
        batch_first = kwargs.get("batch_first", args[2] if len(args) > 2 else False)
        _lengths_on_the_host(lengths)
        host = self.known_value(lengths) if isinstance(lengths, FakeTensor) else lengths
        if host is None:
            return None
        steps, batch = (padded.shape[1], padded.shape[0]) if batch_first else padded.shape[:2]
        with unset_fake_temporarily():
            placeholder = torch.empty((batch, steps, 1) if batch_first else (steps, batch, 1))
            try:
                data, batch_sizes = func(placeholder, host, batch_first)
            except RuntimeError as error:  # upstream's own check on the program's real values
                raise as_on_a_gpu(error) from None
        return padded.new_empty((data.shape[0], *padded.shape[2:])), batch_sizes

    def _selected(self, mask: torch.Tensor, shape: torch.Size) -> int:
        """How many elements a boolean mask broadcast to `shape` selects: its real count where its value is known,
        else every element (warned)."""
        value = self.known_value(mask)
        if value is None:
            self.warn(Note(NoteKind.SELECTION_ASSUMED_ALL, SELECTION_WARNING))
            self._note_sizer("a boolean-mask selection")
            return shape.numel()
        with unset_fake_temporarily():
            return int(value.broadcast_to(shape).count_nonzero())

    # ---- Python-level ways out of a tensor ---------------------------------------------------------------------
    def install_python_protocols(self) -> None:
        """FakeTensor's `__format__`, `tolist`, `numpy`/`__array__`: stand-ins instead of errors (process-global)."""
        original_numpy = torch.Tensor.numpy
        original_tolist = torch.Tensor.tolist
        original_format = torch.Tensor.__format__
        stand_ins = self

        def numpy(tensor: torch.Tensor, *, force: bool = False) -> Any:
            if not isinstance(tensor, FakeTensor):
                return original_numpy(tensor, force=force)
            value = stand_ins.known_value(tensor)
            if value is not None:  # a private copy: the program may write into the array
                return original_numpy(value, force=force).copy()
            stand_ins._stood_in(tensor, "tensor.numpy()")
            stand_ins._note_asker()
            stand_ins.warn(Note(NoteKind.VALUES_READ_AS_ONES, "tensor.numpy() returned ones (no real data under fake "
                                                              "CUDA)", "numpy"))
            return _ones_like_on_host(tensor).numpy()

        def tolist(tensor: torch.Tensor) -> Any:
            if not isinstance(tensor, FakeTensor):
                return original_tolist(tensor)
            value = stand_ins.known_value(tensor)
            if value is not None:
                return original_tolist(value)
            stand_ins._stood_in(tensor, "tensor.tolist()")
            stand_ins._note_asker()
            stand_ins.warn(Note(NoteKind.VALUES_READ_AS_ONES, "tensor.tolist() returned ones (no real data under fake "
                                                              "CUDA)", "tolist"))
            return original_tolist(_ones_like_on_host(tensor))

        def format_(tensor: torch.Tensor, spec: str) -> str:
            if not isinstance(tensor, FakeTensor):
                return original_format(tensor, spec)
            if tensor.dim() == 0:
                return format(tensor.item(), spec)  # the scalar stand-in, warned once as such
            return format(repr(tensor), spec if spec and not spec[-1:].isalpha() else "")

        torch.Tensor.numpy = numpy
        torch.Tensor.tolist = FakeTensor.tolist = tolist  # FakeTensor's own goes element by element
        torch.Tensor.__format__ = format_
        FakeTensor.data_ptr = fake_data_ptr


def fake_data_ptr(tensor: torch.Tensor) -> int:
    """A fake tensor's address, distinct per storage as a GPU's: upstream's is 0 for every fake (its meta storage),
    and programs key tensors by it. accelerate's FSDP2 preparation maps each optimizer parameter to its sharded
    one by `data_ptr()`: with one key for all, every parameter of a fake-loaded model became the last one, and the
    optimizer stepped (and kept state for) one parameter. The storage's own identity (its StorageImpl's address,
    shared by its views) stands in for its base; an empty storage has none (0), as a freed or unallocated one.
    The address is never one the host can read: a native extension handed it (ctypes, a C library given a GPU
    tensor's pointer) faults, as on a GPU where device memory is not the host's, instead of reading or writing the
    tracer's heap. So it lies above the canonical 47-bit user space (bit 62 set; still a positive int64), one
    256 KiB slot per storage (its StorageImpl's 16-byte-aligned address, shifted), a view's offset inside it."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return 0
    return FAKE_ADDRESS_BASE + ((storage._cdata >> 4) << 18) + tensor.storage_offset() * tensor.element_size()


FAKE_ADDRESS_BASE = 1 << 62


def _lengths_on_the_host(lengths: torch.Tensor) -> None:
    """upstream's _pack_padded_sequence refuses lengths on the GPU: so does the trace, as the program's error. Raised
    while the recorder handles the fake mode's refusal of the op, which is not the cause (`from None`)."""
    if lengths.device.type != "cpu":
        raise as_on_a_gpu(RuntimeError(f"pack_padded_sequence takes its lengths as a 1D CPU int64 tensor (upstream's "
                                       f"_pack_padded_sequence refuses them on {lengths.device})")) from None


def _ones_like_on_host(tensor: torch.Tensor) -> torch.Tensor:
    with unset_fake_temporarily():
        dtype = tensor.dtype if tensor.dtype not in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2) \
            else torch.float32
        return torch.ones(tuple(tensor.shape), dtype=dtype)


def guess_truth(tensor: torch.Tensor, op: str, args: tuple) -> None:
    """Remember what a boolean result most plausibly holds, for a later `.item()`/`if` on it."""
    if op in _BOOL_TRUTH:
        tensor._xmem_truth = _BOOL_TRUTH[op]
    elif args and isinstance(args[0], torch.Tensor) and hasattr(args[0], "_xmem_truth"):
        if op in _BOOL_KEEP:
            tensor._xmem_truth = args[0]._xmem_truth
        elif op in _BOOL_FLIP:
            tensor._xmem_truth = not args[0]._xmem_truth


def note_offset(tensor: torch.Tensor, op: str, args: tuple) -> None:
    """Remember that a 0-d integer tensor is another one plus or minus a Python integer (`end = start + size`), so
    that its stand-in keeps that difference from the other's: coqui-tts's VITS slices `x[:, start:start + size]`
    with a random start on the GPU, and stand-ins of 1 for both ends made the slice empty."""
    sign = OFFSET_OPS[op]
    if len(args) < 2 or tensor.dim() != 0 or tensor.dtype.is_floating_point or tensor.dtype.is_complex \
            or tensor.dtype == torch.bool:
        return
    base, number = args[0], args[1]
    if isinstance(base, torch.Tensor) and base.dim() == 0 and type(number) is int:
        # weakly: the base's block is freed when the program drops it, as on a GPU (a counter `i = i + 1` would
        # otherwise keep every earlier one alive); a base gone by then counts as its own stand-in, 1
        tensor._xmem_offset = (weakref.ref(base), sign * number)


OFFSET_OPS = {"add": 1, "sub": -1}  # (note_offset) the ops, and the sign each gives its number


def _unique_upper_bound(name: str, x: torch.Tensor, args: tuple, kwargs: dict,
                        bounds: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
    """(values, inverse, counts) of a unique op with every value distinct, as many as there are elements or, for
    values within a known range, as the range holds; unrequested parts are empty."""
    inverse_at, counts_at = _UNIQUE_OPS[name]

    def asked(position: int | None, keyword: str) -> bool:
        if position is None:
            return False
        return bool(kwargs.get(keyword, args[position] if len(args) > position else False))

    distinct = x.numel() if bounds is None else min(x.numel(), bounds[1] - bounds[0] + 1)
    values = torch.empty(distinct if name != "unique_dim" else x.shape, dtype=x.dtype, device=x.device)
    inverse = torch.empty(x.shape if asked(inverse_at, "return_inverse") else 0, dtype=torch.long, device=x.device)
    if counts_at is None:
        return values, inverse
    counts = torch.empty(distinct if asked(counts_at, "return_counts") else 0, dtype=torch.long, device=x.device)
    return values, inverse, counts


def _caller_frame() -> FrameType | None:
    """The innermost frame outside the tracer and torch's dispatch machinery: the code that asked. A torch function
    mode's handler is machinery too, wherever it is defined: under `with torch.device("cuda")` every tensor method
    passes through DeviceContext.__torch_function__ (torch/utils/_device.py), and a `while True: ... if not
    mask.any(): break` loop (nn.init.trunc_normal_'s rejection sampling) must be found in its own frame."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_name in _HANDLERS or
                                 any(part in frame.f_code.co_filename for part in _INTERNAL_FILES)):
        frame = frame.f_back
    return frame


def _in_while_loop(code: CodeType, offset: int) -> bool:
    """Whether the instruction at `offset` lies inside a `while` loop of `code`."""
    return any(start <= offset <= end for start, end in _while_loops(code))


@functools.lru_cache(maxsize=1024)
def _while_loops(code: CodeType) -> tuple[tuple[int, int], ...]:
    """The (first, last) offsets of the loops in `code` that are not `for` loops: each backward jump and its target,
    less those that go back to a `for` loop's FOR_ITER (which ends with its iterable) or an await's SEND. Read from
    the bytecode of the interpreter that runs it, so a multi-line condition or `while True: ... break` counts too."""
    instructions = list(dis.get_instructions(code))
    names = {instruction.offset: instruction.opname for instruction in instructions}
    return tuple((instruction.argval, instruction.offset) for instruction in instructions
                 if instruction.opcode in _JUMPS and isinstance(instruction.argval, int)
                 and instruction.argval <= instruction.offset and names.get(instruction.argval) not in _NOT_WHILE)


_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)
_NOT_WHILE = ("FOR_ITER", "SEND")


def _truth_that_raises(code: CodeType, offset: int) -> bool | None:
    """The answer to the test at `offset` after which the code raises at once (`if x.min() < left: raise ...`,
    the `assert`'s False), where only one answer does; else None. The side an answer takes is read from the
    conditional jump that asks (a `TO_BOOL` before it, from Python 3.13): the jump's target for the truth it jumps
    on, the next instruction for the other; that side raises when a RAISE_VARARGS comes before any other jump or
    return."""
    instructions = _instructions(code)
    at = next((i for i, instruction in enumerate(instructions) if instruction.offset == offset), None)
    if at is not None and instructions[at].opname == "TO_BOOL" and at + 1 < len(instructions):
        at += 1
    if at is None or at + 1 >= len(instructions):
        return None
    jump = instructions[at]
    jumps_on = _JUMPS_ON.get(jump.opname.replace("FORWARD_", "").replace("BACKWARD_", ""))
    if jumps_on is None:
        return None
    target = next((i for i, instruction in enumerate(instructions) if instruction.offset == jump.argval), None)
    jumped_raises = target is not None and _raises_at_once(instructions, target)
    if jumped_raises == _raises_at_once(instructions, at + 1):
        return None
    return jumps_on if jumped_raises else not jumps_on


def _raises_at_once(instructions: tuple, start: int) -> bool:
    """Whether the straight-line code from the `start`-th instruction reaches a `raise` before it can go elsewhere."""
    for instruction in instructions[start:]:
        if instruction.opname == "RAISE_VARARGS":
            return True
        if instruction.opcode in _JUMPS or instruction.opname.startswith(("RETURN", "YIELD", "RERAISE")):
            return False
    return False


@functools.lru_cache(maxsize=1024)
def _instructions(code: CodeType) -> tuple:
    return tuple(dis.get_instructions(code))


# a conditional jump's opcode (Python 3.11's with FORWARD_/BACKWARD_ taken out) -> the truth it jumps on
_JUMPS_ON = {"POP_JUMP_IF_TRUE": True, "POP_JUMP_IF_FALSE": False, "JUMP_IF_TRUE_OR_POP": True,
             "JUMP_IF_FALSE_OR_POP": False}
