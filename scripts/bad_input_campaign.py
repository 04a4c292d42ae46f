#!/usr/bin/env python3
"""The project's own campaign of bad and hostile inputs (issue 14) against the dev cluster, as throw-away
non-root users; prints what must all be 0, and sbatch's latency.

    sudo python3 scripts/bad_input_campaign.py [--keep] [--only KIND] [--workers N]

It starts two dev clusters of its own (scripts/slurm-dev-cluster.sh: inline mode on port 6917, partition mode on
6957; LABs under /tmp/xmem-campaign), makes the users xmemcamp-a and xmemcamp-b (useradd -m) and an environment
they can run (a venv of the system python3 reading this working tree and .venv's packages: the project's venv
links into /root, mode 700). Each case is submitted twice by the same user: with cli_filter.lua switched off
(XMEM_NO_FILTER=1, the reference: what Slurm alone does) and through xmem-slurm. Jobs carry --begin=now+1hour, so
nothing trains; they are cancelled at the end.

Figures (each over the cases where it applies):
  lost             the reference was accepted, the filtered submission got no job id and no refusal from xmem
  blocked wrongly  the reference was accepted, xmem refused it (every site config here is fail-open)
  left held        deferred mode: still held for xmem 180 s after sbatch (the user's own --hold excepted)
  wrong request    the filtered job asks for less GPU memory than an estimate that ran out of memory, or kept no
                   GPU at all where the reference had one
  user's text      the filtered job's comment does not start with the reference's (what the user wrote, unchanged)
  leftover procs   processes of the campaign users still alive at the end (no job runs: all are xmem's or the
                   traced programs')
  files changed    files under the users' homes and job directories that differ after the campaign, outside
                   xmem's own cache (~/.cache/xmem-*) and the estimator's scratch
  cross-user       cases where one user's planted files changed another user's outcome from its baseline

Group "trust" (issue 21; `--only trust` runs it alone): jobs that run, measure files planted by another user or
twisted by the job's own, and one user's forged records; its figures: files changed through a planted name,
another user's plant that succeeded, calibration moved by one user's records, jobs or Epilogs that hung.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = Path(os.environ.get("XMEM_CAMPAIGN_ROOT", "/tmp/xmem-campaign"))  # another root and port offset: a second
USERS = ("xmemcamp-a", "xmemcamp-b")                                      # campaign beside the first
PORTS = {mode: port + int(os.environ.get("XMEM_CAMPAIGN_PORT_OFFSET", "0"))
         for mode, port in {"inline": 6917, "partition": 6957}.items()}
DEFERRED_SETTLE_S = 180
PLANTED = ("/tmp/xmem-slurm-native-", "/tmp/xmem-slurm-slots")  # where cross-user cases plant (removed at the end)

TRAIN = """\
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(32, 256, device="cuda")).sum()
    opt.zero_grad(); loss.backward(); opt.step()
"""
# Hostile or odd training programs: name -> source (each also trains unless it cannot).
PROGRAMS = {
    "train": TRAIN,
    "huge_message": "raise RuntimeError('bad: ' + 'x' * 1_000_000)\n",
    "os_exit": "import os\nos._exit(0)\n",
    "kill_self": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "abort": "import os\nos.abort()\n",
    "exit_3": "import sys\nsys.exit(3)\n",
    "no_cuda": "print('tensorflow would use the GPU here')\n",
    "cuda_in_subprocess": "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'print(1)'])\n",
    "popen_child": "import subprocess\nsubprocess.Popen(['sleep', '600'])\n" + TRAIN,
    "double_fork": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                   "        time.sleep(600)\n    os._exit(0)\n" + TRAIN,
    "writes_files": "open('written-by-trace.txt', 'w').write('x')\n"
                    "import os\nopen(os.path.expanduser('~/planted.txt'), 'w').write('x')\n" + TRAIN,
    "deletes_own_script": "import os\nos.remove(__file__)\n" + TRAIN,
    "bad_alloc_conf": "import os\nos.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'nonsense:yes'\n" + TRAIN,
    "oom_everywhere": "import torch\nw = torch.empty(200_000, 200_000, device='cuda')\n" + TRAIN,
    "stdin_reader": "import sys\nsys.stdin.read()\n" + TRAIN,
    "loud_output": "print('y' * 10_000_000)\n" + TRAIN,
    "sleeps_forever": "import time\ntime.sleep(3600)\n",
    "host_memory_hog": "chunks = []\nwhile True:\n    chunks.append(bytearray(256 << 20))\n",
    "writes_xmem_cache": "import os, glob\nfor p in glob.glob(os.path.expanduser('~/.cache/xmem-*/**/*.json'), "
                         "recursive=True):\n    open(p, 'w').write('{\"decision\": {\"action\": \"rewrite\", "
                         "\"gres\": \"gpu:h100:1\"}}')\n" + TRAIN,
    "syntax_error": "def (:\n",
    "imports_missing": "import no_such_module_xyz\n",
    "unicode": "print('héllo wörld ✓')\n" + TRAIN,
    "reads_argv": "import sys\nassert sys.argv[1:] == ['--lr', '1e-3'], sys.argv\n" + TRAIN,
}


@dataclass
class Case:
    kind: str
    name: str
    script: str  # the batch script's text
    options: tuple[str, ...] = ()  # sbatch options before the script
    args: tuple[str, ...] = ()  # after it
    env: dict[str, str] = field(default_factory=dict)
    mode: str = "inline"
    user: str = USERS[0]
    plant: str | None = None  # cross-user: what the other user plants first (see plant())


@dataclass
class Outcome:
    case: Case
    ref_ok: bool
    ok: bool
    job_id: str | None
    stderr: str
    seconds: float
    request: str | None = None
    ref_request: str | None = None
    held: bool = False
    problems: list[str] = field(default_factory=list)


def batch(body: str, directives: str = "#SBATCH --gres=gpu:1") -> str:
    return f"#!/bin/bash\n{directives}\n{body}"


def cases() -> list[Case]:
    out: list[Case] = []
    add = out.append
    # 1. hostile programs, inline and deferred
    for name in PROGRAMS:
        args = ("--lr", "1e-3") if name == "reads_argv" else ()
        line = f"python {name}.py" + (" \"$@\"" if args else "")
        add(Case("program", name, batch(line + "\n"), args=args))
        add(Case("program", name + "@partition", batch(f"# deferred\n{line}\n"), args=args, mode="partition"))
    # 2. directives and options as users write them, good and bad
    directive_cases = {
        "long_export_line": "#SBATCH --gres=gpu:1\n#SBATCH --export=ALL," +
                            ",".join(f"V{i}={'x' * 40}" for i in range(3500)),
        "long_comment_line": "#SBATCH --gres=gpu:1\n#SBATCH --comment=" + "c" * 20000,
        "quotes_in_export": '#SBATCH --gres=gpu:1\n#SBATCH --export=ALL,MSG="hello world",WINPATH=C:\\dir\\x',
        "quotes_in_comment": '#SBATCH --gres=gpu:1\n#SBATCH --comment="say \\"hi\\" C:\\x xmem: mine"',
        "unicode_comment": "#SBATCH --gres=gpu:1\n#SBATCH --comment=étude✓",
        "hetjob": "#SBATCH --ntasks=1\n#SBATCH hetjob\n#SBATCH --gres=gpu:1",
        "packjob": "#SBATCH --gres=gpu:1\n#SBATCH packjob\n#SBATCH --ntasks=1",
        "two_gpu_options": "#SBATCH --gres=gpu:1 --gpus=1",
        "per_task_2": "#SBATCH --ntasks=2 --gpus-per-task=1",
        "per_task_3": "#SBATCH --ntasks=3 --gpus-per-task=1",
        "per_node_2": "#SBATCH --gpus-per-node=2",
        "gres_2": "#SBATCH --gres=gpu:2",
        "gres_4": "#SBATCH --gres=gpu:4",
        "typed_a100": "#SBATCH --gres=gpu:a100:1",
        "typed_mig": "#SBATCH --gres=gpu:1g.10gb:1",
        "mps_share": "#SBATCH --gres=mps:50",
        "unknown_type": "#SBATCH --gres=gpu:abc:1",
        "gres_zero": "#SBATCH --gres=gpu:0",
        "gres_with_other": "#SBATCH --gres=gpu:1,tmpfs:1G",
        "gpus_typed": "#SBATCH --gpus=h100:1",
        "no_partition": "#SBATCH --gres=gpu:1 --partition=nosuch",
        "cpu_job": "#SBATCH --ntasks=1",
        "many_directives": "\n".join(["#SBATCH --gres=gpu:1"] + ["#SBATCH --comment=x"] * 5000),
        "directive_after_command": "#SBATCH --ntasks=1\necho hi\n#SBATCH --gres=gpu:1",
        "unbalanced_quote": '#SBATCH --gres=gpu:1\n#SBATCH --comment="open',
        "user_hold": "#SBATCH --gres=gpu:1 --hold",
        "export_none": "#SBATCH --gres=gpu:1 --export=NONE",
        "chdir_elsewhere": "#SBATCH --gres=gpu:1 --chdir=/tmp",
        "time_limit": "#SBATCH --gres=gpu:1 --time=00:10:00",
    }
    for name, directives in directive_cases.items():
        add(Case("directive", name, batch("python train.py\n", directives)))
        add(Case("directive", name + "@partition", batch("# deferred\npython train.py\n", directives),
                 mode="partition"))
    # 3. script shapes
    shapes = {
        "no_shebang": "#SBATCH --gres=gpu:1\npython train.py\n",
        "dos_lines": "#!/bin/bash\r\n#SBATCH --gres=gpu:1\r\npython train.py\r\n",
        "empty_body": "#!/bin/bash\n#SBATCH --gres=gpu:1\n",
        "binary": "#!/bin/bash\n#SBATCH --gres=gpu:1\n\x00\x01\x02\xff\n",
        "big_file": "#!/bin/bash\n#SBATCH --gres=gpu:1\n" + "# padding\n" * 300_000 + "python train.py\n",
        "python_shebang": "#!/usr/bin/env python3\n#SBATCH --gres=gpu:1\n" + TRAIN,
        "shell_tricks": "#!/bin/bash\n#SBATCH --gres=gpu:1\nset -e\nA=$(echo train)\n"
                        "for i in 1; do python $A.py; done\n",
        "srun_python": "#!/bin/bash\n#SBATCH --gres=gpu:1\nsrun python train.py\n",
        "torchrun": "#!/bin/bash\n#SBATCH --gres=gpu:2\ntorchrun --nproc-per-node=2 train.py\n",
        "two_commands": "#!/bin/bash\n#SBATCH --gres=gpu:1\npython no_cuda.py\npython train.py\n",
        "missing_program": "#!/bin/bash\n#SBATCH --gres=gpu:1\npython not_here.py\n",
        "eval_line": "#!/bin/bash\n#SBATCH --gres=gpu:1\neval \"python train.py\"\n",
    }
    for name, text in shapes.items():
        add(Case("shape", name, text))
    add(Case("shape", "wrap", "", options=("--gres=gpu:1", "--wrap=python train.py")))
    add(Case("shape", "hetjob_command_line", batch("python train.py\n", "#SBATCH --ntasks=1"),
             options=("--ntasks=1", ":", "--gres=gpu:1")))
    # 4. the submitting environment
    envs = {
        "sbatch_gres_abc": {"SBATCH_GRES": "gpu:abc"}, "sbatch_gres_2": {"SBATCH_GRES": "gpu:2"},
        "sbatch_partition": {"SBATCH_PARTITION": "debug"}, "sbatch_export_none": {"SBATCH_EXPORT": "NONE"},
        "alloc_conf_garbage": {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:abc"},
        "pythonpath_shadow": {"PYTHONPATH": "__JOBDIR__/shadow"}, "ld_preload": {"LD_PRELOAD": "/nonexistent.so"},
        "missing_config": {"XMEM_CONFIG": "/nonexistent/xmem.toml"},
        "invalid_config": {"XMEM_CONFIG": "__JOBDIR__/invalid.toml"},
        "tmpdir_unwritable": {"TMPDIR": "/proc"}, "home_with_space": {"HOME": "__HOME__/with space"},
        "cuda_visible_empty": {"CUDA_VISIBLE_DEVICES": ""}, "lang_c": {"LANG": "C", "LC_ALL": "C"},
        "huge_env_var": {"BIG": "z" * 100_000},
    }
    for name, env in envs.items():
        add(Case("environment", name, batch(f"# env {name}\npython train.py\n"), env=env))
        add(Case("environment", name + "@partition", batch(f"# env {name} deferred\npython train.py\n"),
                 env=env, mode="partition"))
    # 5. one user plants files where another's xmem looks (the other submits a plain job)
    for plant_kind in ("native_dir", "native_so", "slot_dir", "slot_symlink"):
        add(Case("cross-user", plant_kind, batch(f"# cross {plant_kind}\npython train.py\n"), user=USERS[1],
                 plant=plant_kind))
    return out


# --- the machinery ---------------------------------------------------------------------------------------------

def sh(*argv: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def setup_users_and_env() -> Path:
    for user in USERS:
        if sh("id", user).returncode != 0:
            sh("useradd", "-m", user, check=True)
    venv = ROOT / "venv"
    if not (venv / "bin" / "python").exists():
        sh("/usr/bin/python3", "-m", "venv", "--without-pip", str(venv), check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    project_site = next((REPO / ".venv" / "lib").glob("python3*/site-packages"))
    (site / "xmem-campaign.pth").write_text(f"{REPO}\n{project_site}\n")
    (venv / "bin" / "xmem-slurm").write_text(f"#!{venv}/bin/python\nimport sys\nfrom xmem.cli import main\n"
                                             "sys.exit(main())\n")
    (venv / "bin" / "xmem-slurm").chmod(0o755)
    sh("chmod", "-R", "a+rX", str(ROOT))
    return venv


def start_cluster(mode: str, venv: Path) -> dict[str, str]:
    lab = ROOT / f"lab-{mode}"
    env = {**os.environ, "XMEM_SLURM": str(venv / "bin" / "xmem-slurm"), "XMEM_PYTHON": str(venv / "bin" / "python")}
    env.pop("SLURM_JOB_ID", None)
    up = sh("bash", str(REPO / "scripts" / "slurm-dev-cluster.sh"), "up", "--lab", str(lab), "--port",
            str(PORTS[mode]), "--mode", mode, timeout=300, env=env)
    if up.returncode != 0:
        raise SystemExit(f"dev cluster ({mode}) did not start:\n{up.stdout}\n{up.stderr}")
    config = lab / "etc" / "xmem.toml"
    text = config.read_text()
    text = re.sub(r'(?m)^cache_dir = .*$', 'cache_dir = "~/.cache/xmem-campaign"', text, count=1)
    text = re.sub(r'(?m)^timeout_s = .*$', "timeout_s = 60", text, count=1)
    if re.search(r"(?m)^memory_limit_gib = ", text):  # a shared host: 2 GiB per trace
        text = re.sub(r"(?m)^memory_limit_gib = .*$", "memory_limit_gib = 2", text, count=1)
    else:
        text = re.sub(r"(?m)^\[estimate\]$", "[estimate]\nmemory_limit_gib = 2", text, count=1)
    config.write_text(text)
    sh("chmod", "-R", "a+rX", str(lab / "etc"))
    return {"SLURM_CONF": str(lab / "etc" / "slurm.conf"), "XMEM_CONFIG": str(config)}


def user_env(user: str, cluster: dict[str, str], venv: Path, extra: dict[str, str], job_dir: Path) -> list[str]:
    home = Path(f"/home/{user}")
    env = {"HOME": str(home), "USER": user, "LOGNAME": user, "PATH": f"{venv}/bin:/usr/bin:/bin", **cluster}
    for k, v in extra.items():
        env[k] = v.replace("__JOBDIR__", str(job_dir)).replace("__HOME__", str(home))
    return ["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items())]


def job_dir_for(case: Case, index: int) -> Path:
    d = Path(f"/home/{case.user}/campaign/{index:03d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', case.name)}")
    d.mkdir(parents=True, exist_ok=True)
    for name, source in PROGRAMS.items():
        (d / f"{name}.py").write_text(source)
    (d / "shadow").mkdir(exist_ok=True)
    (d / "shadow" / "torch.py").write_text("raise ImportError('a shadowing torch.py')\n")
    (d / "invalid.toml").write_text("[policy]\nfailure = 'sometimes'\n")
    (d / "job.sh").write_text(case.script, errors="surrogateescape")
    (Path(f"/home/{case.user}") / "with space").mkdir(exist_ok=True)
    sh("chown", "-R", f"{case.user}:{case.user}", f"/home/{case.user}")
    return d


def submit(case: Case, prefix: list[str], job_dir: Path, filtered: bool) -> tuple[subprocess.CompletedProcess, float]:
    env_off = [] if filtered else ["XMEM_NO_FILTER=1"]
    script = [] if case.name == "wrap" else [str(job_dir / "job.sh"), *case.args]
    argv = [*prefix, *env_off, "sbatch", "--parsable", "--begin=now+3600", "-o", "/dev/null",
            *case.options, *script]
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=job_dir, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        done = subprocess.CompletedProcess(argv, 124, "", "campaign: sbatch timed out after 400 s")
    return done, time.monotonic() - started


def job_fields(job_id: str, cluster: dict[str, str]) -> dict[str, str]:
    out = sh("scontrol", "show", "job", "-o", job_id, env={**os.environ, **cluster}).stdout.strip().splitlines()
    line = out[0] if out else ""
    return dict(p.split("=", 1) for p in re.split(r" (?=[A-Z][A-Za-z:/]*=)", line) if "=" in p)


def gpu_request(fields: dict[str, str]) -> str | None:
    return next((f"{k}={fields[k]}" for k in ("TresPerNode", "TresPerJob", "TresPerTask")
                 if fields.get(k) not in (None, "", "(null)")), None)


def settle(job_id: str, cluster: dict[str, str], user_hold: bool) -> bool:
    """Deferred mode: True when the job is still held for xmem after DEFERRED_SETTLE_S."""
    deadline = time.monotonic() + DEFERRED_SETTLE_S
    while time.monotonic() < deadline:
        f = job_fields(job_id, cluster)
        state = re.search(r"xmem:\S*\bstate=(\w+)", f.get("Comment", ""))
        if f.get("JobState") != "PENDING" or user_hold or f.get("Reason") != "JobHeldUser" \
                or (state and state.group(1) == "stuck"):
            return f.get("Reason") == "JobHeldUser" and not user_hold
        time.sleep(1)
    return True


def plant(kind: str, victim: str) -> None:
    """What the other user (USERS[0]) leaves where `victim`'s xmem looks."""
    attacker, uid = USERS[0], sh("id", "-u", victim).stdout.strip()
    run_as = ["runuser", "-u", attacker, "--", "sh", "-c"]
    commands = {  # S1 and S3 of issue 14: a shim the victim would load, slot locks the victim would wait on
        "native_dir": f"mkdir -p {PLANTED[0]}{uid} && chmod 777 {PLANTED[0]}{uid}",
        "native_so": f"mkdir -p {PLANTED[0]}{uid} && for f in a b c; do : > {PLANTED[0]}{uid}/$f.so; done",
        "slot_dir": f"mkdir -p {PLANTED[1]}/{victim} && chmod 700 {PLANTED[1]}/{victim}",
        "slot_symlink": f"for i in 0 1 2 3; do ln -sf /home/{attacker}/owned-$i {PLANTED[1]}/{victim}-$i.lock; done",
    }
    sh(*run_as, commands[kind] + " 2>/dev/null; true")


def snapshot(paths: list[Path]) -> dict[str, str]:
    """Files under `paths` -> a digest, outside xmem's own cache."""
    seen: dict[str, str] = {}
    for root in paths:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith("xmem-")]  # ~/.cache/xmem-campaign, native
            for name in filenames:
                p = Path(dirpath) / name
                try:
                    seen[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.stat().st_size < 1 << 24 \
                        else str(p.stat().st_mtime_ns)
                except OSError:
                    continue
    return seen


def run_case(index: int, case: Case, clusters: dict[str, dict[str, str]], venv: Path,
             baseline: dict[str, str | None]) -> Outcome:
    cluster = clusters[case.mode]
    job_dir = job_dir_for(case, index)
    prefix = user_env(case.user, cluster, venv, case.env, job_dir)
    ref, _ = submit(case, prefix, job_dir, filtered=False)
    ref_id = ref.stdout.strip().split(";")[0] if ref.returncode == 0 else None
    ref_fields = job_fields(ref_id, cluster) if ref_id else {}
    ref_request = gpu_request(ref_fields)
    if case.plant:
        plant(case.plant, case.user)
    done, seconds = submit(case, prefix, job_dir, filtered=True)
    job_id = done.stdout.strip().split(";")[0] if done.returncode == 0 else None
    out = Outcome(case, ref.returncode == 0, done.returncode == 0, job_id, done.stderr, seconds,
                  ref_request=ref_request)
    if job_id and case.mode == "partition" and "held until" in done.stderr:
        out.held = settle(job_id, cluster, user_hold="--hold" in case.script)
    if job_id:
        fields = job_fields(job_id, cluster)
        out.request = gpu_request(fields)
        written = ref_fields.get("Comment", "(null)")
        if written != "(null)" and not fields.get("Comment", "").startswith(written):
            out.problems.append("user's text")
    if out.ref_ok and not out.ok:  # every site config here is fail-open: xmem may refuse nothing
        out.problems.append("blocked wrongly" if "xmem-slurm" in done.stderr else "lost")
    if out.held:
        out.problems.append("left held")
    if ref_request and job_id and out.request is None:
        out.problems.append("wrong request")
    if case.name.startswith("oom_everywhere") and out.request and ("1g.10gb" in out.request or "mps" in out.request):
        out.problems.append("wrong request")
    if case.plant and baseline.get(case.name) is not None and out.request != baseline[case.name]:
        out.problems.append("cross-user")
    for i in (ref_id, job_id):
        if i:
            sh("scancel", i, env={**os.environ, **cluster})
    return out


def leftover_processes() -> list[str]:
    found = []
    for user in USERS:
        ps = sh("ps", "-u", user, "-o", "pid=,args=").stdout.strip().splitlines()
        found += [f"{user}: {line.strip()}" for line in ps if line.strip()]
    return found


# === group "trust" (issue 21): measure files and forged records ===================================================
# These jobs run (no --begin): the root Prolog makes each job's measure file, the Epilog records it. The attacker is
# USERS[0], the victim USERS[1]; each case is a name and a check returning its problems. Figures: "files changed"
# (a victim's file or a root file written through a planted name), "cross-user" (the attacker's plant succeeded),
# "calibration moved" (one user's records changed what `calibrate --from-store` fits), "job hung".

# Traced at submission (where SLURM_JOB_ID is the filter's stand-in "0"), not run: the job has no GPU.
TRUST_TRAIN = "import os, sys\nif os.environ.get('SLURM_JOB_ID', '0') != '0':\n    sys.exit(0)\n" + TRAIN
FORGED_PEAK = 60 << 30  # the campaign of issue 21: six jobs claiming 60 GiB moved the A100's context there
FORGED_STAMP = "xmem:peak=1;need=1;type=a100;req=gpu:a100:1;act=rewrite"


def trust_job(user: str, cluster: dict[str, str], venv: Path, body: str, options: tuple[str, ...] = (),
              unfiltered: bool = False, hold: bool = False) -> str | None:
    """Submit a job of `user` whose script trains (for the estimate) and then runs `body`; its id."""
    work = Path(f"/home/{user}/campaign-trust")
    work.mkdir(parents=True, exist_ok=True)
    (work / "train.py").write_text(TRUST_TRAIN)
    script = work / f"job-{abs(hash((body, options))) % 10**8}.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --gres=gpu:a100:1\npython train.py\n{body}\n")
    sh("chown", "-R", f"{user}:{user}", str(work))
    prefix = user_env(user, cluster, venv, {}, work)
    argv = [*prefix, *(["XMEM_NO_FILTER=1"] if unfiltered else []), "sbatch", "--parsable", "-o", "/dev/null",
            *(["--hold"] if hold else []), *options, str(script)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=work, stdin=subprocess.DEVNULL)
    return done.stdout.strip().split(";")[0] if done.returncode == 0 else None


def trust_wait(job_id: str | None, cluster: dict[str, str], timeout: float = 240) -> bool:
    """The job ended and the Epilog recorded it; False when that did not happen within `timeout`."""
    deadline = time.monotonic() + timeout
    lab = Path(cluster["SLURM_CONF"]).parents[1]
    while job_id and time.monotonic() < deadline:
        if job_fields(job_id, cluster).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") \
                and trust_record(job_id, lab) is not None:
            return True
        time.sleep(1)
    return False


def trust_record(job_id: str | None, lab: Path) -> dict | None:
    for line in (lab / "records.jsonl").read_text().splitlines() if (lab / "records.jsonl").exists() else []:
        record = json.loads(line)
        if record.get("job_id") == job_id:
            return record
    return None


def next_job_ids(cluster: dict[str, str], count: int) -> list[int]:
    """The ids the next submissions will get: Slurm hands them out in order (a held probe job shows where)."""
    probe = sh("sbatch", "--parsable", "--hold", "-o", "/dev/null", "--wrap=true", env={**os.environ, **cluster,
                                                                                       "XMEM_NO_FILTER": "1"})
    first = int(probe.stdout.strip().split(";")[0])
    sh("scancel", str(first), env={**os.environ, **cluster})
    return list(range(first + 1, first + 1 + count))


def trust_cases(cluster: dict[str, str], venv: Path, lab: Path) -> list[tuple[str, list[str]]]:
    attacker, victim = USERS
    vuid = sh("id", "-u", victim).stdout.strip()
    measure = lab / "measure"
    precious = Path(f"/home/{victim}/precious.txt")
    precious.write_text("the victim's own work\n")
    sh("chown", f"{victim}:{victim}", str(precious))
    root_file = ROOT / "root-only.txt"
    root_file.write_text("root's\n")
    as_attacker = ["runuser", "-u", attacker, "--", "sh", "-c"]
    write_peak = 'echo \'{"peak_bytes": %d}\' > "$XMEM_MEASURE_FILE"'
    results: list[tuple[str, list[str]]] = []

    def victim_job(body: str = write_peak % (1 << 30)) -> tuple[str | None, bool]:
        job = trust_job(victim, cluster, venv, body)
        return job, trust_wait(job, cluster)

    def untouched() -> list[str]:
        bad = [] if precious.read_text() == "the victim's own work\n" else ["files changed"]
        return bad + ([] if root_file.read_text() == "root's\n" else ["files changed"])

    # 1-5: the attacker plants names where the victim's next jobs will write
    plants = {
        "symlink_next_ids": "ln -s {precious} {measure}/xmem-measure-{i}.json; "
                            "ln -s {precious} {measure}/{vuid}/xmem-measure-{i}.json",
        "squat_user_dir": "mkdir {measure}/{vuid}; ln -s /home/{attacker} {measure}/{vuid}",
        "fifo_next_id": "mkfifo {measure}/xmem-measure-{i}.json {measure}/{vuid}/xmem-measure-{i}.json",
        "hardlink_next_id": "ln {precious} {measure}/xmem-measure-{i}.json",
        "symlink_to_root_file": "ln -s {root_file} {measure}/{vuid}/xmem-measure-{i}.json",
    }
    for name, command in plants.items():
        ids = next_job_ids(cluster, 3)
        for i in ids:
            sh(*as_attacker, command.format(precious=precious, measure=measure, vuid=vuid, attacker=attacker, i=i,
                                            root_file=root_file) + " 2>/dev/null; true")
        job, ended = victim_job()
        problems = untouched() + ([] if ended else [f"job hung ({job})"])
        planted = [p for p in measure.rglob("*") if p.lstat().st_uid == int(sh("id", "-u", attacker).stdout)]
        problems += ["cross-user"] * bool(planted)
        record = trust_record(job, lab)
        if not record or record.get("measured_bytes") != 1 << 30:  # the victim's own write landed where it should
            problems.append(f"measurement lost ({job})")
        results.append((f"measure/{name}", problems))
    # 6-9: the job's user does odd things with their own file (the Epilog runs as root)
    own = {
        "own_leftover_symlink": None,  # planted by the victim before the job, at the job's own name
        "job_links_file_to_root_file": f'ln -sf {root_file} "$XMEM_MEASURE_FILE"',
        "job_writes_100_MiB": 'head -c 104857600 /dev/zero > "$XMEM_MEASURE_FILE"',
        "job_makes_a_fifo": 'rm -f "$XMEM_MEASURE_FILE"; mkfifo "$XMEM_MEASURE_FILE"',
    }
    for name, body in own.items():
        if body is None:
            (i,) = next_job_ids(cluster, 1)
            sh("runuser", "-u", victim, "--", "ln", "-s", str(precious), f"{measure}/{vuid}/xmem-measure-{i}.json")
            job, ended = victim_job()
        else:
            job, ended = victim_job(body)
        record = trust_record(job, lab)
        problems = untouched() + ([] if ended and record else [f"job hung ({job})"])
        if (body is not None) == bool(record and record.get("measured_bytes")):  # a bad file is never measured
            problems.append(f"trusted a bad file ({job})" if body else f"measurement lost ({job})")
        results.append((f"measure/{name}", problems))
    # 10-13: one user's forged records, then the site's calibration on the store as it is
    forged = {
        "comment_without_filter": dict(options=("--comment", FORGED_STAMP), unfiltered=True),
        "comment_after_submission": dict(hold=True),
        "stamp_in_export": dict(options=("--export=ALL,XMEM_PEAK_BYTES=1,XMEM_NEEDED_BYTES=1",)),
        "infinite_peak": dict(body='echo 1e400 > "$XMEM_MEASURE_FILE"'),
    }
    for name, how in forged.items():
        body = how.pop("body", write_peak % FORGED_PEAK)
        for _ in range(6):
            job = trust_job(attacker, cluster, venv, body, **how)
            if how.get("hold") and job:
                sh("runuser", "-u", attacker, "--", "scontrol", "update", f"JobId={job}", f"Comment={FORGED_STAMP}",
                   env={**os.environ, **cluster})
                sh("runuser", "-u", attacker, "--", "scontrol", "release", job, env={**os.environ, **cluster})
            trust_wait(job, cluster)
        results.append((f"forged/{name}", calibration_moved(lab)))
    return results


def calibration_moved(lab: Path) -> list[str]:
    """`calibrate --from-store` as a site runs it (and with the jobs' own files trusted) on the store so far:
    whatever it fits must not be the forged 60 GiB."""
    problems = []
    for extra in ((), ("--trust-job-files",)):
        done = sh(str(ROOT / "venv" / "bin" / "xmem-slurm"), "calibrate", "--from-store", "--store",
                  str(lab / "records.jsonl"), "--config", str(lab / "etc" / "xmem.toml"), "--dry-run", *extra,
                  timeout=120)
        moved = [int(n) for n in re.findall(r"(?m)^context_bytes = (\d+)$", done.stdout)]
        if any(n > 8 << 30 for n in moved):
            problems.append("calibration moved")
    return problems


def run_trust_group(clusters: dict[str, dict[str, str]], venv: Path) -> list[tuple[str, list[str]]]:
    results = trust_cases(clusters["inline"], venv, ROOT / "lab-inline")
    for name, problems in results:
        print(f"    trust {name:40s} {', '.join(problems) or 'ok'}", flush=True)
    return results

def trust_main(clusters: dict[str, dict[str, str]], venv: Path, keep: bool) -> int:
    """`--only trust`: the group alone, its figures, the clusters down."""
    started = time.monotonic()
    results = run_trust_group(clusters, venv)
    labels = ("files changed", "cross-user", "calibration moved", "job hung", "measurement lost", "trusted a bad file")
    counts = {label: sum(any(p.startswith(label) for p in ps) for _, ps in results) for label in labels}
    return group_figures("trust", results, counts, leftover_processes(), started, clusters, keep)


def group_figures(group: str, results: list, counts: dict[str, int], procs: list[str], started: float,
                  clusters: dict, keep: bool) -> int:
    """A group's closing figures (cases, seconds, each count, leftover processes), its clusters taken down unless
    kept; exit status 0 when no case found a problem and nothing was left running."""
    print(f"\n{group} cases: {len(results)}, {time.monotonic() - started:.0f} s")
    for label, count in counts.items():
        print(f"{label + ':':48s} {count}")
    print(f"{'leftover processes at the end:':48s} {len(procs)}")
    for line in procs[:10]:
        print("  leftover:", line)
    if not keep:
        for mode in clusters:
            sh("bash", str(REPO / "scripts" / "slurm-dev-cluster.sh"), "down", "--lab", str(ROOT / f"lab-{mode}"),
               timeout=120)
    return 0 if not any(problems for _, problems in results) and not procs else 1

# === end of group "trust" ===========================================================================================


# === group "containment" (issue 21: the sandbox and root; `--only containment`, no cluster needed) ==================
# Each case is a program of the campaign user's that tries one way out of the sandbox, traced by `xmem-slurm
# check` of a batch script (cold, then through the warm tracer); afterwards the host is searched for its effect.

CONTAIN_LISTEN_TCP = 6999  # a listener on every address: a connection from a traced program is an escape
CONTAIN_ABSTRACT = b"\0xmem-campaign-contain"
CONTAIN_RUN = Path("/run/xmem-campaign")  # a stand-in for /run/munge: a service's unix socket under /run
CONTAIN_PRELUDE = """\
import ctypes, glob, os, socket, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
home = os.environ["HOME"]
def mounts():
    return [line.split()[4] for line in open("/proc/self/mountinfo")]
def covering(path):
    return max((p for p in mounts() if (path + "/").startswith(p.rstrip("/") + "/")), key=len)
def mark(name):
    try:
        open(os.path.join(home, name), "w").write("escaped")
    except OSError:
        pass
"""
CONTAIN_PROGRAMS = {
    "umount_home": "libc.umount2(covering(home).encode(), 2)\nmark('escaped-umount')",
    "umount_everything": "for p in reversed(mounts()):\n    libc.umount2(p.encode(), 2)\nmark('escaped-all')",
    "remount_shim_cache_rw": "d = os.environ['XMEM_SHIM_DIR']\nlibc.mount(None, d.encode(), None, 32 | 4096, None)\n"
                             "[open(f, 'ab').write(b'x') for f in glob.glob(d + '/*')]",
    "nested_userns_umount": "libc.unshare(0x10000000 | 0x00020000)\nlibc.umount2(covering(home).encode(), 2)\n"
                            "mark('escaped-nested')",
    "setns_to_init": "fd = os.open('/proc/1/ns/mnt', os.O_RDONLY)\nlibc.setns(fd, 0)\nmark('escaped-setns')",
    "chroot_out": "os.makedirs('/tmp/x', exist_ok=True)\ntry:\n    os.chroot('/tmp/x')\nexcept OSError:\n    pass\n"
                  "mark('escaped-chroot')",
    "ptrace_init": "print(libc.ptrace(16, 1, 0, 0))\ntry:\n    os.listdir('/proc/1/root/')\nexcept OSError:\n    pass\n"
                   "mark('escaped-ptrace')",
    "overwrite_shim": "[open(f, 'wb').write(b'planted') for f in glob.glob(os.environ['XMEM_SHIM_DIR'] + '/*')]",
    "overwrite_home_cache": "[open(f, 'wb').write(b'planted') for f in "
                            "glob.glob(home + '/.cache/xmem-slurm/native/*')]",
    "replace_shim_by_rename": "d = os.environ['XMEM_SHIM_DIR']\nfor f in glob.glob(d + '/*.so'):\n"
                              "    open(d + '/new', 'wb').write(b'planted')\n    os.replace(d + '/new', f)",
    "service_socket_under_run": "s = socket.socket(socket.AF_UNIX)\ns.connect('/run/xmem-campaign/munge.socket.2')",
    "munge_socket": "s = socket.socket(socket.AF_UNIX)\ns.connect('/run/munge/munge.socket.2')",
    "abstract_socket": "s = socket.socket(socket.AF_UNIX)\ns.connect(b'\\0xmem-campaign-contain')",
    "tcp_to_host": "a = [l.split()[1] for l in open('/proc/net/fib_trie')]\n"
                   "s = socket.create_connection((os.environ['XMEM_CAMP_HOST'], 6999), timeout=3)",
    "sbatch_from_inside": "subprocess.run(['sbatch', '--wrap', 'true'], timeout=30)",
    "daemon_left_behind": "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        import time\n"
                          "        time.sleep(300)\n        mark('escaped-daemon')\n    os._exit(0)",
    "other_users_file": "open(os.environ['XMEM_CAMP_OTHER'], 'w').write('changed by another user')",
    "scratch_symlinks": "argv = open('/proc/self/cmdline', 'rb').read().split(b'\\0')\n"
                        "scratch = os.path.dirname(argv[argv.index(b'--out') + 1].decode())\n"
                        "os.symlink(home + '/.profile', scratch + '/trace.json.tmp')\n"
                        "os.symlink(home, scratch + '/cow-home')",
    "dev_shm_plant_then_preload": "open('/dev/shm/xmem-campaign-hook.so', 'wb').write(open(os.environ['XMEM_CAMP_HOOK'],"
                                  " 'rb').read())",
}
CONTAIN_HOOK = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void hook(void) {
    const char *m = getenv("XMEM_CAMP_MARKER");
    FILE *f = m ? fopen(m, "a") : NULL;
    if (f) { fputs("ran\n", f); fclose(f); }
}
"""


def contain_listeners() -> list:
    import socket
    CONTAIN_RUN.mkdir(exist_ok=True)
    unix = socket.socket(socket.AF_UNIX)
    (CONTAIN_RUN / "munge.socket.2").unlink(missing_ok=True)
    unix.bind(str(CONTAIN_RUN / "munge.socket.2"))
    os.chmod(CONTAIN_RUN / "munge.socket.2", 0o777)
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(CONTAIN_ABSTRACT)
    tcp = socket.create_server(("0.0.0.0", CONTAIN_LISTEN_TCP))
    for s in (unix, abstract, tcp):
        s.listen()
        s.setblocking(False)
    return [unix, abstract, tcp]


def contain_connections(listeners: list) -> int:
    count = 0
    for s in listeners:
        try:
            while True:
                s.accept()[0].close()
                count += 1
        except BlockingIOError:
            pass
    return count


def contain_state(user: str) -> dict[str, str]:
    home = Path(f"/home/{user}")
    paths = [*home.glob("escaped-*"), *(home / ".cache" / "xmem-slurm" / "native").glob("*"), home / ".profile",
             *Path("/tmp").glob(f"xmem-slurm-native-*/*"), home / "hook-ran.txt", ROOT / "other.txt"]
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths if p.is_file()}


def contain_cases(venv: Path) -> list[tuple[str, list[str]]]:
    user, other = USERS
    home = Path(f"/home/{user}")
    job_dir = home / "contain"
    shutil.rmtree(job_dir, ignore_errors=True)
    job_dir.mkdir(parents=True)
    (job_dir / "hook.c").write_text(CONTAIN_HOOK)
    sh("gcc", "-shared", "-fPIC", str(job_dir / "hook.c"), "-o", str(job_dir / "hook.so"), check=True)
    (ROOT / "other.txt").write_text("the other user's file\n")
    os.chmod(ROOT / "other.txt", 0o666)
    sh("chown", f"{other}:{other}", str(ROOT / "other.txt"))
    sh("chown", "-R", f"{user}:{user}", str(job_dir))
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))
        host = probe.getsockname()[0]
    listeners = contain_listeners()
    results = []
    env = {"HOME": str(home), "USER": user, "LOGNAME": user, "PATH": f"{venv}/bin:/usr/bin:/bin",
           "XMEM_WARM_IDLE_S": "60"}
    try:
        for name, body in CONTAIN_PROGRAMS.items():
            for warm in ("0", "1"):
                (job_dir / "escape.py").write_text(CONTAIN_PRELUDE + body + "\n")
                preload = "export LD_PRELOAD=$PWD/hook.so\n" if name == "dev_shm_plant_then_preload" or warm == "0" \
                    else ""
                (job_dir / "job.sh").write_text(
                    f"#!/bin/bash\n#SBATCH --gres=gpu:1\n{preload}export XMEM_CAMP_MARKER={home}/hook-ran.txt\n"
                    f"export XMEM_CAMP_HOST={host} XMEM_CAMP_OTHER={ROOT}/other.txt XMEM_CAMP_HOOK=$PWD/hook.so\n"
                    "python escape.py\n")
                sh("chown", "-R", f"{user}:{user}", str(job_dir))
                before = contain_state(user)
                command = ["runuser", "-u", user, "--", "env", "-i",
                           *(f"{k}={v}" for k, v in {**env, "XMEM_WARM_TRACER": warm}.items()),
                           f"{venv}/bin/xmem-slurm", "check", "--json", "--gpu", "a100", "job.sh"]
                done = subprocess.run(command, cwd=job_dir, capture_output=True, text=True, timeout=300)
                problems = [] if contain_ran(done) else ["not traced"]
                if contain_state(user) != before:
                    problems.append("user files changed")
                if contain_connections(listeners):
                    problems.append("network reached")
                results.append((f"contain/{name}{'@warm' if warm == '1' else ''}", problems))
                print(f"    contain {results[-1][0]:44s} {', '.join(problems) or 'ok'}", flush=True)
        for verb in ("check", "estimate"):
            results.append((f"contain/root_{verb}s_users_program", contain_root_case(venv, job_dir, user, verb)))
            print(f"    contain {results[-1][0]:44s} {', '.join(results[-1][1]) or 'ok'}", flush=True)
    finally:
        for s in listeners:
            s.close()
        shutil.rmtree(CONTAIN_RUN, ignore_errors=True)
        Path("/dev/shm/xmem-campaign-hook.so").unlink(missing_ok=True)
    return results


def contain_ran(done: subprocess.CompletedProcess) -> bool:
    """The program ran to its end in the sandbox: no error, or its own (an escape that raised)."""
    try:
        reply = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False
    ran = ("user_error", "not_modelled")  # its own exception, or one raised through a patched file API
    return all(error["kind"] in ran for error in reply.get("errors", [])) and "job" in reply


def contain_root_case(venv: Path, job_dir: Path, user: str, verb: str) -> list[str]:
    """Root runs `check` on the user's script (or `estimate` on their program): it records its uid; never 0."""
    marker = job_dir / "ran-as.txt"
    (job_dir / "escape.py").write_text(f"import os\nopen({str(marker)!r}, 'w').write(str(os.getuid()))\n")
    (job_dir / "job.sh").write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython escape.py\n")
    sh("chown", "-R", f"{user}:{user}", str(job_dir))
    marker.unlink(missing_ok=True)
    what = ["job.sh"] if verb == "check" else ["--", "python", "escape.py"]
    subprocess.run([f"{venv}/bin/xmem-slurm", verb, "--json", "--gpu", "a100", *what], cwd=job_dir, capture_output=True,
                   text=True, timeout=300, env={k: v for k, v in os.environ.items() if k != "XMEM_CONFIG"})
    return ["user code run as root"] if marker.exists() and marker.read_text() == "0" else []


def contain_main(venv: Path) -> int:
    """`--only containment`: the group alone and its figures (no cluster is started)."""
    started = time.monotonic()
    results = contain_cases(venv)
    time.sleep(2)
    servers = [line for line in leftover_processes() if "xmem.trace.child.warm_server import main" in line]  # idle, by design
    procs = [line for line in leftover_processes() if line not in servers]
    for line in servers:
        sh("kill", line.split(": ", 1)[1].split()[0])
    print(f"\ncontainment cases: {len(results)}, {time.monotonic() - started:.0f} s")
    for label in ("user files changed", "network reached", "user code run as root", "not traced"):
        print(f"{label + ':':48s} {sum(any(p.startswith(label) for p in ps) for _, ps in results)}")
    print(f"{'leftover processes:':48s} {len(procs)}")
    return 0 if not any(problems for _, problems in results) and not procs else 1

# === end of group "containment" =====================================================================================


# === group "requests" (issue 21: requests and leftovers; `--only requests`) =======================================
# Array jobs sized by one task, cache entries edited or dated in the future, sbatch killed with -9 mid-estimate,
# an estimation job leaving a warm tracer behind, `fit`/`check --vary` over 1..10^24. Each case: a name and its
# problems. Figures: lost, blocked wrongly, left held, wrong request, leftover processes (and files), no answer.

WIDE = """\
import os, torch, torch.nn as nn
width = 8192 * (1 + int(os.environ.get("SLURM_ARRAY_TASK_ID", "0")))
model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)).cuda()
opt = torch.optim.Adam(model.parameters())
for step in range(2):
    loss = model(torch.randn(4, width, device="cuda")).sum()
    opt.zero_grad(); loss.backward(); opt.step()
"""  # Adam on a width x width layer: 1 GiB for task 0, 16 GiB for task 3 (no 9.75 GiB slice holds it)
BATCH = TRAIN.replace("torch.randn(32, 256", "torch.randn(int(__import__('sys').argv[1]), 256")
SLOW = "import time\ntime.sleep(600)\n"
HUGE = 10**24
REQ_USER = "xmemcamp-r"  # a user of its own: other groups' processes are not this group's leftovers


def req_processes(user: str = REQ_USER) -> list[str]:
    return [line.strip() for line in sh("ps", "-u", user, "-o", "pid=,args=").stdout.splitlines() if line.strip()]


def req_dir(user: str, name: str) -> Path:
    d = Path(f"/home/{user}/campaign-requests/{name}")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    for file, source in (("wide.py", WIDE), ("train.py", TRAIN), ("batch.py", BATCH), ("slow.py", SLOW)):
        (d / file).write_text(source)
    return d


def req_submit(user: str, cluster: dict[str, str], venv: Path, d: Path, text: str, *options: str,
               env: dict[str, str] | None = None, filtered: bool = True) -> tuple[str | None, str]:
    (d / "job.sh").write_text(text)
    sh("chown", "-R", f"{user}:{user}", str(d))
    prefix = user_env(user, cluster, venv, env or {}, d)
    argv = [*prefix, *([] if filtered else ["XMEM_NO_FILTER=1"]), "sbatch", "--parsable", "--begin=now+3600",
            "-o", "/dev/null", *options, str(d / "job.sh")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=d, stdin=subprocess.DEVNULL)
    return (done.stdout.strip().split(";")[0] if done.returncode == 0 else None), done.stderr


def req_request(job: str | None, cluster: dict[str, str], mode: str) -> str | None:
    if job and mode == "partition" and settle(job, cluster, user_hold=False):
        return "HELD"
    return gpu_request(job_fields(job, cluster)) if job else None


def req_cache(user: str, cluster: dict[str, str]) -> Path:
    return Path(f"/home/{user}/.cache/xmem-campaign/analyses")


def requests_cases(clusters: dict[str, dict[str, str]], venv: Path) -> list[tuple[str, list[str]]]:
    user = REQ_USER
    if sh("id", user).returncode != 0:
        sh("useradd", "-m", user, check=True)
    inline = clusters["inline"]
    results: list[tuple[str, list[str]]] = []

    def record(name: str, problems: list[str], *jobs: str | None, cluster: dict[str, str] = inline) -> None:
        for job in jobs:
            if job:
                sh("scancel", job, env={**os.environ, **cluster})
        results.append((f"requests/{name}", problems))
        print(f"    requests {name:40s} {', '.join(problems) or 'ok'}", flush=True)

    # 1-6: arrays: the request must hold the widest task, as the same job's single last task gets it
    arrays = {"range": ("--array=0-3", "--array=3"), "step_throttle": ("--array=0-12:4%2", "--array=12"),
              "list": ("--array=3,0,1", "--array=3"), "env_inx": ("", "--array=3")}
    for name, (spec, last) in arrays.items():
        for mode in ("inline", "partition") if name == "range" else ("inline",):
            d = req_dir(user, f"array-{name}-{mode}")
            cluster = clusters[mode]
            env = {"SBATCH_ARRAY_INX": "0-3"} if name == "env_inx" else {}
            head = "#!/bin/bash\n#SBATCH --gres=gpu:1\n" + (f"#SBATCH {spec}\n" if spec else "")
            ref, _ = req_submit(user, cluster, venv, d, head + "python wide.py\n", env=env, filtered=False)
            job, err = req_submit(user, cluster, venv, d, head + "python wide.py\n", env=env)
            single, _ = req_submit(user, cluster, venv, d, f"#!/bin/bash\n#SBATCH --gres=gpu:1\n#SBATCH {last}\n"
                                   "python wide.py\n")
            got, want = req_request(job, cluster, mode), req_request(single, cluster, mode)
            problems: list[str] = []
            if ref is not None and job is None:
                problems.append("blocked wrongly" if "xmem-slurm" in err else "lost")
            problems += ["left held"] * (got == "HELD")
            problems += ["wrong request"] * (got != want or "1g.10gb" in (got or ""))
            record(f"array_{name}@{mode}", problems, ref, job, single, cluster=cluster)
    d = req_dir(user, "array-bad")
    ref, _ = req_submit(user, inline, venv, d, "#!/bin/bash\n#SBATCH --gres=gpu:1 --array=5-1\npython train.py\n",
                        filtered=False)
    job, _ = req_submit(user, inline, venv, d, "#!/bin/bash\n#SBATCH --gres=gpu:1 --array=5-1\npython train.py\n")
    record("array_refused_spec", ["lost"] * (ref is not None and job is None), ref, job)

    # 7-12: a cache entry edited to a request sbatch refuses, or the cluster lacks: the resubmission is estimated
    # again and gets the first submission's request
    edits = {"gpu8_mps100": {"gres": "gpu:8,mps:100"}, "unknown_type": {"gres": "gpu:nosuch:1"},
             "too_many": {"gres": "gpu:a100:8"}, "mig_count": {"gres": "gpu:1g.10gb:4"},
             "gpus_option": {"option": "gpus", "gpus": "h100:9", "gres": None},
             "mps_over": {"gres": "mps:a100:500"}}
    for name, edit in edits.items():
        d = req_dir(user, f"cache-{name}")
        text = f"#!/bin/bash\n#SBATCH --gres=gpu:1\n# {name}\npython train.py\n"
        cache = req_cache(user, inline)
        before = set(cache.glob("*.json")) if cache.is_dir() else set()
        first, _ = req_submit(user, inline, venv, d, text)
        want = req_request(first, inline, "inline")
        for entry in set(cache.glob("*.json")) - before:
            data = json.loads(entry.read_text())
            if data.get("decision"):
                data["decision"].update(edit)
                entry.write_text(json.dumps(data))  # the user's own file, still theirs
        again, err = req_submit(user, inline, venv, d, text)
        problems = ["lost"] * (first is not None and again is None)
        problems += ["wrong request"] * (again is not None and req_request(again, inline, "inline") != want)
        record(f"cache_edited_{name}", problems, first, again)

    # 13: 500 entries dated in the future must not evict every new one: the resubmission is a cache hit
    cache = req_cache(user, inline)
    cache.mkdir(parents=True, exist_ok=True)
    for i in range(500):
        p = cache / f"future{i:03d}.json"
        p.write_text('{"decision": null, "peaks": {}, "errors": []}')
        os.utime(p, (4e9, 4e9))
    sh("chown", "-R", f"{user}:{user}", str(cache))
    d = req_dir(user, "cache-future")
    text = "#!/bin/bash\n#SBATCH --gres=gpu:1\n# future-dated cache\npython train.py\n"
    first, _ = req_submit(user, inline, venv, d, text)
    again, err = req_submit(user, inline, venv, d, text)
    problems = ["lost"] * (first is None or again is None) + ["evicted at once"] * ("cached estimate" not in err)
    record("cache_500_future_entries", problems, first, again)
    for p in cache.glob("future*.json"):
        p.unlink()

    # 14-15: sbatch killed with -9 while its filter traces: nothing of the user's may run 5 s later, no file stays
    for name, options in (("script", ()), ("wrap", ("--wrap=python slow.py",))):
        d = req_dir(user, f"kill-{name}")
        (d / "job.sh").write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython slow.py\n")
        sh("chown", "-R", f"{user}:{user}", str(d))
        argv = [*user_env(user, inline, venv, {}, d), "sbatch", "--begin=now+3600", "--gres=gpu:1", *options,
                *([] if options else [str(d / "job.sh")])]
        proc = subprocess.Popen(argv, cwd=d, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while not any("slow.py" in line and "sbatch" not in line for line in req_processes()) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        sbatch_pid = sh("pgrep", "-u", user, "-x", "sbatch").stdout.split()
        for pid in sbatch_pid:
            os.kill(int(pid), 9)
        proc.wait()
        time.sleep(5)
        left = [line for line in req_processes() if "xmem" in line or "slow.py" in line]
        uid = int(sh("id", "-u", user).stdout)
        files = [p for p in Path("/tmp").glob("lua_*") if p.lstat().st_uid == uid]
        record(f"sbatch_kill9_{name}", ["leftover processes"] * bool(left) + ["leftover files"] * bool(files))

    # 16: deferred estimation with the warm tracer asked for leaves no server on the estimation node
    part = clusters["partition"]
    d = req_dir(user, "deferred-warm")
    job, _ = req_submit(user, part, venv, d, "#!/bin/bash\n#SBATCH --gres=gpu:1\n# warm\npython train.py\n",
                        env={"XMEM_WARM_TRACER": "1"})
    held = req_request(job, part, "partition") == "HELD"
    time.sleep(3)
    left = [line for line in req_processes() if "xmem.trace.child.warm_server" in line]
    record("deferred_warm_tracer", ["left held"] * held + ["leftover processes"] * bool(left) + ["lost"] * (job is None),
           job, cluster=part)

    # 17-18: fit and check --vary over 1..10^24 answer within 600 s and say where the search ended
    d = req_dir(user, "fit-huge")
    (d / "job.sh").write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython batch.py {}\n")
    sh("chown", "-R", f"{user}:{user}", str(d))
    for name, verb in (("fit", ["fit", "--json", "--gpu", "a100", "--vary", f"batch=1..{HUGE}", "--",
                                "python", "batch.py", "{}"]),
                       ("check_vary", ["check", "--json", str(d / "job.sh"), "--vary", f"batch=1..{HUGE}"])):
        prefix = user_env(user, inline, venv, {}, d)
        try:
            done = subprocess.run([*prefix, f"{venv}/bin/xmem-slurm", *verb], capture_output=True, text=True,
                                  timeout=600, cwd=d)
            answer = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            answer = {}
        record(f"{name}_1_to_10e24", [] if answer.get("note") and answer.get("limits") else ["no answer"])
    return results


def requests_main(clusters: dict[str, dict[str, str]], venv: Path, keep: bool) -> int:
    """`--only requests`: the group alone, its figures, the clusters down."""
    started = time.monotonic()
    results = requests_cases(clusters, venv)
    labels = ("lost", "blocked wrongly", "left held", "wrong request", "leftover processes", "leftover files",
              "evicted at once", "no answer")
    counts = {label: sum(label in ps for _, ps in results) for label in labels}
    return group_figures("requests", results, counts, req_processes(), started, clusters, keep)

# === end of group "requests" ========================================================================================


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run only the cases of this kind (program, directive, shape, environment, "
                                       "cross-user, trust, containment)")
    parser.add_argument("--keep", action="store_true", help="leave the clusters up at the end")
    parser.add_argument("--workers", type=int, default=3, help="cases submitted side by side (default 3)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: it makes users and starts Slurm daemons")
    ROOT.mkdir(parents=True, exist_ok=True)
    venv = setup_users_and_env()
    if args.only == "containment":  # issue 21's sandbox and root cases: no cluster needed
        return contain_main(venv)
    if args.only == "trust":  # the inline cluster is enough
        return trust_main({"inline": start_cluster("inline", venv)}, venv, args.keep)
    clusters = {mode: start_cluster(mode, venv) for mode in PORTS}
    if args.only == "requests":  # issue 21's requests and leftovers: its own figures
        return requests_main(clusters, venv, args.keep)
    todo = [c for c in cases() if not args.only or c.kind == args.only]
    homes = [Path(f"/home/{u}") for u in USERS]
    for home in homes:  # a fresh start: no job directory, no cached analysis from an earlier campaign
        shutil.rmtree(home / "campaign", ignore_errors=True)
        shutil.rmtree(home / ".cache" / "xmem-campaign", ignore_errors=True)
        (home / "planted.txt").unlink(missing_ok=True)
    before = snapshot(homes)
    baseline: dict[str, str | None] = {}
    for c in todo:  # the victim's request without anything planted, for the cross-user cases
        if c.plant:
            o = run_case(999, Case(c.kind, c.name, c.script, user=c.user), clusters, venv, {})
            baseline[c.name] = o.request
    started = time.monotonic()
    outcomes = []

    def one(index: int, case: Case) -> Outcome:
        outcome = run_case(index, case, clusters, venv, baseline)
        mark = ", ".join(outcome.problems) or "ok"
        line = outcome.stderr.strip().splitlines()[-1][:150] if outcome.stderr.strip() else ""
        print(f"{index:3d} {case.kind:11s} {case.name:32s} {outcome.seconds:6.2f} s  {mark:14s} {line}", flush=True)
        return outcome
    # Independent cases side by side (a deferred one mostly waits for its estimation job); the planting ones
    # last and alone, since what they plant stays until the end.
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        outcomes += pool.map(lambda ic: one(*ic), [(i, c) for i, c in enumerate(todo) if not c.plant])
    outcomes += [one(i, c) for i, c in enumerate(todo) if c.plant]
    trust = run_trust_group(clusters, venv) if not args.only else []  # its own figures, below
    time.sleep(5)  # estimation jobs finishing
    after = snapshot(homes)
    campaign_dirs = {str(h / "campaign") for h in homes}
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p)
                     and not any(p.startswith(d + "/") and p.endswith("/job.sh") for d in campaign_dirs)
                     and not any(p.startswith(d + "/") and (p.endswith(".py") or p.endswith(".toml"))
                                 for d in campaign_dirs))
    procs = leftover_processes()
    count = lambda what: sum(what in o.problems for o in outcomes)
    latencies = [o.seconds for o in outcomes if o.ok]
    kinds = ", ".join(f"{k} {sum(o.case.kind == k for o in outcomes)}" for k in dict.fromkeys(o.case.kind
                                                                                           for o in outcomes))
    p90 = sorted(latencies)[int(0.9 * (len(latencies) - 1))]
    print(f"\ncases: {len(outcomes)} ({kinds}), {time.monotonic() - started:.0f} s")
    for label, value in (("submissions lost", count("lost")), ("blocked wrongly", count("blocked wrongly")),
                         ("left held", count("left held")), ("wrong request", count("wrong request")),
                         ("user's text changed", count("user's text")),
                         ("leftover processes", len(procs)),
                         ("files changed outside the estimator's scratch", len(changed)),
                         ("cross-user effects", count("cross-user"))):
        print(f"{label + ':':48s} {value}")
    print(f"{'sbatch latency (accepted submissions):':48s} median {statistics.median(latencies):.2f} s, "
          f"p90 {p90:.2f} s, max {max(latencies):.2f} s")
    if trust:
        print(f"{'trust group (issue 21) cases:':48s} {len(trust)}")
        for label in ("files changed", "cross-user", "calibration moved", "job hung", "measurement lost",
                      "trusted a bad file"):
            print(f"{'  trust: ' + label + ':':48s} {sum(any(p.startswith(label) for p in ps) for _, ps in trust)}")
    for p in procs[:10]:
        print("  leftover:", p)
    for p in changed[:10]:
        print("  changed:", p)
    for o in outcomes:
        if o.problems:
            print(f"  {o.case.kind}/{o.case.name}: {', '.join(o.problems)}: {o.stderr.strip()[:300]}")
    for user in USERS:  # what the cross-user cases planted (only the attacker's own entries)
        uid = sh("id", "-u", user).stdout.strip()
        shutil.rmtree(f"{PLANTED[0]}{uid}", ignore_errors=True)
    attacker_uid = int(sh("id", "-u", USERS[0]).stdout.strip())
    for entry in Path(PLANTED[1]).glob("*"):
        if entry.lstat().st_uid == attacker_uid:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    if not args.keep:
        for mode in PORTS:
            sh("bash", str(REPO / "scripts" / "slurm-dev-cluster.sh"), "down", "--lab", str(ROOT / f"lab-{mode}"),
               timeout=120)
    return 0 if not any(o.problems for o in outcomes) and not procs and not changed \
        and not any(problems for _, problems in trust) else 1


if __name__ == "__main__":
    sys.exit(main())
