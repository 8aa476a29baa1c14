"""Training: tokenizer, quantization, the base model and its LoRA config (model; GPTQ bases: gptq), what a family
needs from its config -- attention, what all-linear adapts, named experts, tied embeddings (architecture; the
structure itself is read in sft_recipe/model_structure.py) -- TRL's trainer with verified saves and pickle-free
checkpoints (trainer), SIGTERM/SIGUSR1/Ctrl-C at a step end on every rank (preemption), a non-finite loss or gradient
norm stopping every rank (divergence), and the run record with FLOPs and MFU (record, flops)."""
