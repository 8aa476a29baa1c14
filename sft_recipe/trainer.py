"""SFTTrainer with the recipe's guarantees on every save and resume.

- Every save that writes adapter files goes through `adapter.save_final_adapter` (gathered, fixed, verified).
- FSDP1 checkpoints save and load the LoRA weights (peft 0.21's naming bug otherwise saves none and resumes from
  fresh LoRA weights with exit code 0).
- A resume that loads no trainable weights stops the run instead of silently training from scratch.
"""

from __future__ import annotations

import os

from trl import SFTTrainer

from . import compat
from .adapter import save_final_adapter
from .checkpoints import mark_complete


class ResumeError(RuntimeError):
    pass


class RecipeSFTTrainer(SFTTrainer):
    def __init__(self, *args, verify_adapter: bool = True, **kwargs):
        compat.fsdp1_checkpoint_model_io_with_clean_names()
        super().__init__(*args, **kwargs)
        self.verify_adapter = verify_adapter

    def _writes_adapter_files(self) -> bool:
        from peft import PeftModel

        if not isinstance(self.accelerator.unwrap_model(self.model), PeftModel):
            return False
        if not self.is_fsdp_enabled:
            return True
        return "FULL_STATE_DICT" in str(self.accelerator.state.fsdp_plugin.state_dict_type)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Adapter saves (single process, or FSDP FULL_STATE_DICT) are checked like the final adapter."""
        if not self._writes_adapter_files():
            super().save_model(output_dir, _internal_call)
            return
        save_final_adapter(self, output_dir or self.args.output_dir, verify=self.verify_adapter,
                           trust_remote_code=self.args.trust_remote_code)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_checkpoint(self, model, trial):
        """Mark the checkpoint complete once every rank has written it (resume skips unmarked ones)."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        super()._save_checkpoint(model, trial)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            mark_complete(folder, self.state.global_step)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        from .report import trainable_checksum

        target = model if model is not None else self.model
        before = trainable_checksum(self.accelerator, target)
        result = super()._load_from_checkpoint(resume_from_checkpoint, model)
        if trainable_checksum(self.accelerator, target) == before:
            raise ResumeError(
                f"resuming from {resume_from_checkpoint} loaded no trainable weights: training would silently "
                "restart from fresh LoRA weights. The checkpoint may come from another model/adapter config, or "
                "was written without its adapter weights.")
        return result

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if plugin is not None and plugin.fsdp_version == 1:
            compat.init_optimizer_state_before_fsdp1_load(self.optimizer)
        super()._load_optimizer_and_scheduler(checkpoint)
        if not any(self.optimizer.state.values()):
            raise ResumeError(f"resuming from {checkpoint} restored no optimizer state: training would continue "
                              "with fresh Adam moments and diverge from the interrupted run.")
