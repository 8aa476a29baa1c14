"""What a run leaves behind: the adapter, gathered per engine (gather) and written atomically and verified
(adapter), with the generation config that stops at the chat format's end of turn (generation); checkpoints, their
completeness marker and `latest` (checkpoints), pickle-free RNG/optimizer/scheduler state (state_io), file records
and fingerprints (integrity), a resume's base and LoRA shape against the checkpoint's (resume_match), one run per
output_dir (run_hold), and a full disk at a save ending every rank (disk_full)."""
