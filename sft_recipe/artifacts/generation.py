"""The generation config a trained model is saved with, so that `generate()` stops where the model learned to end an
answer, and the adapter card lines that load it.

A chat format can end turns with a token the base model never stops at: chatml makes `<|im_end|>` the tokenizer's
EOS, and Llama-3-style templates close a turn with `<|eot_id|>` beside the base's `<|end_of_text|>`. `generate()`
stops only at the generation config's `eos_token_id`, so with the base's config every answer runs on to
`max_new_tokens`. The final adapter and every checkpoint therefore carry a `generation_config.json`: the base's own
(its sampling settings kept) with the chat format's end-of-turn id added after the base's EOS ids. PEFT 0.21's
`AutoPeftModelForCausalLM` reads only the base's generation config, so the adapter's model card gives the line
that loads the adapter's one; `merge_adapter.py` puts the same ids in the merged model's config (`add_chat_eos`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shlex
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"  # transformers' GENERATION_CONFIG_NAME
MODEL_CARD = "README.md"  # what PEFT's save_pretrained writes beside the adapter
CARD_HEADING = "## How to Get Started with the Model"  # the section of PEFT's (huggingface_hub's) card template
CARD_PLACEHOLDER = "[More Information Needed]"
_ANSWER_MARKER = "sft-recipe-answer-marker"  # rendered as an assistant turn's content, to find what closes it


def _as_ids(value) -> list[int]:
    """A generation config's eos_token_id (None, an int or a list) as a list."""
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _special_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens, the ones added with `add_tokens(..., special_tokens=True)` included
    (transformers 5 lists only the named ones, e.g. eos/pad, in `all_special_ids`)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}


def end_of_turn_token_id(tokenizer) -> int | None:
    """The special token the tokenizer's chat template closes an assistant turn with (chatml `<|im_end|>`, the tiny
    and zephyr templates `</s>`, Llama-3 `<|eot_id|>`), found by rendering one turn and reading what follows the
    answer; None without a chat template, when the template refuses a user-assistant exchange, or when nothing
    special follows the answer."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _ANSWER_MARKER}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that needs a system turn or other roles: only its EOS is known then
        return None
    if not isinstance(text, str) or _ANSWER_MARKER not in text:
        return None
    after_answer = text[text.rindex(_ANSWER_MARKER) + len(_ANSWER_MARKER):]
    special = _special_ids(tokenizer)
    for token_id in tokenizer(after_answer, add_special_tokens=False)["input_ids"]:
        if token_id in special:
            return int(token_id)
    return None


def chat_eos_token_ids(base_eos, tokenizer) -> list[int]:
    """The ids `generate()` must stop at for a model trained with this tokenizer (its chat format and template):
    the base's own EOS ids first (int, list or None, as a generation config holds them; the model still ends plain
    text with them), then the tokenizer's EOS and the template's end-of-turn token where they differ."""
    ids = _as_ids(base_eos)
    for token_id in (tokenizer.eos_token_id, end_of_turn_token_id(tokenizer)):
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    return ids


def add_chat_eos(generation_config, tokenizer) -> None:
    """Set `chat_eos_token_ids` on a generation config in place (one id stays an int, as transformers writes it)."""
    ids = chat_eos_token_ids(generation_config.eos_token_id, tokenizer)
    if ids and ids != _as_ids(generation_config.eos_token_id):
        generation_config.eos_token_id = ids[0] if len(ids) == 1 else ids
        generation_config._from_model_config = False  # no longer what config.json implies: say so in the file


def base_generation_config(base_name_or_path: str, trust_remote_code: bool = False, fallback=None):
    """The base's generation_config.json, or (none saved) the one transformers derives from its config.json: read
    from the files, not the training model, which TRL changes (its pad token). `fallback` (the training model's
    config) where the base's files cannot be read any more: a save at the end of a long run must not fail on it."""
    from transformers import GenerationConfig

    from sft_recipe.model.shape import read_config

    try:
        try:
            return GenerationConfig.from_pretrained(base_name_or_path)
        except OSError:  # no generation_config.json: transformers builds one from config.json the same way
            config = read_config(base_name_or_path, trust_remote_code)
            return GenerationConfig.from_model_config(config)
    except (OSError, ValueError) as e:
        if fallback is None:
            raise
        logger.warning("the base model's generation config cannot be read (%s: %s); the training model's is saved "
                       "instead", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return copy.deepcopy(fallback)


def trained_base_name(model) -> str | None:
    """The base model a trained (PEFT or plain) model was loaded from."""
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        config = peft_config.get(getattr(model, "active_adapter", None)) or next(iter(peft_config.values()))
        return config.base_model_name_or_path
    return getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)


def text_tokenizer(processing_class):
    """The tokenizer of a processing class (a multimodal processor holds one)."""
    return getattr(processing_class, "tokenizer", processing_class)


def write_generation_config(folder: str | os.PathLike, base_name_or_path: str, tokenizer,
                            trust_remote_code: bool = False, fallback=None) -> tuple[object, list[int]]:
    """Write `folder/generation_config.json`: the base's, stopping at the chat format's end of turn too.
    Returns (the config written, the base's own EOS ids)."""
    config = base_generation_config(base_name_or_path, trust_remote_code, fallback)
    base_eos = _as_ids(config.eos_token_id)
    add_chat_eos(config, tokenizer)
    config.save_pretrained(str(folder))
    return config, base_eos


def ensure_generation_config(folder: str | os.PathLike, trainer) -> None:
    """A checkpoint folder's generation config, where its adapter save did not write one (FSDP SHARDED_STATE_DICT
    checkpoints: the adapter lives in DCP shards); main process, before the completeness marker records the files."""
    if (Path(folder) / GENERATION_CONFIG).is_file() or trainer.processing_class is None:
        return
    model = trainer.accelerator.unwrap_model(trainer.model)
    base = trained_base_name(model)
    if base:
        write_generation_config(folder, base, text_tokenizer(trainer.processing_class),
                                trust_remote_code=trainer.args.trust_remote_code,
                                fallback=getattr(model, "generation_config", None))


# --- the model card --------------------------------------------------------------------------------------------------

def _token_list(tokenizer, ids: list[int]) -> str:
    return ", ".join(f"`{tokenizer.convert_ids_to_tokens(i)}`" for i in ids)


def usage_section(adapter_dir: str, tokenizer, generation_config, base_eos: list[int]) -> str:
    """The card's "How to Get Started" text: load the adapter with its generation config, generate, or merge and use
    a pipeline. `base_eos`: the base's own EOS ids, to say what the adapter's config adds."""
    ids = _as_ids(generation_config.eos_token_id)
    added = [i for i in ids if i not in base_eos]
    merged_dir = f"{adapter_dir.rstrip('/')}-merged"
    if added:
        why = (f"This adapter ends its answers with {_token_list(tokenizer, added)}, the chat format's end of turn, "
               f"which the base model's generation config does not stop at (it stops at "
               f"{_token_list(tokenizer, base_eos) or 'no token'}). `{GENERATION_CONFIG}` in this folder "
               f"stops at both. PEFT's `AutoPeftModelForCausalLM` (0.21) reads only the base model's generation "
               f"config, so set this folder's, or every answer runs on to `max_new_tokens`:")
    else:
        why = (f"`{GENERATION_CONFIG}` in this folder is the base model's, stopping at "
               f"{_token_list(tokenizer, ids) or 'no token'} as this adapter's answers end. PEFT's "
               f"`AutoPeftModelForCausalLM` (0.21) reads only the base model's generation config; setting this "
               f"folder's keeps generation right if the two ever differ:")
    return f"""{CARD_HEADING}

{why}

```python
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer, GenerationConfig

adapter_dir = {json.dumps(adapter_dir)}  # this folder, or the Hub repository it was pushed to
model = AutoPeftModelForCausalLM.from_pretrained(adapter_dir)
tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
model.generation_config = GenerationConfig.from_pretrained(adapter_dir)  # the adapter's, not the base's

messages = [{{"role": "user", "content": "Hello!"}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**inputs, max_new_tokens=256)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```

Or per call: `model.generate(**inputs, generation_config=GenerationConfig.from_pretrained(adapter_dir))`.

Merged into its base (run in the recipe's folder), the model's own generation config stops there too, so the plain
loaders need nothing more:

```bash
python merge_adapter.py --adapter_dir {shlex.quote(adapter_dir)} --output_dir {shlex.quote(merged_dir)}
```

```python
from transformers import pipeline

chat = pipeline("text-generation", model={json.dumps(merged_dir)})
print(chat([{{"role": "user", "content": "Hello!"}}], max_new_tokens=256)[0]["generated_text"][-1]["content"])
```
"""


def _read_card(folder: str | os.PathLike) -> tuple[Path, str, tuple[int, int] | None]:
    """(the card's path, its text, the span of its "How to Get Started" section up to the next `## ` heading, or None
    where it has none)."""
    path = Path(folder) / MODEL_CARD
    card = path.read_text(encoding="utf-8") if path.is_file() else ""
    start = card.find(CARD_HEADING)
    if start < 0:
        return path, card, None
    following = card.find("\n## ", start + len(CARD_HEADING))
    return path, card, (start, len(card) if following < 0 else following + 1)


def add_usage_to_card(folder: str | os.PathLike, section: str) -> None:
    """Put `section` in place of the card template's empty "How to Get Started" section (or at the end of a card
    without one; a card of its own where PEFT wrote none)."""
    path, card, span = _read_card(folder)
    if span is None:
        card = card.rstrip("\n") + ("\n\n" if card else "") + section
    else:
        start, end = span
        card = card[:start] + section + ("\n" + card[end:] if end < len(card) else "")
    path.write_text(card, encoding="utf-8")


def usage_section_of(folder: str | os.PathLike) -> str | None:
    """The card's loading section as the recipe wrote it (None: the card in `folder` holds none)."""
    _, card, span = _read_card(folder)
    return None if span is None else card[span[0]:span[1]]


@contextmanager
def keeping_usage_section(folder: str | os.PathLike, is_main_process: bool):
    """Around TRL's `create_model_card`, which writes a card of its own over `folder`'s README.md (before a push
    uploads the folder, and at every checkpoint): the loading section the recipe wrote goes back into TRL's card."""
    section = usage_section_of(folder) if is_main_process else None
    yield
    if section is not None and usage_section_of(folder) is None:
        add_usage_to_card(folder, section)


def write_adapter_generation_files(folder: str | os.PathLike, adapter_dir: str, base_name_or_path: str, tokenizer,
                                   trust_remote_code: bool = False, card: bool = True, fallback=None) -> None:
    """An adapter save's `generation_config.json` and (PEFT adapters) the card's usage section. `folder`: where the
    files are written now; `adapter_dir`: the folder the user will load them from, named in the card; `fallback`:
    as for base_generation_config."""
    config, base_eos = write_generation_config(folder, base_name_or_path, tokenizer, trust_remote_code, fallback)
    if card:
        add_usage_to_card(folder, usage_section(adapter_dir, tokenizer, config, base_eos))
