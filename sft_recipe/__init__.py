"""The recipe's library: train.py tells the story, these modules do each step (README "Files" maps them)."""

from sft_recipe.logs import quiet_library_notices

quiet_library_notices()  # before anything imports bitsandbytes, DeepSpeed or parses TrainingArguments
