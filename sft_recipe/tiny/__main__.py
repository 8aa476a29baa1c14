"""`python -m sft_recipe.tiny`: the command line of cli.py.

The command lives in cli.py, not here, so that the package can export `main` without importing this module:
runpy warns when the module it is about to run as __main__ was already imported by its package.
"""

from sft_recipe.tiny.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
