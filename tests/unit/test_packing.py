"""Packing without cross-contamination: with the recipe's default (`--packing True`, TRL's best-fit packing, which is
padding-free: documents laid end to end with position ids restarting at 0 and no attention mask), every token's loss
equals its loss when its document runs alone. Checked for the SDPA kernel the recipe uses on CPU and for eager
attention; the same documents packed naively (positions running on, plain causal mask) disagree, so the test can
fail."""

import pytest
import torch
import torch.nn.functional as F

TOLERANCE = 1e-4  # fp32 on CPU: the only difference is summation order inside attention (measured ~1e-6)


def _token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Loss of predicting ids[1:] from each prefix (the model's own shift)."""
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="none")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_and_unpacked_losses_agree_per_token(tiny, attention):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    tokenizer = AutoTokenizer.from_pretrained(str(tiny.model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir), attn_implementation=attention).eval()
    texts = ["What is the capital of France? Paris.", "Name a colour of the sky. Blue, on a clear day.",
             "What is the opposite of hot?"]
    docs = [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]

    with torch.no_grad():
        alone = [_token_nll(model(doc[None], use_cache=False).logits[0], doc) for doc in docs]
        batch = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id or 0, padding_free=True)(
            [{"input_ids": doc.tolist()} for doc in docs])
        assert batch["position_ids"][0].tolist() == [i for d in docs for i in range(len(d))]  # restarts per document
        # use_cache=False as the trainer passes it: transformers derives the per-document mask from position_ids only
        # when no KV cache is in play (with a cache, packed documents would silently attend to each other).
        packed_logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                              use_cache=False).logits[0]
        # positions run on, attention crosses documents
        naive_logits = model(input_ids=batch["input_ids"], use_cache=False).logits[0]

    start, naive_gap = 0, 0.0
    for doc, expected in zip(docs, alone):
        span = slice(start, start + len(doc))
        torch.testing.assert_close(_token_nll(packed_logits[span], doc), expected, rtol=0, atol=TOLERANCE)
        naive_gap = max(naive_gap, float((_token_nll(naive_logits[span], doc) - expected).abs().max()))
        start += len(doc)
    assert naive_gap > 100 * TOLERANCE  # later documents see earlier ones when positions are not reset
