"""Training: the model and its LoRA config (model, gptq), the trainer and its checkpoint overrides (trainer),
preemption, and the run record (record, flops)."""
