"""The renting questions (sft_recipe/plan/renting.py): the fewest GPUs of a given memory that fit a run and the
longest --max_seq_len that fits a setup, each with its plan and launch command; and TRL's --activation_offloading
in the plan (what moves to host RAM measured with autograd's saved-tensor hooks, as TRL's offloading sees them).

Everything plans on the meta device from the shipped Llama-2-70B config: no weights, a few seconds.
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from sft_recipe.config.args import ConfigError
from sft_recipe.plan import GIB, main, parse_train_flags, plan_memory, read_accelerate_config
from sft_recipe.plan.components import offloaded_activation_bytes, pinned
from sft_recipe.plan.guide_renting import guide_renting
from sft_recipe.plan.inputs import workload
from sft_recipe.plan.renting import (
    fewest_gpus as fewest,
)
from sft_recipe.plan.renting import (
    gpu_counts,
    longest_seq_len,
    run_from_flags,
    with_flags,
)
from tests.helpers import REPO

LORA = ["--config", "recipes/llama2_70b_lora.yaml"]
QLORA = ["--config", "recipes/llama2_70b_qlora.yaml"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the commands name recipes/ and configs/ as a user at the repo root types them


@pytest.fixture(scope="module")
def lora_run():
    return run_from_flags(LORA, "configs/fsdp_config.yaml")


@pytest.fixture(scope="module")
def lora_fp32_run():
    return run_from_flags([*LORA, "--torch_dtype", "float32"], "configs/fsdp_config.yaml")


@pytest.fixture(scope="module")
def qlora_run():
    return run_from_flags(QLORA, "configs/fsdp_config_qlora.yaml")


def _by(answers, **what):
    return next(a for a in answers if all(getattr(a, k) == v for k, v in what.items()))


def _replan(command: str, gpu_memory_gib: float):
    """The plan of a printed command, read back as a user would run it: its YAML, launcher overrides and flags."""
    tokens = shlex.split(command)
    split = tokens.index("train.py")
    launcher, train = tokens[2:split], tokens[split + 1:]
    opts = dict(zip(launcher[::2], launcher[1::2]))
    config = read_accelerate_config(opts["--config_file"])
    if "--fsdp_offload_params" in opts:
        config = {**config, "fsdp_config": {**config["fsdp_config"],
                                            "fsdp_offload_params": opts["--fsdp_offload_params"] == "true"}}
    for key in ("offload_optimizer_device", "offload_param_device"):  # accelerate's DeepSpeed overrides
        if f"--{key}" in opts:
            config = {**config, "deepspeed_config": {**config["deepspeed_config"], key: opts[f"--{key}"]}}
    config = {**config, "num_processes": int(opts["--num_processes"]),
              "num_machines": int(opts.get("--num_machines", config.get("num_machines") or 1))}
    model_args, data_args, _, training_args = parse_train_flags(train, "cuda")
    return plan_memory(model_args, data_args, training_args, config, None, gpu_memory_gib, "cuda", ladder=False)


# ------------------------------------------------------------------------------------------------ fewest GPUs


def test_fewest_gpus_fits_and_one_fewer_does_not(lora_run):
    """Each answer fits in every phase; the count before it on the search's ladder (1..8, then whole machines) does
    not; the printed command plans to the same peak."""
    counts = gpu_counts()
    for a in fewest(lora_run, 80.0):
        if not a.fits:
            assert a.engine == "ddp" and not a.command
            continue
        assert a.plan.fits and a.plan.peak_gib <= 80.0
        if a.engine != "ddp" and a.num_processes > 1:
            fewer = counts[counts.index(a.num_processes) - 1]
            one_less = fewest(lora_run, 80.0, engines=(a.engine,), offload=(a.offload,), max_gpus=fewer)[0]
            assert not one_less.fits, (a.engine, a.offload, fewer)
        assert _replan(a.command, 80.0).peak_gib == pytest.approx(a.plan.peak_gib)


def test_offload_and_a_bf16_base_need_fewer_gpus(lora_run, lora_fp32_run):
    bf16 = fewest(lora_run, 80.0, engines=("fsdp1",))
    fp32 = fewest(lora_fp32_run, 80.0, engines=("fsdp1",))
    assert _by(bf16, offload=True).num_processes < _by(bf16, offload=False).num_processes
    assert _by(bf16, offload=False).num_processes < _by(fp32, offload=False).num_processes
    # with the plan's measured error as headroom (11%): a bf16 base on 6, fp32 (upstream's load) past one machine
    assert (_by(bf16, offload=False).num_processes, _by(fp32, offload=False).num_processes) == (6, 16)


def test_fewest_gpus_is_monotonic_in_gpu_memory(lora_fp32_run):
    """Bigger GPUs never need more of them; small ones spill onto whole machines, named with the multi-node YAML;
    below what one GPU's activations and buffers take, no count fits and the answer says why."""
    counts = [fewest(lora_fp32_run, gib, engines=("fsdp2",), offload=(False,))[0] for gib in (64, 80, 141)]
    assert all(a.fits for a in counts)
    assert [a.num_processes for a in counts] == sorted((a.num_processes for a in counts), reverse=True)
    many = counts[0]
    assert many.num_processes > 8 and many.num_processes % 8 == 0 and many.num_machines == many.num_processes // 8
    assert f"configs/multi_node/fsdp2_config.yaml --num_machines {many.num_machines}" in many.command
    assert "--main_process_ip" in many.command
    never = fewest(lora_fp32_run, 48.0, engines=("fsdp2",), offload=(False,))[0]
    assert not never.fits and not never.command and "activations and buffers do not shrink" in never.note


def test_the_global_batch_grows_with_the_gpus_and_the_answer_says_how_to_keep_it(lora_fp32_run):
    a = _by(fewest(lora_fp32_run, 80.0, engines=("fsdp1",), offload=(False,)), offload=False)
    assert a.global_batch == a.num_processes * 8 * 4  # micro-batch 8, accumulation 4
    assert f"--gradient_accumulation_steps {8 * 8 * 4 // (a.num_processes * 8)} keeps the global batch of 256" \
        in a.note


def test_ddp_fits_on_one_gpu_or_none(tiny):
    run = run_from_flags(["--model_name_or_path", str(tiny.model_dir)])
    answers = fewest(run, 80.0)
    ddp = _by(answers, engine="ddp")
    assert ddp.fits and ddp.num_processes == 1 and "configs/single.yaml" in ddp.command
    assert all(a.num_processes == 1 for a in answers)


def test_host_memory_is_a_constraint_when_given(lora_run):
    free = _by(fewest(lora_run, 80.0, engines=("fsdp1",), offload=(True,)), offload=True)
    assert free.fits and free.num_processes == 1
    tight = fewest(lora_run, 80.0, engines=("fsdp1",), offload=(True,),
                   host_memory_gib=free.plan.host_peak_bytes / GIB - 1)[0]
    assert not tight.fits or tight.plan.host_peak_bytes < free.plan.host_peak_bytes


# ----------------------------------------------------------------------------------------- longest sequence


def test_longest_seq_len_fits_and_one_token_longer_does_not(qlora_run):
    for a in longest_seq_len(qlora_run, 24.0):
        assert a.fits and a.plan.fits, a
        assert f"--max_seq_len {a.seq_len}" in a.command
        assert _replan(a.command, 24.0).peak_gib == pytest.approx(a.plan.peak_gib)
        longer = _replan(a.command.replace(f"--max_seq_len {a.seq_len}", f"--max_seq_len {a.seq_len + 1}"), 24.0)
        assert not longer.fits, a


def test_checkpointing_and_activation_offloading_raise_the_longest_length(qlora_run):
    answers = longest_seq_len(qlora_run, 24.0)
    plain = _by(answers, checkpointing=False, activation_offloading=False).seq_len
    ckpt = _by(answers, checkpointing=True, activation_offloading=False).seq_len
    both = _by(answers, checkpointing=True, activation_offloading=True)
    assert plain < ckpt < both.seq_len
    # train.py refuses activation offloading under FSDP1: the answer launches the shipped FSDP2 twin
    assert both.engine == "fsdp2" and "--config_file configs/fsdp2_config_qlora.yaml" in both.command
    assert "--activation_offloading True" in both.command and "--gradient_checkpointing True" in both.command


def test_longest_seq_len_is_monotonic_in_gpu_memory(qlora_run):
    lengths = [longest_seq_len(qlora_run, gib, checkpointing=(True,), activation_offloading=(False,))[0].seq_len
               for gib in (16, 24, 48, 80)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]


def test_longest_seq_len_on_cpu_plans_rss_per_rank(tiny):
    run = run_from_flags(["--model_name_or_path", str(tiny.model_dir), "--packing", "True"], device="cpu")
    answers = longest_seq_len(run, 1.0)
    assert {(a.checkpointing, a.activation_offloading) for a in answers} == {(True, False), (False, False)}
    assert all(a.fits and a.plan.device == "cpu" for a in answers)
    with pytest.raises(ConfigError, match="CPU run"):
        longest_seq_len(run, 1.0, activation_offloading=(True,))


def test_with_flags_replaces_every_spelling():
    argv = ["--config", "r.yaml", "--max_length=512", "--gradient_checkpointing", "--activation_offloading", "True",
            "--lora_r", "8"]
    out = with_flags(argv, {("--max_seq_len", "--max_length"): "4096",
                            ("--gradient_checkpointing", "--activation_checkpointing"): "False",
                            ("--activation_offloading",): None})
    assert out == ["--config", "r.yaml", "--lora_r", "8", "--max_seq_len", "4096", "--gradient_checkpointing",
                   "False"]


# ------------------------------------------------------------------------------------- activation offloading


def test_activation_offloading_moves_the_checkpoints_to_host_ram():
    """Under FSDP2 with checkpointing: GPU keeps 2 layer inputs in flight instead of L; each machine's host RAM
    gains n x L pinned layer inputs (+ what is saved outside the layers)."""
    cfg = read_accelerate_config(REPO / "configs" / "fsdp2_config.yaml")
    plans = {}
    for off in (False, True):
        args = parse_train_flags([*LORA, "--activation_offloading", str(off)], "cuda")
        plans[off] = plan_memory(*args[:2], args[3], cfg, None, 80.0, "cuda", ladder=False)
    w = workload(*args[:2], args[3], "cuda")
    rows = {r.name: r.bytes for r in plans[True].rows}
    T, h, a, L = w.tokens, 8192, 2, 80
    assert rows["activations: checkpoints in flight"] == 2 * T * h * a
    host = {r.name: r.bytes for r in plans[True].host_rows}
    assert host["offloaded activations"] == 8 * (L * pinned(T * h * a) + T * h * (4 + a))
    assert plans[True].peak_gib < plans[False].peak_gib - 15  # L*T*h*a = 20 GiB leaves the GPU
    assert "activation offloading" in plans[True].setup


def test_activation_offloading_is_refused_where_train_py_refuses_it(tiny):
    for config, flags, device, needle in (("configs/fsdp_config.yaml", LORA, "cuda", "FSDP1"),
                                          ("configs/cpu/single.yaml", ["--model_name_or_path", str(tiny.model_dir)],
                                           "cpu", "CPU run")):
        args = parse_train_flags([*flags, "--activation_offloading", "True"], device)
        with pytest.raises(ConfigError, match=needle):
            plan_memory(*args[:2], args[3], read_accelerate_config(config), None, 80.0, device)


def _offloaded_per_layer(layers: int, checkpointing: bool, reentrant: bool = False) -> tuple[float, float]:
    """(forward, backward) bytes per token that reach the outermost saved-tensor hook -- what TRL's
    OffloadActivations copies to host -- filtered as TRL filters (>= 1024 bytes, not a parameter's storage)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                      num_key_value_heads=1, tie_word_embeddings=False, attn_implementation="sdpa",
                      num_hidden_layers=layers)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    add_fused_lm_head(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM")).train()
    model.enable_input_require_grads()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[str, dict] = {"forward": {}, "backward": {}}
    phase = ["forward"]
    # Every storage the hook saw stays referenced until the count is done: a freed tensor's address can otherwise be
    # handed to its successor, which would then be taken for the same tensor (the count depended on what ran before).
    alive = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params and t.element_size() * t.nelement() >= 1024:
            alive.append(t.untyped_storage())
            seen[phase[0]].setdefault((t.untyped_storage().data_ptr(), t.dtype), t.element_size() * t.nelement())
        return t

    tokens = 256
    ids = torch.randint(0, cfg.vocab_size, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        phase[0] = "backward"
        out.loss.backward()
    return sum(seen["forward"].values()) / tokens, sum(seen["backward"].values()) / tokens


def test_what_activation_offloading_moves_matches_autograd_hooks(tmp_path):
    """Per layer (2 layers minus 1): with non-reentrant checkpointing the layer input (h*a bytes per token) and
    nothing in backward; without checkpointing all of c; with reentrant checkpointing the recomputation reaches the
    hook too (the formula adds one layer's T*c): the same bytes as the unchecked forward of a layer. Counted with
    every seen storage kept alive, so the result does not depend on what the allocator did before (issue: a freed
    tensor's reused address made the count depend on test order)."""
    from sft_recipe.plan.components import activation_bytes_per_token_per_layer
    from sft_recipe.plan.shape import model_shape

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 256,
        "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 1, "num_hidden_layers": 2,
        "tie_word_embeddings": False}))
    run = run_from_flags(["--model_name_or_path", str(tmp_path), "--use_peft_lora", "True", "--lora_r", "8",
                          "--lora_dropout", "0.0", "--lora_target_modules", "all-linear"])
    c = activation_bytes_per_token_per_layer(model_shape(str(tmp_path)), run.workload, "cuda")
    ckpt = [_offloaded_per_layer(n, True) for n in (1, 2)]
    assert ckpt[1][0] - ckpt[0][0] == 256 * 2 and ckpt[0][1] == ckpt[1][1] == 0
    plain = [_offloaded_per_layer(n, False) for n in (1, 2)]
    assert plain[1][0] - plain[0][0] == pytest.approx(c, rel=0.05)
    reentrant = [_offloaded_per_layer(n, True, reentrant=True) for n in (1, 2)]
    # The reentrant recomputation saves, through the same hook, exactly what an unchecked forward of the layer saves.
    assert reentrant[1][1] - reentrant[0][1] == plain[1][0] - plain[0][0]
    assert reentrant[1][1] - reentrant[0][1] == pytest.approx(c, rel=0.05)
    w = run.workload.__class__(**{**run.workload.__dict__, "activation_offloading": True,
                                  "gradient_checkpointing": True, "reentrant_checkpointing": True, "seq_len": 256})
    total, formula = offloaded_activation_bytes(model_shape(str(tmp_path)), w)
    assert "reentrant" in formula and total >= 256 * c


# ------------------------------------------------------------------------------------------- CLI and guide


def test_cli_prints_the_table_and_the_command(capsys):
    assert main(["--fewest_gpus", "--gpu_memory_gib", "80", "--config_file", "configs/fsdp_config.yaml", *LORA,
                 "--engines", "fsdp1", "--no_breakdown"]) == 0
    out = capsys.readouterr().out
    assert "fewest GPUs of 80 GiB" in out
    assert "accelerate launch --config_file configs/fsdp_config.yaml --num_processes 6 train.py --config " \
           "recipes/llama2_70b_lora.yaml" in out
    assert "--fsdp_offload_params true" in out
    assert main(["--longest_seq_len", "--gpu_memory_gib", "24", "--config_file", "configs/fsdp_config_qlora.yaml",
                 *QLORA, "--json"]) == 0
    answers = json.loads(capsys.readouterr().out)["answers"]
    assert len(answers) == 4 and all(a["command"].startswith("accelerate launch") for a in answers)
    assert all(a["plan"]["rows"] for a in answers)  # the breakdown
    assert main(["--fewest_gpus", "--longest_seq_len", "--gpu_memory_gib", "80", *LORA]) == 2


def test_guide_answers_the_renting_questions():
    """The guide's LoRA run: a bf16 base fits on fewer 80 GiB GPUs than upstream's fp32 load and needs half the host
    RAM at load; QLoRA on 2x24 GiB: checkpointing is what makes 2048 fit."""
    answers = guide_renting()
    bf16, fp32 = answers["lora-8x80"], answers["lora-8x80-float32"]
    assert bf16["fewest"][0].num_processes < fp32["fewest"][0].num_processes
    assert bf16["on_8"].peak_gib < fp32["on_8"].peak_gib
    load = {k: {r.name: r.bytes for r in v["on_8"].host_rows}["loading"] for k, v in (("bf16", bf16), ("fp32", fp32))}
    assert load["fp32"] == pytest.approx(2 * load["bf16"])
    qlora = answers["qlora-2x24-offload"]
    assert _by(qlora, checkpointing=True, activation_offloading=False).seq_len >= 2048
    assert _by(qlora, checkpointing=False, activation_offloading=False).seq_len < 2048


def test_the_docs_renting_section_is_what_the_plan_answers(capsys):
    """docs/memory-and-speed.md's renting tables hold the planner's numbers, and its commands run and print the
    launch command it quotes."""
    import re

    from sft_recipe.plan.guide_renting import host_at_load_gib

    text = (REPO / "docs" / "memory-and-speed.md").read_text()
    section = text.split("## Renting: how few GPUs, how long a sequence", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    answers = guide_renting()
    for key, label in (("lora-8x80-float32", "| fp32"), ("lora-8x80", "| bf16")):
        row = next(line for line in lines if line.startswith(label))
        on8, (plain, off) = answers[key]["on_8"], answers[key]["fewest"]
        for cell in (f"| {on8.peak_gib:.1f} GiB |", f"| {host_at_load_gib(on8):.0f} GiB |",
                     f"**{plain.num_processes}** ({plain.plan.peak_gib:.1f} GiB each)",
                     f"{off.num_processes} ({off.plan.peak_gib:.1f} GiB; host "
                     f"{off.plan.host_peak_bytes / GIB:.0f} GiB)"):
            assert cell in row, (cell, row)
    rows = [line for line in lines if line.startswith("| on") or line.startswith("| off")]
    assert len(rows) == 4
    for a, row in zip(answers["qlora-2x24-offload"], rows):
        assert row.startswith(f"| {'on' if a.checkpointing else 'off'}")
        assert f"| {a.seq_len} |" in row.replace("**", "") and f"| {a.plan.host_peak_bytes / GIB:.0f} GiB |" in row
    commands = [" ".join(c.split()) for c in re.findall(r"`(python -m sft_recipe\.plan --[fl][^`]+)`", section)]
    assert len(commands) == 2
    for command in commands:
        assert main(command.split()[3:] + ["--no_breakdown"]) == 0
    out = capsys.readouterr().out
    quoted = " ".join(re.search(r"`(accelerate launch [^`]+)`", section).group(1).split())
    assert quoted in out
