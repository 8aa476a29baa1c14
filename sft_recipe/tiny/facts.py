"""The demo's task: 40 facts asked as chats, six question phrasings for training and a seventh held out for testing.

Changing anything here changes the built bytes: bump ``BUILD_FORMAT_VERSION`` in ``store.py`` with it.
"""

from __future__ import annotations

import random

from sft_recipe.scoring import Conversation

SPLITS = ("train", "test")

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
