"""From a ServeConfig to a running router, with startup problems as one-line errors.

`build_router(cfg)` resolves named models ('tiny' is written, 'smollm2' fetched, once, in
this process, before any worker starts) and builds the colocated LocalBackend or the P/D
router; a model, config or bind problem raises `StartupError`, which the CLI prints as
`pdserve: error: ...` (exit status 2) instead of a traceback.
"""

from __future__ import annotations

import importlib
import inspect

from cluster.config.serve import ServeConfig


class StartupError(Exception):
    """A model, config or bind problem found while starting: `pdserve: error: ...`, exit 2."""


def startup_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the model or configuration is unusable", not a bug: every
    ModelLoadError (a ValueError) / ModelFetchError, a config ValueError, a file that
    cannot be read, an unbindable port."""
    from cluster.http.asgi_server import BindError
    from engine.model_fetch import ModelFetchError

    return (ValueError, OSError, ModelFetchError, BindError)


def resolve_model(cfg: ServeConfig) -> ServeConfig:
    """`cfg` with model.path a directory; the served model name keeps the name the user
    gave ('smollm2', 'tiny')."""
    path = str(cfg.model.resolve_path())
    if path == cfg.model.path:
        return cfg
    values = {"model.path": path}
    if cfg.server.served_model_name is None:
        values["server.served_model_name"] = cfg.model.path
    return cfg.with_values(values)


def launcher_available() -> bool:
    """True when the disaggregated backend (cluster.launch.launcher) can be imported."""
    try:
        importlib.import_module("cluster.launch.launcher")
    except ImportError:
        return False
    return True


async def build_router(cfg: ServeConfig):
    """The colocated LocalBackend, or the P/D router from cluster.launch.launcher.

    A model, config or bind problem raises StartupError with a one-line reason."""
    try:
        return await _build_router(resolve_model(cfg))
    except startup_errors() as e:
        raise StartupError(str(e)) from e


async def _build_router(cfg: ServeConfig):
    if cfg.pools.colocated:
        from cluster.launch.local_backend import LocalBackend

        return LocalBackend.from_config(cfg)
    try:
        from cluster.launch.launcher import build_disaggregated_router
    except ImportError as e:
        raise StartupError(f"the disaggregated backend is unavailable ({e}); serve the "
                           "colocated engine with --colocated") from None
    router = build_disaggregated_router(cfg)
    return await router if inspect.isawaitable(router) else router
