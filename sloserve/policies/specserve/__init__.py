"""SpecServe (SpecServe paper; docs/design.md sec. 5): the policy (policy.py) and its plans."""

from sloserve.policies.specserve.options import SpecServeOptions
from sloserve.policies.specserve.policy import SpecServePolicy

__all__ = ["SpecServeOptions", "SpecServePolicy"]
