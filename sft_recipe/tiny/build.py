"""The demo's tokenizer and model: a byte-level BPE trained on the task's text, and a seeded random Llama.

Changing anything here changes the built bytes: bump ``BUILD_FORMAT_VERSION`` in ``store.py`` with it.
"""

from __future__ import annotations

from collections.abc import Iterator

from sft_recipe.tiny.facts import FACTS, SPLITS, TRAIN_QUESTION_TEMPLATES, make_conversations

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
