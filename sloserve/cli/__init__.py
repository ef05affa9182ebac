"""The top floor: command-line tools and drivers (the SGLang launcher, the profilers, trace
replay and its sweeps, the simulator's fidelity check). They import any package below;
nothing below imports them (pyproject.toml's import contracts). The `python -m` names of
README stay: sloserve/launch.py and train_draft.py are top-floor modules themselves, and the
old names inside library packages are shims that run these modules by name."""
