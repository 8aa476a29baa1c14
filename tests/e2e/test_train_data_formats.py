"""Each data format through the real train.py: recognised with no flag, trained end to end on the tiny model with
the adapter verified, and what was trained recorded (data_report.json, the trainer's own counts). Sources of
different shapes (a chat, prompt/completion rows, text) train as one mixture (`--dataset_name a,b,c`) on one
process, under FSDP2 (new-token rows trained, then resumed on one rank from the same prepared copy) and under
ZeRO-3, each source's loss tokens those it trains alone; prompt/completion 2:1 with a copy of itself (one shape)
under FSDP1, through `accelerate launch`. A bad file and the preview stop before any weight is loaded: the model
folder they are given has no weights at all."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from safetensors import safe_open

from tests.helpers import REPO, launch_env, launch_train, run_command

FLAGS = ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "all-linear",
         "--max_steps", "2", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--report_to", "none",
         "--save_strategy", "no", "--eval_strategy", "no", "--max_seq_len", "128", "--seed", "3"]
# format folders (several: one mixture) -> (formats detected, the report's format, loss on the answers only)
CASES = {"sharegpt": (["sharegpt"], "sharegpt", False),
         "prompt_completion": (["prompt_completion"], "prompt_completion", True)}
# mixtures of sources of different shapes: (engine's config, launcher flags, sources, recipe flags); "text" is the
# tiny data rendered as text (--dataset_text_field content)
ZERO3 = ["--per_device_train_batch_size", "2", "--ddp_backend", "gloo", "--bf16", "False"]
MIXED = {"single": (None, (), ("sharegpt", "prompt_completion_chat", "prompt_completion", "text"),
                    ["--packing", "True"]),
         "fsdp2": ("cpu/fsdp2_config.yaml", (), ("messages", "alpaca", "text"),
                   ["--packing", "False", "--chat_template_format", "chatml", "--train_new_tokens", "True",
                    "--save_strategy", "steps", "--save_steps", "2"]),
         "zero3": ("cpu/deepspeed_config.yaml", (), ("sharegpt", "prompt_completion", "text"),
                   ["--packing", "True", *ZERO3])}


def _dataset_name(format_datasets, case: str) -> str:
    return ",".join(str(format_datasets[part]) for part in case.split("+"))


def _train(tiny, dataset_dir, out, *extra):
    cmd = [sys.executable, str(REPO / "train.py"), "--model_name_or_path", str(tiny.model_dir), "--dataset_name",
           str(dataset_dir), "--output_dir", str(out), *FLAGS, *extra]
    return run_command(cmd, out)


def _answer_tokens(tiny) -> int:
    """Tokens of every train answer and its EOS, counted from the answers alone: what answer-only loss trains."""
    from transformers import AutoTokenizer

    from sft_recipe.tiny import load_conversations

    tok = AutoTokenizer.from_pretrained(str(tiny.model_dir))
    return sum(len(tok(c[-1]["content"] + tok.eos_token, add_special_tokens=False)["input_ids"])
               for c in load_conversations(tiny, "train"))


def _assert_trained(result, case: str, answer_tokens: int | None, rows: int = 240):
    """`answer_tokens`: what the loss must count (every answer of the rows trained), None: every token."""
    detected, fmt, answers_only = CASES[case]
    assert result.returncode == 0, result.output[-4000:]
    assert all(f"format '{one}' detected" in result.output for one in detected) and "data report" in result.output
    assert "adapter check OK" in result.output
    with safe_open(str(result.output_dir / "adapter_model.safetensors"), "pt") as f:
        assert sum("lora_" in k for k in f.keys()) == 28
    report = json.loads((result.output_dir / "data_report.json").read_text())
    train = report["splits"]["train"]
    assert train["format"] == fmt and train["rows"] == rows and train["rows_dropped"] == 0
    check = report["trainer_check"]  # counted on the trainer's own prepared dataset
    assert check["matches_prediction"] and check["loss_tokens"] == train["loss_tokens"]
    if answers_only:
        assert (answer_tokens is None or train["loss_tokens"] == answer_tokens) and \
            0.1 < train["loss_token_share"] < 0.6
    else:
        assert train["loss_token_share"] == 1.0
    return report


@pytest.mark.parametrize("case", list(CASES))
def test_format_trains_end_to_end(tiny, format_datasets, tmp_path, case):
    result = _train(tiny, _dataset_name(format_datasets, case), tmp_path / "out", "--packing", "True")
    report = _assert_trained(result, case, _answer_tokens(tiny) if CASES[case][2] else None)
    assert report["packing"] and 0.5 < report["splits"]["train"]["packing_efficiency"] <= 1


@pytest.mark.parametrize("config,case,version,shares,taken", [
    # 2:1 of prompt/completion and a copy of it: all of the first, 120 of the second
    ("cpu/fsdp_config.yaml", "prompt_completion", 1, "2,1", (240, 120))])
def test_answer_only_formats_under_fsdp_train_the_answers_only(tiny, format_datasets, tmp_path, config, case, version,
                                                              shares, taken):
    out = tmp_path / "out"
    sources = _dataset_name(format_datasets, case)
    if "+" not in case:  # a second source of the same format: the same rows, under another folder
        shutil.copytree(format_datasets[case], tmp_path / "again")
        sources += f",{tmp_path / 'again'}"
    result = launch_train(config, out, ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", sources, *FLAGS,
                                        "--packing", "False", "--dataset_proportions", shares])
    report = _assert_trained(result, case, None, rows=sum(taken))
    # every answer of the first source and those of the rows taken of the second
    assert _answer_tokens(tiny) < report["splits"]["train"]["loss_tokens"] < 2 * _answer_tokens(tiny)
    assert [s["train_rows"] for s in report["sources"]] == list(taken)
    facts = result.record
    how = facts["distribution"]
    assert how["fsdp_version"] == version and how["num_processes"] == 2 and how["fsdp_modules"] > 0  # real FSDP
    assert result.output.count("data report") == 1  # one block, from the main process


@pytest.fixture
def weightless_model(tiny, tmp_path):
    """The tiny model's folder without its weights: a run that gets past the data step would fail loading them."""
    folder = tmp_path / "no-weights"
    shutil.copytree(tiny.model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return folder


def test_bad_rows_stop_before_the_model_loads_with_exit_2(tiny, tmp_path):
    rows = [json.loads(line) for line in (tiny.jsonl_dir / "train.jsonl").read_text().splitlines()[:4]]
    rows[2] = {"messages": []}
    rows[3]["messages"][-1]["content"] = None
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"messages": [\n')
    rows = [{"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]}]
    (data / "test.jsonl").write_text(json.dumps(rows[0]) + "\n")
    out = tmp_path / "out"
    # The real model (a folder without weights is refused before the data is read): no weight may load.
    result = run_command([sys.executable, str(REPO / "train.py"), "--model_name_or_path", str(tiny.model_dir),
                          "--dataset_name", str(data), "--output_dir", str(out), *FLAGS], out)
    assert result.returncode == 2, result.output[-3000:]
    assert "Traceback" not in result.output and "Loading weights" not in result.output
    train = data / "train.jsonl"
    assert f"{train} line 3: `messages` is an empty conversation" in result.output
    assert f"{train} line 4: `messages` message " in result.output and "has `content` null" in result.output
    assert f"{train} line 5: not valid JSON" in result.output
    assert f"{data / 'test.jsonl'} line 1: `messages` message 1 has the unknown role 'human'" in result.output
    assert "4 bad row(s) of 6. Fix: map the unknown roles with --dataset_role_map gpt=assistant,human=user" in \
        result.output
    assert not (out / "data_report.json").exists()


def test_preview_shows_the_trained_tokens_and_warns_about_a_short_max_length(tiny, format_datasets, weightless_model,
                                                                              tmp_path):
    out = tmp_path / "preview"
    result = run_command([sys.executable, str(REPO / "train.py"), "--model_name_or_path", str(weightless_model),
                          "--dataset_name", str(format_datasets["alpaca"]), "--output_dir", str(out),
                          "--preview_examples", "2", "--max_seq_len", "8"], out)
    assert result.returncode == 0, result.output[-3000:]
    assert result.output.count("=== train example") == 2 and "cut at max_length 8" in result.output
    assert "WARNING: 100% of the train examples are longer than max_length 8" in result.output
    assert not (out / "data_report.json").exists()  # a preview writes nothing
    wide = run_command([sys.executable, str(REPO / "train.py"), "--model_name_or_path", str(weightless_model),
                        "--dataset_name", str(format_datasets["alpaca"]), "--output_dir", str(out),
                        "--preview_examples", "1"], out)
    from sft_recipe.tiny import load_conversations

    answer = load_conversations(tiny, "train")[0][-1]["content"]
    assert wide.returncode == 0 and f"⟦{answer}</s>⟧" in wide.output and "WARNING: " not in wide.output


def test_a_held_out_eval_slice_is_evaluated_and_named_in_the_report(tiny, tmp_path):
    """Data with no test split: --splits train --eval_split_size 0.1 trains on 216 rows and evaluates on the 24 held
    out (one process; the slice is carved before tokenizing, so every engine gets the same splits)."""
    out = tmp_path / "out"
    result = _train(tiny, tiny.jsonl_dir, out, "--splits", "train", "--eval_split_size", "0.1", "--max_steps", "4",
                    "--eval_strategy", "steps", "--eval_steps", "2")
    assert result.returncode == 0, result.output[-4000:]
    report = json.loads((out / "data_report.json").read_text())
    assert report["splits"]["test"]["held_out_of"] == "train: --eval_split_size 0.1, seed 3"
    assert (report["splits"]["train"]["rows"], report["splits"]["test"]["rows"]) == (216, 24)
    assert len(result.record["training"]["eval_losses"]) == 2  # steps 2 and 4, on the held-out rows


@pytest.fixture(scope="module")
def mixed_runs(tiny, format_datasets, tmp_path_factory):
    """engine -> (its launch of a MIXED mixture, the sources' folders, the flags, the environment), launched once."""
    runs = {}

    def run(engine: str):
        if engine not in runs:
            config, launcher_args, parts, extra = MIXED[engine]
            folders = [str(tiny.text_dir if part == "text" else format_datasets[part]) for part in parts]
            out = tmp_path_factory.mktemp(f"mixed-{engine}") / "out"
            flags = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", ",".join(folders), *FLAGS,
                     "--dataset_text_field", "content", *extra]
            env = launch_env(cpu_switch=engine != "zero3")
            result = run_command([sys.executable, str(REPO / "train.py"), "--output_dir", str(out), *flags], out, env) \
                if config is None else launch_train(config, out, flags, env=env, launcher_args=launcher_args)
            runs[engine] = (result, folders, flags, env)
        return runs[engine]

    return run


def _alone(tiny, tmp_path, folder: str, flags: list[str]):
    """The train split's report of one source read alone with a run's flags, in this process: what it trains."""
    from sft_recipe.config.args import parse_args
    from sft_recipe.config.launch_env import LaunchEnv
    from sft_recipe.data import prepared_copy
    from sft_recipe.data.report import measure
    from sft_recipe.train.model import load_tokenizer

    named = flags.index("--dataset_name") + 1
    flags = [*flags[:named], folder, *flags[named + 1:]]
    if "--ddp_backend" in flags:  # a process group's setting, none in this process; the data does not depend on it
        at = flags.index("--ddp_backend")
        flags = flags[:at] + flags[at + 2:]
    model, data_args, _, training_args = parse_args([*flags, "--output_dir", str(tmp_path / "alone")], LaunchEnv())
    tokenizer = load_tokenizer(model, False)
    data = prepared_copy.prepare_here(data_args, training_args, tokenizer)[0]
    return measure(data, tokenizer, training_args).splits["train"]


@pytest.mark.parametrize("engine", list(MIXED))
def test_sources_of_different_formats_train_as_one_mixture(mixed_runs, tiny, tmp_path, monkeypatch, engine):
    from sft_recipe.data import prepared_copy

    result, folders, flags, _ = mixed_runs(engine)
    assert result.returncode == 0, result.output[-6000:]
    assert "adapter check OK" in result.output and "the sources give TRL different rows" in result.output
    report = json.loads((result.output_dir / "data_report.json").read_text())
    train, sources = report["splits"]["train"], report["sources"]
    monkeypatch.setattr(prepared_copy, "copy_root", lambda: tmp_path / "copies")
    alone = [_alone(tiny, tmp_path, folder, flags) for folder in folders]
    # each source trains what it trains alone, and the mixture is their sum: counted by the trainer itself too
    assert [s["loss_tokens"] for s in sources] == [one.loss_tokens for one in alone]
    assert train["loss_tokens"] == sum(one.loss_tokens for one in alone) == report["trainer_check"]["loss_tokens"]
    assert report["trainer_check"]["matches_prediction"] and train["rows"] == 240 * len(folders)
    assert [(s["name"], s["train_rows"]) for s in sources] == [(folder, 240) for folder in folders]
    if engine != "single":
        how = result.record["distribution"]
        assert how["num_processes"] == 2 and (engine == "zero3" or how["fsdp_modules"] > 0)


def test_a_mixture_of_formats_resumes_on_another_rank_count_from_its_prepared_copy(mixed_runs, tmp_path):
    """The FSDP2 run's checkpoint-2 resumed on one rank with the same global batch (2 x 4 rows = 1 x 4 x 2), in the
    same datasets cache: the prepared copy is read, not prepared again, and training goes on to step 3."""
    first, _, flags, env = mixed_runs("fsdp2")
    assert first.returncode == 0, first.output[-6000:]
    out = tmp_path / "resumed"
    shutil.copytree(first.output_dir, out)
    result = launch_train("cpu/fsdp2_config.yaml", out, [
        *flags, "--max_steps", "3", "--gradient_accumulation_steps", "2",
        "--resume_from_checkpoint", str(out / "checkpoint-2")], env=env, launcher_args=("--num_processes", "1"))
    assert result.returncode == 0, result.output[-6000:]
    assert "read the copy a previous launch prepared" in result.output and "adapter check OK" in result.output
    assert result.record["distribution"]["num_processes"] == 1 and result.record["training"]["global_steps"] == 3
    assert json.loads((out / "data_report.json").read_text())["splits"] == \
        json.loads((first.output_dir / "data_report.json").read_text())["splits"]
