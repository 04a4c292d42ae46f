"""What xmem-slurm does on the compute node: the TaskProlog's exports and the Epilog's record.

Owns the root Prolog's work (the job's measure file, made for its user in a directory only that user and root
reach; the MPS control daemon's memory limit, from what Slurm allocated), the advisory MPS memory limit derived from
the job stamp (xmem.slurm.stamp: the TaskProlog sees the stamp's `XMEM_*` variables, else asks slurmctld for the
job's comment; the Epilog sees the comment), reading a job's measured peak (NVML accounting, else the file the job
wrote), and the node's settings (`NodeSettings`: the record store and the measure directory, read from the
environment when a command runs, never at import). Functions take the environment as a mapping and return data;
the CLI does the printing and the store writing. Nothing here may fail a job: callers catch everything.
"""

from __future__ import annotations

import json
import math
import os
import pwd
import re
import stat
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from xmem.slurm.scontrol import scontrol_show_job
from xmem.slurm.stamp import WHY_ENCODED_ENV, WHY_ENV, JobStamp, comment_fields
from xmem.slurm.store import DEFAULT_STORE, JobRecord
from xmem.text import ascii_whole_number, comment_text, one_line
from xmem.units import MIB

MEASURE_FILE_MAX_BYTES = 4096
STORE_ENV = "XMEM_STORE"  # the record store: the Epilog appends to it, `report` and `calibrate` read it
MEASURE_DIR_ENV = "XMEM_MEASURE_DIR"  # where jobs leave their measured peak: slurm/task_prolog.sh exports it


@dataclass(frozen=True)
class NodeSettings:
    """The node-side settings an install leaves in the environment. Read when a command runs (`read`), not when
    xmem is imported: a variable set after the import (by a wrapper, a test) counts, and nothing is frozen into a
    default."""

    store: str = DEFAULT_STORE
    measure_dir: str | None = None

    @classmethod
    def read(cls, env: Mapping[str, str], *, store: str | None = None,
             measure_dir: str | None = None) -> NodeSettings:
        """The settings a command runs with: the option it was given, else the variable in `env`, else the
        default. An empty XMEM_MEASURE_DIR is unset (as an option's environment variable is)."""
        return cls(store=env.get(STORE_ENV, DEFAULT_STORE) if store is None else store,
                   measure_dir=(env.get(MEASURE_DIR_ENV) or None) if measure_dir is None else measure_dir)


# --- TaskProlog ------------------------------------------------------------------------------------------------

def comment_from_scontrol(job_id: str, timeout_s: float = 5.0) -> str | None:
    """The job's comment, asked of slurmctld (the TaskProlog's environment has no SLURM_JOB_COMMENT)."""
    try:
        comment = scontrol_show_job(job_id, timeout_s).get("Comment")
    except (OSError, subprocess.SubprocessError, LookupError):
        return None
    return comment if comment not in (None, "(null)") else None


def job_stamp(env: Mapping[str, str],
              comment_of: Callable[[str], str | None] = comment_from_scontrol) -> tuple[JobStamp, str | None]:
    """The stamp from the job's XMEM_* variables, else (--export=NONE; a deferred job, whose request was set
    after sbatch) from its comment; and `why`, the user's line decoded (`xmem.text.comment_text`), from the line
    the filter exported (WHY_ENCODED_ENV), else from the comment. Slurm is asked only for a job that exported no
    stamp."""
    stamp, exported = JobStamp.from_env(env), env.get(WHY_ENCODED_ENV)
    if stamp.is_empty() and env.get("SLURM_JOB_ID"):
        comment = comment_of(env["SLURM_JOB_ID"])
        why = exported if exported is not None else comment_fields(comment).get("why")
        return JobStamp.from_comment(comment), comment_text(why) if why else None
    return stamp, comment_text(exported) if exported else None


def mps_memory_limit(env: Mapping[str, str], stamp: JobStamp, total_bytes: int | None) -> str | None:
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for an MPS job: the estimate plus margin, never above the share's
    memory (the GPU's memory times the share's thread percentage, Slurm's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE).
    Device ordinals are as the MPS client enumerates them: 0..n-1 over CUDA_VISIBLE_DEVICES."""
    percentage = ascii_whole_number(env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
    if not percentage:
        return None
    limit = stamp.needed_bytes or stamp.peak_bytes
    share = total_bytes * percentage // 100 if total_bytes else None
    if limit is None or (share is not None and limit > share):
        limit = share
    if not limit:
        return None
    devices = [d for d in env.get("CUDA_VISIBLE_DEVICES", "0").split(",") if d.strip()] or ["0"]
    mib = math.ceil(limit / MIB)
    return ",".join(f"{i}={mib}M" for i in range(len(devices)))


def measure_file_path(measure_dir: str | None, uid: int, job_id: str | None) -> str | None:
    """`<measure_dir>/<uid>/xmem-measure-<job>.json`: the root Prolog makes it (`prepare_measure_file`)."""
    if not measure_dir or ascii_whole_number(job_id) is None or uid < 0:
        return None
    return os.path.join(measure_dir, str(uid), f"xmem-measure-{job_id}.json")


def prolog_exports(env: Mapping[str, str], *, total_bytes_of: Callable[[str], int | None],
                   measure_dir: str | None,
                   comment_of: Callable[[str], str | None] = comment_from_scontrol) -> list[tuple[str, str]]:
    """The (name, value) pairs the TaskProlog exports into the task. Empty for a job xmem-slurm never saw."""
    stamp, why = job_stamp(env, comment_of)
    # Slurm takes the rest of the line as the value: a decoded newline (a comment the user set) would start another
    exports = [(WHY_ENV, one_line(why))] if why else []
    if stamp.is_empty():
        return exports
    exports = list(stamp.env().items()) + exports
    measure = measure_file_path(measure_dir, os.geteuid(), env.get("SLURM_JOB_ID"))
    if measure and _own_regular_file(measure):
        exports.append(("XMEM_MEASURE_FILE", measure))
    total = total_bytes_of(stamp.gpu_type) if stamp.gpu_type else None
    limit = mps_memory_limit(env, stamp, total)
    if limit:
        exports.append(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", limit))
    return exports


def _own_regular_file(path: str) -> bool:
    """The root Prolog made it for us: a regular file (not a link) of the caller's."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


# --- root Prolog -----------------------------------------------------------------------------------------------

class MeasureDirRefused(Exception):
    """The measure directory is not one only root can write: no file is made in it."""


def prepare_measure_file(measure_dir: str, uid: int, gid: int, job_id: str) -> str:
    """As root, before the job: make `<measure_dir>/<uid>/xmem-measure-<job>.json`, empty, owned by the job's user.

    Only root can add names to `measure_dir` (owned by the caller, not group- or world-writable: else
    MeasureDirRefused), so no other user can plant a link where a job writes; `<uid>` is the user's own 0700
    directory, made or re-owned here. The file is created exclusively without following links; a name the user
    left there (a link, an old file) is removed first. Every step goes through directory descriptors, so no path is
    resolved twice."""
    path = measure_file_path(measure_dir, uid, job_id)
    if path is None:
        raise MeasureDirRefused(f"no measure file for job {job_id!r} of uid {uid}")
    top = os.open(measure_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(top)
        if info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise MeasureDirRefused(f"{measure_dir} must be root's and writable by root only "
                                    f"(it is uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o})")
        own = _user_dir(top, str(uid), uid, gid)
    finally:
        os.close(top)
    try:
        name = os.path.basename(path)
        for _ in range(2):
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=own)
                break
            except FileExistsError:
                os.unlink(name, dir_fd=own)  # unlinkat: never follows; the user's own leftover or link
        else:
            raise MeasureDirRefused(f"{path} keeps coming back")
        try:
            os.fchown(fd, uid, gid)
        finally:
            os.close(fd)
    finally:
        os.close(own)
    return path


def _user_dir(top: int, name: str, uid: int, gid: int) -> int:
    """The user's 0700 directory under `top`, as an open descriptor (made here when missing)."""
    try:
        os.mkdir(name, 0o700, dir_fd=top)
    except FileExistsError:
        pass
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
    info = os.fstat(fd)
    if (info.st_uid, info.st_gid) != (uid, gid):
        os.fchown(fd, uid, gid)
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.fchmod(fd, 0o700)
    return fd


MPS_CONTROL = "nvidia-cuda-mps-control"


def mps_share_mib(env: Mapping[str, str], total_mib_of: Callable[[int], int | None]) -> dict[int, int]:
    """Device index -> the MPS share's memory in MiB, from what Slurm allocated: the Prolog's
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (the job's mps count over the GPU's) of each allocated GPU's memory. Never
    from the job's comment or environment, which the user writes."""
    percentage = ascii_whole_number(env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
    if percentage is None or not 0 < percentage <= 100:
        return {}
    shares = {}
    for index in gpu_indices(env.get("SLURM_JOB_GPUS") or env.get("CUDA_VISIBLE_DEVICES")):
        total = total_mib_of(index)
        if total:
            shares[index] = total * percentage // 100
    return shares


def gpu_indices(text: str | None) -> list[int]:
    """`0,2` (SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES) as device indices; anything else in the list is left out."""
    found = (ascii_whole_number(item.strip()) for item in (text or "").split(","))
    return [index for index in found if index is not None]


def mps_limit_commands(shares: Mapping[int, int], user_servers: list[str]) -> list[str]:
    """The control daemon's commands that cap each client's pinned device memory at the share (NVIDIA's
    nvidia-cuda-mps-control grammar): the default, for the server the job's first CUDA call will start, and the
    user's servers already running (a default reaches only servers started after it)."""
    commands = [f"set_default_device_pinned_mem_limit {dev} {mib}M" for dev, mib in sorted(shares.items())]
    commands += [f"set_device_pinned_mem_limit {pid} {dev} {mib}M"
                 for pid in user_servers for dev, mib in sorted(shares.items())]
    return commands


def enforce_mps_share(env: Mapping[str, str], uid: int, *, control: str,
                      total_mib_of: Callable[[int], int | None]) -> list[str]:
    """As root, before an MPS job: send `mps_limit_commands` to the control daemon, one per call (as
    `echo CMD | nvidia-cuda-mps-control`). Returns the commands sent; raises when the daemon refuses one."""
    shares = mps_share_mib(env, total_mib_of)
    if not shares:
        return []
    servers = [pid for pid in _mps_control(control, "get_server_list").split()
               if ascii_whole_number(pid) is not None and _uid_of_process(pid) == uid]
    commands = mps_limit_commands(shares, servers)
    for command in commands:
        _mps_control(control, command)
    return commands


def _mps_control(control: str, command: str) -> str:
    done = subprocess.run([control], input=command + "\n", capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"{control}: {command!r} exited {done.returncode}: {done.stderr.strip()[:200]}")
    return done.stdout


def _uid_of_process(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def gpu_total_mib(index: int, nvidia_smi: str = "nvidia-smi") -> int | None:
    """The GPU's memory as the driver reports it (root Prolog: the node's truth, not the job's GPU type)."""
    try:
        done = subprocess.run([nvidia_smi, f"--id={index}", "--query-gpu=memory.total",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return ascii_whole_number(done.stdout.strip()) if done.returncode == 0 else None


# --- Epilog ----------------------------------------------------------------------------------------------------

MAX_MEASURED_BYTES = 1 << 50  # 1 PiB: far above any GPU's memory; a larger "peak" is a typo or mischief


def read_measure_file(path: str, owner_uid: int | None = None) -> int | None:
    """The peak the job wrote: a bare integer or {"peak_bytes": N}. The epilog runs as root in a directory every
    job can write, so the file counts only if it is a regular file (no symlink) owned by the job's user
    (`owner_uid`; default: the caller), at most MEASURE_FILE_MAX_BYTES long (a longer one is refused, not cut),
    holding a whole, finite number of bytes in range. Anything else reads as no measurement."""
    owner = os.geteuid() if owner_uid is None else owner_uid
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != owner or info.st_size > MEASURE_FILE_MAX_BYTES:
            return None
        blob = os.read(fd, MEASURE_FILE_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(blob) > MEASURE_FILE_MAX_BYTES:  # grew after the fstat
        return None
    try:
        data = json.loads(blob.decode(errors="replace").strip())
    except (ValueError, RecursionError):
        return None
    return _measured_bytes(data.get("peak_bytes") if isinstance(data, dict) else data)


def _measured_bytes(value: object) -> int | None:
    """A positive, finite, in-range number of bytes (`1e400` parses as infinity; `2.5e9` is fine)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value) if 0 < value <= MAX_MEASURED_BYTES else None


def job_uid(env: Mapping[str, str]) -> int:
    """The job's user id from the epilog's environment (SLURM_JOB_UID, else SLURM_JOB_USER); -1 (no one) if
    neither says, so that no measure file is trusted."""
    uid = ascii_whole_number(env.get("SLURM_JOB_UID"))
    if uid is not None:
        return uid
    try:
        return pwd.getpwnam(env.get("SLURM_JOB_USER", "")).pw_uid
    except KeyError:
        return -1


def nvml_peak(gpu_indices: list[int], since: float | None) -> int | None:
    """Largest per-process peak (context included) NVML accounting recorded on the job's GPUs for processes
    started after `since`. Needs pynvml and accounting mode on (`nvidia-smi -am 1`); None otherwise."""
    try:
        import pynvml  # optional: only on GPU nodes
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        peaks = []
        for index in gpu_indices:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            if pynvml.nvmlDeviceGetAccountingMode(handle) != pynvml.NVML_FEATURE_ENABLED:
                continue
            for pid in pynvml.nvmlDeviceGetAccountingPids(handle):
                stats = pynvml.nvmlDeviceGetAccountingStats(handle, pid)
                if since is None or stats.startTime / 1e6 >= since:
                    peaks.append(int(stats.maxMemoryUsage))
        return max(peaks) if peaks else None
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def sacct_gpumem(job_ids: list[str], sacct: str = "sacct", timeout_s: float = 60.0) -> dict[str, int]:
    """Job id -> the largest `gres/gpumem` of its steps in Slurm's accounting (`TRESUsageInMax`: what slurmstepd
    read from NVML, as root, while the steps ran; sites with `AccountingStorageTRES=gres/gpumem` and slurmdbd).
    Jobs without it (no GPU step, no accounting of it, sacct absent) are left out. Slurm prints sizes in binary
    units (`38888M`); a bare number is bytes."""
    found: dict[str, int] = {}
    for start in range(0, len(job_ids), 500):
        chunk = [j for j in job_ids[start:start + 500] if ascii_whole_number(j) is not None]
        if not chunk:
            continue
        try:
            done = subprocess.run([sacct, "-n", "-P", "-j", ",".join(chunk), "-o", "JobIDRaw,TRESUsageInMax"],
                                  capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.SubprocessError):
            return found
        for line in done.stdout.splitlines() if done.returncode == 0 else []:
            step, _, tres = line.partition("|")
            value = re.search(r"(?:^|,)gres/gpumem=([0-9]+(?:\.[0-9]+)?)([KMGTP]?)(?:,|\||$)", tres)
            if value:
                job = step.split(".")[0]
                size = int(float(value.group(1)) * _UNITS[value.group(2)])
                if size > 0 and size <= MAX_MEASURED_BYTES:
                    found[job] = max(found.get(job, 0), size)
    return found


def exit_code_of(env: Mapping[str, str]) -> int | None:
    """The job's exit status: SLURM_JOB_EXIT_CODE2 is "status:signal"; SLURM_JOB_EXIT_CODE a wait() status."""
    code2 = env.get("SLURM_JOB_EXIT_CODE2", "")
    status, _, signal = code2.partition(":")
    status, signal = ascii_whole_number(status), ascii_whole_number(signal)
    if status is not None and signal is not None:
        return status if signal == 0 else 128 + signal
    raw = ascii_whole_number(env.get("SLURM_JOB_EXIT_CODE"))
    return raw >> 8 if raw is not None else None


def epilog_record(env: Mapping[str, str], *, measure_dir: str | None,
                  nvml: Callable[[list[int], float | None], int | None] = nvml_peak,
                  now: Callable[[], float] = time.time) -> JobRecord | None:
    """The store record for a finished job, or None when there is nothing to learn from it (no estimate and
    no measurement). Removes the job's measurement file once read."""
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    stamp = JobStamp.from_comment(env.get("SLURM_JOB_COMMENT"))
    # NVML, read here as root, first: the job cannot write it. The job's own file only where NVML has nothing;
    # it is kept as "file", which calibration does not trust (xmem.slurm.store_fit.TRUSTED_MEASUREMENTS).
    gpus = gpu_indices(env.get("SLURM_JOB_GPUS"))
    start = ascii_whole_number(env.get("SLURM_JOB_START_TIME"))
    measured = nvml(gpus, None if start is None else float(start)) if gpus else None
    measured_by = "nvml" if measured else None
    path = measure_file_path(measure_dir, job_uid(env), job_id)
    if path:
        from_file = read_measure_file(path, job_uid(env))
        if measured is None and from_file:
            measured, measured_by = from_file, "file"
        try:
            os.unlink(path)
        except OSError:
            pass
    deferred = comment_fields(env.get("SLURM_JOB_COMMENT"))
    if stamp.is_empty() and measured is None and "state" not in deferred:
        return None
    state = deferred.get("state")
    if state == "pending":  # never held for xmem, so a put-off job whose estimate never came back: ran unchanged
        state = "failed"
    return JobRecord(job_id=job_id, user=env.get("SLURM_JOB_USER"), gpu_type=stamp.gpu_type,
                     gres=stamp.request, estimate_bytes=stamp.peak_bytes, needed_bytes=stamp.needed_bytes,
                     exit_code=exit_code_of(env), measured_bytes=measured, measured_by=measured_by,
                     ended_at=now(), deferred_state=state,
                     request_before=comment_text(deferred.get("was", "")) or None)
