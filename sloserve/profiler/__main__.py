"""`python -m sloserve.profiler`, as documented: runs sloserve/cli/profile.py, the
command's home on the top floor. It runs the module by name so that this package imports
nothing above it (the top floor imports this package)."""

import runpy

runpy.run_module("sloserve.cli.profile", run_name="__main__", alter_sys=True)
