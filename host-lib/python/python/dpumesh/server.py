"""Serves a WSGI app (Flask) on the mesh: ``python -m dpumesh.server app:app``, or an
ASGI app (FastAPI, Starlette): ``python -m dpumesh.server --asgi app:app``.

The service registers with its node over the control channel (``DPUMESH_CONTROL``,
set by ``dpumesh up`` or the pod spec) and serves requests from its RX ring on the
Rust event loop; ``get_context()`` inside a handler gives the request's graph.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Any, Callable, Optional

from . import _native
from .context import _serving, get_context
from .asgi_serve import ConcurrentDispatcher
from .wsgi import Dispatcher

__all__ = ["get_context", "run", "main"]


def run(
    app: Callable[..., Any],
    *,
    service: Optional[str] = None,
    pod: Optional[str] = None,
    control: Optional[str] = None,
    threads: Optional[int] = None,
    asgi: bool = False,
) -> None:
    """Registers with the node and serves ``app`` (an ASGI app with ``asgi``: its
    lifespan runs around the serving) until interrupted.

    ``service``, ``pod`` and ``control`` default to ``DPUMESH_SERVICE``,
    ``DPUMESH_POD`` and ``DPUMESH_CONTROL``; ``threads`` (internal steps' pool) to
    ``DPUMESH_THREADS`` or 2."""
    control = control or os.environ.get("DPUMESH_CONTROL")
    if not control:
        raise RuntimeError(
            "DPUMESH_CONTROL (the node's control socket) is not set: start the service "
            "with `dpumesh up`, or pass control="
        )
    service = service or os.environ.get("DPUMESH_SERVICE")
    if not service:
        raise RuntimeError("DPUMESH_SERVICE (the service's name in the mesh) is not set")
    pod = pod or os.environ.get("DPUMESH_POD") or f"{service}-{os.getpid()}"
    if threads is None:
        threads = int(os.environ.get("DPUMESH_THREADS", "2"))
    dispatcher = ConcurrentDispatcher(app, service) if asgi else Dispatcher(app, service)
    _serving.set()
    try:
        if asgi:
            # One asyncio loop serves every request concurrently and drives the
            # service's event loop (dpumesh.asgi_serve); SIGINT/SIGTERM end it.
            dispatcher.serve(control, pod, service)
        else:
            _native.serve(dispatcher, control, pod, service, threads)
    finally:
        _serving.clear()
        if asgi:
            dispatcher.close()


def load(spec: str, app_dir: Optional[str] = None, kind: str = "WSGI") -> Callable[..., Any]:
    """``module:attribute`` (``module`` alone means ``module:app``), as gunicorn, imported
    from ``app_dir`` (default: the current directory)."""
    module_name, _, attribute = spec.partition(":")
    directory = os.path.abspath(app_dir or os.getcwd())
    if directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(f"dpumesh.server: cannot import {module_name!r} from {directory}: {e}") from None
    attribute = attribute or "app"
    try:
        app = getattr(module, attribute)
    except AttributeError:
        raise SystemExit(f"dpumesh.server: {module_name} has no {attribute!r}") from None
    if not callable(app):
        raise SystemExit(f"dpumesh.server: {spec} is not a {kind} app")
    return app


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dpumesh.server",
        description="Serve a WSGI app (Flask), or with --asgi an ASGI app (FastAPI), on the mesh.",
    )
    parser.add_argument("app", help="module:attribute of the app (e.g. app:app)")
    parser.add_argument("--asgi", action="store_true", help="the app is ASGI (FastAPI, Starlette)")
    parser.add_argument("--service", help="service name (default: $DPUMESH_SERVICE)")
    parser.add_argument("--pod", help="pod name (default: $DPUMESH_POD or service-pid)")
    parser.add_argument("--control", help="the node's control socket (default: $DPUMESH_CONTROL)")
    parser.add_argument("--threads", type=int, help="threads for internal steps (default 2)")
    parser.add_argument("--app-dir", help="import the app from this folder (default: the current one)")
    args = parser.parse_args(argv)
    # DPUMESH_LOG is a Rust filter (`warn`, `dpumesh=debug`): its plain levels apply.
    level = os.environ.get("DPUMESH_LOG", "warning").upper()
    logging.basicConfig(
        level=level if level in ("DEBUG", "INFO", "WARN", "WARNING", "ERROR") else "WARNING",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    app = load(args.app, args.app_dir, "ASGI" if args.asgi else "WSGI")
    try:
        run(
            app,
            service=args.service,
            pod=args.pod,
            control=args.control,
            threads=args.threads,
            asgi=args.asgi,
        )
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        raise SystemExit(f"dpumesh.server: {e}") from None


if __name__ == "__main__":
    main()
