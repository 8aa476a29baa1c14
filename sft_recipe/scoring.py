"""Score a chat model on the final assistant turn of conversations: greedy exact match and answer-token accuracy.

Library code: `sft_recipe.evaluate` compares an adapter with its base through it, and the tiny demo's docs and tests
measure the held-out split with it. It works with any tokenizer that carries a chat template.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

# One chat: [{"role": ..., "content": ...}, ...], ending with the assistant turn that is scored.
Conversation = list[dict[str, str]]


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _stop_token_ids(model, tokenizer) -> set[int]:
    stop: set[int] = set()
    if tokenizer.eos_token_id is not None:
        stop.add(int(tokenizer.eos_token_id))
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        stop.add(eos)
    elif eos is not None:
        stop.update(int(i) for i in eos)
    return stop


def _model_device(model):
    import torch

    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def _groups_by_length(sequences: Sequence[Sequence[int]], batch_size: int) -> Iterator[list[int]]:
    # Equal-length batches need no padding, hence no attention mask or position-id bookkeeping: the result is
    # the same as scoring one conversation at a time.
    by_length: dict[int, list[int]] = {}
    for index, sequence in enumerate(sequences):
        by_length.setdefault(len(sequence), []).append(index)
    for length in sorted(by_length):
        indices = by_length[length]
        for start in range(0, len(indices), batch_size):
            yield indices[start : start + batch_size]


def score_answers(
    model,
    tokenizer,
    conversations: Sequence[Conversation],
    max_new_tokens: int = 24,
    batch_size: int = 32,
    add_special_tokens: bool = True,
) -> dict[str, Any]:
    """Score ``model`` on the final assistant turn of each conversation.

    The prompt is ``tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)`` with whatever chat
    template the tokenizer carries.  Rendered text is tokenized with ``add_special_tokens`` (default True: what
    TRL does to a text field such as the recipe's ``content``, so the model is scored on inputs shaped like its
    training data; pass False to mirror TRL's conversational path, ``apply_chat_template(tokenize=True)``).
    Returns

    * ``exact_match``: share of conversations whose greedy generation (up to an EOS token, special tokens
      dropped, whitespace stripped) equals the reference answer;
    * ``answer_token_accuracy``: teacher-forced next-token accuracy over the tokens of the rendered assistant
      turn (answer text plus the template's end-of-turn tokens), pooled over all conversations;
    * ``samples``: ``(prompt_text, reference, generated)`` per conversation, in input order.

    Works with a ``LlamaForCausalLM``, a ``peft.PeftModel`` around one, or anything callable as
    ``model(input_ids=...)`` that returns an object with ``.logits``.  The model's train/eval mode is restored.
    """
    import torch

    if not conversations:
        raise ValueError("no conversations to score")
    prompt_texts: list[str] = []
    references: list[str] = []
    prompt_ids: list[list[int]] = []
    full_ids: list[list[int]] = []
    answer_starts: list[int] = []
    for messages in conversations:
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError("each conversation must end with an assistant message")
        prompt_text = tokenizer.apply_chat_template(list(messages[:-1]), add_generation_prompt=True, tokenize=False)
        full_text = tokenizer.apply_chat_template(list(messages), tokenize=False)
        ids_prompt = _encode(tokenizer, prompt_text, add_special_tokens)
        ids_full = _encode(tokenizer, full_text, add_special_tokens)
        # The answer starts where prompt and full rendering diverge (normally right after the prompt; earlier if
        # tokens merge across the boundary), as in TRL's prompt/completion split.
        answer_start = _common_prefix_length(ids_prompt, ids_full)
        if answer_start >= len(ids_full):
            raise ValueError(f"empty reference answer after tokenization: {full_text!r}")
        prompt_texts.append(prompt_text)
        references.append(messages[-1]["content"])
        prompt_ids.append(ids_prompt)
        full_ids.append(ids_full)
        answer_starts.append(answer_start)

    device = _model_device(model)
    stop_ids = _stop_token_ids(model, tokenizer)
    was_training = bool(getattr(model, "training", False))
    if hasattr(model, "eval"):
        model.eval()
    generations: list[list[int]] = [[] for _ in conversations]
    correct_tokens = 0
    total_tokens = 0
    try:
        with torch.no_grad():
            # Teacher forcing: logits at position t predict token t + 1.
            for batch in _groups_by_length(full_ids, batch_size):
                input_ids = torch.tensor([full_ids[i] for i in batch], device=device)
                predictions = model(input_ids=input_ids, use_cache=False).logits.argmax(dim=-1).cpu()
                for row, i in enumerate(batch):
                    start = answer_starts[i]
                    targets = torch.tensor(full_ids[i][start:])
                    predicted = predictions[row, start - 1 : len(full_ids[i]) - 1]
                    correct_tokens += int((predicted == targets).sum())
                    total_tokens += len(targets)

            # Greedy decoding without a KV cache: sequences are short, and a plain forward works for any model.
            for batch in _groups_by_length(prompt_ids, batch_size):
                input_ids = torch.tensor([prompt_ids[i] for i in batch], device=device)
                finished = [False] * len(batch)
                for _ in range(max_new_tokens):
                    next_ids = model(input_ids=input_ids, use_cache=False).logits[:, -1, :].argmax(dim=-1)
                    for row, i in enumerate(batch):
                        if finished[row]:
                            continue
                        token = int(next_ids[row])
                        if token in stop_ids:
                            finished[row] = True
                        else:
                            generations[i].append(token)
                    if all(finished):
                        break
                    input_ids = torch.cat([input_ids, next_ids[:, None].to(input_ids.device)], dim=1)
    finally:
        if was_training and hasattr(model, "train"):
            model.train()

    samples = []
    exact = 0
    for i in range(len(conversations)):
        generated = tokenizer.decode(generations[i], skip_special_tokens=True).strip()
        exact += int(generated == references[i].strip())
        samples.append((prompt_texts[i], references[i], generated))
    return {
        "exact_match": exact / len(conversations),
        "answer_token_accuracy": correct_tokens / total_tokens,
        "samples": samples,
    }
