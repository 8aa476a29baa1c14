"""SFTTrainer whose adapter saves, checkpoints included, are gathered, fixed and verified like the final one."""

from __future__ import annotations

from trl import SFTTrainer

from .adapter import save_final_adapter


class RecipeSFTTrainer(SFTTrainer):
    """Routes every save that writes adapter files through `adapter.save_final_adapter`.

    So checkpoints of single-process runs and FULL_STATE_DICT adapter saves are checked like the final adapter.
    SHARDED_STATE_DICT checkpoints write no adapter files and keep the library's path. (FSDP checkpoints with
    FULL_STATE_DICT also go through accelerate's `save_fsdp_model`, which still hits the peft 0.21 naming bug and, on
    CPU, the offload crash: checkpoint/resume under FSDP is not yet covered by this recipe.)
    """

    def __init__(self, *args, verify_adapter: bool = True, **kwargs):
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
        if not self._writes_adapter_files():
            super().save_model(output_dir, _internal_call)
            return
        save_final_adapter(self, output_dir or self.args.output_dir, verify=self.verify_adapter,
                           trust_remote_code=self.args.trust_remote_code)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
