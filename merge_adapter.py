"""Merge a trained LoRA/DoRA (or QLoRA) adapter into its base model, after training, in one plain process:

    python merge_adapter.py --adapter_dir runs/demo --output_dir runs/demo-merged

The result loads with `AutoModelForCausalLM.from_pretrained("runs/demo-merged")`. Not under `accelerate launch`:
merging inside FSDP is what the upstream guide says fails; this reloads the base unsharded instead.
`python merge_adapter.py --help` lists the options; the logic is in sft_recipe/merge.py.
"""

import sys

from sft_recipe.startup import freeze_imports, prepare_tool_imports

if __name__ == "__main__":  # as train.py: the libraries import without the cyclic collector (sft_recipe/startup.py)
    prepare_tool_imports()

from sft_recipe.merge import main  # noqa: E402  (imports PEFT and transformers)

if __name__ == "__main__":
    freeze_imports()
    sys.exit(main())
