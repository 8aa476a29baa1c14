"""run_peft_slurm.sh builds the right launch command on every node, without Slurm or GPUs.

Fake `srun` (runs the command once per node, as Slurm would, with that task's SLURM_PROCID), fake `scontrol`
(host list, records requeues) and a fake `accelerate` (records its argv and whether SIGUSR1 is ignored) go first on
PATH; the script itself runs unchanged under bash with the SLURM_* variables sbatch would set.
tests/e2e/test_multinode.py runs the same script with the real launcher and training.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import JOB_ID, REPO, slurm_env, write_shims

SCRIPT = REPO / "run_peft_slurm.sh"
def run_script(tmp_path: Path, env: dict, *flags: str) -> subprocess.CompletedProcess:
    write_shims(tmp_path / "bin")
    return subprocess.run(["bash", str(SCRIPT), *flags], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)


def launches(tmp_path: Path) -> dict[int, dict]:
    """machine rank -> what the fake accelerate recorded on that node."""
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "log").glob("accelerate-*.json"))]
    return {int(r["slurm_procid"]): r for r in records}


def option(argv: list[str], name: str) -> str:
    """The value of a launcher option (before train.py)."""
    launcher = argv[:argv.index("train.py")]
    assert launcher.count(name) == 1, f"{name} given {launcher.count(name)} times in {launcher}"
    return launcher[launcher.index(name) + 1]


def train_flags(argv: list[str]) -> list[str]:
    return argv[argv.index("train.py") + 1:]


def test_two_nodes_one_launch_each_with_its_own_machine_rank(tmp_path):
    env = slurm_env(tmp_path, 2, ["gpu07", "gpu08"])
    result = run_script(tmp_path, env, "--max_steps", "3")
    assert result.returncode == 0, result.stdout
    by_rank = launches(tmp_path)
    assert sorted(by_rank) == [0, 1]
    for rank, record in by_rank.items():
        argv = record["argv"]
        assert argv[0] == "launch"
        # Read on the node: expanded in the batch script instead, every node would claim machine 0.
        assert option(argv, "--machine_rank") == str(rank)
        assert option(argv, "--config_file") == "configs/multi_node/fsdp_config.yaml"
        assert option(argv, "--num_machines") == "2"
        assert option(argv, "--num_processes") == "16"  # 2 nodes x 8 GPUs: all ranks of all machines
        assert option(argv, "--main_process_ip") == "gpu07"  # the allocation's first host, on every node
        assert option(argv, "--main_process_port") == "29500"
        assert option(argv, "--rdzv_backend") == "static"
        flags = train_flags(argv)
        assert flags[-2:] == ["--max_steps", "3"], "extra flags come last, so they override the defaults"
        assert flags[flags.index("--output_dir") + 1] == str(tmp_path / "out")
        assert "--resume_from_checkpoint" not in flags  # nothing to resume from yet
        assert record["usr1_ignored"], "the launcher must survive Slurm's SIGUSR1 (the ranks handle it)"
    srun_args = (tmp_path / "log" / "srun.args").read_text().split()
    assert "--ntasks-per-node=1" in srun_args and "--nodes=2" in srun_args and "--kill-on-bad-exit=1" in srun_args
    assert not (tmp_path / "log" / "requeue").exists()


def test_environment_overrides_reach_every_node(tmp_path):
    env = slurm_env(tmp_path, 3, ["a1", "b2", "c3"], GPUS_PER_NODE="4", MAIN_PROCESS_PORT="31000",
                    ACCELERATE_CONFIG="configs/multi_node/fsdp2_config.yaml", MODEL="org/model",
                    DATASET="org/data")
    result = run_script(tmp_path, env)
    assert result.returncode == 0, result.stdout
    by_rank = launches(tmp_path)
    assert sorted(by_rank) == [0, 1, 2]
    for rank, record in by_rank.items():
        argv = record["argv"]
        assert option(argv, "--machine_rank") == str(rank)
        assert (option(argv, "--num_machines"), option(argv, "--num_processes")) == ("3", "12")
        assert (option(argv, "--main_process_ip"), option(argv, "--main_process_port")) == ("a1", "31000")
        assert option(argv, "--config_file") == "configs/multi_node/fsdp2_config.yaml"
        flags = train_flags(argv)
        assert flags[flags.index("--model_name_or_path") + 1] == "org/model"
        assert flags[flags.index("--dataset_name") + 1] == "org/data"


def test_gpu_count_comes_from_slurm_when_not_given(tmp_path):
    env = slurm_env(tmp_path, 2, ["n1", "n2"], SLURM_GPUS_ON_NODE="4")
    assert run_script(tmp_path, env).returncode == 0
    assert option(launches(tmp_path)[0]["argv"], "--num_processes") == "8"


def test_preempted_run_requeues_the_job_and_exits_75(tmp_path):
    env = slurm_env(tmp_path, 2, ["gpu07", "gpu08"], SHIM_PREEMPT="1")
    result = run_script(tmp_path, env)
    assert result.returncode == 75, result.stdout
    assert (tmp_path / "log" / "requeue").read_text().split() == [JOB_ID]
    assert f"preempted: requeueing job {JOB_ID}" in result.stdout


def test_requeued_job_resumes_from_the_newest_complete_checkpoint(tmp_path):
    checkpoint = tmp_path / "out" / "checkpoint-7"
    checkpoint.mkdir(parents=True)
    (checkpoint / "checkpoint_complete.json").write_text("{}")
    env = slurm_env(tmp_path, 2, ["gpu07", "gpu08"], SLURM_RESTART_COUNT="1")
    assert run_script(tmp_path, env, "--learning_rate", "5e-5").returncode == 0
    for record in launches(tmp_path).values():
        flags = train_flags(record["argv"])
        # Before the user's flags: an explicit --resume_from_checkpoint on the command line still wins.
        assert flags[-4:] == ["--resume_from_checkpoint", "latest", "--learning_rate", "5e-5"]


def test_incomplete_checkpoint_or_auto_resume_off_starts_fresh(tmp_path):
    (tmp_path / "out" / "checkpoint-9").mkdir(parents=True)  # no completion marker: a save that was cut off
    assert run_script(tmp_path, slurm_env(tmp_path, 2, ["a", "b"])).returncode == 0
    assert "--resume_from_checkpoint" not in launches(tmp_path)[0]["argv"]

    (tmp_path / "out" / "checkpoint-9" / "checkpoint_complete.json").write_text("{}")
    assert run_script(tmp_path, slurm_env(tmp_path, 2, ["a", "b"], AUTO_RESUME="0")).returncode == 0
    assert "--resume_from_checkpoint" not in launches(tmp_path)[0]["argv"]


def test_a_stale_preemption_note_does_not_requeue_a_failed_run(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "preempted.json").write_text('{"global_step": 3}')  # from an earlier, resumed preemption
    result = run_script(tmp_path, slurm_env(tmp_path, 2, ["a", "b"], SHIM_EXIT="1"))
    assert result.returncode == 1, result.stdout
    assert not (tmp_path / "log" / "requeue").exists()


def test_requeues_stop_at_the_limit(tmp_path):
    env = slurm_env(tmp_path, 2, ["a", "b"], SHIM_PREEMPT="1", SLURM_RESTART_COUNT="3", MAX_REQUEUES="3")
    result = run_script(tmp_path, env)
    assert result.returncode == 75
    assert not (tmp_path / "log" / "requeue").exists()
    assert "already requeued 3 times (MAX_REQUEUES=3)" in result.stdout


def test_outside_slurm_it_says_how_to_submit(tmp_path):
    env = {k: v for k, v in slurm_env(tmp_path, 2, ["a", "b"]).items() if not k.startswith("SLURM_")}
    result = run_script(tmp_path, env)
    assert result.returncode == 2
    assert "sbatch --nodes=2 run_peft_slurm.sh" in result.stdout
    assert not launches(tmp_path)


def test_host_list_that_disagrees_with_the_node_count_is_refused(tmp_path):
    result = run_script(tmp_path, slurm_env(tmp_path, 2, ["only-one"]))
    assert result.returncode == 2
    assert "scontrol lists 1 hosts" in result.stdout and "SLURM_NNODES is 2" in result.stdout
    assert not launches(tmp_path)


def _sbatch_directives() -> list[str]:
    """#SBATCH lines sbatch reads: only those before the first command line count."""
    directives = []
    for line in SCRIPT.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            directives.append(line[len("#SBATCH"):].strip())
        elif line.strip() and not line.startswith("#"):
            break
    return directives


def test_sbatch_header_asks_for_the_preemption_warning_and_one_task_per_node():
    directives = _sbatch_directives()
    assert "--ntasks-per-node=1" in directives
    assert "--requeue" in directives
    assert "--open-mode=append" in directives  # a requeued job appends to the same log
    signal_directive = next(d for d in directives if d.startswith("--signal="))
    match = re.fullmatch(r"--signal=(B:)?USR1@(\d+)", signal_directive)
    assert match and not match.group(1), "all step processes (the ranks) get the signal, not just the batch shell"
    assert int(match.group(2)) >= 120, "time to finish a step and write a checkpoint"
    assert len(directives) == len([line for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")])


def test_header_gives_the_command():
    head = SCRIPT.read_text().splitlines()[:4]
    assert head[0] == "#!/usr/bin/env bash" and head[1].startswith("# ")
    assert any("sbatch" in line and "run_peft_slurm.sh" in line for line in head)


@pytest.mark.parametrize("name", ["fsdp_config.yaml", "fsdp2_config.yaml", "fsdp_config_qlora.yaml"])
def test_multi_node_configs_are_the_single_machine_ones_across_machines(name):
    """Same FSDP settings as the one-machine config; only the machine count and the rendezvous differ."""
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file

    multi = yaml.safe_load((REPO / "configs" / "multi_node" / name).read_text())
    single = yaml.safe_load((REPO / "configs" / name).read_text())
    loaded = load_config_from_file(str(REPO / "configs" / "multi_node" / name))
    assert loaded.num_machines == 2 and loaded.num_processes == 16 and loaded.rdzv_backend == "static"
    assert multi["fsdp_config"] == single["fsdp_config"]
    assert multi["mixed_precision"] == single["mixed_precision"]
    differing = {k for k in multi.keys() | single.keys() if multi.get(k) != single.get(k)}
    assert differing == {"num_machines", "num_processes", "main_process_ip", "main_process_port"}
    assert multi["main_process_ip"].endswith(".invalid"), "a forgotten IP must never resolve"


@pytest.mark.parametrize("config,script_flag", [
    ("configs/multi_node/fsdp_config_qlora.yaml", ("--use_4bit_quantization", "True")),
    ("configs/multi_node/fsdp_config.yaml", ("--use_4bit_quantization", "False")),
])
def test_each_node_launches_the_recipe_its_config_names(tmp_path, config, script_flag):
    """A QLoRA config under Slurm trains with the QLoRA flags (it used to exec run_peft_fsdp.sh, LoRA, silently)."""
    env = slurm_env(tmp_path, 2, ["gpu07", "gpu08"], ACCELERATE_CONFIG=config)
    result = run_script(tmp_path, env, "--max_steps", "3")
    assert result.returncode == 0, result.stdout
    for record in launches(tmp_path).values():
        flags = train_flags(record["argv"])
        name, value = script_flag
        last = len(flags) - 1 - flags[::-1].index(name)  # the last value of a flag is the one train.py uses
        assert flags[last + 1] == value, flags
        assert option(record["argv"], "--config_file") == config


def test_a_recipe_script_that_does_not_exist_is_named(tmp_path):
    env = slurm_env(tmp_path, 2, ["gpu07", "gpu08"], RECIPE_SCRIPT="run_peft_nope.sh")
    result = run_script(tmp_path, env)
    assert result.returncode == 2 and "RECIPE_SCRIPT=run_peft_nope.sh: no such launcher here" in result.stdout
    assert "run_peft_qlora_fsdp.sh" in result.stdout and not launches(tmp_path)
