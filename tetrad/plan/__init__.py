"""The planner: predicted memory, FLOPs and communication of a layout (`tetrad plan`)."""

from tetrad.plan.estimate import Estimate, estimate

__all__ = ["Estimate", "estimate"]
