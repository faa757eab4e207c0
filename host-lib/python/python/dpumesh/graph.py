"""The low-level Execution Graph: ``order``, ``pipe``, ``EgressStep``, ``InternalStep``.

The high-level API (:class:`dpumesh.context.ExecutionContext`) builds these; a handler
can also build them itself and add them with ``ctx.add(node)``. Everything a step is
given is checked here, when the graph is built (inside the handler), so a mistake is an
exception naming the step rather than a failed request later. The Rust event loop runs
the graph with the semantics of the Rust library (``dpumesh-host``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

__all__ = [
    "EgressStep",
    "InternalStep",
    "Order",
    "Pipe",
    "StepRef",
    "order",
    "pipe",
    "normalize_request",
    "validate",
]

#: A request as a step sends it: ``(method, url, headers, body)``.
RequestTuple = tuple


class StepRef(str):
    """A scheduled step, as ``ctx.call`` and ``ctx.run_internal`` return it: its id
    (a ``str``), usable in another step's ``inputs``."""

    __slots__ = ()

    @property
    def id(self) -> str:
        return str(self)


def _step_id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{what} must be a non-empty str, got {type(value).__name__}")
    return str(value)


def _input_ids(inputs: Any, step: str) -> tuple:
    if inputs is None:
        return ()
    if isinstance(inputs, str):
        # A single id is a common slip for a list of one: refuse it, a str is iterable.
        raise TypeError(f"step {step!r}: inputs must be a list of step ids, not a str")
    out = []
    for item in inputs:
        if isinstance(item, (EgressStep, InternalStep)):
            item = item.id
        out.append(_step_id(item, f"step {step!r}: an input"))
    return tuple(out)


def _timeout(value: Any, step: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise TypeError(f"step {step!r}: timeout must be a positive number of seconds")
    return float(value)


def _headers(value: Any, where: str) -> list:
    """Headers as a list of ``(name, value)`` str pairs, from a mapping or pairs."""
    if value is None:
        return []
    items: Iterable = value.items() if isinstance(value, Mapping) else value
    out = []
    try:
        for pair in items:
            name, val = pair
            if not isinstance(name, str) or not isinstance(val, str):
                raise TypeError
            out.append((name, val))
    except (TypeError, ValueError):
        raise TypeError(
            f"{where}: headers must be a dict of str to str (or (name, value) pairs)"
        ) from None
    return out


def _body(value: Any, where: str) -> bytes:
    if value is None:
        return b""
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{where}: body must be str, bytes or None, got {type(value).__name__}")


def normalize_request(value: Any, where: str) -> tuple:
    """A request tuple ``(method, url, headers, body)`` in its checked form:
    ``(str, str, [(str, str)], bytes)``. Raises ``TypeError`` naming ``where``."""
    if not isinstance(value, (tuple, list)) or len(value) != 4:
        raise TypeError(
            f"{where}: a request is a (method, url, headers, body) tuple, "
            f"got {type(value).__name__}"
            + (f" of {len(value)}" if isinstance(value, (tuple, list)) else "")
        )
    method, url, headers, body = value
    if not isinstance(method, str) or not method:
        raise TypeError(f"{where}: the method must be a non-empty str")
    if not isinstance(url, str) or not url:
        raise TypeError(f"{where}: the url must be a non-empty str")
    return (method.upper(), url, _headers(headers, where), _body(body, where))


class EgressStep:
    """HTTP calls through the mesh.

    ``requests`` is a list of ``(method, url, headers, body)``; ``request_builder``
    (instead) makes that list when the step starts, from the results of ``inputs``
    (an empty list skips the step; several requests fan out, one after another, or at
    once when ``concurrent``)."""

    _kind = "egress"
    __slots__ = ("id", "requests", "request_builder", "inputs", "timeout", "concurrent")

    def __init__(
        self,
        id: str,
        requests: Optional[Sequence] = None,
        *,
        inputs: Iterable = (),
        request_builder: Optional[Callable[..., Any]] = None,
        timeout: Optional[float] = None,
        concurrent: bool = False,
    ) -> None:
        self.id = _step_id(id, "a step id")
        if request_builder is not None and not callable(request_builder):
            raise TypeError(f"step {self.id!r}: request_builder must be callable")
        if request_builder is None:
            if requests is None or isinstance(requests, (str, bytes)):
                raise TypeError(
                    f"step {self.id!r}: requests must be a list of "
                    "(method, url, headers, body) tuples"
                )
            requests = [
                normalize_request(r, f"step {self.id!r}, request {i}")
                for i, r in enumerate(requests)
            ]
        else:
            requests = []
        self.requests = requests
        self.request_builder = request_builder
        self.inputs = _input_ids(inputs, self.id)
        self.timeout = _timeout(timeout, self.id)
        self.concurrent = bool(concurrent)

    def __repr__(self) -> str:
        return f"EgressStep({self.id!r})"


class InternalStep:
    """A Python function run on the service's thread pool with the results of
    ``inputs`` as keyword arguments named by step id (see the docs for the positional
    fallback). Its return value is the step's output."""

    _kind = "internal"
    __slots__ = ("id", "func", "args", "kwargs", "inputs", "timeout")

    def __init__(
        self,
        id: str,
        func: Callable[..., Any],
        inputs: Iterable = (),
        *,
        args: Sequence = (),
        kwargs: Optional[Mapping[str, Any]] = None,
        timeout: Optional[float] = None,
    ) -> None:
        self.id = _step_id(id, "a step id")
        if not callable(func):
            raise TypeError(f"step {self.id!r}: func must be callable")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"step {self.id!r}: args must be a tuple")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise TypeError(f"step {self.id!r}: kwargs must be a dict")
        self.func = func
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.inputs = _input_ids(inputs, self.id)
        self.timeout = _timeout(timeout, self.id)
        clash = set(self.kwargs) & set(self.inputs)
        if clash:
            raise ValueError(
                f"step {self.id!r}: {sorted(clash)} named both in kwargs and in inputs"
            )

    def __repr__(self) -> str:
        return f"InternalStep({self.id!r})"


Node = Union["Order", "Pipe", EgressStep, InternalStep]


def _nodes(steps: Any, what: str) -> list:
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
        raise TypeError(f"{what} takes a list of steps")
    out = list(steps)
    for s in out:
        if not isinstance(s, (Order, Pipe, EgressStep, InternalStep)):
            raise TypeError(
                f"{what}: {s!r} is not a step (EgressStep, InternalStep, order or pipe)"
            )
    return out


class _Block:
    _kind = ""
    __slots__ = ("steps",)

    def __init__(self, steps: Iterable) -> None:
        self.steps = _nodes(steps, type(self).__name__.lower())

    def __repr__(self) -> str:
        return f"{type(self).__name__.lower()}({self.steps!r})"


class Order(_Block):
    """Steps run one after another; the first failure stops the sequence."""

    _kind = "order"
    __slots__ = ()


class Pipe(_Block):
    """Steps run at the same time; the block fails, naming them, when any failed."""

    _kind = "pipe"
    __slots__ = ()


def order(steps: Iterable) -> Order:
    """Runs ``steps`` in order."""
    return Order(steps)


def pipe(steps: Iterable) -> Pipe:
    """Runs ``steps`` at the same time."""
    return Pipe(steps)


def step_ids(node: Any) -> list:
    """Every step id in ``node``, in order."""
    if isinstance(node, (Order, Pipe)):
        return [i for s in node.steps for i in step_ids(s)]
    return [node.id]


def validate(node: Any, done: set, taken: set) -> None:
    """Checks ``node`` as the Rust library will: ids unique (``taken`` holds those of
    the request so far and gets ``node``'s), and each input a step finished before its
    step starts (``done`` holds those; on return it also holds ``node``'s steps).
    Raises ``ValueError`` naming the step."""
    for sid in step_ids(node):
        if sid in taken:
            raise ValueError(f"step id {sid!r} is used twice in this request")
        taken.add(sid)
    _check(node, done, taken)


def _check(node: Any, done: set, scheduled: set) -> None:
    if isinstance(node, Order):
        for s in node.steps:
            _check(s, done, scheduled)
    elif isinstance(node, Pipe):
        after = []
        for s in node.steps:
            _check(s, set(done), scheduled)
            after.extend(step_ids(s))
        done.update(after)
    else:
        check_inputs(node, done, scheduled)
        done.add(node.id)


def check_inputs(step: Any, done: set, scheduled: set) -> None:
    """Each of ``step``'s inputs is a step in ``done`` (finished before it starts);
    ``scheduled`` (every id so far) tells "later or at the same time" from "unknown"."""
    for i in step.inputs:
        if i not in done:
            why = (
                "runs at the same time (same parallel block) or later"
                if i in scheduled
                else "is not a step scheduled before it"
            )
            raise ValueError(f"step {step.id!r} takes input {i!r}, which {why}")
