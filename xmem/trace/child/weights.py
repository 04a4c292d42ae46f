"""Weights on disk are never read: checkpoints load as fake tensors made from their metadata.

Owns the patches of the checkpoint entry points: safetensors' `safe_open` (and `safetensors.torch.load_file`,
which opens through it), `torch.load` and `nn.Module.load_state_dict`. The rule:

* A load bound for the GPU gives fake tensors, made from the file's metadata only: safetensors' JSON header, or the
  pickle of a torch checkpoint (torch's FakeTensorMode-aware loading makes each storage a meta storage that knows
  its offset in the file). Bound for the GPU: a safetensors `device` on cuda; a `torch.load` whose `map_location`
  (or, without one, the checkpoint's saved location) puts tensors on cuda; every load made while a
  `from_pretrained` runs (transformers, peft, diffusers...: pretrained weights are loaded to be trained on the GPU,
  whatever device they pass through on the way).
* A load bound for the CPU stays real and memory-mapped (safetensors' own mmap backend; `torch.load(mmap=True)` for
  a checkpoint file in torch's zip format): its pages are read only where the program computes on them on the CPU.
  A `torch.load` whose tensors go partly to cuda takes those from the fake load and the rest from the mapped one.
* `load_state_dict` of memory-mapped checkpoint tensors into a CPU module of the same shapes and dtypes points the
  module's tensors at the mapped data instead of copying it (the Parameter objects stay, so an optimizer built
  before keeps them), so that moving the module to the GPU afterwards reads nothing either.

* `torch.save` writes for real, into the sandbox (never the user's files): host data round-trips, and what the GPU
  holds (fake tensors) is written as metadata only (torch's own `skip_data` layout: each such storage a record of
  its size with nothing written, a hole in the file), so that a later `torch.load` of it gives fakes of the same
  shapes, dtypes and devices by the rule above. A path is opened through Python's `open`, as is the path a load
  maps, so that the fallback sandbox, which redirects Python's file APIs, sees those writes and reads too.

`install(fake_context)` applies the patches once per process (the tracing child); `fake_context()` must return a
context in which new tensors are fake and recorded (the child's FakeTensorMode, with the recorder above it).
Import only in the tracing child, after `xmem.trace.child.fakecuda`.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections import OrderedDict
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils import _pytree as pytree

from xmem.trace.errors import as_on_a_gpu  # a corrupt checkpoint fails on a GPU too: the program's error
from xmem.trace.wire import Note, NoteKind

FakeContext = Callable[[], AbstractContextManager]

# safetensors' dtype names (the format's spec) -> torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100 << 20  # safetensors refuses larger headers too

_fake_context: FakeContext | None = None
MAPPED = "_xmem_mapped"  # the attribute marking a tensor of a memory-mapped torch checkpoint (real, unread)
_mapped_files: set[tuple[int, int]] = set()  # (device, inode) of each checkpoint file a load mapped


def install(fake_context: FakeContext) -> None:
    """Patch the checkpoint entry points (once per process)."""
    global _fake_context
    if _fake_context is not None:
        _fake_context = fake_context
        return
    _fake_context = fake_context
    torch.load = _make_load(torch.load)
    torch.save = _make_save(torch.save)
    torch.serialization._save = _fakes_as_metadata(torch.serialization._save)
    torch.nn.Module.load_state_dict = _make_load_state_dict(torch.nn.Module.load_state_dict)
    _patch_safetensors()
    # transformers materialises checkpoint tensors on a thread pool to overlap file reads; nothing is read here,
    # and the fake tensors' one mode must not be entered by several threads at once (its kernel-invocation state)
    os.environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")


# ---- where a load is bound ----------------------------------------------------------------------------------------
def _is_cuda(device: Any) -> bool:
    """A device as the loaders take it: an int (safetensors: a CUDA index), a name or a torch.device."""
    if device is None:
        return False
    if isinstance(device, int):
        return True
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):
        return False


def _inside_from_pretrained() -> bool:
    """Whether a `from_pretrained` is on the stack (asked once per file opened: cheap)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "from_pretrained":
            return True
        frame = frame.f_back
    return False


def _make_fake(shape: Any, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A fake tensor of a checkpoint entry, on `device`, the host included: a host tensor made by the fake mode's
    factories would be real there (host work runs for real), and a 7B-70B checkpoint loaded to the host first
    (then converted to fp32 by transformers' loader, then sharded) would be allocated, converted and touched for
    real, 2-3 s per GB on 2 cores, for values no GPU figure depends on."""
    assert _fake_context is not None, "weights.install() was not called"
    with _fake_context():
        if torch.device(device).type != "cpu":
            return torch.empty(tuple(shape), dtype=dtype, device=device)
        mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        with unset_fake_temporarily():
            meta = torch.empty(tuple(shape), dtype=dtype, device="meta")
        return FakeTensor(mode, meta, torch.device("cpu"))


# ---- safetensors ----------------------------------------------------------------------------------------------------
def read_safetensors_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of a safetensors file: {name: {dtype, shape, data_offsets}, "__metadata__": {...}}. Reads
    8 + header bytes, nothing of the data."""
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) != 8:
            raise as_on_a_gpu(OSError(f"{path}: not a safetensors file (shorter than its header length)"))
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise as_on_a_gpu(OSError(f"{path}: not a safetensors file (header of {length} bytes)"))
        return json.loads(file.read(length))


class FakeSafeOpen:
    """`safetensors.safe_open` whose tensors are fake, made from the header on `device` (its API for torch)."""

    def __init__(self, filename: str | os.PathLike, framework: str = "pt", device: Any = "cpu", **_: Any) -> None:
        self._header = read_safetensors_header(filename)
        self._metadata = self._header.pop("__metadata__", None)
        self._device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)

    def __enter__(self) -> "FakeSafeOpen":
        return self

    def __exit__(self, *exc: Any) -> None: ...

    def close(self) -> None: ...

    def keys(self) -> list[str]:
        return sorted(self._header)

    def offset_keys(self) -> list[str]:
        return sorted(self._header, key=lambda name: self._header[name]["data_offsets"][0])

    def metadata(self) -> dict[str, str] | None:
        return self._metadata

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self._header[name]
        return _make_fake(entry["shape"], SAFETENSORS_DTYPES[entry["dtype"]], self._device)

    def get_tensors(self) -> dict[str, torch.Tensor]:
        return {name: self.get_tensor(name) for name in self.offset_keys()}

    def get_slice(self, name: str) -> "FakeSlice":
        return FakeSlice(self._header[name], self._device)


class FakeSlice:
    """safetensors' PySafeSlice: shape and dtype from the header; indexing makes the selected part, compact."""

    def __init__(self, entry: dict[str, Any], device: torch.device) -> None:
        self._entry, self._device = entry, device

    def get_shape(self) -> list[int]:
        return list(self._entry["shape"])

    def get_dtype(self) -> str:
        return self._entry["dtype"]

    def __getitem__(self, index: Any) -> torch.Tensor:
        shape = torch.empty(self._entry["shape"], device="meta")[index].shape
        return _make_fake(shape, SAFETENSORS_DTYPES[self._entry["dtype"]], self._device)


def _patch_safetensors() -> None:
    try:
        import safetensors
        import safetensors.torch
    except ImportError:  # the program cannot use it either
        return
    original = safetensors.safe_open

    def safe_open(filename: Any, framework: str, device: Any = "cpu", **kwargs: Any) -> Any:
        if framework in ("pt", "torch") and (_is_cuda(device) or _inside_from_pretrained()):
            return FakeSafeOpen(filename, framework, device if _is_cuda(device) else "cpu")
        return original(filename, framework, device=device, **kwargs)

    safetensors.safe_open = safe_open
    safetensors.torch.safe_open = safe_open  # load_file opens through the name it imported
    _rebind_imported(original, safe_open)


def _rebind_imported(original: Any, patched: Any) -> None:
    """Modules imported before the patch that took `safe_open` by name (`from safetensors import safe_open`:
    transformers.modeling_utils) get the patched one: in the warm tracer the server imported them before any job
    (a cold trace imports them after), and through the name they hold a from_pretrained read every weight."""
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if isinstance(names, dict) and names.get("safe_open") is original:
            names["safe_open"] = patched


# ---- torch.load -----------------------------------------------------------------------------------------------------
def _make_load(original: Callable) -> Callable:
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        start = _checkpoint_start(f)
        if map_location == "meta" or start is None:
            return original(f, map_location, *args, **kwargs)
        try:
            assert _fake_context is not None
            with _fake_context():  # torch's fake-aware loading: meta storages with their file offsets
                fake = original(f, map_location, *args, **kwargs)
        except Exception:  # noqa: BLE001 - what torch would say (a bad file, weights_only) comes from the real load
            _rewind(f, start)
            return original(f, map_location, *args, **kwargs)
        if _inside_from_pretrained() or _all_bound_for_cuda(fake):
            return fake
        is_path = isinstance(f, (str, os.PathLike))
        if kwargs.get("mmap") is None and is_path:
            kwargs["mmap"] = True
        _rewind(f, start)
        try:
            with unset_fake_temporarily():  # torch loads onto meta wherever a fake mode is active: the program's is
                real = original(_opened_path(f) if kwargs.get("mmap") else f,
                                "cpu" if _any_bound_for_cuda(fake) else map_location, *args, **kwargs)
        except RuntimeError as error:
            if not any(sign in str(error) for sign in OUT_OF_HOST_MEMORY):
                raise
            # the trace's host-memory limit, not the job's (a mapping counts at its full size): past it the host
            # tensors are fake, as model tensors past the host budget are born
            _say(Note(NoteKind.CHECKPOINT_ON_HOST_FAKE, "checkpoint tensors loaded to the host past the trace's "
                      "memory limit are fake (no real values): host-side code that reads their values gets stand-ins"))
            return fake
        if kwargs.get("mmap") and is_path:
            identity = _file_identity(f)
            if identity is not None:
                _mapped_files.add(identity)
        for leaf in pytree.tree_leaves(real):
            if isinstance(leaf, torch.Tensor) and kwargs.get("mmap"):
                setattr(leaf, MAPPED, True)
        return _merge(fake, real)
    return load


# What torch says when the host memory for a load is refused (a mapping: ENOMEM; an allocation: its CPU allocator)
OUT_OF_HOST_MEMORY = ("Cannot allocate memory", "can't allocate memory")


def _say(warning: str) -> None:
    import xmem.trace.child.fakecuda as fakecuda
    if fakecuda._installed is not None:
        fakecuda._installed.on_warning(warning)


def _opened_path(f: Any) -> Any:
    """The file a path names as Python's `open` finds it: the fallback sandbox redirects Python's file APIs into its
    copy-on-write directory, and torch maps a checkpoint (mmap=True) by name, past them."""
    try:
        with open(f, "rb") as file:
            return file.name
    except OSError:
        return f


def _checkpoint_start(f: Any) -> int | None:
    """Where a checkpoint in torch's zip format (the one torch.save writes) starts: 0 for a path to one, the position
    of a seekable file object at one (loaded twice: fake, then real); None for anything else."""
    try:
        if isinstance(f, (str, os.PathLike)):
            with open(f, "rb") as file:
                return 0 if file.read(4) == b"PK\x03\x04" else None
        if not (hasattr(f, "seekable") and f.seekable() and hasattr(f, "read")):
            return None
        start = f.tell()
        magic = f.read(4)
        f.seek(start)
        return start if magic == b"PK\x03\x04" else None
    except (OSError, ValueError):
        return None


def _rewind(f: Any, start: int) -> None:
    if not isinstance(f, (str, os.PathLike)):
        f.seek(start)


def _bound_for_cuda(leaf: Any) -> bool:
    if isinstance(leaf, torch.Tensor):
        return leaf.device.type == "cuda"
    if isinstance(leaf, torch.nn.Module):
        return any(t.device.type == "cuda" for t in [*leaf.parameters(), *leaf.buffers()])
    return False


def _tensor_leaves(tree: Any) -> list[Any]:
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, (torch.Tensor, torch.nn.Module))]


def _all_bound_for_cuda(tree: Any) -> bool:
    leaves = _tensor_leaves(tree)
    return bool(leaves) and all(_bound_for_cuda(leaf) for leaf in leaves)


def _any_bound_for_cuda(tree: Any) -> bool:
    return any(_bound_for_cuda(leaf) for leaf in _tensor_leaves(tree))


def _merge(fake: Any, real: Any) -> Any:
    """The loaded object with cuda-bound leaves from the fake load and the others from the real (mapped) one."""
    fake_leaves, fake_spec = pytree.tree_flatten(fake)
    real_leaves, real_spec = pytree.tree_flatten(real)
    if fake_spec != real_spec:  # objects pytree does not open hold the tensors: the fake load as a whole
        return fake
    return pytree.tree_unflatten([f if _bound_for_cuda(f) else r for f, r in zip(fake_leaves, real_leaves)],
                                 real_spec)


# ---- torch.save -----------------------------------------------------------------------------------------------------
def _make_save(original: Callable) -> Callable:
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        # the legacy format (`_use_new_zipfile_serialization=False`) copies every storage to the host, which a fake
        # tensor's cannot be: the zip format, which torch.load reads as well, is written instead
        args = args[:2] + (True,) + args[3:] if len(args) > 2 else args
        kwargs.pop("_use_new_zipfile_serialization", None)
        if not isinstance(f, (str, os.PathLike)):
            return original(obj, f if _seekable(f) else _ForwardOnly(f), *args, **kwargs)
        if _file_identity(f) in _mapped_files:
            return _save_beside(original, obj, f, args, kwargs)
        with open(f, "wb") as file:  # torch's writer would open a path from C++, past the fallback sandbox
            return original(obj, file, *args, **kwargs)
    return save


def _save_beside(original: Callable, obj: Any, f: Any, args: tuple, kwargs: dict) -> None:
    """Save over a checkpoint that a load mapped, whose tensors may still be alive (ultralytics' strip_optimizer
    saves the checkpoint it has just loaded under the same name). Truncated in place, the file would take the pages
    from under them (SIGBUS at their next read), where the program, whose load read the file into memory, loses
    nothing: the new file is written beside it and takes its name, and the mapped one lives on, unnamed."""
    beside = f"{os.fsdecode(f)}.xmem-{os.getpid()}"
    with open(beside, "wb") as file:
        original(obj, file, *args, **kwargs)
    os.replace(beside, f)


def _seekable(f: Any) -> bool:
    seekable = getattr(f, "seekable", None)
    return callable(seekable) and bool(seekable())


class _ForwardOnly:
    """A stream that cannot seek (a zip member opened for writing: stable-baselines3 saves its policy so), as torch's
    writer sees it. A fake tensor's storage record is written as metadata only: torch's writer steps over its bytes
    with `seek(size, SEEK_CUR)`, leaving a hole that reads as zeros. A stream that cannot seek gets the zeros
    written instead, the bytes the hole stands for, as torch.save writes every record of such a stream in order."""

    ZEROS = bytes(1 << 20)

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_CUR or offset < 0:
            return self._stream.seek(offset, whence)  # the stream's own error: only a step forward is written
        for start in range(0, offset, len(self.ZEROS)):
            self._stream.write(self.ZEROS[:min(len(self.ZEROS), offset - start)])
        return offset

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _file_identity(path: Any) -> tuple[int, int] | None:
    """(device, inode) of the file a path names, opened through Python's `open` as the fallback sandbox redirects
    it; None where it cannot be opened."""
    try:
        with open(path, "rb") as file:
            info = os.fstat(file.fileno())
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _fakes_as_metadata(save_records: Callable) -> Callable:
    """torch.serialization._save (pickle `obj`, then one record per storage, "data/0", "data/1"...) that writes the
    fake tensors' storages as metadata only and every other storage's bytes.

    torch's `skip_data(materialize_fake_tensors=True)` pickles a FakeTensor as a plain tensor whose storage is saved
    at the fake's device, and writes each storage's record without its bytes (`write_record_metadata`). It is
    all-or-nothing; the records are written one by one in key order, reading the flag before each, so the flag is
    set for each record from whether its storage is fake (a meta storage: only fake tensors have one that is saved).
    """
    from torch.serialization import _serialization_tls

    def save_fake_storages_as_metadata(obj: Any, zip_file: Any, pickle_module: Any, pickle_protocol: Any,
                                       *args: Any, **kwargs: Any) -> None:
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            fake = [storage.device.type == "meta" for storage in _storages_in_key_order(obj, pickle_module,
                                                                                        pickle_protocol)]
            if not any(fake):
                _serialization_tls.skip_data = False
                return save_records(obj, zip_file, pickle_module, pickle_protocol, *args, **kwargs)
            records = _RecordsBySkip(zip_file, fake, _serialization_tls)
            return save_records(obj, records, pickle_module, pickle_protocol, *args, **kwargs)

    return save_fake_storages_as_metadata


def _storages_in_key_order(obj: Any, pickle_module: Any, protocol: Any) -> list[torch.UntypedStorage]:
    """The storages `_save` will write, in the order of their keys: its pickler's `persistent_id` keys each storage
    (a TypedStorage's untyped one) by its StorageImpl address, numbered as first met. Found by the same pickling,
    its bytes thrown away."""
    order: dict[int, torch.UntypedStorage] = {}

    class StorageCollector(pickle_module.Pickler):  # type: ignore[name-defined, misc]
        def persistent_id(self, value: Any) -> Any:
            if isinstance(value, torch.storage.TypedStorage) or torch.is_storage(value):
                storage = value._untyped_storage if isinstance(value, torch.storage.TypedStorage) else value
                order.setdefault(storage._cdata, storage)
                return "storage"
            return None

    StorageCollector(_Discard(), protocol=protocol).dump(obj)
    # the class is garbage in a cycle (as every class) that holds `order` through its method's closure until the
    # collector runs: emptied here, or the saved GPU tensors would outlive the program's last reference to them
    storages = list(order.values())
    order.clear()
    return storages


class _Discard:
    def write(self, data: Any) -> int:
        return len(data)


class _RecordsBySkip:
    """The zip writer `_save` writes into, which sets torch's skip-data flag for each storage record before `_save`
    reads it: on for a fake tensor's storage (its size, no bytes), off for a host one (its bytes)."""

    def __init__(self, writer: Any, fake: list[bool], flags: Any) -> None:
        self._writer, self._fake, self._flags, self._storages = writer, fake, flags, 0
        flags.skip_data = True  # while pickling: fake tensors are pickled as tensors at their device

    def write_record(self, name: str, *args: Any) -> None:
        self._writer.write_record(name, *args)
        self._next(name)

    def write_record_metadata(self, name: str, *args: Any) -> None:
        self._writer.write_record_metadata(name, *args)
        self._next(name)

    def _next(self, name: str) -> None:
        if name.startswith("data/"):
            self._storages += 1
        self._flags.skip_data = self._storages < len(self._fake) and self._fake[self._storages]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


# ---- load_state_dict --------------------------------------------------------------------------------------------
def _make_load_state_dict(original: Callable) -> Callable:
    def load_state_dict(self: torch.nn.Module, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if not assign and any(getattr(value, MAPPED, False) for value in state_dict.values()):
            state_dict = _bind_mapped(self, state_dict)
        return original(self, state_dict, strict=strict, assign=assign)
    return load_state_dict


def _bind_mapped(module: torch.nn.Module, state_dict: Any) -> Any:
    """Point the module's real CPU tensors at the mapped checkpoint tensors of the same shape and dtype; the state
    dict handed on names the module's own tensor there, whose copy onto itself torch skips."""
    own = module.state_dict(keep_vars=True)
    bound = OrderedDict(state_dict)
    for name, value in state_dict.items():
        target = own.get(name)
        if (getattr(value, MAPPED, False) and isinstance(target, torch.Tensor) and not isinstance(target, FakeTensor)
                and target.device.type == "cpu" and target.dtype == value.dtype and target.shape == value.shape):
            with torch.no_grad():
                target.data = value
            bound[name] = target
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        bound._metadata = metadata  # type: ignore[attr-defined]
    return bound
