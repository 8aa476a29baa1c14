"""Tests for sft_recipe.scoring: exact match and answer-token accuracy of a chat model, on the tiny demo's data."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from sft_recipe.scoring import score_answers
from sft_recipe.tiny import heldout_conversations, make_conversations

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.model_dir)


@pytest.fixture(scope="module")
def model(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny.model_dir)


class _Oracle(torch.nn.Module):
    """A fake causal LM that always predicts the next token of whichever reference sequence it is reading."""

    def __init__(self, sequences: list[list[int]], vocab_size: int, fallback_id: int) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives score_answers a device to read
        self.vocab_size = vocab_size
        self.fallback_id = fallback_id
        self.next_token: dict[tuple[int, ...], int] = {}
        for sequence in sequences:
            for end in range(1, len(sequence)):
                self.next_token[tuple(sequence[:end])] = sequence[end]

    def forward(self, input_ids: torch.Tensor, **kwargs) -> SimpleNamespace:
        batch, length = input_ids.shape
        logits = torch.zeros(batch, length, self.vocab_size)
        for row in range(batch):
            prefix = input_ids[row].tolist()
            for end in range(1, length + 1):
                logits[row, end - 1, self.next_token.get(tuple(prefix[:end]), self.fallback_id)] = 1.0
        return SimpleNamespace(logits=logits)


def test_score_answers_is_perfect_for_an_oracle(tokenizer):
    conversations = make_conversations("test")[:9]
    references = [tokenizer(tokenizer.apply_chat_template(m, tokenize=False))["input_ids"] for m in conversations]
    oracle = _Oracle(references, len(tokenizer), fallback_id=tokenizer.eos_token_id)
    result = score_answers(oracle, tokenizer, conversations, batch_size=4)
    assert result["exact_match"] == 1.0
    assert result["answer_token_accuracy"] == 1.0
    assert [sample[1] for sample in result["samples"]] == [m[-1]["content"] for m in conversations]
    assert [sample[2] for sample in result["samples"]] == [m[-1]["content"] for m in conversations]
    assert result["samples"][0][0] == tokenizer.apply_chat_template(
        conversations[0][:-1], add_generation_prompt=True, tokenize=False
    )

    # An oracle for the wrong answers scores zero exact matches and loses the answer tokens.
    wrong = [[*m[:-1], {"role": "assistant", "content": "The colour of snow is white."}] for m in conversations[1:]]
    wrong_ids = [tokenizer(tokenizer.apply_chat_template(m, tokenize=False))["input_ids"] for m in wrong]
    misled = _Oracle(wrong_ids, len(tokenizer), fallback_id=tokenizer.eos_token_id)
    result = score_answers(misled, tokenizer, conversations[1:])
    assert result["exact_match"] == 0.0
    assert result["answer_token_accuracy"] < 0.6


def test_score_answers_on_random_base_and_peft(model, tokenizer, tiny):
    from peft import LoraConfig, get_peft_model

    conversations = heldout_conversations(tiny)[:6]
    base = score_answers(model, tokenizer, conversations, max_new_tokens=8)
    assert 0.0 <= base["exact_match"] <= 1.0 and 0.0 <= base["answer_token_accuracy"] <= 1.0
    assert base["answer_token_accuracy"] < 0.2  # random weights know nothing
    assert len(base["samples"]) == len(conversations)

    # Equal-length batching must not change results.
    one_by_one = score_answers(model, tokenizer, conversations, max_new_tokens=8, batch_size=1)
    assert one_by_one == base

    # A fresh LoRA adapter is a no-op (B is zero), so a PeftModel scores exactly like its base.
    torch.manual_seed(0)
    peft_model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    try:
        peft_model.train()
        wrapped = score_answers(peft_model, tokenizer, conversations, max_new_tokens=8)
        assert peft_model.training  # mode restored
        assert wrapped == base
    finally:
        peft_model.unload()  # leave the shared model fixture as it was


def test_score_answers_uses_the_tokenizers_current_template(tokenizer):
    conversations = make_conversations("test")[:3]
    chatml = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    chatml.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    chatml.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    references = [chatml(chatml.apply_chat_template(m, tokenize=False))["input_ids"] for m in conversations]
    oracle = _Oracle(references, len(chatml), fallback_id=chatml.eos_token_id)
    result = score_answers(oracle, chatml, conversations)
    assert all(re.match(r"<\|im_start\|>", sample[0]) for sample in result["samples"])
    # The oracle continues past the answer with "<|im_end|>\n" then stops; special tokens are dropped.
    assert result["exact_match"] == 1.0 and result["answer_token_accuracy"] == 1.0


def test_score_answers_rejects_bad_input(model, tokenizer):
    with pytest.raises(ValueError):
        score_answers(model, tokenizer, [])
    with pytest.raises(ValueError):
        score_answers(model, tokenizer, [[{"role": "user", "content": "hi"}]])
