"""What a model family allows, read from the model class, its config and the libraries' own declarations on the
meta device (sft_recipe/model/reach.py), never from a list of family names. Each refusal comes before any weight
loads, with what works instead:

- no decoder-only causal-LM layout TRL can train: the class holds parameters outside its backbone and output head
  (a BERT-style prediction head, ELECTRA's generator head), which TRL's fused LM head never runs -- and most such
  models are encoders that attend both ways;
- `--gradient_checkpointing True` on a class that declares `supports_gradient_checkpointing = False` (CTRL,
  OpenAI-GPT, JetMoE, ...: transformers raises after the load);
- `--packing True` where the model's sequence-mixing functions fall back on torch code that cannot keep packed
  sequences apart without a kernel package (model/kernels.py: Mamba, hybrids, linear attention);
- a router auxiliary loss coefficient for a model without router logits, and a router loss (TRL computes Mixtral's)
  on a model without routed experts of that kind (`router_loss`: TRL's rule, in one place);
- `--lora_target_modules` naming linears the training forward does not train as plain linears, or that PEFT
  refuses for this model type (all-linear leaves both out, and says so: structure.LoraTargets.note).
"""

from __future__ import annotations

from sft_recipe.model.kernels import packing_kernel_gaps
from sft_recipe.model.reach import (
    gradient_checkpointing_support,
    head_bypassed_modules,
    peft_refused,
    reached_linears,
)
from sft_recipe.model.shape import is_linear
from sft_recipe.model.structure import expert_blocks, parse_target_modules, peft_adapts


def family_problems(model_args, t, model) -> list[str]:
    """The refusals above for `model` (built on the meta device from model_args' config)."""
    name = f"{type(model).__name__} ({model.config.model_type})"
    problems = []
    bypassed = head_bypassed_modules(model)
    if bypassed:
        problems.append(
            f"--model_name_or_path {model_args.model_name_or_path}: {name} has no decoder-only causal-LM layout TRL "
            f"can train: its output head also needs {', '.join(bypassed[:3])}, which TRL's SFTTrainer never runs (it "
            "scores tokens with the output head applied straight to the backbone's last hidden state), so the loss "
            "would not be this model's; most models of this layout (BERT-, ELECTRA-, RoBERTa-style) are encoders "
            "that attend both ways. Fix: fine-tune a decoder-only model (Llama, Qwen, Mistral, Gemma, ...); see "
            "docs/models.md.")
    if getattr(t, "gradient_checkpointing", False) and not gradient_checkpointing_support(model):
        problems.append(
            f"--gradient_checkpointing True: {name} does not support activation checkpointing (its class declares "
            "supports_gradient_checkpointing = False; transformers would raise after the weights load). Fix: "
            "--gradient_checkpointing False (activations then take more memory: see `python -m sft_recipe.plan`).")
    gaps = packing_kernel_gaps(type(model))
    if getattr(t, "packing", False) and gaps:
        functions = sorted(f for fs in gaps.values() for f in fs)
        problems.append(
            f"--packing True: {name} mixes tokens with {', '.join(functions[:4])}, whose torch fallback cannot keep "
            f"packed sequences apart without {' and '.join(sorted(gaps))} (transformers raises mid-step, or lets a "
            "convolution run across documents). Fix: --packing False, or install "
            f"{' '.join(sorted(gaps))} (CUDA kernels) on every machine.")
    problems += _router_loss_problems(t, model, name)
    if model_args.use_peft_lora:
        problems += _named_target_problems(model_args, model)
    return problems


def router_loss(t, text_config) -> tuple[float | None, float, bool]:
    """TRL 1.16's own rule (SFTTrainer.__init__), the one home of it here: (the flag, the coefficient the run uses,
    whether the loss is on). The coefficient is the flag's, else the config's (0 when it declares none); the loss is
    on where the config declares `output_router_logits` and the coefficient is not 0."""
    flag = getattr(t, "router_aux_loss_coef", None)
    coefficient = getattr(text_config, "router_aux_loss_coef", 0.0) if flag is None else flag
    return flag, coefficient, hasattr(text_config, "output_router_logits") and coefficient != 0.0


def _router_loss_problems(t, model, name: str) -> list[str]:
    """Both ways a router auxiliary loss fails: a coefficient given for a config without router logits (TRL refuses
    it once the model has loaded), and a loss TRL computes as Mixtral's (per-layer logits over E routed experts) on
    a model that declares one but holds no routed experts of that kind (Doge's and Flint's product-key experts die
    in it at the first step: "tuple index out of range")."""
    text = model.config.get_text_config()
    flag, coefficient, enabled = router_loss(t, text)
    if flag and not hasattr(text, "output_router_logits"):
        return [f"--router_aux_loss_coef {flag}: {name} is not a mixture-of-experts model with router logits, so "
                "there is no auxiliary loss to weight (TRL 1.16's SFTTrainer refuses it once the model has loaded). "
                "Fix: drop --router_aux_loss_coef."]
    if not enabled or expert_blocks(model):
        return []
    return [f"--router_aux_loss_coef {coefficient}: {name} declares a router auxiliary loss, but holds no routed "
            "experts of the kind TRL's load-balancing loss describes (experts x out x in weights, or a list of expert "
            "MLPs beside a router), and TRL computes that loss for every such config at the first step. Fix: "
            "--router_aux_loss_coef 0 (trains without the balancing term)."]


def _named_target_problems(model_args, model) -> list[str]:
    parsed = parse_target_modules(model_args.lora_target_modules)
    if parsed == "all-linear" or not parsed:
        return []
    # What PEFT will adapt with the list as given (leaf names, full names, patterns), by PEFT's own matching.
    modules = dict(model.named_modules())
    named = sorted(n for n in peft_adapts([x for x in parsed if x != "all-linear"], model)[0]
                   if is_linear(modules[n]))
    problems = []
    reached = reached_linears(model)
    idle = [n for n in named if n not in reached] if reached is not None else []
    if idle:
        problems.append(
            f"--lora_target_modules: {len(idle)} of the linears it names are not trained as plain linears by this "
            f"model's training forward (e.g. {', '.join(idle[:3])}: cross-attention to an encoder it does not have "
            "here, a weight a kernel reads directly, a selection with no gradient, a grouped projection): their LoRA "
            "would stay at zero or not fit. Fix: all-linear (which leaves them out), or name only plain linears the "
            "forward trains.")
    refused = peft_refused(model, named)
    if refused:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in refused})
        problems.append(f"--lora_target_modules: PEFT refuses {leaves} on this model: "
                        f"{next(iter(refused.values()))}. Fix: drop them, or all-linear (which leaves them out).")
    return problems


def token_table_problems(model_args, added_tokens: int, trust_remote_code: bool = False) -> list[str]:
    """Tokens the run adds (a chat format's) grow the embeddings, but not a table the model indexes by token id
    beside them (DeepSeek-V4's hash router `tid2eid`, one row per vocabulary id): the first new id would index past
    its end mid-step. Found on the meta device as any tensor, other than the embeddings, with one row per id. And
    the resize itself, tried on the meta device: a class whose resize fails (xLSTM) is refused here too."""
    from sft_recipe.model.shape import meta_model

    try:
        model = meta_model(model_args.model_name_or_path, trust_remote_code)
    except Exception:  # noqa: BLE001 -- an unbuildable config is refused by validation
        return []
    vocab = model.config.get_text_config().vocab_size
    embeddings = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
                  for p in m.parameters()}  # the resize grows these (an output head's bias too: Phi)
    tables = [n for n, x in [*model.named_parameters(), *model.named_buffers()]
              if x.dim() >= 1 and x.shape[0] == vocab and id(x) not in embeddings]
    if not tables:
        try:  # the resize the load will do, done on the meta device: xLSTM's _init_weights fails in it (5.24)
            model.resize_token_embeddings(vocab + added_tokens, mean_resizing=False)
        except Exception as e:  # noqa: BLE001 -- whatever transformers raises, quoted
            return [f"--chat_template_format {model_args.chat_template_format}: it adds {added_tokens} tokens, and "
                    f"transformers cannot grow {type(model).__name__}'s embeddings for them "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Fix: --chat_template_format "
                    "none (the tokenizer's own template and tokens)."]
        return []
    return [f"--chat_template_format {model_args.chat_template_format}: it adds {added_tokens} tokens, but "
            f"{type(model).__name__} indexes {', '.join(tables[:2])} by token id with one row per id of its "
            f"{vocab}, which growing the embeddings does not grow: the first new id would fail mid-step. Fix: "
            "--chat_template_format none (the tokenizer's own template and tokens)."]
