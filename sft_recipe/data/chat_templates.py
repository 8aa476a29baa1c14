"""The chat formats the recipe writes (--chat_template_format chatml / zephyr) and what TRL needs of a template for
--assistant_only_loss: checked in the data step, which holds the tokenizer, before any weight loads.

Our templates wrap assistant turns in {% generation %} so TRL's assistant-only loss can find them. TRL 1.16's
`SFTTrainer.__init__` calls `get_training_chat_template` (ValueError for a template it has no training version of)
and its `_prepare_dataset` tokenize_fn raises RuntimeError "at least one example has no assistant tokens".
"""

from __future__ import annotations

from dataclasses import dataclass

# Our own Jinja templates. Assistant turns are wrapped in {% generation %} so TRL's assistant-only loss can find them.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ChatFormat:
    template: str
    extra_special_tokens: tuple[str, ...]
    eos_token: str | None  # None: keep the tokenizer's


CHAT_FORMATS = {
    # chatml ends a turn with <|im_end|>, so it becomes EOS: generation then stops at the end of the answer.
    "chatml": ChatFormat(CHATML_TEMPLATE, ("<|im_start|>", "<|im_end|>"), "<|im_end|>"),
    "zephyr": ChatFormat(ZEPHYR_TEMPLATE, ("<|user|>", "<|assistant|>", "<|system|>"), None),
}
PAD_TOKEN = "<pad>"


def assistant_only_loss_template(tokenizer) -> tuple[str | None, list[str]]:
    """(the chat template TRL 1.16 will render with instead of the tokenizer's, None for the tokenizer's own;
    problems). As SFTTrainer.__init__ decides: a template with {% generation %} markers is used as it is; otherwise
    `get_training_chat_template` returns TRL's training version of a template it knows, or raises."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if tokenizer.chat_template and has_generation_markers(tokenizer.chat_template):
        return None, []
    try:
        return get_training_chat_template(tokenizer), []
    except Exception as e:  # ValueError for a template TRL has no training version of
        first = (str(e).splitlines()[0] if str(e) else type(e).__name__).rstrip(".")
        return None, ["--assistant_only_loss True: the tokenizer's chat template has no {% generation %} markers, "
                      "so TRL cannot tell assistant tokens apart, and TRL 1.16 has no training version of this "
                      f"template (get_training_chat_template: {first}). Fix: --chat_template_format chatml (or "
                      "zephyr), whose templates mark assistant turns; or a template that wraps each assistant "
                      "answer in {% generation %}...{% endgeneration %}."]


def assistant_tokens_problem(messages: list[dict], tokenizer, chat_template: str | None) -> str | None:
    """Why TRL 1.16 would find no assistant token in this conversation (its tokenize_fn raises RuntimeError "at least
    one example has no assistant tokens"), or None. The template marks assistant text with {% generation %}; a token
    is in TRL's mask when it overlaps a marked span, so a non-empty span is a masked token. Rendered, not tokenized."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = tokenizer.get_chat_template(chat_template)
    try:
        _, spans = render_jinja_template(conversations=[messages], chat_template=template,
                                         return_assistant_tokens_mask=True, **tokenizer.special_tokens_map)
    except Exception:  # render_problem reports template errors; this check has nothing to add
        return None
    if any(end > start for start, end in spans[0]):
        return None
    return ("no assistant tokens: the chat template marks nothing of it with {% generation %} (an empty assistant "
            "answer?), and with --assistant_only_loss True TRL 1.16 stops at such a row")
