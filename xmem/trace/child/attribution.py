"""Whose fault the exception that ended a traced program is: the fake GPU's ("not_modelled", exit 11) or the
program's own ("user_error", exit 5: what a real GPU would raise too).

Decided from the exception itself (its class, where it was raised) and the exceptions it was raised from, never from
what the program printed. It is the fake GPU's when any exception of the chain is
- NotModelled: raised where the fake world knows what it lacks; its message names it;
- raised by xmem's own code (its innermost frame is in the xmem package), unless marked `errors.as_on_a_gpu`
  or a path's own answer relayed by the sandbox's file APIs (a missing file: the program's, as on the cluster);
- a limit of torch's fake tensor mode: an exception class defined by its modules (UnsupportedOperatorException,
  DataDependentOutputException, ...), except the one that restates a real op's check (FAKE_MODE_AS_ON_A_GPU), or
  the refusal of torch.library.custom_op's fake kernel for an op registered without one (CUSTOM_OP_FILE);
- the CUDA driver or runtime: an exception class of a CUDA binding package (CUDA_BINDINGS);
- a size that depends on values of GPU tensors the fake GPU does not have (`nonzero` of a mask made from model
  weights, a boolean-mask selection, `unique`, `bincount`: StandIns.sized_in), where the error was raised under the
  code that asked for it, or is an op's or a library's refusal (RuntimeError, IndexError, ValueError) after it: the
  shapes that failed were the stand-in's, not the program's;
and, unless the program's own `raise` statement made it (its words are then its own):
- a CUDA library's file named in the error (a failed load: this machine has no driver, and the fake GPU none);
- torch's answers from its real runtime, which has no device here (REAL_CUDA_SIGNS);
- the fake representation seen through: torch's C++ refusing to hand out a storage or data pointer, or finding a
  tensor on `meta` (every GPU tensor here is a FakeTensor over a meta tensor); C++ errors carry no Python origin,
  so these few are known by their words (FAKE_REPRESENTATION).
A non-zero sys.exit made while handling an exception (a command-line framework that prints the error and exits) is
that exception's. The message is one line: what is missing, and where the program reached it (its innermost own
frame; the library in between, when the failure came from one).
"""

from __future__ import annotations

import functools
import os
import re
import site
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import Collection, Iterator, Mapping

from xmem.trace.errors import REAL_CUDA_SIGNS, NotModelled, raised_as_on_a_gpu
from xmem.trace.wire import OFFLINE_BY_THE_TRACE_ENV

XMEM_DIR = str(Path(__file__).resolve().parents[2]) + os.sep  # the xmem package directory
# The sandbox's copy-on-write file APIs stand in for Python's own: a missing file, an existing one, a directory
# where a file was asked (and the reverse) are what the program's path gives on the cluster too. (Its refusals,
# EACCES/EROFS where the job could write, stay ours.)
SANDBOX_FILE = str(Path(__file__).resolve().parents[1] / "sandbox.py")
PATH_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)
# Modules whose exception classes are limits of the fake tensor mode, not of the program.
FAKE_MODE_MODULES = ("torch._subclasses.fake_", "torch.fx.experimental.symbolic_shapes")
# What torch raises when FakeTensorMode declines an op on a tensor subclass it does not know (a plain-data subclass
# such as torchvision's tv_tensors.Image: fake_tensor's _check_for_subclass) and no other handler takes it
DECLINED_BY_FAKE_MODE = "all __torch_dispatch__ handlers returned NotImplemented"
# ...but for these, which restate a check the real op makes on a GPU too (tensors of one op on two devices).
FAKE_MODE_AS_ON_A_GPU = ("FakeTensorDeviceMismatchError",)
# Where torch.library.custom_op's fake kernel refuses an op that has none of its own (no register_fake).
CUSTOM_OP_FILE = os.path.join("torch", "_library", "custom_ops.py")
# Packages that bind the CUDA driver or runtime themselves: their own exceptions mean the driver answered.
CUDA_BINDINGS = ("cupy", "cupy_backends", "pycuda", "cuda.bindings", "cuda.cuda", "cuda.cudart", "numba.cuda")
# A CUDA library's file name in a failed load ("libcudart.so.12: cannot open shared object file").
CUDA_LIBRARY = re.compile(r"\blib(cuda|cudart|nvrtc|cublas\w*|cudnn\w*|nvJitLink|cufft|curand|cusparse)\b[\w.]*")
# What torch's C++ says when it meets a FakeTensor's missing storage or its meta inner tensor.
FAKE_REPRESENTATION = re.compile(r"Cannot access (storage|data pointer)|doesn't have storage|\bmeta\b")


@dataclass(frozen=True)
class Attribution:
    kind: str  # "not_modelled" or "user_error"
    message: str  # one line
    user_traceback: str  # the user's own frames and the exception line


def attribute(error: BaseException, stand_in_askers: Collection[CodeType] = (),
              stand_in_sizes: Mapping[CodeType, str] | None = None) -> Attribution:
    """The kind and one-line message of `error`, which ended the program (a SystemExit: a non-zero status).
    `stand_in_askers`: the code objects that were handed stand-in values of GPU tensors (StandIns.asked_in);
    `stand_in_sizes`: those that were handed a stood-in size, with what it was and where (StandIns.sized_in)."""
    if isinstance(error, SystemExit):
        return _attribute_exit(error, stand_in_askers, stand_in_sizes)
    frames = traceback.extract_tb(error.__traceback__)
    own = [frame for frame in frames if _is_users(frame.filename)]
    text = "".join(["Traceback (most recent call last):\n", *traceback.format_list(own),
                    *traceback.format_exception_only(type(error), error)])
    for link in _chain(error):
        lack = _what_we_lack(link)
        if lack is not None:
            return Attribution("not_modelled", f"not modelled: {lack}{_where(own, frames)}", text)
    sized = _stood_in_size(error, stand_in_sizes or {})
    if sized is not None:
        return Attribution("not_modelled", "not modelled: a size that depends on values of GPU tensors, which the "
                           f"fake GPU does not have (the size of {sized} was stood in for), then "
                           f"{type(error).__name__}: {first_line(error)}{_where(own, frames)}", text)
    if frames and _checked_stand_ins(error, frames[-1], stand_in_askers):
        return Attribution("not_modelled", "not modelled: a check failed on values of GPU tensors, which the fake "
                           f"GPU stands in for ({type(error).__name__}: {first_line(error)}){_where(own, frames)}", text)
    where = f" (at {Path(own[-1].filename).name}:{own[-1].lineno})" if own else ""
    return Attribution("user_error", f"{type(error).__name__}: {first_line(error)}{where}", text)


# huggingface_hub's words for "not in the cache, and offline": a file (LocalEntryNotFoundError, which
# transformers and datasets raise their own errors from) or any call to the hub (OfflineModeIsEnabled).
HUB_OFFLINE_ERRORS = ("LocalEntryNotFoundError", "OfflineModeIsEnabled")


def _hub_offline(error: BaseException) -> str | None:
    """A model-hub download refused because the trace made the node offline (the job asked for no offline mode of
    its own: wire.OFFLINE_BY_THE_TRACE_ENV): the trace's lack of network, with what to do; None otherwise."""
    if os.environ.get(OFFLINE_BY_THE_TRACE_ENV) != "1":
        return None
    if not (type(error).__module__.startswith("huggingface_hub") and type(error).__name__ in HUB_OFFLINE_ERRORS):
        return None
    return (f"the trace has no network, and this would be downloaded from the model hub ({type(error).__name__}: "
            f"{first_line(error)}); download it once into the job's Hugging Face cache (hf download ...) so that "
            "the trace finds it, or set HF_HUB_OFFLINE=1 in the job if its nodes have no network either")


def _attribute_exit(error: SystemExit, stand_in_askers: Collection[CodeType],
                    stand_in_sizes: Mapping[CodeType, str] | None) -> Attribution:
    """sys.exit(N) while handling an exception (a CLI that prints the error and exits): that exception decides."""
    handled = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    if handled is not None:
        found = attribute(handled, stand_in_askers, stand_in_sizes)
        if found.kind == "not_modelled":
            return found
    return Attribution("user_error", f"the program exited with status {error.code}", "")


def _what_we_lack(error: BaseException) -> str | None:
    """What the fake GPU lacks, if `error` (one exception of the chain) comes from it; else None."""
    if isinstance(error, NotModelled):
        return first_line(error)
    offline = _hub_offline(error)
    if offline is not None:
        return offline
    if raised_as_on_a_gpu(error):
        return None
    said = f"{type(error).__name__}: {first_line(error)}"
    origin = _origin(error)
    if isinstance(error, PATH_ERRORS) and origin is not None and origin.filename == SANDBOX_FILE:
        return None  # the copy-on-write layer relays what the path itself gives on any machine
    if origin is not None and origin.filename.startswith(XMEM_DIR):
        return f"the fake GPU's {Path(origin.filename).stem}.{origin.name} failed ({said})"
    module = type(error).__module__
    if module.startswith(FAKE_MODE_MODULES) and isinstance(error, RuntimeError) and \
            type(error).__name__ not in FAKE_MODE_AS_ON_A_GPU:  # (not its cache's control flow, _BypassDispatchCache)
        return said
    if isinstance(error, TypeError) and DECLINED_BY_FAKE_MODE in str(error) and "FakeTensorMode" in str(error):
        return f"a tensor subclass the fake GPU cannot hold ({_declined_subclass(error)})"
    if origin is not None and origin.name == "fake_impl" and origin.filename.endswith(CUSTOM_OP_FILE):
        return f"an op with no fake kernel ({said})"  # torch.library.custom_op without register_fake: runs on a GPU
    if module.startswith(CUDA_BINDINGS):
        return f"{module.split('.')[0]} calls the CUDA driver directly ({said})"
    if origin is not None and _is_users(origin.filename) and (origin.line or "").lstrip().startswith("raise"):
        return None  # the program's own raise: its words are its own, whatever they say
    text = str(error)
    library = CUDA_LIBRARY.search(text)
    if library is not None:
        driver = library.group(1) == "cuda"
        does = "calls the CUDA driver directly" if driver else "loads a CUDA library that is not here"
        return f"{_library(error) or 'the program'} {does} ({said})"
    if isinstance(error, RuntimeError) and any(sign in text for sign in REAL_CUDA_SIGNS):
        return f"this reached the real CUDA runtime ({first_line(error)})"
    if isinstance(error, (RuntimeError, NotImplementedError)) and FAKE_REPRESENTATION.search(text):
        return f"a GPU tensor's data or storage, which the fake GPU does not hold ({said})"
    return None


def _stood_in_size(error: BaseException, sizers: Mapping[CodeType, str]) -> str | None:
    """What stood-in size the error follows from, if any: one asked by code the error was raised under (any
    exception: its shapes, its checks of them), else the first one asked, where the error is an op's or a library's
    refusal (RuntimeError, IndexError, ValueError; not the program's own `raise`/`assert`, whose words are its own)."""
    if not sizers:
        return None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in sizers:
            return sizers[tb.tb_frame.f_code]
        tb = tb.tb_next
    origin = _origin(error)
    own_statement = origin is not None and _is_users(origin.filename) and \
        (origin.line or "").lstrip().startswith(("raise", "assert"))
    if isinstance(error, (RuntimeError, IndexError, ValueError)) and not own_statement:
        return next(iter(sizers.values()))
    return None


def _checked_stand_ins(error: BaseException, innermost: traceback.FrameSummary,
                       askers: Collection[CodeType]) -> bool:
    """The program's own check (an `assert` or `raise` statement) failed in code that was handed stand-in values
    of GPU tensors (a shuffled batch compared with its expected order): on a GPU the values are real. A check in
    other code, or an op's own error (a shape mismatch), is left to the rules above."""
    if not askers or not (innermost.line or "").lstrip().startswith(("assert", "raise")):
        return False
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code in askers


def _chain(error: BaseException) -> Iterator[BaseException]:
    """The exception, then what it was raised from or while handling (once each)."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)


def _origin(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost Python frame of the exception: where it was raised (or the call into C++ that raised it)."""
    frames = traceback.extract_tb(error.__traceback__)
    return frames[-1] if frames else None


def _declined_subclass(error: BaseException) -> str:
    """The tensor subclass whose `__torch_function__` passed the op down to the fake mode (its `cls`), innermost
    first; else the error's first line."""
    tb, found = error.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "__torch_function__" and isinstance(tb.tb_frame.f_locals.get("cls"), type):
            found = tb.tb_frame.f_locals["cls"]
        tb = tb.tb_next
    return f"{found.__module__}.{found.__qualname__}" if found is not None else first_line(error)


def _library(error: BaseException) -> str | None:
    """The top-level package of the innermost frame in site-packages: the library that failed."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        package = _package(frame.filename)
        if package is not None:
            return package
    return None


def _where(own: list[traceback.FrameSummary], frames: list[traceback.FrameSummary]) -> str:
    """Where the program reached it: its innermost own frame, and the library it called there with the innermost
    line of that library's own that got there (the entry point alone rarely says which call it was)."""
    if not own:
        return ""
    at = f"{Path(own[-1].filename).name}:{own[-1].lineno}"
    after = frames[[id(frame) for frame in frames].index(id(own[-1])) + 1:]
    library = next((name for name in map(_package, (frame.filename for frame in after)) if name), None)
    if library is None or library == "torch":  # every GPU op goes through torch: naming it adds nothing
        return f" (at {at})"
    inner = [frame for frame in after if _package(frame.filename) == library][-1]
    return f" (in {library} at {_library_path(inner.filename)}:{inner.lineno}, called at {at})"


def _library_path(filename: str) -> str:
    """A library file's path from its site-packages root (ultralytics/engine/trainer.py)."""
    root = next(root for root in _library_roots() if filename.startswith(root))
    return filename[len(root):]


def _package(filename: str) -> str | None:
    for root in _library_roots():
        if filename.startswith(root):
            return filename[len(root):].split(os.sep, 1)[0].removesuffix(".py")
    return None


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """Where installed libraries live: the interpreter's site-packages, a distribution's dist-packages, the user's."""
    paths = sysconfig.get_paths()
    roots = [paths["purelib"], paths["platlib"], *site.getsitepackages(), site.getusersitepackages()]
    return tuple(dict.fromkeys(root.rstrip(os.sep) + os.sep for root in roots))


def _is_users(filename: str) -> bool:
    """A frame of the user's own files: not ours, not the stdlib's or an installed library's (torch included)."""
    paths = sysconfig.get_paths()
    not_users = (XMEM_DIR, paths["stdlib"] + os.sep, *_library_roots(), "<frozen")
    return not filename.startswith(not_users)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
