"""What the Rust event loop calls back into: an internal step's function and a request
builder, with the results of their inputs, and the conversion of what they return.

An exception here fails the step: the Rust side turns it into the step's error
(``"TypeError: ..."``), which propagates as the seed's error semantics say.
"""

from __future__ import annotations

import inspect
import json
import logging
import types
from typing import Any, Callable

from ._native import StepResult
from .graph import normalize_request

log = logging.getLogger("dpumesh")

_VAR_KEYWORDS = inspect.CO_VARKEYWORDS


def _keywords(func: Callable[..., Any]) -> tuple:
    """The names ``func`` takes by keyword, and whether it takes ``**kwargs``."""
    target = func.__func__ if isinstance(func, types.MethodType) else func
    code = getattr(target, "__code__", None)
    if isinstance(target, types.FunctionType) and code is not None:
        # The code object answers without building a Signature (a few µs per call).
        first = code.co_posonlyargcount
        last = code.co_argcount + code.co_kwonlyargcount
        return frozenset(code.co_varnames[first:last]), bool(code.co_flags & _VAR_KEYWORDS)
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return frozenset(), True
    names = frozenset(
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def call_with_inputs(func: Callable[..., Any], args: tuple, kwargs: dict, inputs: dict) -> Any:
    """``func(*args, **kwargs)`` with each input as a keyword argument named by its step
    id; an input whose id ``func`` does not take by keyword (no such parameter, no
    ``**kwargs``) is passed positionally after ``args``, in ``inputs`` order — so
    ``def f(user_step)`` with ``inputs=["get_user"]`` works, as in the seed's example."""
    if not inputs:
        return func(*args, **kwargs)
    names, any_keyword = _keywords(func)
    keyword = dict(kwargs)
    positional = list(args)
    for step_id, result in inputs.items():
        if any_keyword or step_id in names:
            keyword[step_id] = result
        else:
            positional.append(result)
    return func(*positional, **keyword)


def run_internal(step: str, func: Callable[..., Any], args: tuple, kwargs: dict, inputs: dict) -> tuple:
    """Runs an internal step: ``(status or None, [(name, value)], body bytes)``."""
    try:
        value = call_with_inputs(func, args, kwargs, inputs)
    except Exception:
        log.warning("internal step %r raised", step, exc_info=True)
        raise
    return output(value, f"internal step {step!r}")


def build_requests(step: str, builder: Callable[..., Any], inputs: dict) -> list:
    """Runs a request builder: a list of checked ``(method, url, headers, body)``."""
    where = f"request_builder of step {step!r}"
    try:
        value = call_with_inputs(builder, (), {}, inputs)
    except Exception:
        log.warning("%s raised", where, exc_info=True)
        raise
    single = isinstance(value, tuple) and len(value) == 4 and isinstance(value[0], str)
    if single or not isinstance(value, (list, tuple)):
        hint = " (wrap the one request in a list)" if single else ""
        raise TypeError(
            f"{where} returned {type(value).__name__}; it must return a list of "
            f"(method, url, headers, body) tuples ([] skips the step){hint}"
        )
    return [normalize_request(r, f"{where}, request {i}") for i, r in enumerate(value)]


_JSON = [("content-type", "application/json")]
_TEXT = [("content-type", "text/plain; charset=utf-8")]


def _response_like(value: Any) -> bool:
    return hasattr(value, "status_code") and hasattr(value, "get_data") and hasattr(value, "headers")


def output(value: Any, where: str) -> tuple:
    """A step's return value as ``(status or None, headers, body)``.

    ``None`` → empty; ``str`` → UTF-8 text; ``bytes`` → as is; ``dict``/``list`` → JSON;
    a ``StepResult`` or a Werkzeug/Flask ``Response`` → its status, headers, body;
    ``(body, status)``, ``(body, headers)`` or ``(body, status, headers)`` as in Flask."""
    if value is None:
        return (None, [], b"")
    if isinstance(value, str):
        return (None, _TEXT, value.encode("utf-8"))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return (None, [], bytes(value))
    if isinstance(value, (dict, list)):
        try:
            return (None, _JSON, json.dumps(value).encode("utf-8"))
        except (TypeError, ValueError) as e:
            raise TypeError(f"{where} returned a {type(value).__name__} that is not JSON: {e}") from None
    if isinstance(value, StepResult):
        return (value.status_code, list(value.headers.items()), value.content)
    if _response_like(value):
        return (int(value.status_code), list(value.headers.items()), value.get_data())
    if isinstance(value, tuple) and 2 <= len(value) <= 3:
        body, rest = value[0], value[1:]
        status, headers = None, []
        for part in rest:
            if isinstance(part, int) and not isinstance(part, bool) and status is None:
                status = part
            elif isinstance(part, (dict, list)) and not headers:
                headers = list(part.items()) if isinstance(part, dict) else list(part)
            else:
                raise TypeError(
                    f"{where} returned a tuple whose {type(part).__name__} is neither a "
                    "status (int) nor headers (dict)"
                )
        if status is not None and not 100 <= status <= 999:
            raise TypeError(f"{where} returned status {status}")
        inner_status, inner_headers, data = output(body, where)
        return (status if status is not None else inner_status, inner_headers + headers, data)
    raise TypeError(
        f"{where} returned {type(value).__name__}; return str, bytes, a dict or list "
        "(sent as JSON), None, a StepResult, or a (body, status[, headers]) tuple"
    )
