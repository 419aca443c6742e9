"""Step handlers by name: a registry, the decorator that fills it, and the built-ins.

A step's `handler` is looked up by its registered name first; a name of the form
`package.module:function` is imported on first use.

What a worker offers (and so claims) is its registered names, plus `module:function` for
each public function of the modules it loaded (`JOBPLANE_HANDLERS`): a worker cannot know
in advance which other modules it could import.
"""

import asyncio
import importlib
import inspect
import os
import traceback
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

from jobplane.worker.context import FatalError, RetryableError, StepContext

Handler = Callable[[StepContext], Awaitable[Any]] | Callable[[StepContext], Any]


class HandlerRegistry:
    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self._modules: list[ModuleType] = []

    def register(self, name: str) -> Callable[[Handler], Handler]:
        def decorate(fn: Handler) -> Handler:
            self._handlers[name] = fn
            return fn

        return decorate

    def resolve(self, name: str) -> Handler | None:
        if name in self._handlers:
            return self._handlers[name]
        module, _, attr = name.partition(":")
        if not attr:
            return None
        try:
            fn: Handler = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            return None
        self._handlers[name] = fn
        return fn

    def name_of(self, fn: Handler) -> str:
        """The name a step calls `fn` by: the name it was registered under, else
        `module:function`, which a worker that loads its module offers."""
        for name, registered in self._handlers.items():
            if registered is fn and ":" not in name:
                return name
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if module is None or module == "__main__" or not qualname.isidentifier():
            raise ValueError(
                f"handler {fn!r} has no name a worker can find: register it with "
                "@handler(name), or define it at the top level of an importable module"
            )
        return f"{module}:{qualname}"

    def __contains__(self, name: str) -> bool:
        return self.resolve(name) is not None

    def load(self, modules: list[str]) -> None:
        """Import handler modules (JOBPLANE_HANDLERS): their decorators register their
        handlers, and their functions are offered by `module:function` name. A module that
        does not import is a `HandlerModuleError` saying why in one line."""
        for module in modules:
            try:
                self._modules.append(importlib.import_module(module))
            except ModuleNotFoundError as exc:
                if exc.name and (module + ".").startswith(exc.name + "."):
                    raise HandlerModuleError(
                        f"handler module {module!r} not found: is its folder on PYTHONPATH?"
                    ) from exc
                raise HandlerModuleError(_failure(module, exc)) from exc
            except Exception as exc:
                raise HandlerModuleError(_failure(module, exc)) from exc

    def offered(self) -> list[str]:
        """The handler names this registry offers, sorted."""
        names = set(self._handlers)
        for module in self._modules:
            names.update(
                f"{module.__name__}:{name}"
                for name, fn in vars(module).items()
                if inspect.isfunction(fn)
                and fn.__module__ == module.__name__
                and not name.startswith("_")
            )
        return sorted(names)


registry = HandlerRegistry()
handler = registry.register


class HandlerModuleError(Exception):
    """A handler module that would not import, said in one line: a process refuses to start."""


def load_modules(modules: list[str]) -> None:
    """Import handler modules (JOBPLANE_HANDLERS) into the default registry."""
    registry.load(modules)


# Frames of the import machinery, which say nothing about a module that failed to import.
_IMPORTLIB = ("<frozen ", os.path.dirname(importlib.__file__))


def _failure(module: str, exc: Exception) -> str:
    """The exception and the line that raised it: the innermost frame outside the import
    machinery (a SyntaxError names its line itself)."""
    # The first frame is `load`'s own.
    frames = traceback.extract_tb(exc.__traceback__)[1:]
    ours = [f for f in frames if not f.filename.startswith(_IMPORTLIB)]
    where = f" ({ours[-1].filename}:{ours[-1].lineno})" if ours else ""
    return f"handler module {module!r} failed to import: {type(exc).__name__}: {exc}{where}"


# -- built-ins, so shipped templates work out of the box ------------------------------------------


@handler("builtin.noop")
async def noop(ctx: StepContext) -> None:
    return None


@handler("builtin.sleep")
async def sleep(ctx: StepContext) -> dict[str, float]:
    """Sleep `payload.sleepSeconds` in slices, reporting progress and honouring cancel."""
    total = float(ctx.payload.get("sleepSeconds", 1))
    slice_ = min(0.1, total) or 0.1
    slept = 0.0
    while slept < total:
        ctx.checkpoint()
        await asyncio.sleep(min(slice_, total - slept))
        slept += slice_
        ctx.progress(min(100.0, 100 * slept / total) if total else 100, f"slept {slept:.1f}s")
    return {"sleptSeconds": total}


@handler("builtin.fail")
async def fail(ctx: StepContext) -> None:
    """Fail retryably while `attempt <= payload.failTimes`; fatally when `payload.fatal`."""
    if ctx.payload.get("fatal"):
        raise FatalError("builtin.fail: fatal by request")
    if ctx.attempt <= int(ctx.payload.get("failTimes", 0)):
        raise RetryableError(f"builtin.fail: failing attempt {ctx.attempt}")


@handler("builtin.echo")
async def echo(ctx: StepContext) -> dict[str, Any]:
    return ctx.payload
