"""The suite's own machinery (docs/testing.md): a shared run launches once for every worker and caller, a reader that
writes into its folder is named at the end, and the launch table counts and keys launches as it says."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests import shared_runs
from tests.helpers import RunResult
from tests.launch_budget import is_recipe_launch, launch_key, summarise


def _fake_launches(monkeypatch, calls: list):
    """launch_train replaced by one that writes an adapter file and records its call: no process is started."""

    def fake_launch_train(config, output_dir, args, env=None, launcher_args=()):
        calls.append((config, args, env.get("HF_TOKEN")))
        output_dir.mkdir(parents=True)
        (output_dir / "adapter_model.safetensors").write_bytes(b"weights")
        (output_dir / "run_record.json").write_text(json.dumps({"training": {"losses": [1.0, 0.5]}}))
        return RunResult(0, "adapter check OK", output_dir)

    monkeypatch.setattr(shared_runs, "launch_train", fake_launch_train)


def _tiny(tmp_path):
    return SimpleNamespace(**{f"{k}_dir": tmp_path / k for k in ("model", "jsonl", "disk", "parquet", "text")})


def test_a_shared_run_launches_once_for_every_caller_and_every_worker(tmp_path, monkeypatch):
    calls: list = []
    _fake_launches(monkeypatch, calls)
    root = tmp_path / "shared-runs"
    first, second = shared_runs.SharedRuns(_tiny(tmp_path), root), shared_runs.SharedRuns(_tiny(tmp_path), root)
    a, b, c = first("lora-fsdp1"), first("lora-fsdp1"), second("lora-fsdp1")  # `second`: another xdist worker
    assert len(calls) == 1
    config, args, token = calls[0]
    assert config == "cpu/fsdp_config.yaml" and token == shared_runs.SECRET_TOKEN
    assert args[args.index("--model_name_or_path") + 1] == str(tmp_path / "model")  # the tiny bundle's path filled in
    assert args[args.index("--dataset_name") + 1] == str(tmp_path / "disk")
    assert a.output_dir == b.output_dir == c.output_dir == root / "lora-fsdp1"
    assert c.returncode == 0 and c.output == "adapter check OK" and c.record["training"]["losses"] == [1.0, 0.5]
    assert first.changed() == [] and second.changed() == []


def test_a_deepspeed_shared_run_launches_without_the_cpu_switch(tmp_path, monkeypatch):
    envs = []
    monkeypatch.setattr(shared_runs, "launch_train", lambda config, out, args, env=None: (envs.append(env), RunResult(
        0, "", out))[1])
    runs = shared_runs.SharedRuns(_tiny(tmp_path), tmp_path / "shared-runs")
    runs("lora-zero3"), runs("lora-fsdp2")
    assert "ACCELERATE_USE_CPU" not in envs[0] and envs[1]["ACCELERATE_USE_CPU"] == "true"


def test_a_reader_that_writes_into_a_shared_folder_is_named(tmp_path, monkeypatch):
    _fake_launches(monkeypatch, [])
    runs = shared_runs.SharedRuns(_tiny(tmp_path), tmp_path / "shared-runs")
    out = runs("qlora-single").output_dir
    (out / "merged").mkdir()
    (out / "merged" / "model.safetensors").write_bytes(b"a reader's file")
    (changed,) = runs.changed()
    assert changed.startswith("qlora-single:") and "merged/model.safetensors" in changed


def test_every_shared_launch_names_its_engine_and_fills_every_path(tmp_path):
    for name, launch in shared_runs.SHARED_LAUNCHES.items():
        args = launch.train_args(_tiny(tmp_path))
        assert (tmp_path / "model").as_posix() in args and not any("{" in a for a in args), name
        assert (launch.config.startswith("cpu/") and launch.flag("--output_dir") is None), name  # the registry's


def test_the_launch_key_leaves_out_where_a_run_writes_and_which_port_it_talks_on():
    one = ["/v/bin/accelerate", "launch", "--config_file", "/work/main/configs/cpu/fsdp_config.yaml",
           "--main_process_port", "40001", "train.py", "--output_dir", "/tmp/pytest-of-root/a/run",
           "--model_name_or_path", "/tmp/pytest-of-root/p-1/tiny0/model", "--seed", "3"]
    other = [w.replace("40001", "51234").replace("/a/run", "/b/other").replace("p-1", "p-2") for w in one]
    assert launch_key(one) == launch_key(other)
    assert launch_key(one) == "/v/bin/accelerate launch --config_file fsdp_config.yaml train.py --model_name_or_path " \
                              "model --seed 3"
    assert launch_key(one) != launch_key([*one[:-1], "4"])


def test_the_table_counts_launches_per_file_and_names_the_repeats():
    launch = ["accelerate", "launch", "train.py", "--seed", "3"]
    records = [{"test": "tests/e2e/test_a.py::t1", "argv": launch, "recipe": True, "seconds": 10.0, "cpu_seconds": 9},
               {"test": "tests/e2e/test_b.py::t2", "argv": launch, "recipe": True, "seconds": 12.0, "cpu_seconds": 15},
               {"test": "tests/e2e/test_b.py::t3", "argv": [*launch[:-1], "4"], "recipe": True, "seconds": 11.0,
                "cpu_seconds": None},  # reaped where it could not be read: counted as nothing
               {"test": "tests/test_c.py::t4", "argv": ["bash", "-c", "true"], "recipe": False, "seconds": 0.5,
                "cpu_seconds": 0.4}]
    lines = summarise(records, pytest_cpu_seconds=120.4)
    assert lines[0] == "launches: 3 recipe launches in 33 s (2 distinct), 1 other processes in 0 s"
    assert lines[2].split() == ["tests/e2e/test_b.py", "2", "23", "15"]
    assert lines[3].split() == ["tests/e2e/test_a.py", "1", "10", "9"]
    assert lines[4].startswith("launched more than once (1 repeats)") and "test_a.py::t1" in lines[5]
    assert lines[-1] == ("CPU-seconds (user + sys): recipe launches 24, other processes 0, the pytest processes "
                         "themselves 120")
    assert not summarise(records)[-1].startswith("CPU-seconds")  # without the pytest processes' own: no such line
    assert is_recipe_launch(["/v/bin/python", "tests/e2e/quantized_load_worker.py"])
    assert is_recipe_launch(["bash", "run_peft_fsdp.sh"]) and is_recipe_launch(["python", "-m", "sft_recipe.plan"])
    from tests.helpers import accelerate_launch  # the tests' launcher runs a bench script: still a recipe launch

    assert is_recipe_launch([*accelerate_launch(), "--config_file", "c.yaml", "bench/train_syncing_module_states.py"])
    assert not is_recipe_launch(["bash", "scripts/setup_gptq.sh"]) and not is_recipe_launch(["git", "ls-files"])


def test_a_flag_from_the_recipe_yaml_counts_in_the_launchs_cell(tmp_path):
    """bench/suite_launches.py's cells (what the suite exercises, compared before and after a change) read what the
    launch's --config YAML gives, as train.py does: one run reporting to W&B and MLflow through a YAML list is both
    cells; the command line still wins."""
    import sys

    from tests.helpers import REPO
    from tests.launch_budget import recipe_yaml_of

    sys.path.insert(0, str(REPO / "bench"))
    from suite_launches import cell_of

    recipe = tmp_path / "trackers.yaml"
    recipe.write_text("report_to: [wandb, mlflow]\n")
    argv = ["python", "train.py", "--model_name_or_path", "/tmp/x/model", "--config", str(recipe)]
    values = recipe_yaml_of(argv)
    assert values == {"report_to": ["wandb", "mlflow"]}
    assert cell_of(argv, values) == ("train.py", "one process (python)", "model", "report=mlflow", "report=wandb")
    assert cell_of([*argv, "--report_to", "none"], values) == ("train.py", "one process (python)", "model")
    assert recipe_yaml_of(["python", "train.py"]) is None and recipe_yaml_of(["x", "--config", "/nonexistent"]) is None
    # a folder the run starts from is a feature of its cell, whichever folder it is
    for flag, name in (("--adapter_name_or_path", "adapter-start"), ("--resume_from_checkpoint", "resume")):
        assert cell_of([*argv, flag, "/tmp/pytest-7/run3"], {}) == ("train.py", "one process (python)", "model",
                                                                     f"{name}=*")


def test_a_childs_cpu_seconds_are_read_as_it_is_reaped_with_its_own_children(monkeypatch):
    """The recorded CPU of a process is the kernel's count for it and the processes it waited for (a launcher's
    ranks), by wait or by poll; a child that only sleeps records almost none."""
    import sys
    import time

    from tests import launch_budget

    monkeypatch.setattr(launch_budget, "_RECORDS", [])
    monkeypatch.setitem(launch_budget._CURRENT_TEST, "nodeid", "tests/unit/test_suite_budget.py::t")
    burn = [sys.executable, "-c", "import time; end = time.process_time() + 0.3\nwhile time.process_time() < end: pass"]
    launch_budget._TimedPopen(burn).wait()
    polled = launch_budget._TimedPopen(["bash", "-c", " ".join(f"'{w}'" for w in burn) + "; sleep 0.2"])
    while polled.poll() is None:
        time.sleep(0.02)
    launch_budget._TimedPopen(["sleep", "0.3"]).wait()
    waited, by_poll, slept = launch_budget._RECORDS
    assert waited["cpu_seconds"] >= 0.3 and by_poll["cpu_seconds"] >= 0.3  # the grandchild's 0.3 s counted
    assert by_poll["seconds"] >= 0.5 and slept["seconds"] >= 0.3 and slept["cpu_seconds"] < 0.1


def test_the_start_up_floor_counts_one_launcher_and_each_rank_on_its_machine():
    """bench/suite_floor.py: the processes a launch starts, read from the accelerate config the suite ships (2 ranks,
    1 for the one-process config, 1 per machine for the two-machine one) and the launcher's own flags."""
    import sys

    from tests.helpers import REPO

    sys.path.insert(0, str(REPO / "bench"))
    from suite_floor import kind_of, tally

    def launch(config: str, *extra: str) -> list[str]:
        return ["python", "tests/accelerate_launcher.py", "--config_file", str(REPO / "configs" / "cpu" / config),
                *extra, "train.py", "--max_steps", "3"]

    assert kind_of(launch("fsdp2_config.yaml")) == ("train.py under the launcher", 2)
    assert kind_of(launch("fsdp_config.yaml", "--num_processes", "4")) == ("train.py under the launcher", 4)
    assert kind_of(launch("single.yaml")) == ("train.py under the launcher", 1)
    assert kind_of(launch("multi_node_fsdp_config.yaml", "--machine_rank", "1")) == ("train.py under the launcher", 1)
    worker = launch("fsdp2_config.yaml")
    worker[worker.index("train.py")] = "tests/e2e/disk_full_worker.py"
    assert kind_of(worker) == ("a test worker or bench/train_*.py under the launcher", 2)
    assert kind_of(["python", "train.py", "--help"]) == ("train.py, one process", 0)
    assert kind_of(["bash", "run_peft_fsdp.sh", "--bf16", "True"]) == ("other programs (not modelled)", None)
    gone = ["python", "tests/accelerate_launcher.py", "--config_file", "/nonexistent/edited.yaml", "train.py"]
    assert kind_of(gone)[1] is None  # its ranks are unknown: not priced as one process
    rows = tally([{"argv": launch("fsdp2_config.yaml"), "cpu_seconds": 9.0}, {"argv": gone, "cpu_seconds": 7.0},
                  {"argv": ["python", "train.py"], "cpu_seconds": 4.0}], train_s=3.0, launcher_s=1.0)
    assert rows["train.py under the launcher"] == [1, 3, 9.0, 7.0]  # the launcher + 2 ranks at 3
    assert rows["train.py, one process"] == [1, 1, 4.0, 3.0]
    assert [row[1:4:2] for kind, row in rows.items() if "gone" in kind] == [[0, 0.0]]  # shown, priced at nothing
