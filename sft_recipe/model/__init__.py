"""What the recipe knows about a model, read from its config on the meta device (no weight is read): the one room to
look in for "what does the recipe know about my model?".

- `shape.py`: the config (read once per process), the dtype, the model built on the meta device, what a linear is.
- `structure.py`: MoE experts, routers, shared experts, the text decoder, what `all-linear` means for this model.
- `reach.py`: what training runs of a model: the backbone, the linears the loss's gradient reaches, PEFT's refusals.
- `family_rules.py`: what a family allows (router loss, packing kernels, tied embeddings trained...), decided from
  the module structure, never from class or leaf names.
- `architecture.py`: the checks the recipe asks before any weight loads (attention, LoRA targets, tied training,
  the family's rules), and the attention implementation a load uses.
- `kernels.py`: which kernel packages a model's packed-sequence training needs (read from transformers' own decision;
  registered in `compat` too, since it reads a private closure and says when that can go).

The room stands on the ground floor: it imports nothing of the recipe but `errors` (the flags' types only for
annotations), so every other room -- workarounds, settings, data, the plan, training, the checks -- can ask it.
"""
