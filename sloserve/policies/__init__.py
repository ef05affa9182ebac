"""Speculation policies: SpecServe and the baselines it is measured against (one module
each, its docstring naming the rule it follows), built by name in registry.py."""
