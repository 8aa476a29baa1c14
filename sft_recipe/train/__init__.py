"""Training: tokenizer, quantization, the base model and its LoRA config (model; GPTQ bases: gptq; what a family
needs from its config is sft_recipe/model/'s), TRL's trainer with verified saves and pickle-free checkpoints
(trainer), a resume that follows changed settings (resume_settings), SIGTERM/SIGUSR1/SIGHUP/Ctrl-C at a step end on
every rank (preemption), a non-finite loss or gradient norm stopping every rank (divergence), a rank lost mid-run said
in one line (lost_rank), and the run record with FLOPs and MFU (record, flops)."""
