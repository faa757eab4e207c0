"""DPUmesh's host library for Python: Flask handlers build Execution Graphs that the
service's Rust event loop runs from the node's descriptor rings.

High level (inside a route handler served by ``dpumesh.server``)::

    from dpumesh.server import get_context

    ctx = get_context()
    with ctx.parallel():
        ctx.call("GET", "http://user/me", id="user")
        ctx.call("GET", "http://reservation/list", id="reservations")
    ctx.run_internal(merge, inputs=["user", "reservations"])
    return ""

Low level: ``order``, ``pipe``, ``EgressStep``, ``InternalStep`` (``ctx.add(node)``).
"""

from ._native import StepResult
from .context import ExecutionContext, get_context
from .graph import EgressStep, InternalStep, StepRef, order, pipe

__all__ = [
    "EgressStep",
    "ExecutionContext",
    "InternalStep",
    "StepRef",
    "StepResult",
    "get_context",
    "order",
    "pipe",
]
