"""The high-level API: ``get_context()`` inside a Flask handler gives the request's
:class:`ExecutionContext`; the handler schedules steps on it and returns ``""``; the
server runs the graph and answers with its result.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

from .graph import (
    EgressStep,
    InternalStep,
    Order,
    Pipe,
    StepRef,
    check_inputs,
    step_ids,
    validate,
)

__all__ = ["ExecutionContext", "get_context"]

_local = threading.local()
#: Set while a dpumesh server runs in this process (``get_context`` outside a handler
#: is then a mistake, not "not on the mesh").
_serving = threading.Event()
#: Why ``get_context`` has no context for this process's handlers, if it never has
#: one (an ASGI app served concurrently: it answers by itself).
_no_graphs: Optional[str] = None


class _Frame:
    __slots__ = ("kind", "nodes", "ids")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.nodes: list = []
        self.ids: list = []


class ExecutionContext:
    """One request's graph under construction.

    Steps scheduled one after another run in that order (the first failure stops the
    sequence); steps scheduled inside ``with ctx.parallel():`` run at the same time.
    The request is answered with the result of the last step."""

    def __init__(self) -> None:
        self._stack = [_Frame("order")]
        self._taken: set = set()
        self._next = 0
        self.used = False

    # -- scheduling -----------------------------------------------------------------

    def call(
        self,
        method: str,
        url: str,
        *,
        headers: Optional[Mapping[str, str]] = None,
        body: Any = None,
        inputs: Iterable = (),
        request_builder: Optional[Callable[..., Any]] = None,
        id: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> StepRef:
        """Schedules an HTTP call to another service (``http://service/path``).

        With ``request_builder`` the call's requests are made when the step starts,
        from the results of ``inputs`` (the ``url`` given here is then ignored): ``[]``
        skips the step, several tuples fan out (at once inside ``parallel``)."""
        sid = self._new_id(id)
        requests = None if request_builder is not None else [(method, url, headers, body)]
        step = EgressStep(
            sid,
            requests,
            inputs=inputs,
            request_builder=request_builder,
            timeout=timeout,
            concurrent=self._in_parallel(),
        )
        return self._push(step)

    def run_internal(
        self,
        func: Callable[..., Any],
        *,
        args: Iterable = (),
        kwargs: Optional[Mapping[str, Any]] = None,
        inputs: Iterable = (),
        id: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> StepRef:
        """Schedules ``func(*args, **kwargs, **inputs)`` on the thread pool; its return
        value is the step's output (``str``, ``bytes``, a ``dict``/``list`` sent as JSON,
        ``None``, or a ``(body, status[, headers])`` tuple)."""
        sid = self._new_id(id)
        args = tuple(args) if not isinstance(args, tuple) else args
        step = InternalStep(sid, func, inputs, args=args, kwargs=kwargs, timeout=timeout)
        return self._push(step)

    @contextlib.contextmanager
    def parallel(self) -> Iterator["ExecutionContext"]:
        """Steps scheduled inside the block run at the same time."""
        with self._block("pipe"):
            yield self

    @contextlib.contextmanager
    def sequence(self) -> Iterator["ExecutionContext"]:
        """Steps scheduled inside the block run one after another (useful inside a
        parallel block)."""
        with self._block("order"):
            yield self

    def add(self, node: Any) -> None:
        """Adds a low-level node (``order``, ``pipe``, ``EgressStep``,
        ``InternalStep``) to the current block."""
        if not isinstance(node, (Order, Pipe, EgressStep, InternalStep)):
            raise TypeError(f"{node!r} is not a step (EgressStep, InternalStep, order or pipe)")
        frame = self._stack[-1]
        if isinstance(node, (Order, Pipe)):
            validate(node, self._visible(), self._taken)
            frame.ids.extend(step_ids(node))
        else:
            # One step (the high-level calls): the same checks without walking a tree.
            if node.id in self._taken:
                raise ValueError(f"step id {node.id!r} is used twice in this request")
            if node.inputs:
                check_inputs(node, self._visible(), self._taken)
            self._taken.add(node.id)
            frame.ids.append(node.id)
        self.used = True
        frame.nodes.append(node)

    # -- internals ------------------------------------------------------------------

    def _in_parallel(self) -> bool:
        return self._stack[-1].kind == "pipe"

    def _new_id(self, id: Optional[str]) -> str:
        if id is not None:
            if isinstance(id, StepRef):
                id = str(id)
            if not isinstance(id, str) or not id:
                raise TypeError("id must be a non-empty str")
            return id
        while True:
            generated = f"step-{self._next}"
            self._next += 1
            if generated not in self._taken:
                return generated

    def _visible(self) -> set:
        # Steps of enclosing sequences are finished before a new step starts; members
        # of an enclosing parallel block run at the same time as it.
        visible: set = set()
        for frame in self._stack:
            if frame.kind == "order":
                visible.update(frame.ids)
        return visible

    def _push(self, step: Any) -> StepRef:
        self.add(step)
        return StepRef(step.id)

    @contextlib.contextmanager
    def _block(self, kind: str) -> Iterator[None]:
        frame = _Frame(kind)
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            if frame.nodes:
                node = Pipe(frame.nodes) if kind == "pipe" else Order(frame.nodes)
                parent = self._stack[-1]
                parent.nodes.append(node)
                parent.ids.extend(frame.ids)

    def graph(self) -> list:
        """The top-level sequence's nodes (blocks still open are closed)."""
        while len(self._stack) > 1:
            frame = self._stack.pop()
            if frame.nodes:
                node = Pipe(frame.nodes) if frame.kind == "pipe" else Order(frame.nodes)
                self._stack[-1].nodes.append(node)
                self._stack[-1].ids.extend(frame.ids)
        return self._stack[0].nodes


def get_context() -> Optional[ExecutionContext]:
    """The current request's context, inside a route handler served by
    ``dpumesh.server``. ``None`` when the app is not served by dpumesh (plain Flask,
    tests), so ``if ctx is not None:`` keeps one handler working in both."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None and _no_graphs is not None:
        raise RuntimeError(_no_graphs)
    if ctx is None and _serving.is_set():
        raise RuntimeError(
            "dpumesh.server.get_context() was called outside a request handler "
            "(call it inside a route function while the request is being handled)"
        )
    return ctx


@contextlib.contextmanager
def current(ctx: ExecutionContext) -> Iterator[None]:
    """Makes ``ctx`` the one ``get_context()`` returns on this thread."""
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield
    finally:
        _local.ctx = previous
