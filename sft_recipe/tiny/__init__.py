"""Embedded, offline default for the SFT recipe: a tiny random Llama, a tokenizer and a learnable chat dataset.

The upstream recipe (PEFT ``examples/sft``) expects a Hub model such as Llama-2-70B and a Hub chat dataset.
Neither can be downloaded here, so this package builds small stand-ins that exercise the same code paths:

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
``sft_recipe.scoring.score_answers`` measures the held-out answers.  A LoRA adapter (r=8, alpha=16, all linear
layers) on the frozen random base learns the task in about 200 optimizer steps of ~32 conversations each at a
constant lr of 5e-3 (held-out exact match 0 -> 0.2-0.8 depending on the seed, answer-token accuracy 0 -> 0.83-0.98);
with 8 conversations per step it needs about 400-600 steps.

Usage::

    python -m sft_recipe.tiny --output_dir .tiny            # build once; later calls are no-ops
    python -m sft_recipe.tiny --output_dir .tiny --force    # rebuild

Modules: ``facts`` (the task and its conversations), ``build`` (tokenizer and model), ``store`` (the bundle on disk:
layout, writers, stamp, lock), ``bench_model`` (a bigger model for the benchmarks), ``cli`` (the command above).
This package is the demo: it may use the library, the library never imports it.
"""

from sft_recipe.tiny.bench_model import build_bench_model
from sft_recipe.tiny.build import (
    ASSISTANT_HEADER,
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    LM_HEAD_INIT_LOGIT_STD,
    SPECIAL_TOKENS,
    SYSTEM_HEADER,
    TOKENIZER_VOCAB_SIZE,
    UNK_TOKEN,
    USER_HEADER,
    build_model,
    build_tokenizer,
)
from sft_recipe.tiny.cli import main
from sft_recipe.tiny.facts import (
    FACTS,
    HELDOUT_QUESTION_TEMPLATES,
    RELATION_PHRASES,
    SPLITS,
    SYSTEM_PROMPT_FRACTION,
    SYSTEM_PROMPTS,
    TRAIN_QUESTION_TEMPLATES,
    Conversation,
    make_conversations,
)
from sft_recipe.tiny.store import (
    BUILD_FORMAT_VERSION,
    READY_FILE,
    TinyPaths,
    build_tiny,
    heldout_conversations,
    is_ready,
    load_conversations,
)

__all__ = [
    "ASSISTANT_HEADER", "BOS_TOKEN", "BUILD_FORMAT_VERSION", "CHAT_TEMPLATE", "Conversation", "EOS_TOKEN", "FACTS",
    "HELDOUT_QUESTION_TEMPLATES", "LM_HEAD_INIT_LOGIT_STD", "READY_FILE", "RELATION_PHRASES", "SPECIAL_TOKENS",
    "SPLITS", "SYSTEM_HEADER", "SYSTEM_PROMPTS", "SYSTEM_PROMPT_FRACTION", "TOKENIZER_VOCAB_SIZE",
    "TRAIN_QUESTION_TEMPLATES", "TinyPaths", "UNK_TOKEN", "USER_HEADER", "build_bench_model", "build_model",
    "build_tiny", "build_tokenizer", "heldout_conversations", "is_ready", "load_conversations", "main",
    "make_conversations",
]
