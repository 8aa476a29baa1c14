"""The run record: its summary line speaks the user's words (checked on recorded sections), every field has one
declared home, and a CPU evaluation does not read as changed frozen weights."""

from __future__ import annotations

import pytest

from sft_recipe.train.record import SECTIONS, RunRecord, summary_line

BASE = {"wrapped_class": "PeftModelForCausalLM", "global_steps": 4, "train_seconds": 1.5,
        "peak_rss_mib_per_rank": [600.0], "frozen_changed": False, "trainable_changed": True, "device": "cpu"}


def _line(**facts) -> str:
    """The line from a record whose sections hold `facts` (each field put in the section that declares it)."""
    facts = {**BASE, **facts}
    record = {name: {k: v for k, v in facts.items() if k in fields} for name, fields in SECTIONS.items()}
    assert sum(len(section) for section in record.values()) == len(facts)  # every field found its section
    return summary_line(record)


@pytest.mark.parametrize("facts,expected", [
    ({"distributed_type": "NO", "num_processes": 1}, "run summary: one process on cpu ("),
    ({"distributed_type": "FSDP", "fsdp_version": 2, "num_processes": 2}, "run summary: FSDP2 on 2 x cpu ("),
    ({"distributed_type": "MULTI_CPU", "num_processes": 2}, "run summary: DDP on 2 x cpu ("),
    ({"distributed_type": "DEEPSPEED", "num_processes": 2}, "run summary: DeepSpeed on 2 x cpu ("),
])
def test_how_it_ran(facts, expected):
    assert _line(**facts).startswith(expected)


def test_the_loss_part_says_what_was_logged():
    common = {"distributed_type": "NO", "num_processes": 1}
    assert "loss 3.000 -> 1.000," in _line(**common, losses=[3.0, 2.0, 1.0])
    assert "loss 2.500 (logged once)," in _line(**common, losses=[2.5])
    line = _line(**common, losses=[])
    assert "nan" not in line and "no training loss logged (--logging_steps is more than the steps run)" in line


def test_what_moved_is_said_loudly_when_wrong():
    line = _line(distributed_type="NO", num_processes=1, frozen_changed=True, trainable_changed=False)
    assert "frozen weights CHANGED, trainable weights DID NOT MOVE" in line


def test_a_field_no_section_declares_is_refused():
    record = object.__new__(RunRecord)  # set() needs only the sections
    record.record = {name: {} for name in SECTIONS}
    record.set("training", losses=[1.0])
    assert record.record["training"] == {"losses": [1.0]}
    with pytest.raises(KeyError, match="declares no field"):
        record.set("training", peak_rss_mib_per_rank=[1.0])  # a memory field


def test_a_cpu_evaluation_does_not_change_frozen_4bit_bytes(tiny):
    """bitsandbytes re-lays out 4-bit bytes in a CPU eval forward (AVX512-BF16 CPUs): the checksum must not see it."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from sft_recipe import compat
    from sft_recipe.measure import local_sums

    model = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir), quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
    frozen_before = local_sums(model)
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5, 6]]))
    relaid = local_sums(model) != frozen_before
    restored = compat.restore_bnb_4bit_storage_layout(model)
    assert (restored > 0) == relaid, "a re-layout happened exactly when there was something to restore"
    if not restored:
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes keeps the stored layout (nothing to undo here)")
    assert local_sums(model) == frozen_before
    assert compat.restore_bnb_4bit_storage_layout(model) == 0


def test_undoing_the_4bit_re_layout_never_asks_peft_wrappers_for_their_merged_weight(tiny):
    """PEFT's trainable-token wrapper answers `.weight` by merging its rows into the base weight; under FSDP1 that
    weight is a flat shard and the merge raised IndexError at the end of a QLoRA run with --train_new_tokens
    (bench/use_orig_params.py). The base weight stood for by a shard of it here, as FSDP1 leaves it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sft_recipe import compat

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny.model_dir)), LoraConfig(
        r=4, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [3, 4, 5]}))
    embedding = model.get_input_embeddings()
    embedding.token_adapter.base_layer.weight.data = embedding.token_adapter.base_layer.weight.data.flatten()[:1536]
    with pytest.raises(IndexError):
        getattr(embedding, "weight")  # noqa: B009 -- what `getattr(module, "weight")` did
    assert compat.restore_bnb_4bit_storage_layout(model) == 0 and torch.is_tensor(embedding.token_adapter.base_layer
                                                                                 .weight)


def test_the_checksum_sees_a_changed_value_and_a_permutation():
    """measure._checksum: any changed word, and values moved to other positions (a plain word sum is blind to that:
    two ranks whose packing order differs would have compared equal)."""
    import torch

    from sft_recipe.measure import CHECKSUM_MODULUS, tensors_checksum

    t = torch.arange(3000, dtype=torch.float32)
    base = tensors_checksum([t])
    assert tensors_checksum([t.clone()]) == base and 0 <= base < CHECKSUM_MODULUS
    changed = t.clone()
    changed[1234] += 1
    swapped = t.clone()
    swapped[[10, 2000]] = swapped[[2000, 10]]
    assert tensors_checksum([changed]) != base
    assert tensors_checksum([swapped]) != base
    assert int(t.view(torch.int32).sum()) == int(swapped.view(torch.int32).sum())  # what the plain sum would say
    big = torch.full((3 * 2**20 + 5,), -1.5e38, dtype=torch.float32)  # several chunks of extreme words
    assert 0 <= tensors_checksum([big]) < CHECKSUM_MODULUS


def _finished_record() -> RunRecord:
    """A record at a one-process run's end: write() needs the trainer's accelerator and checkpoint costs alone."""
    from types import SimpleNamespace

    import torch

    record = object.__new__(RunRecord)
    record.record = {name: {} for name in SECTIONS}
    accelerator = SimpleNamespace(num_processes=1, is_main_process=True, device=torch.device("cpu"))
    record.trainer = SimpleNamespace(accelerator=accelerator, checkpoint_save_costs=[])
    facts = {**BASE, "distributed_type": "NO", "num_processes": 1, "losses": [3.0, 2.0], "loss_steps": [1, 2]}
    for name, fields in SECTIONS.items():
        record.set(name, **{k: v for k, v in facts.items() if k in fields})
    return record


def test_the_loss_curve_is_drawn_unless_the_run_says_not_and_then_no_earlier_one_stays(tmp_path):
    _finished_record().write(str(tmp_path), run={}, final_save=None)
    assert (tmp_path / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"  # the default: every run draws it
    assert (tmp_path / "run_record.json").is_file()
    # --plot_loss_curve False in the same folder: the record is written, the curve the first run drew is gone
    (tmp_path / "run_record.json").unlink()
    _finished_record().write(str(tmp_path), run={}, final_save=None, plot=False)
    assert (tmp_path / "run_record.json").is_file() and not (tmp_path / "loss_curve.png").exists()
