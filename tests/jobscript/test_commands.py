"""Finding the training command(s) of a batch script by a static read."""

import sys
from pathlib import Path

from xmem.jobscript import parse_jobscript

ENV = {"HOME": "/home/u", "PATH": "/usr/bin:/bin", "USER": "u"}


def parse(body: str, **kw):
    kw.setdefault("env", ENV)
    return parse_jobscript("#!/bin/bash\n#SBATCH --gres=gpu:1\n" + body, **kw)


def only_command(body: str, **kw):
    job = parse(body, **kw)
    assert not job.problems, job.problems
    assert len(job.commands) == 1, job.commands
    return job.commands[0]


def test_python_script_with_arguments():
    c = only_command("python train.py --lr 1e-3\n")
    assert c.argv == ("python", "train.py", "--lr", "1e-3")
    assert (c.launcher, c.ranks, c.line_no, c.python) == ("python", None, 3, None)


def test_python3_and_interpreter_flags_dropped():
    c = only_command("python3 -u -W ignore train.py\n")
    assert c.argv == ("python", "train.py")


def test_python_dash_m_module():
    assert only_command("python -m pkg.train --epochs 2\n").argv == ("python", "-m", "pkg.train", "--epochs", "2")


def test_torchrun_estimates_one_rank_and_keeps_the_rank_count():
    c = only_command("torchrun --standalone --nproc_per_node=4 train.py --bs 8\n")
    assert c.argv == ("python", "train.py", "--bs", "8")
    assert (c.launcher, c.ranks) == ("torchrun", 4)


def test_torchrun_option_values_from_command_output_do_not_matter():
    c = only_command("torchrun --nnodes 2 --nproc-per-node 2 --rdzv-endpoint $(hostname):29500 train.py\n")
    assert c.argv == ("python", "train.py") and c.ranks == 2


def test_python_dash_m_torch_distributed_run_is_torchrun():
    c = only_command("python -m torch.distributed.run --nproc_per_node 2 -m pkg.train\n")
    assert c.argv == ("python", "-m", "pkg.train")
    assert (c.launcher, c.ranks) == ("torchrun", 2)


def test_srun_python_with_srun_options():
    c = only_command("srun --ntasks-per-node=2 -l --mpi=none python train.py\n")
    assert c.argv == ("python", "train.py")
    assert (c.launcher, c.ranks) == ("srun", 2)


def test_srun_without_task_count_takes_the_jobs():
    job = parse_jobscript("#SBATCH --ntasks-per-node=4\nsrun python train.py\n", env=ENV)
    assert job.commands[0].ranks == 4


def test_accelerate_launch_passes_mixed_precision_to_the_script():
    c = only_command("accelerate launch --num_processes 2 --mixed_precision bf16 --multi_gpu train.py --x 1\n")
    assert c.argv == ("python", "train.py", "--x", "1")
    assert (c.launcher, c.ranks) == ("accelerate", 2)
    assert c.env["ACCELERATE_MIXED_PRECISION"] == "bf16"


def test_cd_sets_the_working_directory_relative_to_the_previous_one():
    c = only_command("cd /data/proj\ncd sub/../run\npython train.py\n", submit_cwd="/home/u")
    assert c.cwd == "/data/proj/run"


def test_working_directory_defaults_to_submit_dir_then_chdir_directive():
    assert only_command("python t.py\n", submit_cwd="/home/u/p").cwd == "/home/u/p"
    job = parse_jobscript("#SBATCH -D work\npython t.py\n", env=ENV, submit_cwd="/home/u")
    assert job.commands[0].cwd == "/home/u/work"


def test_export_reaches_the_command_and_expands():
    c = only_command("export DATA=/data\nexport OUT=$DATA/out LR=0.1\npython t.py --out ${OUT} --lr $LR\n")
    assert c.argv == ("python", "t.py", "--out", "/data/out", "--lr", "0.1")
    assert c.env == {"DATA": "/data", "OUT": "/data/out", "LR": "0.1"}


def test_plain_assignment_expands_but_is_not_exported():
    c = only_command("EPOCHS=3\npython t.py --epochs $EPOCHS\n")
    assert c.argv[-1] == "3"
    assert "EPOCHS" not in c.env


def test_assignment_prefix_goes_to_that_command_only():
    job = parse("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python a.py\npython b.py\n")
    assert job.commands[0].env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert job.commands[1].env == {}


def test_venv_activation_sets_the_interpreter():
    c = only_command("source /opt/envs/t/bin/activate\npython t.py\n")
    assert c.python == "/opt/envs/t/bin/python"
    assert c.env["VIRTUAL_ENV"] == "/opt/envs/t"
    assert c.env["PATH"] == "/opt/envs/t/bin:/usr/bin:/bin"


def test_dot_activate_relative_to_cwd():
    c = only_command("cd /proj\n. .venv/bin/activate\npython t.py\n")
    assert c.python == "/proj/.venv/bin/python"


def test_explicit_interpreter_path():
    assert only_command("/opt/py/bin/python3 t.py\n").python == "/opt/py/bin/python3"


def test_positional_arguments_and_quoted_all_arguments():
    c = only_command('python t.py --cfg "$1" "$@"\n', script_args=["a b", "c"])
    assert c.argv == ("python", "t.py", "--cfg", "a b", "a b", "c")


def test_unquoted_star_splits_words():
    c = only_command("python t.py $*\n", script_args=["a b", "c"])
    assert c.argv == ("python", "t.py", "a", "b", "c")


def test_default_value_expansion_and_home_tilde():
    c = only_command("python ~/t.py --bs ${BS:-32}\n")
    assert c.argv == ("python", "/home/u/t.py", "--bs", "32")


def test_line_continuations():
    c = only_command("python train.py \\\n  --lr 1e-3 \\\n  --epochs 2\n")
    assert c.argv == ("python", "train.py", "--lr", "1e-3", "--epochs", "2")
    assert c.line_no == 3


def test_redirections_and_pipes_are_not_arguments():
    c = only_command("python train.py --x 1 > out.log 2>&1 | tee all.log\n")
    assert c.argv == ("python", "train.py", "--x", "1")


def test_wrappers_are_stripped():
    assert only_command("exec time nohup python t.py\n").argv == ("python", "t.py")
    c = only_command("env -u X OMP_NUM_THREADS=4 python t.py\n")
    assert c.argv == ("python", "t.py") and c.env == {"OMP_NUM_THREADS": "4"}


def test_here_document_bodies_are_skipped_and_lines_stay_right():
    job = parse("cat > cfg.yaml <<EOF\npython not_me.py\nEOF\npython t.py\n")
    assert [c.argv for c in job.commands] == [("python", "t.py")]
    assert job.commands[0].line_no == 6


def test_slurm_variables_known_from_the_request_expand():
    job = parse_jobscript("#SBATCH -J exp1 --cpus-per-task=8\npython t.py --name $SLURM_JOB_NAME "
                          "--workers $SLURM_CPUS_PER_TASK\n", env=ENV)
    assert job.commands[0].argv[-4:] == ("--name", "exp1", "--workers", "8")


def test_several_training_commands_are_all_found():
    job = parse("python prep.py\npython train.py\n")
    assert [c.argv[1] for c in job.commands] == ["prep.py", "train.py"]


def test_diagnostic_python_calls_are_not_training():
    job = parse("python -c 'import torch'\npython --version\npython -m pip install x\npython t.py\n")
    assert [c.argv for c in job.commands] == [("python", "t.py")]


def test_python_shebang_script_is_itself_the_training_script():
    job = parse_jobscript("#!/usr/bin/env python3\n#SBATCH --gres=gpu:1\nimport torch\n", path="/j/job.py",
                          script_args=["--x"], env=ENV)
    assert job.commands[0].argv == ("python", "/j/job.py", "--x")
    assert not job.problems


# -- what a static read cannot settle is reported with its line, never guessed -----------------------------------

def test_command_in_a_loop_is_a_problem_not_a_command():
    job = parse("for seed in 1 2 3; do\n  python t.py --seed $seed\ndone\n")
    assert not job.commands
    assert job.problems[0].line_no == 4 and "loop" in job.problems[0].reason


def test_command_in_a_conditional_is_a_problem():
    job = parse('if [ -n "$X" ]; then python a.py; fi\npython b.py\n')
    assert [c.argv[1] for c in job.commands] == ["b.py"]
    assert job.problems[0].line_no == 3


def test_argument_from_command_output_is_a_problem():
    job = parse("python t.py --cfg $(ls configs | head -1)\n")
    assert not job.commands
    assert "command output" in job.problems[0].reason and job.problems[0].line_no == 3


def test_variable_set_from_command_output_is_a_problem_where_used():
    job = parse("CFG=$(cat cfg.txt)\npython t.py --cfg $CFG\n")
    assert job.problems[0].line_no == 4 and "$CFG" in job.problems[0].reason


def test_runtime_only_slurm_variable_is_a_problem():
    job = parse("python t.py --task $SLURM_ARRAY_TASK_ID\n")
    assert not job.commands and "set when the job runs" in job.problems[0].reason


def test_cd_to_unknown_directory_makes_later_commands_problems():
    job = parse("cd $(mktemp -d)\npython t.py\n")
    assert not job.commands and "working directory" in job.problems[0].reason


def test_unsupported_launchers_are_problems():
    job = parse("singularity exec img.sif python t.py\nmpirun -np 2 python t.py\n")
    assert not job.commands
    assert [p.line_no for p in job.problems] == [3, 4]


def test_launchers_read_as_the_tracer_reads_them():
    """One grammar (xmem.launchers): deepspeed and accelerate's module too, and an unknown count is one per GPU."""
    job = parse("deepspeed --num_gpus=2 train.py --deepspeed_config ds.json\n"
                "python -m accelerate.commands.launch --num_processes=2 -m pkg.train\n"
                "torchrun --nproc_per_node=$(nvidia-smi -L | wc -l) t.py\n"
                "torchrun --no-python t.sh\n")
    deepspeed, accelerate, every_gpu = job.commands
    assert deepspeed.argv == ("python", "train.py", "--deepspeed_config", "ds.json")
    assert (deepspeed.launcher, deepspeed.ranks, deepspeed.env["WORLD_SIZE"]) == ("deepspeed", 2, "2")
    assert (accelerate.argv, accelerate.launcher, accelerate.ranks) == (("python", "-m", "pkg.train"), "accelerate", 2)
    assert (every_gpu.ranks, every_gpu.env["WORLD_SIZE"]) == (None, "1")  # the job's node has one GPU
    assert [(p.line_no, p.reason.split(":")[0]) for p in job.problems] == [(6, "torchrun")]


def test_script_without_any_command_says_so():
    job = parse("echo hello\nnvidia-smi\n")
    assert not job.commands
    assert job.problems[0].line_no == 0 and "no training command" in job.problems[0].reason


def test_unterminated_quote_is_a_syntax_problem():
    job = parse("python t.py 'oops\n")
    assert "unterminated single quote" in job.problems[0].reason


def test_unknown_conda_environment_is_a_problem():
    job = parse("conda activate nowhere-env\npython t.py\n", env={**ENV, "CONDA_EXE": "/nonexistent/bin/conda"})
    assert job.problems[0].line_no == 3 and "nowhere-env" in job.problems[0].reason


def test_conda_environment_by_path(tmp_path):
    c = only_command(f"conda activate {tmp_path}/envs/t\npython t.py\n")
    assert c.python == f"{tmp_path}/envs/t/bin/python"


def test_conda_environment_by_name_in_the_base_envs_folder(tmp_path):
    (tmp_path / "envs" / "t").mkdir(parents=True)
    c = only_command("conda activate t\npython t.py\n", env={**ENV, "CONDA_EXE": f"{tmp_path}/bin/conda"})
    assert c.python == f"{tmp_path}/envs/t/bin/python"


def test_what_sbatch_itself_refuses_is_reported():
    no_shebang = parse_jobscript("#SBATCH --gres=gpu:1\npython t.py\n", env=ENV)
    assert [(p.line_no, "first line" in p.reason) for p in no_shebang.problems] == [(1, True)]
    dos = parse_jobscript("#!/bin/bash\r\n#SBATCH --gres=gpu:1\r\npython t.py\r\n", env=ENV)
    assert [(p.line_no, "dos2unix" in p.reason) for p in dos.problems] == [(1, True)]


def test_command_after_or_runs_only_on_failure_so_it_is_a_problem():
    job = parse("cd /data && python a.py || python fallback.py\n")
    assert [c.argv[1] for c in job.commands] == ["a.py"]
    assert job.problems[0].line_no == 3 and "fallback" in job.problems[0].line


def test_function_definitions_do_not_leave_the_rest_of_the_script_inside_a_block():
    job = parse("function setup() {\n  python inner.py\n}\nlog() { echo \"$@\"; }\npython t.py\n")
    assert [c.argv[1] for c in job.commands] == ["t.py"]
    assert [p.line_no for p in job.problems] == [4]


def test_default_values_are_expanded_too():
    c = only_command('python t.py --data ${DATA:-$HOME/data} --tag ${TAG-"a b"}\n')
    assert c.argv == ("python", "t.py", "--data", "/home/u/data", "--tag", "a b")


def test_typical_cluster_scripts():
    data = Path(__file__).parents[1] / "data" / "jobscripts"
    torchrun = parse_jobscript((data / "multi-gpu-torchrun.sh").read_text(), submit_cwd="/home/u/proj", env=ENV)
    [c] = torchrun.commands
    assert c.argv == ("python", "train.py", "--config", "configs/base.yaml", "--out", "runs/llm_0")
    assert (c.launcher, c.ranks, c.cwd) == ("srun", 4, "/home/u/proj")
    assert c.env["OMP_NUM_THREADS"] == "32"
    assert [p.line_no for p in torchrun.problems] == [14]  # conda env 'myenv' not found from here
    venv = parse_jobscript((data / "venv-python.sh").read_text(), submit_cwd="/home/u/proj", env=ENV)
    assert not venv.problems
    [c] = venv.commands
    assert c.argv == ("python", "main.py", "--epochs=10", "--lr", "3e-4")
    assert c.python == "/home/u/proj/venv/bin/python"


def test_submit_dir_is_where_sbatch_ran_even_with_chdir():
    job = parse_jobscript("#!/bin/bash\n#SBATCH -D work\npython t.py --from $SLURM_SUBMIT_DIR\n", env=ENV,
                          submit_cwd="/home/u")
    assert job.commands[0].cwd == "/home/u/work"
    assert job.commands[0].argv[-1] == "/home/u"


def test_environment_runners_are_problems_not_silently_skipped():
    job = parse("uv run python t.py\npoetry run python t.py\nuv pip install numpy\n")
    assert not job.commands
    assert [(p.line_no, p.reason) for p in job.problems] == [
        (3, "python is started through 'uv', which xmem does not follow"),
        (4, "python is started through 'poetry', which xmem does not follow")]


def test_subshell_changes_do_not_leak():
    job = parse("(cd /elsewhere && export X=1 && python a.py)\npython b.py\n", submit_cwd="/home/u")
    assert [(c.argv[1], c.cwd, dict(c.env)) for c in job.commands] == [
        ("a.py", "/elsewhere", {"X": "1"}), ("b.py", "/home/u", {})]


def test_export_of_a_value_with_spaces_is_one_assignment():
    c = only_command('A="x y"\nexport B=$A\ndeclare C=$A\npython t.py "$B" "$C"\n')
    assert c.argv == ("python", "t.py", "x y", "x y")
    assert c.env == {"B": "x y"}


def test_the_batch_script_reader_does_not_import_the_tracer():
    import subprocess
    import sys
    code = "import sys, xmem.jobscript; print(*sorted(m for m in sys.modules if m.startswith('xmem.trace')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == ""


def test_a_console_script_is_a_python_program_run_on_its_environments_python(tmp_path):
    """`trl sft`, `tune run`: an environment's console script (a python shebang, the rule the tracer uses too) is
    the training command, found on the script's PATH or by path, on the python beside it; pip is not training."""
    bin_dir = tmp_path / "env" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    for name, first_line in [("train-cli", f"#!{bin_dir / 'python'}"), ("pip", f"#!{bin_dir / 'python'}"),
                             ("tool", "#!/bin/sh")]:
        (bin_dir / name).write_text(first_line + "\nimport sys\n")
        (bin_dir / name).chmod(0o755)
    job = parse(f"source {tmp_path}/env/bin/activate\npip install x\ntool run\ntrain-cli sft --lr 1\n"
                f"srun --ntasks-per-node=2 env/bin/train-cli run cfg\n", submit_cwd=str(tmp_path))
    assert not job.problems, job.problems
    cli = str(bin_dir / "train-cli")
    assert [(c.argv, c.python, c.launcher, c.ranks, c.line_no) for c in job.commands] == [
        (("python", cli, "sft", "--lr", "1"), str(bin_dir / "python"), "python", None, 6),
        (("python", cli, "run", "cfg"), str(bin_dir / "python"), "srun", 2, 7)]


# --- shell wrappers (issue 31): run as the job runs them, their Python processes traced ----------------------------

def test_a_shell_wrapper_that_starts_python_is_the_training_command(tmp_path):
    (tmp_path / "train.sh").write_text("#!/bin/bash\nexport NCCL_DEBUG=WARN\ntorchrun --nproc_per_node 2 train.py\n")
    command = only_command(f"cd {tmp_path}\nbash train.sh --epochs 1\n")
    assert command.argv == ("bash", "train.sh", "--epochs", "1") and command.launcher == "shell"
    assert command.cwd == str(tmp_path)


def test_a_script_with_a_shell_shebang_run_directly_is_a_wrapper(tmp_path):
    wrapper = tmp_path / "run.sh"
    wrapper.write_text("#!/usr/bin/env bash\npython -m pkg.train\n")
    wrapper.chmod(0o755)
    command = only_command(f"cd {tmp_path}\n./run.sh\n")
    assert command.argv == ("./run.sh",) and command.launcher == "shell"


def test_an_inline_shell_command_naming_python_is_a_wrapper():
    command = only_command("sh -c 'python train.py --lr 1'\n")
    assert command.argv == ("sh", "-c", "python train.py --lr 1")


def test_a_shell_script_that_starts_no_python_is_not_the_training(tmp_path):
    (tmp_path / "prepare.sh").write_text("#!/bin/bash\nmkdir -p data\ntar xf data.tar -C data\n")
    (tmp_path / "train.py").write_text("")
    command = only_command(f"cd {tmp_path}\nbash prepare.sh\npython train.py\n")
    assert command.argv[0] == "python" and command.argv[1].endswith("train.py")


def test_a_script_the_static_read_cannot_name_is_run_whole(tmp_path):
    """Issue 31: a training command in a loop (or behind a value known only when the job runs) is not guessed: the
    batch script itself is the command, run as Slurm runs it (its shebang, the job's working directory)."""
    script = tmp_path / "job.sh"
    body = "#!/bin/bash\n#SBATCH --gres=gpu:1\nfor lr in 0.1 0.01; do\n  srun python train.py --lr $lr\ndone\n"
    script.write_text(body)
    job = parse_jobscript(body, path=str(script), script_args=["x"], submit_cwd=str(tmp_path), env=ENV,
                          run_unnamed=True)
    assert not parse_jobscript(body, path=str(script), env=ENV).commands  # the static read alone names none
    assert len(job.commands) == 1
    command = job.commands[0]
    assert command.argv == ("/bin/bash", str(script), "x") and command.launcher == "batch script"
    assert command.cwd == str(tmp_path)
    assert all(problem.reason.endswith("the script is run whole instead") for problem in job.problems)


def test_a_script_that_names_no_python_launcher_is_not_run(tmp_path):
    job = parse("for f in a b; do\n  ./simulate $f\ndone\n", run_unnamed=True)
    assert not job.commands and job.problems
