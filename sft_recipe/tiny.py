"""Embedded, offline default for the SFT recipe: a tiny random Llama, a tokenizer and a learnable chat dataset.

The upstream recipe (PEFT ``examples/sft``) expects a Hub model such as Llama-2-70B and a Hub chat dataset.
Neither can be downloaded here, so this module builds small stand-ins that exercise the same code paths:

* ``model/``: a ``LlamaForCausalLM`` with random (seeded) weights and Llama-2-like shapes in miniature
  (grouped-query attention, untied embeddings, no pad token), saved next to its tokenizer.
* the tokenizer: a byte-level BPE trained on the dataset text, with Llama-2 special tokens
  (``<s>``, ``</s>``, ``<unk>``), no pad token and no ChatML tokens, so that the recipe's own
  ``--chat_template_format chatml|zephyr`` path has to add tokens and resize the embeddings.
  It carries a plain-text chat template (``### User:`` / ``### Assistant:``) with ``{% generation %}``
  markers so assistant-only loss can be computed.
* ``data/``: the same conversations as JSONL, ``save_to_disk`` folders, Parquet, and pre-rendered CSV text.

The task is a table of 40 facts (opposites, irregular plurals, animal sounds, colours) asked with six question
phrasings in the train split (240 rows) and a seventh, held-out phrasing in the test split (40 rows).
:func:`score_answers` measures the held-out answers.  A LoRA adapter (r=8, alpha=16, all linear layers) on the
frozen random base learns the task in about 200 optimizer steps of ~32 conversations each at a constant lr of
5e-3 (held-out exact match 0 -> 0.2-0.8 depending on the seed, answer-token accuracy 0 -> 0.83-0.98); with 8
conversations per step it needs about 400-600 steps.

Usage::

    python -m sft_recipe.tiny --output_dir .tiny            # build once; later calls are no-ops
    python -m sft_recipe.tiny --output_dir .tiny --force    # rebuild
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import glob
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Bump when anything that changes the built bytes changes (facts, templates, tokenizer or model recipe), so that
# an existing build is no longer considered up to date.
BUILD_FORMAT_VERSION = 1

SPLITS = ("train", "test")
READY_FILE = "READY"

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
# Order fixes the ids: <unk>=0, <s>=1, </s>=2, as in the Llama-2 tokenizer (and LlamaConfig's defaults).
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN)

# Upper bound on the vocabulary, special tokens and the 256 byte symbols included.  BPE training stops earlier,
# once no pair of symbols occurs twice (552 tokens for this corpus), by which point every word of the dataset is a
# single token: multi-token answers made the task markedly slower to learn for LoRA on a random base.
TOKENIZER_VOCAB_SIZE = 640

# Spread of the random model's initial logits (see build_model); 1.6 gives std 0.2 for hidden_size 64.
LM_HEAD_INIT_LOGIT_STD = 1.6

# Role headers of CHAT_TEMPLATE (kept in step with it by hand; the tests render the template and compare).
USER_HEADER = "### User:\n"
ASSISTANT_HEADER = "### Assistant:\n"
SYSTEM_HEADER = "### System:\n"

# The template is plain text so that a random base model has no special marker tokens to learn.  There is no
# `bos_token` in it: the tokenizer adds `<s>` itself when text is tokenized with special tokens (what TRL does for
# a text field), and putting it in the template as well would give two BOS tokens on that path.  The assistant
# content *and* the closing `</s>` sit inside `{% generation %}` so that assistant-only loss teaches the model to
# stop.  The rendering ends with `</s>` and no trailing newline, so TRL does not append another EOS.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{ '### System:\\n' + message['content'] }}"
    "{%- elif message['role'] == 'user' -%}"
    "{{ '### User:\\n' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '### Assistant:\\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{%- else -%}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '\\n### Assistant:\\n' }}{%- endif -%}"
)

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "Answer in one short sentence.",
)
# Share of rows that start with a system message; it shifts token positions, which discourages the adapter from
# memorising absolute positions instead of reading the question.
SYSTEM_PROMPT_FRACTION = 0.3

# Every relation is asked through its "phrase" (e.g. "the opposite of hot"), which the answer repeats:
# "The opposite of hot is cold."  The question templates wrap the phrase in different wording.
TRAIN_QUESTION_TEMPLATES = (
    "What is {phrase}?",
    "Tell me {phrase}.",
    "Please name {phrase}.",
    "Do you know {phrase}?",
    "I would like to know {phrase}.",
    "Name {phrase}, please.",
)
# Held out: only the test split uses it, so the test measures new wording of known facts, not new facts.
HELDOUT_QUESTION_TEMPLATES = ("Can you say {phrase}?",)

RELATION_PHRASES = {
    "opposite": "the opposite of {subject}",
    "plural": "the plural of {subject}",
    "sound": "the sound a {subject} makes",
    "colour": "the colour of {subject}",
}

# (relation, subject, answer): ten per relation.  Forty facts is about what LoRA on the frozen random base
# memorises in ~200 steps (sixty took two to three times as many).  Some subjects recur across relations (cat,
# mouse, wolf, leaf, pig) so that the adapter has to read the relation, not only the subject.
FACTS: tuple[tuple[str, str, str], ...] = (
    ("opposite", "hot", "cold"),
    ("opposite", "big", "small"),
    ("opposite", "fast", "slow"),
    ("opposite", "up", "down"),
    ("opposite", "day", "night"),
    ("opposite", "wet", "dry"),
    ("opposite", "happy", "sad"),
    ("opposite", "light", "dark"),
    ("opposite", "full", "empty"),
    ("opposite", "strong", "weak"),
    ("plural", "mouse", "mice"),
    ("plural", "child", "children"),
    ("plural", "foot", "feet"),
    ("plural", "tooth", "teeth"),
    ("plural", "man", "men"),
    ("plural", "goose", "geese"),
    ("plural", "person", "people"),
    ("plural", "cat", "cats"),
    ("plural", "leaf", "leaves"),
    ("plural", "wolf", "wolves"),
    ("sound", "cow", "moo"),
    ("sound", "dog", "woof"),
    ("sound", "cat", "meow"),
    ("sound", "duck", "quack"),
    ("sound", "sheep", "baa"),
    ("sound", "pig", "oink"),
    ("sound", "lion", "roar"),
    ("sound", "snake", "hiss"),
    ("sound", "mouse", "squeak"),
    ("sound", "wolf", "howl"),
    ("colour", "the sky", "blue"),
    ("colour", "grass", "green"),
    ("colour", "snow", "white"),
    ("colour", "coal", "black"),
    ("colour", "blood", "red"),
    ("colour", "a banana", "yellow"),
    ("colour", "a carrot", "orange"),
    ("colour", "a leaf", "green"),
    ("colour", "a pig", "pink"),
    ("colour", "chocolate", "brown"),
)

Conversation = list[dict[str, str]]


@dataclass(frozen=True)
class TinyPaths:
    """Where a built tiny bundle lives; every field is an absolute path."""

    root: Path
    model_dir: Path  # model weights, config and tokenizer (load both with `from_pretrained(model_dir)`)
    jsonl_dir: Path  # {train,test}.jsonl, one {"messages": [...]} per line
    disk_dir: Path  # {train,test}/ from `Dataset.save_to_disk`; pass as the recipe's --dataset_name
    parquet_dir: Path  # {train,test}.parquet with a `messages` column
    text_dir: Path  # {train,test}.csv with a `content` column of chat-template-rendered text

    @classmethod
    def under(cls, root: str | os.PathLike[str]) -> TinyPaths:
        """Paths of a bundle rooted at ``root`` (whether or not it has been built)."""
        root_path = Path(root).resolve()
        data = root_path / "data"
        return cls(
            root=root_path,
            model_dir=root_path / "model",
            jsonl_dir=data / "jsonl",
            disk_dir=data / "disk",
            parquet_dir=data / "parquet",
            text_dir=data / "text",
        )


# --------------------------------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------------------------------


def _answer(relation: str, subject: str, answer: str) -> str:
    phrase = RELATION_PHRASES[relation].format(subject=subject)
    return f"{phrase[0].upper()}{phrase[1:]} is {answer}."


def _question(template: str, relation: str, subject: str) -> str:
    phrase = RELATION_PHRASES[relation].format(subject=subject)
    return template.format(phrase=phrase)


def make_conversations(split: str, seed: int = 0) -> list[Conversation]:
    """The conversations of ``split`` ("train" or "test"), in their stored order.

    Train: every fact asked with every train template, shuffled with ``seed``.  Test: every fact asked with the
    held-out template(s), in fact-table order.  A seeded share of rows in both splits opens with a system message.
    """
    if split == "train":
        templates = TRAIN_QUESTION_TEMPLATES
    elif split == "test":
        templates = HELDOUT_QUESTION_TEMPLATES
    else:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    # A private RNG keyed on split and seed, so the two splits do not depend on each other or on global state.
    rng = random.Random(f"sft_recipe.tiny/{split}/{seed}")
    conversations: list[Conversation] = []
    for template in templates:
        for relation, subject, answer in FACTS:
            messages: Conversation = []
            if rng.random() < SYSTEM_PROMPT_FRACTION:
                messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            messages.append({"role": "user", "content": _question(template, relation, subject)})
            messages.append({"role": "assistant", "content": _answer(relation, subject, answer)})
            conversations.append(messages)
    if split == "train":
        rng.shuffle(conversations)
    return conversations


def _tokenizer_training_text(seed: int) -> Iterator[str]:
    """Text the BPE is trained on: every message of both splits and the role headers."""
    # Both splits: the test split differs only in wording, and an unseen word must not fall apart into bytes
    # just because it occurs in the held-out template.
    for split in SPLITS:
        for conversation in make_conversations(split, seed):
            for message in conversation:
                yield message["content"]
    # Each header about as often as it occurs in the rendered train split, so its merges rank accordingly.
    for header in (SYSTEM_HEADER, USER_HEADER, ASSISTANT_HEADER):
        for _ in range(len(FACTS) * len(TRAIN_QUESTION_TEMPLATES)):
            yield header


# --------------------------------------------------------------------------------------------------------------
# Tokenizer and model
# --------------------------------------------------------------------------------------------------------------


def build_tokenizer(seed: int = 0):
    """Train the byte-level BPE and wrap it as a ``PreTrainedTokenizerFast`` with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    # add_prefix_space=False: the first word of a text is not given a leading space, so decode(encode(x)) == x.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so that any text (including the recipe's own markers) can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_tokenizer_training_text(seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        # Llama-2 behaviour: `<s>` is prepended when special tokens are added, `</s>` is not appended.  transformers
        # turns these flags into the post-processor saved in tokenizer.json but does not save the flags themselves,
        # so a reloaded tokenizer reports add_bos_token=False and still prepends `<s>`.
        add_bos_token=True,
        add_eos_token=False,
        model_max_length=1024,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer, *, hidden_size: int = 64, num_hidden_layers: int = 2, seed: int = 0):
    """A seeded random ``LlamaForCausalLM`` (fp32) whose vocabulary matches ``tokenizer`` exactly."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    num_attention_heads = 4
    if hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of {num_attention_heads} attention heads")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        # Grouped-query attention (2 query heads per kv head), as in Llama-2-70B, so LoRA sees k/v
        # projections narrower than q/o.
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,  # Llama-2 base has no pad token; the recipe must cope with that.
        tie_word_embeddings=False,
        dtype="float32",
    )
    # fork_rng: seeding must not leak into the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        # The final RMSNorm makes hidden states unit-RMS, so logit std = std(lm_head) * sqrt(hidden_size).  With the
        # default std 0.02 a 64-wide model's logits stay below ~1.3 whatever the hidden state, so a frozen head
        # caps the loss near ln(vocab) and LoRA can change the argmax but never become confident.  Rescaling
        # only the head gives logits of realistic spread; it is still a seeded random init.
        torch.nn.init.normal_(model.lm_head.weight, mean=0.0, std=LM_HEAD_INIT_LOGIT_STD / hidden_size**0.5)
    model.to(torch.float32)
    model.eval()
    return model


# --------------------------------------------------------------------------------------------------------------
# Writing the bundle
# --------------------------------------------------------------------------------------------------------------


def _write_data(paths: TinyPaths, tokenizer, seed: int) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    for directory in (paths.jsonl_dir, paths.disk_dir, paths.parquet_dir, paths.text_dir):
        directory.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        conversations = make_conversations(split, seed)
        rows = [{"messages": messages} for messages in conversations]

        with open(paths.jsonl_dir / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

        table = pa.Table.from_pylist(rows)
        pq.write_table(table, paths.parquet_dir / f"{split}.parquet")

        # datasets 5 fingerprints an in-memory table by content, so state.json is reproducible as it is.
        datasets.Dataset(table).save_to_disk(str(paths.disk_dir / split))

        with open(paths.text_dir / f"{split}.csv", "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(["content"])
            for messages in conversations:
                writer.writerow([tokenizer.apply_chat_template(messages, tokenize=False)])


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    # A few-second build needs no progress bars; restore the caller's settings afterwards.
    import datasets
    from transformers.utils import logging as hf_logging

    datasets_bars = datasets.is_progress_bar_enabled()
    transformers_bars = hf_logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if datasets_bars:
            datasets.enable_progress_bars()
        if transformers_bars:
            hf_logging.enable_progress_bar()


def _build_into(paths: TinyPaths, *, hidden_size: int, num_hidden_layers: int, seed: int) -> None:
    tokenizer = build_tokenizer(seed)
    model = build_model(tokenizer, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, seed=seed)
    with _quiet_progress_bars():
        model.save_pretrained(str(paths.model_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(paths.model_dir))
        _write_data(paths, tokenizer, seed)


def _stamp(hidden_size: int, num_hidden_layers: int, seed: int) -> dict[str, Any]:
    return {
        "format_version": BUILD_FORMAT_VERSION,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "seed": seed,
    }


def _read_stamp(root: Path) -> dict[str, Any] | None:
    try:
        return json.loads((root / READY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _exclusive_lock(directory: Path) -> Iterator[None]:
    # Several ranks of a torchrun job may call build_tiny at once; the lock makes one build and the rest wait
    # and then find it ready.  Locking the parent directory itself (Linux flock accepts a directory descriptor)
    # leaves no lock file behind in the user's tree.
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _apply_umask_modes(tree: Path) -> None:
    # mkdtemp makes the folder private (0700) and some writers create 0600 files; give the bundle the modes a
    # plain mkdir/open would have, so that it can be shared like any other build output.
    umask = os.umask(0)
    os.umask(umask)
    tree.chmod(0o777 & ~umask)
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o777 & ~umask)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~umask)


def build_tiny(
    output_dir: str | os.PathLike[str],
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    seed: int = 0,
    force: bool = False,
) -> TinyPaths:
    """Build the tiny model, tokenizer and datasets under ``output_dir`` unless an identical build is there.

    The bundle is built in a temporary sibling folder and moved into place with ``os.replace`` only once complete
    (the ``READY`` stamp is its last file), so an interrupted build never leaves a folder that looks ready.
    An existing ``output_dir`` is replaced only if it is empty or is itself a bundle (has ``READY``); any other
    folder is left alone and an error is raised, so a mistyped path cannot wipe unrelated files.
    """
    paths = TinyPaths.under(output_dir)
    root = paths.root
    wanted = _stamp(hidden_size, num_hidden_layers, seed)
    root.parent.mkdir(parents=True, exist_ok=True)

    with _exclusive_lock(root.parent):
        if not force and _read_stamp(root) == wanted:
            return paths
        if root.exists() and any(root.iterdir()) and not (root / READY_FILE).exists():
            raise FileExistsError(f"{root} exists, is not empty and was not built by sft_recipe.tiny; not replacing it")

        # Under the lock no other build is running, so any temp folder left here is from a killed build.
        for stale in glob.glob(str(root.parent / f".{root.name}.tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)

        tmp_root = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
        try:
            _build_into(
                TinyPaths.under(tmp_root), hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, seed=seed
            )
            _apply_umask_modes(tmp_root)
            (tmp_root / READY_FILE).write_text(json.dumps(wanted, sort_keys=True) + "\n", encoding="utf-8")
            if root.exists():
                # os.replace cannot overwrite a non-empty directory: move the old bundle aside first.
                old_root = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-old-", dir=root.parent))
                os.replace(root, old_root / root.name)
                os.replace(tmp_root, root)
                shutil.rmtree(old_root, ignore_errors=True)
            else:
                os.replace(tmp_root, root)
        finally:
            if tmp_root.exists():
                shutil.rmtree(tmp_root, ignore_errors=True)
    return paths


def is_ready(
    output_dir: str | os.PathLike[str], *, hidden_size: int = 64, num_hidden_layers: int = 2, seed: int = 0
) -> bool:
    """Whether ``output_dir`` holds a complete bundle built with these parameters."""
    return _read_stamp(TinyPaths.under(output_dir).root) == _stamp(hidden_size, num_hidden_layers, seed)


# --------------------------------------------------------------------------------------------------------------
# Evaluation helpers
# --------------------------------------------------------------------------------------------------------------


def _as_paths(paths_or_dir: TinyPaths | str | os.PathLike[str]) -> TinyPaths:
    return paths_or_dir if isinstance(paths_or_dir, TinyPaths) else TinyPaths.under(paths_or_dir)


def load_conversations(paths_or_dir: TinyPaths | str | os.PathLike[str], split: str) -> list[Conversation]:
    """The conversations of ``split`` as stored in the bundle's JSONL file."""
    path = _as_paths(paths_or_dir).jsonl_dir / f"{split}.jsonl"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def heldout_conversations(paths_or_dir: TinyPaths | str | os.PathLike[str]) -> list[Conversation]:
    """The test-split conversations: known facts asked with the held-out phrasing."""
    return load_conversations(paths_or_dir, "test")


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


# --------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default=".tiny", help="where to build the bundle (default: .tiny)")
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_hidden_layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if an identical build exists")
    args = parser.parse_args(argv)

    if not args.force and is_ready(
        args.output_dir, hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers, seed=args.seed
    ):
        print(f"{TinyPaths.under(args.output_dir).root} is up to date")
        return 0
    paths = build_tiny(
        args.output_dir,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers,
        seed=args.seed,
        force=args.force,
    )
    print(f"built {paths.root}")
    print(f"  model + tokenizer: {paths.model_dir}")
    print(f"  datasets:          {paths.disk_dir} (save_to_disk), {paths.jsonl_dir}, {paths.parquet_dir}")
    print(f"  rendered text:     {paths.text_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def build_bench_model(root, tiny_dir, hidden_size: int = 1024, num_hidden_layers: int = 8):
    """A seeded random Llama (fp32) whose weights dominate memory, with the tiny tokenizer, saved under `root`
    (what bench/memory_plan.py and bench/throughput.py train). Builds the tiny default in `tiny_dir` if missing."""
    from pathlib import Path

    from transformers import AutoTokenizer

    build_tiny(Path(tiny_dir))  # no-op when already built
    tokenizer = AutoTokenizer.from_pretrained(str(Path(tiny_dir) / "model"))
    model = build_model(tokenizer, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers)
    out = Path(root) / f"llama-{hidden_size}x{num_hidden_layers}"
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out
