"""#SBATCH directives read as sbatch reads them (Slurm 22.05 option table, getopt rules)."""

import pytest

from xmem.jobscript import GresItem, parse_gpus, parse_gres, parse_jobscript
from xmem.jobscript.directives import DirectiveError, directive_arguments


def request_of(text: str, **kw):
    return parse_jobscript(text, env={}, **kw).directives


def test_long_option_with_equals_and_with_space():
    r = request_of("#!/bin/bash\n#SBATCH --partition=gpu\n#SBATCH --account acct1\npython t.py\n")
    assert r.partition == "gpu"
    assert r.account == "acct1"


def test_short_options_with_space_and_glued_value():
    r = request_of("#SBATCH -p short -Aacct2\n#SBATCH -G 2\n#SBATCH -N1 -n 8\npython t.py\n")
    assert (r.partition, r.account, r.gpus, r.nodes, r.ntasks) == ("short", "acct2", "2", "1", 8)


def test_unambiguous_long_prefix_is_accepted_like_getopt_long():
    assert request_of("#SBATCH --part=debug\npython t.py\n").partition == "debug"


def test_ambiguous_long_prefix_is_a_problem_naming_the_candidates():
    job = parse_jobscript("#SBATCH --gpus-per=1\npython t.py\n", env={})
    assert job.problems[0].line_no == 1
    assert "--gpus-per-node" in job.problems[0].reason and "--gpus-per-task" in job.problems[0].reason


def test_unknown_option_is_a_problem_with_its_line():
    job = parse_jobscript("#!/bin/bash\n#SBATCH --gpu-count=2\npython t.py\n", env={})
    assert [(p.line_no, "unknown option --gpu-count" in p.reason) for p in job.problems] == [(2, True)]


def test_comment_after_directive_is_ignored():
    r = request_of("#SBATCH --gres=gpu:a100:2   # two A100s, please\npython t.py\n")
    assert r.gres == (GresItem("gpu", "a100", 2),)


def test_several_gres_items_in_one_option():
    r = request_of("#SBATCH --gres=gpu:a100:2,mps:50,shard:h100:3\npython t.py\n")
    assert r.gres == (GresItem("gpu", "a100", 2), GresItem("mps", None, 50), GresItem("shard", "h100", 3))


def test_directives_after_the_first_command_are_ignored_as_sbatch_does():
    r = request_of("#!/bin/bash\n#SBATCH -p a\n\nmodule load cuda\n#SBATCH -p b\npython t.py\n")
    assert r.partition == "a"
    assert [raw[0] for raw in r.raw] == ["partition"]


def test_sbatch_magic_must_start_the_line_and_be_followed_by_space():
    r = request_of("  #SBATCH -p indented\n# SBATCH -p spaced\n#SBATCHX -p glued\n#SBATCH -p real\npython t.py\n")
    assert r.partition == "real"
    assert len(r.raw) == 1


def test_later_directive_overrides_earlier_and_command_line_overrides_both():
    text = "#SBATCH -p a\n#SBATCH -p b\n#SBATCH --gres=gpu:1\npython t.py\n"
    assert request_of(text).partition == "b"
    r = request_of(text, cli_options={"partition": "c", "gres": "gres:gpu:h100:1"})
    assert r.partition == "c"
    assert r.gres == (GresItem("gpu", "h100", 1),)  # cli_filter reads gres back with a gres: prefix
    assert r.raw[-1][2] == 0  # line 0: the command line


def test_double_quotes_group_a_value_with_spaces():
    assert directive_arguments(' --job-name="my job" -p x') == ["--job-name=my job", "-p", "x"]


def test_gpus_forms():
    r = request_of("#SBATCH --gpus=h100:1\n#SBATCH --gpus-per-node=2\n#SBATCH --gpus-per-task=a100:1\npython t\n")
    assert (r.gpus, r.gpus_per_node, r.gpus_per_task) == ("h100:1", "2", "a100:1")
    assert r.gpu_items == (GresItem("gpu", "h100", 1), GresItem("gpu", None, 2), GresItem("gpu", "a100", 1))


def test_flag_options_take_no_value():
    r = request_of("#SBATCH --exclusive --requeue -p x\npython t.py\n")
    assert r.partition == "x"
    assert ("exclusive", None, 1) in r.raw


def test_option_needing_a_value_at_end_of_line_is_a_problem():
    job = parse_jobscript("#SBATCH --partition\npython t.py\n", env={})
    assert "needs a value" in job.problems[0].reason


def test_gres_value_forms():
    assert parse_gres("gpu") == (GresItem("gpu", None, 1),)
    assert parse_gres("gpu:2") == (GresItem("gpu", None, 2),)
    assert parse_gres("gpu:1g.10gb:1") == (GresItem("gpu", "1g.10gb", 1),)
    assert parse_gres("gres:mps:25") == (GresItem("mps", None, 25),)
    assert parse_gres("mps:1k") == (GresItem("mps", None, 1024),)
    assert parse_gres("none") == ()
    with pytest.raises(DirectiveError):
        parse_gres("gpu:a100:two")


def test_gpus_value_forms():
    assert parse_gpus("2") == (GresItem("gpu", None, 2),)
    assert parse_gpus("a100:1,h100:2") == (GresItem("gpu", "a100", 1), GresItem("gpu", "h100", 2))
    with pytest.raises(DirectiveError):
        parse_gpus("a100")


def test_wants_gpu_generic_and_explicit_type():
    generic = request_of("#SBATCH --gres=gpu:1\npython t.py\n")
    assert generic.wants_gpu and generic.is_generic_gpu_request and generic.explicit_type is None
    typed = request_of("#SBATCH -G a100:1\npython t.py\n")
    assert typed.wants_gpu and not typed.is_generic_gpu_request and typed.explicit_type == "a100"
    mps = request_of("#SBATCH --gres=mps:40\npython t.py\n")
    assert mps.wants_gpu and not mps.is_generic_gpu_request  # an MPS share is the user's own choice
    assert not request_of("#SBATCH -p cpu\npython t.py\n").wants_gpu
    assert not request_of("#SBATCH --gres=gpu:0\npython t.py\n").wants_gpu


def test_gpu_count_counts_whole_gpus_and_one_for_shares():
    assert request_of("#SBATCH --gres=gpu:a100:2\npython t.py\n").gpu_count == 2
    assert request_of("#SBATCH --gres=shard:3\npython t.py\n").gpu_count == 1
    assert request_of("python t.py\n").gpu_count == 0


def test_non_numeric_ntasks_is_a_problem():
    job = parse_jobscript("#SBATCH --ntasks=many\npython t.py\n", env={})
    assert job.directives.ntasks is None
    assert job.problems[0].line_no == 1 and "ntasks" in job.problems[0].reason


def test_sbatch_environment_variables_sit_between_directives_and_command_line():
    text = "#!/bin/bash\n#SBATCH -p a --gres=gpu:1\npython t.py\n"
    env = {"SBATCH_PARTITION": "b", "SBATCH_GRES": "gpu:h100:1"}
    r = parse_jobscript(text, env=env).directives
    assert (r.partition, r.gres) == ("b", (GresItem("gpu", "h100", 1),))
    assert ("partition", "b", -1) in r.raw
    assert parse_jobscript(text, env=env, cli_options={"partition": "c"}).directives.partition == "c"


def test_constraint_and_job_name():
    r = request_of('#SBATCH --constraint="a100&ib" -J run1\npython t.py\n')
    assert (r.constraint, r.job_name) == ("a100&ib", "run1")


def test_gpu_mixes_slurm_refuses_are_problems_on_the_option_line():
    job = parse_jobscript("#!/bin/bash\n#SBATCH -p x\n#SBATCH --gres=gpu:a100:1,mps:50\npython t.py\n", env={})
    assert [(p.line_no, "mps or shard" in p.reason) for p in job.problems] == [(3, True)]
    job = parse_jobscript("#!/bin/bash\n#SBATCH --gres=gpu:a100:1\n#SBATCH -G 1\npython t.py\n", env={})
    assert [(p.line_no, "with and without a type" in p.reason) for p in job.problems] == [(3, True)]
    assert not parse_jobscript("#!/bin/bash\n#SBATCH --gres=gpu:a100:1,gpu:h100:1\npython t.py\n",
                               env={}).problems


def test_array_task_lists_as_sbatch_reads_them():
    from xmem.jobscript.directives import array_task_ids

    assert array_task_ids("0-15:4%2") == (0, 4, 8, 12)
    assert array_task_ids("7,1-3,2") == (1, 2, 3, 7)
    for bad in ("", "3-1", "1-9:0", "a-b", "0-9999999999"):
        with pytest.raises(DirectiveError):
            array_task_ids(bad)
    from xmem.jobscript.directives import build_request

    request, errors = build_request([], {"array": "5-1"})
    assert request.array == "5-1" and errors and "--array" in errors[0][1]
