"""The adapter a user deploys stops: after a chatml run, generation ends at `<|im_end|>` without naming any stop token,
loaded the way the adapter's model card says, and through a `text-generation` pipeline on the merged model.

One training launch serves every test here (module fixture): the tiny model, chatml, one process. The shortest run
measured to end every answer with `<|im_end|>` (32 of 32 prompts, train and held-out wording, seeds 1, 2, 7) was 100
steps of 8 conversations at lr 3e-3 with the new tokens' rows trained (`--train_new_tokens True`) and the loss on the
answers alone; without training those rows `<|im_end|>` kept p ~0.003 after 200 steps (its lm_head row stays
random), so the model never ends an answer. 120 steps give margin (p(<|im_end|>) ~0.8 where an answer ends, vs ~0.6
at 100): 11.5 s of training; the whole launch (imports, data checks, two checkpoints and the final save,
each verified) took 35-55 s on the 2 shared cores.

Negative controls: the same adapter loaded as PEFT 0.21 does it (`AutoPeftModelForCausalLM` alone, the base's
generation config), and the merged model given the base's generation config, produce the same answer and run past
its `<|im_end|>`: what stops generation is the saved generation config, not the answer.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from sft_recipe.artifacts.checkpoints import checkpoint_damage, checkpoints, read_marker
from sft_recipe.artifacts.generation import GENERATION_CONFIG, MODEL_CARD
from sft_recipe.data.chat_templates import CHAT_FORMATS
from tests.helpers import launch_env, launch_train, run_command

MAX_NEW_TOKENS = 24  # the answers are ~8 tokens ("The opposite of hot is cold."): room to see a run-on
PROMPTS = 8  # held-out wording, with and without a system turn
STEPS, SAVE_STEPS = 120, 60

ANSWERING_RUN = [
    "--chat_template_format", "chatml", "--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16",
    "--lora_dropout", "0.0", "--lora_target_modules", "all-linear", "--train_new_tokens", "True",
    "--assistant_only_loss", "True", "--packing", "False", "--max_steps", str(STEPS),
    "--per_device_train_batch_size", "8", "--learning_rate", "3e-3", "--max_seq_len", "128", "--logging_steps", "20",
    "--save_strategy", "steps", "--save_steps", str(SAVE_STEPS), "--eval_strategy", "no", "--report_to", "none",
    "--seed", "7", "--bf16", "False",
]


def _card_blocks(folder) -> dict[str, list[str]]:
    """language -> the fenced code blocks of the model card, in order."""
    blocks: dict[str, list[str]] = {}
    for language, code in re.findall(r"```(\w+)\n(.*?)```", (folder / MODEL_CARD).read_text(), re.S):
        blocks.setdefault(language, []).append(code)
    return blocks


def _run_card_code(code: str) -> dict:
    """Run a python block of the card as a user would paste it; its namespace (its print goes to a buffer)."""
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, MODEL_CARD, "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("stops") / "adapter"
    result = launch_train("cpu/single.yaml", out, ["--model_name_or_path", str(tiny.model_dir),
                                                    "--dataset_name", str(tiny.jsonl_dir), *ANSWERING_RUN])
    assert result.returncode == 0, result.output[-6000:]
    print(next(line for line in result.output.splitlines() if line.startswith("run summary")))  # shown with -s
    return result


@pytest.fixture(scope="module")
def tokenizer(run):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(run.output_dir))


@pytest.fixture(scope="module")
def end_of_turn(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids(CHAT_FORMATS["chatml"].eos_token)


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[dict]]:
    from sft_recipe.tiny import heldout_conversations

    return [conversation[:-1] for conversation in heldout_conversations(tiny)[:PROMPTS]]


def _answers(model, tokenizer, prompts, **generate_kwargs) -> list[list[int]]:
    """Greedy answers (new token ids) with nothing but max_new_tokens said about stopping."""
    answers = []
    for messages in prompts:
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **generate_kwargs)
        answers.append(output[0, inputs["input_ids"].shape[1]:].tolist())
    return answers


def _assert_stop_at_end_of_turn(answers, end_of_turn, tokenizer):
    for answer in answers:
        text = tokenizer.decode(answer)
        assert len(answer) < MAX_NEW_TOKENS and answer[-1] == end_of_turn, text
        assert answer.count(end_of_turn) == 1, text


def _assert_run_on(answers, stopped, end_of_turn, tokenizer):
    """Each answer is the stopped one, then goes on past its end of turn."""
    for answer, short in zip(answers, stopped):
        assert answer[:len(short)] == short and len(answer) > len(short), tokenizer.decode(answer)


def test_the_adapter_and_every_checkpoint_carry_the_end_of_turn(tiny, run, tokenizer, end_of_turn):
    from transformers import GenerationConfig

    base = GenerationConfig.from_pretrained(str(tiny.model_dir))
    base_eos = [base.eos_token_id] if isinstance(base.eos_token_id, int) else list(base.eos_token_id)
    folders = [run.output_dir, *checkpoints(run.output_dir)]
    assert [p.name for p in folders[1:]] == [f"checkpoint-{s}" for s in range(SAVE_STEPS, STEPS + 1, SAVE_STEPS)]
    for folder in folders:
        saved = GenerationConfig.from_pretrained(str(folder))
        assert saved.eos_token_id == [*base_eos, end_of_turn], folder  # the base's kept first, then <|im_end|>
        for name, value in base.to_diff_dict().items():  # the base's other settings as they were
            if name not in ("eos_token_id", "_from_model_config", "transformers_version"):
                assert getattr(saved, name) == value, (folder, name)
    for checkpoint in folders[1:]:  # written before the marker, which records it
        assert GENERATION_CONFIG in read_marker(checkpoint)["files"] and not checkpoint_damage(checkpoint)


def test_loaded_as_the_card_says_it_stops_at_the_end_of_turn(run, tokenizer, end_of_turn, prompts):
    from peft import AutoPeftModelForCausalLM
    from transformers import GenerationConfig

    card = _card_blocks(run.output_dir)
    namespace = _run_card_code(card["python"][0])  # the card's lines, as printed: load, set, generate
    assert namespace["adapter_dir"] == str(run.output_dir)
    stopped = _answers(namespace["model"], namespace["tokenizer"], prompts)
    _assert_stop_at_end_of_turn(stopped, end_of_turn, tokenizer)

    plain = AutoPeftModelForCausalLM.from_pretrained(str(run.output_dir))  # as PEFT 0.21 loads it: base's config
    _assert_run_on(_answers(plain, tokenizer, prompts), stopped, end_of_turn, tokenizer)
    # The card's other form: the adapter's config passed per call.
    per_call = _answers(plain, tokenizer, prompts,
                        generation_config=GenerationConfig.from_pretrained(str(run.output_dir)))
    assert per_call == stopped


def test_the_merged_model_stops_in_a_pipeline(tiny, run, tokenizer, end_of_turn, prompts):
    from transformers import GenerationConfig

    card = _card_blocks(run.output_dir)
    merge = shlex.split(card["bash"][0].split("#")[0])
    assert merge[:2] == ["python", "merge_adapter.py"]
    merged_dir = merge[merge.index("--output_dir") + 1]
    assert merged_dir == f"{run.output_dir}-merged"
    merged = run_command([sys.executable, *merge[1:]], run.output_dir, env=launch_env(cpu_switch=False))
    assert merged.returncode == 0, merged.output[-4000:]
    merged_eos = json.loads(Path(merged_dir, GENERATION_CONFIG).read_text())["eos_token_id"]
    assert merged_eos == GenerationConfig.from_pretrained(str(run.output_dir)).eos_token_id  # the same ids

    chat = _run_card_code(card["python"][1])["chat"]  # the card's pipeline lines, as printed
    stopped, run_on = [], []
    base_config = GenerationConfig.from_pretrained(str(tiny.model_dir))
    for messages in prompts:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        for answers, extra in ((stopped, {}), (run_on, {"generation_config": base_config})):
            (result,) = chat(messages, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, return_tensors=True, **extra)
            ids = list(result["generated_token_ids"])
            assert ids[:len(prompt)] == list(prompt)
            answers.append(ids[len(prompt):])
    _assert_stop_at_end_of_turn(stopped, end_of_turn, tokenizer)
    _assert_run_on(run_on, stopped, end_of_turn, tokenizer)  # the base's generation config: no stop


def test_sharded_fsdp_checkpoints_carry_it_too(shared_run):
    """FSDP SHARDED_STATE_DICT checkpoints hold DCP shards, not an adapter save: the trainer writes it there."""
    result = shared_run("lora-fsdp1")  # chatml, a checkpoint every 4 steps (tests/shared_runs.py)
    out = result.output_dir
    assert result.returncode == 0, result.output[-6000:]
    from transformers import AutoTokenizer

    end_of_turn = AutoTokenizer.from_pretrained(str(out)).convert_tokens_to_ids(CHAT_FORMATS["chatml"].eos_token)
    saved = checkpoints(out)
    assert [c.name for c in saved] == ["checkpoint-4", "checkpoint-8"]
    for checkpoint in saved:
        assert not (checkpoint / "adapter_model.safetensors").exists()  # the sharded path, not an adapter save
        eos = json.loads((checkpoint / GENERATION_CONFIG).read_text())["eos_token_id"]
        assert eos == json.loads((out / GENERATION_CONFIG).read_text())["eos_token_id"] and end_of_turn in eos
        assert GENERATION_CONFIG in read_marker(checkpoint)["files"] and not checkpoint_damage(checkpoint)
