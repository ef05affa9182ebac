"""`python -m sloserve.replay`, as documented: runs sloserve/cli/replay.py, the
command's home on the top floor. It runs the module by name so that this package imports
nothing above it (the top floor imports this package)."""

import runpy

runpy.run_module("sloserve.cli.replay", run_name="__main__", alter_sys=True)
