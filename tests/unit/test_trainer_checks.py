"""What Trainer, SFTTrainer and accelerate refuse only after the model loaded is refused before any weight loads.

Each check: its trigger is refused with setting, value and fix, and the same config without the trigger passes.
Where cheap, the library's own code is called on the trigger, so a test fails when the library stops refusing it.
"""

import json
import shutil
from types import SimpleNamespace

import pytest
from datasets import Dataset, DatasetDict

from sft_recipe.config.args import ConfigError, DataTrainingArguments, ModelArguments, parse_args
from sft_recipe.config.launch_env import LaunchEnv, read_launch_env
from sft_recipe.preflight.trainer_checks import fsdp_plugin_problems, trainer_problems
from tests.helpers import run_train_in_process

FSDP1 = {"ACCELERATE_USE_FSDP": "true", "ACCELERATE_USE_CPU": "true", "FSDP_VERSION": "1"}
FSDP2 = {**FSDP1, "FSDP_VERSION": "2"}
ZERO3 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
CP2 = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2"}
SP2 = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"}
NO_GC = ["--gradient_checkpointing", "False"]
CONVERSATION = [{"role": "user", "content": "What is the opposite of hot?"},
                {"role": "assistant", "content": "The opposite of hot is cold."}]


def _problems(tiny, tmp_path, flags, env=None, model_dir=None):
    """trainer_problems for the tiny recipe plus `flags`, under the launcher environment `env`. Parsed without that
    environment: parse_args would ask for DeepSpeed's package, which is not what is tested here."""
    argv = ["--model_name_or_path", str(model_dir or tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir),
            "--output_dir", str(tmp_path / "out"), "--bf16", "False", *flags]
    m, d, r, t = parse_args(argv, LaunchEnv())
    return "\n".join(trainer_problems(m, t, read_launch_env(env or {})))


# name: (trigger flags, trigger env, control flags, control env, what the refusal says)
CHECKS = {
    "FSDP activation checkpointing + gradient checkpointing": (
        ["--gradient_checkpointing", "True"], {**FSDP2, "FSDP_ACTIVATION_CHECKPOINTING": "true"},
        NO_GC, {**FSDP2, "FSDP_ACTIVATION_CHECKPOINTING": "true"},
        "fsdp_activation_checkpointing: true in the accelerate config with --gradient_checkpointing True"),
    "--fsdp_config activation checkpointing + gradient checkpointing": (
        ["--fsdp", "full_shard", "--fsdp_config", '{"activation_checkpointing": true}', "--gradient_checkpointing",
         "True"], {}, ["--fsdp", "full_shard", "--fsdp_config", '{"activation_checkpointing": true}', *NO_GC], {},
        "--fsdp_config activation_checkpointing: true with --gradient_checkpointing True"),
    "activation offload without activation checkpointing": (
        NO_GC, {**FSDP2, "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"},
        NO_GC, {**FSDP2, "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true", "FSDP_ACTIVATION_CHECKPOINTING": "true"},
        "fsdp_activation_checkpointing_offload: true offloads the inputs of checkpointed layers, but"),
    "activation offload under FSDP1": (
        NO_GC, {**FSDP1, "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"},
        NO_GC, {**FSDP2, "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"},
        "fsdp_activation_checkpointing_offload: true under FSDP1"),
    "FSDP1 reshard name under FSDP2": (
        [], {**FSDP2, "FSDP_RESHARD_AFTER_FORWARD": "FULL_SHARD"}, [], {**FSDP2, "FSDP_RESHARD_AFTER_FORWARD": "true"},
        "fsdp_reshard_after_forward: FULL_SHARD under FSDP2"),
    "LOCAL_STATE_DICT under FSDP2": (
        [], {**FSDP2, "FSDP_STATE_DICT_TYPE": "LOCAL_STATE_DICT"},
        [], {**FSDP1, "FSDP_STATE_DICT_TYPE": "LOCAL_STATE_DICT"},
        "fsdp_state_dict_type: LOCAL_STATE_DICT under FSDP2"),
    "unknown auto wrap policy": (
        [], {**FSDP2, "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_WRAP"},
        [], {**FSDP2, "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"},
        "fsdp_auto_wrap_policy: 'TRANSFORMER_WRAP' in the accelerate config is not a value accelerate knows"),
    "save_only_model with sharded checkpoints": (
        ["--save_only_model", "True"], FSDP2, [], FSDP2,
        "--save_only_model True with fsdp_state_dict_type: SHARDED_STATE_DICT (from the accelerate config)"),
    "save_only_model + load_best_model_at_end under FSDP": (
        ["--save_only_model", "True", "--load_best_model_at_end", "True", "--eval_strategy", "steps",
         "--save_strategy", "steps"], {**FSDP1, "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"},
        ["--save_only_model", "True", "--eval_strategy", "steps", "--save_strategy", "steps"],
        {**FSDP1, "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"},
        "--save_only_model True with --load_best_model_at_end True under FSDP"),
    "auto_find_batch_size under ZeRO-3": (
        ["--auto_find_batch_size", "True"], ZERO3, ["--auto_find_batch_size", "True"],
        {**ZERO3, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, "--auto_find_batch_size True under DeepSpeed ZeRO-3"),
    "two gradient accumulation settings": (
        ["--accelerator_config", '{"gradient_accumulation_kwargs": {"num_steps": 4}}',
         "--gradient_accumulation_steps", "2"], {},
        ["--accelerator_config", '{"gradient_accumulation_kwargs": {"num_steps": 4}}'], {},
        "--accelerator_config gradient_accumulation_kwargs num_steps 4 and --gradient_accumulation_steps 2"),
    "--fsdp in one process": (["--fsdp", "full_shard"], {}, [], {},
                              "--fsdp (the training argument) in a process that is not part of a distributed launch"),
    "--fsdp with DeepSpeed": (["--fsdp", "full_shard"], ZERO3, [], ZERO3, "--fsdp together with DeepSpeed"),
    "save_strategy best without a metric": (
        ["--save_strategy", "best"], {}, ["--save_strategy", "best", "--metric_for_best_model", "eval_loss"], {},
        "--save_strategy best needs a metric"),
    "padding_free without packing": (["--padding_free", "True", "--packing", "False"], {},
                                     ["--padding_free", "True", "--packing", "True"], {},
                                     "--padding_free True without packing"),
    "chat_template_path": (["--chat_template_path", "template.jinja"], {}, [], {},
                           "--chat_template_path template.jinja"),
    "skip_prepare_dataset": (["--dataset_kwargs", '{"skip_prepare_dataset": true}'], {},
                             ["--dataset_kwargs", '{"skip_prepare_dataset": false}'], {},
                             "--dataset_kwargs skip_prepare_dataset: true"),
    "packing under context parallelism": (["--packing", "True"], CP2, ["--packing", "False"], CP2,
                                          "--packing True with context parallelism (cp_size 2"),
    "DFT loss under DeepSpeed sequence parallelism": (["--loss_type", "dft"], SP2, ["--loss_type", "nll"], SP2,
                                                      "--loss_type dft under DeepSpeed sequence parallelism"),
    "eos_token not in the vocabulary": (["--eos_token", "<|im_end|>"], {},
                                        ["--eos_token", "<|im_end|>", "--chat_template_format", "chatml"], {},
                                        "--eos_token '<|im_end|>' is not a token of this tokenizer"),
    "pad_token not in the vocabulary": (["--pad_token", "<pad>"], {}, ["--pad_token", "</s>"], {},
                                        "--pad_token '<pad>' is not a token of this tokenizer"),
}


@pytest.mark.parametrize("name", CHECKS)
def test_each_check_refuses_its_trigger_and_passes_without_it(name, tiny, tmp_path):
    flags, env, control_flags, control_env, says = CHECKS[name]
    refused = _problems(tiny, tmp_path, flags, env)
    assert says in refused and "Fix:" in refused, refused
    assert says not in _problems(tiny, tmp_path, control_flags, control_env)


def test_nothing_is_refused_for_the_recipe_as_shipped(tiny, tmp_path):
    for env in ({}, FSDP1, FSDP2, {**FSDP2, "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}):
        assert _problems(tiny, tmp_path, ["--gradient_checkpointing", "True", "--packing", "True"], env) == ""


def test_settings_the_command_line_cannot_carry(tiny, tmp_path):
    """More GPUs than processes, packing without max_length, liger's fused loss: set on the parsed arguments."""
    m, d, r, t = parse_args(["--model_name_or_path", str(tiny.model_dir), "--output_dir", str(tmp_path), "--bf16",
                             "False", "--packing", "True"], LaunchEnv())
    assert trainer_problems(m, t, LaunchEnv()) == []
    t._n_gpu, t.max_length = 2, None  # what two visible GPUs and `max_length: null` in a recipe YAML give
    t.use_liger_kernel, t.liger_kernel_config = True, {"fused_linear_cross_entropy": True}
    text = "\n".join(trainer_problems(m, t, LaunchEnv()))
    assert "2 GPUs are visible to one process" in text and "--packing True with no max_length" in text
    assert "--liger_kernel_config fused_linear_cross_entropy: true" in text


# --- accelerate's FSDP plugin: our verdict is accelerate's own, for each value -----------------------------------

PLUGIN_ENVS = [
    ({"FSDP_VERSION": "1"}, False),
    ({"FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "2", "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE",
      "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}, False),
    ({"FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_ACTIVATION_CHECKPOINTING": "true",
      "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"}, False),
    ({"FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "FULL_SHARD"}, True),
    ({"FSDP_VERSION": "2", "FSDP_STATE_DICT_TYPE": "LOCAL_STATE_DICT"}, True),
    ({"FSDP_VERSION": "1", "FSDP_STATE_DICT_TYPE": "FULL"}, True),
    ({"FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "FULL"}, True),
    ({"FSDP_VERSION": "2", "FSDP_BACKWARD_PREFETCH": "BACKWARD"}, True),
    ({"FSDP_VERSION": "2", "FSDP_BACKWARD_PREFETCH": "3"}, True),  # NO_PREFETCH has a name, not a number
    ({"FSDP_VERSION": "1", "FSDP_BACKWARD_PREFETCH": "2", "FSDP_STATE_DICT_TYPE": "3"}, False),
    ({"FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_WRAP"}, True),
    ({"FSDP_VERSION": "2", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"}, True),
    ({"FSDP_VERSION": "1", "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"},
     True),
]


@pytest.mark.parametrize("env,rejected", PLUGIN_ENVS)
def test_fsdp_values_are_judged_as_accelerates_plugin_judges_them(env, rejected, monkeypatch):
    import os

    from accelerate.utils import FullyShardedDataParallelPlugin

    for name in [n for n in os.environ if n.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:  # what Accelerator() builds in the trainer from the launcher's variables
        FullyShardedDataParallelPlugin()
        raised = False
    except (ValueError, KeyError):
        raised = True
    assert raised is rejected
    problems = fsdp_plugin_problems(read_launch_env({"ACCELERATE_USE_FSDP": "true", **env}))
    assert bool(problems) is rejected and all("Fix:" in p for p in problems), problems


# --- transformers' Trainer: its own code still refuses the triggers -----------------------------------------------

def _postprocess(t, monkeypatch, **plugin):
    """transformers' Trainer.create_accelerator_and_postprocess with accelerate's Accelerator replaced by one whose
    state carries `plugin` as its FSDP plugin: the checks transformers runs on it, without a distributed launch."""
    import transformers.trainer as transformers_trainer

    class FsdpAccelerator:
        def __init__(self, **kwargs):
            self.state = SimpleNamespace(fsdp_plugin=SimpleNamespace(**plugin), deepspeed_plugin=None)

        def gather_for_metrics(self, value):
            return value

    monkeypatch.setattr(transformers_trainer, "Accelerator", FsdpAccelerator)
    trainer = object.__new__(transformers_trainer.Trainer)
    trainer.args, trainer.model = t, None
    transformers_trainer.Trainer.create_accelerator_and_postprocess(trainer)


def test_transformers_refuses_what_the_trainer_checks_refuse(tiny, tmp_path, monkeypatch):
    def args(*flags):
        return parse_args(["--model_name_or_path", str(tiny.model_dir), "--output_dir", str(tmp_path), "--bf16",
                           "False", *flags], LaunchEnv())[3]

    plugin = {"activation_checkpointing": True, "state_dict_type": "FULL_STATE_DICT"}
    with pytest.raises(ValueError, match="can't both be set to True"):
        _postprocess(args("--gradient_checkpointing", "True"), monkeypatch, **plugin)
    _postprocess(args(*NO_GC), monkeypatch, **plugin)  # the control
    with pytest.raises(ValueError, match="SHARDED_STATE_DICT"):
        _postprocess(args("--save_only_model", "True", *NO_GC), monkeypatch, activation_checkpointing=False,
                     state_dict_type="StateDictType.SHARDED_STATE_DICT")
    with pytest.raises(ValueError, match="num_steps"):
        _postprocess(args("--accelerator_config", '{"gradient_accumulation_kwargs": {"num_steps": 4}}',
                          "--gradient_accumulation_steps", "2"), monkeypatch, **plugin)

    from transformers.trainer import Trainer

    state = dict(compute_metrics=None, eval_dataset=None, optimizer_cls_and_kwargs=None, optimizer=None,
                 model_init=None, lr_scheduler=None, is_fsdp_enabled=False, is_fsdp_xla_enabled=False,
                 data_collator=lambda rows: rows, train_dataset=None)
    with pytest.raises(ValueError, match="metric_for_best_model"):
        Trainer._validate_args(SimpleNamespace(args=args("--save_strategy", "best"), **state))
    Trainer._validate_args(SimpleNamespace(args=args("--save_strategy", "best", "--metric_for_best_model", "loss"),
                                           **state))


def test_a_quantized_checkpoint_transformers_cannot_train(tiny, tmp_path):
    from transformers.quantizers.auto import AutoHfQuantizer
    from transformers.trainer_utils import validate_quantization_for_training

    def quantized_folder(name, quantization):
        folder = tmp_path / name
        folder.mkdir()
        config = json.loads((tiny.model_dir / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
        return folder

    fp8 = quantized_folder("fp8", {"quant_method": "fbgemm_fp8"})
    assert "quantized with fbgemm_fp8, which transformers 5.24 cannot train" in \
        _problems(tiny, tmp_path, ["--use_peft_lora", "True"], model_dir=fp8)
    # What transformers' validate_quantization_for_training (Trainer.__init__) reads of the loaded model's quantizer.
    assert AutoHfQuantizer.from_config({"quant_method": "fbgemm_fp8"}, pre_quantized=True).is_trainable is False
    nf4 = quantized_folder("nf4", {"quant_method": "bitsandbytes", "load_in_4bit": True})
    assert "cannot be fine-tuned directly" in _problems(tiny, tmp_path, [], model_dir=nf4)
    quantizer = AutoHfQuantizer.from_config({"quant_method": "bitsandbytes", "load_in_4bit": True}, pre_quantized=True)
    with pytest.raises(ValueError, match="purely quantized"):  # a quantized base without an adapter
        validate_quantization_for_training(SimpleNamespace(is_quantized=True, hf_quantizer=quantizer))
    assert _problems(tiny, tmp_path, ["--use_peft_lora", "True"], model_dir=nf4) == ""  # the control


def test_trl_refuses_what_the_sft_checks_refuse(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny.model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir))
    rows = Dataset.from_list([{"messages": CONVERSATION}] * 2)
    for config, says in [({"eos_token": "<|im_end|>"}, "not found in the vocabulary"),
                         ({"padding_free": True, "packing": False}, "max_length` is not enforced")]:
        args = SFTConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", **config)
        with pytest.raises(ValueError, match=says):
            SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)


# --- the data step: --assistant_only_loss, with the template TRL will really use --------------------------------

ANSWER_ONLY_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' }}{% if m['role'] == 'assistant' %}"
                        "{% generation %}{{ m['content'] }}{% endgeneration %}{{ eos_token }}{% else %}"
                        "{{ m['content'] }}{% endif %}{{ '\n' }}{% endfor %}")
# No {% generation %} block (its only "generation" is add_generation_prompt), and not a template TRL can patch.
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def _tokenizer(tiny, template=None):
    from sft_recipe.train.model import load_tokenizer

    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=str(tiny.model_dir)))
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def _prepare(rows, tokenizer):
    from sft_recipe.data.prepare import prepare_for_trl

    return prepare_for_trl(DatasetDict({"train": Dataset.from_list(rows)}), DataTrainingArguments(), "content",
                           tokenizer, assistant_only_loss=True)


def test_a_template_without_generation_block_that_trl_cannot_patch(tiny):
    from trl.chat_template_utils import get_training_chat_template

    tokenizer = _tokenizer(tiny, PLAIN_TEMPLATE)
    with pytest.raises(ValueError, match="patching is not supported"):
        get_training_chat_template(tokenizer)  # what SFTTrainer.__init__ calls for it
    with pytest.raises(ConfigError, match="TRL 1.16 has no training version of this template"):
        _prepare([{"messages": CONVERSATION}], tokenizer)
    _prepare([{"messages": CONVERSATION}], _tokenizer(tiny))  # the control: the tiny template has the markers


def test_a_template_trl_patches_is_the_one_checked_and_measured(tiny, tmp_path):
    from trl import SFTConfig
    from trl.chat_template_utils import get_training_chat_template, llama3_chat_template

    from sft_recipe.data.prepare import LoadedSplits, prepare
    from sft_recipe.data.report import measure

    tokenizer = _tokenizer(tiny, llama3_chat_template)  # markers-free, but TRL ships its training version
    data = prepare(LoadedSplits(DatasetDict({"train": Dataset.from_list([{"messages": CONVERSATION}] * 2)})),
                   DataTrainingArguments(), "content", tokenizer, assistant_only_loss=True)
    assert data.chat_template == get_training_chat_template(tokenizer) is not None
    args = SFTConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, assistant_only_loss=True, max_length=None)
    train = measure(data, tokenizer, args).splits["train"]  # with the tokenizer's template TRL's mask is empty
    assert 0 < train.loss_tokens < train.tokens_trained


def test_a_conversation_with_no_assistant_token_is_a_bad_row(tiny, tmp_path):
    from trl import SFTConfig

    from sft_recipe.data.report import tokenize_like_trl

    tokenizer = _tokenizer(tiny, ANSWER_ONLY_TEMPLATE)
    empty = [CONVERSATION[0], {"role": "assistant", "content": ""}]
    args = SFTConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, assistant_only_loss=True)
    with pytest.raises(RuntimeError, match="no assistant tokens"):  # TRL's own tokenization of that row
        tokenize_like_trl(Dataset.from_list([{"messages": empty}]), tokenizer, args)
    with pytest.raises(ConfigError) as e:
        _prepare([{"messages": CONVERSATION}, {"messages": empty}], tokenizer)
    assert "split 'train' row 2: no assistant tokens" in str(e.value) and "row 1:" not in str(e.value)
    _prepare([{"messages": CONVERSATION}] * 2, tokenizer)  # the control


# --- --max_seq_len against the model's positions ------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_dir(tiny, tmp_path_factory):
    """A tiny GPT-2 (learned absolute positions: 64 of them) with the tiny tokenizer: weights, config, tokenizer."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("gpt2")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny.model_dir))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def test_learned_positions_are_a_limit(tiny, tmp_path, gpt2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gpt2_dir))
    model(input_ids=torch.zeros(1, 64, dtype=torch.long))  # every position it has works
    with pytest.raises(IndexError):
        model(input_ids=torch.zeros(1, 65, dtype=torch.long))  # one more, and the first forward fails
    refused = _problems(tiny, tmp_path, ["--max_seq_len", "65"], model_dir=gpt2_dir)
    assert "--max_seq_len 65: GPT2Config learns one position embedding per position and has 64 " \
           "(max_position_embeddings)" in refused and "Fix: --max_seq_len 64 or less." in refused
    assert _problems(tiny, tmp_path, ["--max_seq_len", "64"], model_dir=gpt2_dir) == ""


def test_rope_beyond_its_positions_is_a_warning_naming_the_scaling(tiny, tmp_path, caplog):
    assert _problems(tiny, tmp_path, ["--max_seq_len", "4096"]) == ""
    assert "max_position_embeddings 1024 and no rope scaling" in caplog.text
    caplog.clear()
    scaled = tmp_path / "scaled"
    shutil.copytree(tiny.model_dir, scaled)
    config = json.loads((scaled / "config.json").read_text())
    rope = {**config["rope_parameters"], "rope_type": "linear", "factor": 2.0}
    (scaled / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    assert _problems(tiny, tmp_path, ["--max_seq_len", "2048"], model_dir=scaled) == ""
    assert "longer than the model was trained for" not in caplog.text  # 1024 positions x factor 2 cover it
    assert _problems(tiny, tmp_path, ["--max_seq_len", "4096"], model_dir=scaled) == ""
    assert "rope scaling linear factor 2 (2048 positions)" in caplog.text and "Fix: --max_seq_len 2048" in caplog.text


# --- before any weight loads: train.py's own entry point, with from_pretrained as a tripwire ----------------------

def test_refused_through_train_py_before_any_weight_loads(tiny, tmp_path, gpt2_dir, monkeypatch, capsys):
    base = ["--dataset_name", str(tiny.jsonl_dir), "--output_dir", str(tmp_path / "out"), "--bf16", "False",
            "--report_to", "none", "--max_steps", "1"]
    plain = tmp_path / "plain"
    shutil.copytree(tiny.model_dir, plain)
    (plain / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
    cases = [(["--model_name_or_path", str(tiny.model_dir), "--save_strategy", "best"],
              "--save_strategy best needs a metric"),
             (["--model_name_or_path", str(gpt2_dir), "--max_seq_len", "65"], "--max_seq_len 65: GPT2Config"),
             (["--model_name_or_path", str(plain), "--assistant_only_loss", "True"],
              "TRL 1.16 has no training version of this template")]
    for flags, says in cases:
        code, err = run_train_in_process([*flags, *base], monkeypatch, capsys)
        assert code == 2 and says in err and "Traceback" not in err, (flags, err)
    control = ["--model_name_or_path", str(tiny.model_dir), "--assistant_only_loss", "True", "--max_seq_len", "128"]
    assert run_train_in_process([*control, *base], monkeypatch, capsys)[0] == "weights"
