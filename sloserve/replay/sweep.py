"""`python -m sloserve.replay.sweep`, as documented: runs sloserve/cli/sweep.py, the
command's home on the top floor. It runs the module by name so that this package imports
nothing above it (the top floor imports this package)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("sloserve.cli.sweep", run_name="__main__", alter_sys=True)
