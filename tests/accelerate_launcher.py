"""`accelerate launch` for the tests: accelerate's own launcher (the parser and `launch_command` that both
`accelerate launch` and `python -m accelerate.commands.launch` run), in a process that imports it without the cyclic
garbage collector and freezes what the import made, as train.py does with its own imports (sft_recipe/startup.py):
0.36 of the launcher process's 1.53 CPU-s (farm-bench, 7 pairs), about 150 times a suite. What it launches, and how,
is accelerate's; the run_peft*.sh scripts and the README's commands go through the `accelerate` CLI itself.
"""

import gc
import sys

gc.disable()
del sys.path[0]  # this folder (tests/): nothing here is the launcher's to import
import accelerate.commands.launch as accelerate_launch  # noqa: E402

gc.freeze()
gc.enable()

if __name__ == "__main__":
    accelerate_launch.main()
