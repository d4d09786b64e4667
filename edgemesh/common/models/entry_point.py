"""A model built by the user's own Python function, named ``package.module:function``.

The function takes no arguments, or ``num_classes`` and/or ``input_shape`` by keyword when its
signature names them, and returns a ``torch.nn.Module`` whose output for one sample of
``input_shape`` is one score per class. The module is imported and the model built and checked
when the spec is made; the spec's builder calls the function again for every model it builds.

An entry point runs code, so it is imported only from a module its caller allows (``allowed``: module-name
prefixes on whole dotted components, a host's ``models.allowed``; or :data:`ANY_MODULE` when the user said
``--trust-code``), checked before anything is imported. The function and every class on the way to it are
public names (no ``_``), none of them a module the allow-list leaves out, and the function is defined in an
allowed module: ``acme.models:os.abort`` or a re-exported ``abort`` is refused like ``os:abort``.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from os import PathLike, fspath
from types import ModuleType
from typing import Any, Final, TypeAlias

from torch import nn

from edgemesh.common.errors import ModelError
from edgemesh.common.models.probe import output_shape
from edgemesh.common.models.specs import ModelSpec, check_io, standardize

BY_KEYWORD = ("num_classes", "input_shape")
"""Arguments the function is given when its signature names them."""


class AnyModule:
    """The allow-list of a user who trusts the code a model names, for one command (``--trust-code``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ANY_MODULE"


ANY_MODULE: Final = AnyModule()
Allowed: TypeAlias = Sequence[str] | AnyModule
"""Module-name prefixes an entry point may be imported from (empty: none), or :data:`ANY_MODULE`."""
ALLOW_HINT: Final = ("a job's entry point runs only code that the configuration of the machine building the model "
                     "allows: add the module, or a package above it, to models.allowed in its [models] section")


def module_allowed(module: str, allowed: Allowed) -> bool:
    """Whether ``allowed`` lets ``module`` be imported: one of its prefixes on whole dotted components (``a.b``
    allows ``a.b`` and ``a.b.c``, not ``a.bc`` nor ``a``)."""
    if isinstance(allowed, AnyModule):
        return True
    if isinstance(allowed, str):  # a bare string would allow each of its characters
        raise TypeError(f"allowed must be a sequence of module names, not the string {allowed!r}")
    return any(module == prefix or module.startswith(prefix + ".") for prefix in allowed)


def _listing(allowed: Allowed) -> str:
    names = list(allowed) if not isinstance(allowed, AnyModule) else []
    return ", ".join(repr(n) for n in names) if names else "none"


@contextmanager
def _import_path(search_path: Sequence[str | PathLike[str]]) -> Iterator[None]:
    """``search_path`` ahead of ``sys.path`` for the duration (each entry removed again afterwards)."""
    added = [fspath(p) for p in search_path]
    sys.path[:0] = added
    if added:
        importlib.invalidate_caches()  # the job's directory may have been written just now
    try:
        yield
    finally:
        for entry in added:
            if entry in sys.path:
                sys.path.remove(entry)


def _is_dotted_name(text: str) -> bool:
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def check_allowed(entry_point: str, allowed: Allowed) -> None:
    """ModelError naming ``entry_point`` unless it is ``package.module:function`` of public names in a module
    ``allowed`` allows; nothing is imported."""
    where = f"entry point {entry_point!r}"
    module_name, colon, attribute = entry_point.partition(":") if isinstance(entry_point, str) else ("", "", "")
    if not colon or not _is_dotted_name(module_name) or not _is_dotted_name(attribute):
        raise ModelError(f"{where}: expected 'package.module:function'")
    private = next((part for part in attribute.split(".") if part.startswith("_")), None)
    if private is not None and not isinstance(allowed, AnyModule):
        raise ModelError(f"{where}: {private!r} is a private name; name a public function of the module")
    if not module_allowed(module_name, allowed):
        raise ModelError(f"{where}: module {module_name!r} is not allowed here (models.allowed: "
                         f"{_listing(allowed)}); {ALLOW_HINT}")


def _resolve(entry_point: str, search_path: Sequence[str | PathLike[str]], allowed: Allowed) -> Callable[..., Any]:
    check_allowed(entry_point, allowed)
    where = f"entry point {entry_point!r}"
    module_name, _, attribute = entry_point.partition(":")
    try:
        with _import_path(search_path):
            target: Any = importlib.import_module(module_name)
    except Exception as exc:  # whatever the user's module raises while it imports
        raise ModelError(f"{where}: module {module_name!r} does not import: {exc}") from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ModelError(f"{where}: module {module_name!r} has no attribute {attribute!r}") from None
        if isinstance(target, ModuleType) and not module_allowed(target.__name__, allowed):
            raise ModelError(f"{where}: {part!r} is the module {target.__name__!r}, which is not allowed here "
                             f"(models.allowed: {_listing(allowed)}); {ALLOW_HINT}")
    if not callable(target):
        raise ModelError(f"{where}: {attribute!r} is a {type(target).__name__}, not callable")
    defined_in = getattr(target, "__module__", None)
    if not isinstance(allowed, AnyModule) and not (isinstance(defined_in, str) and module_allowed(defined_in, allowed)):
        raise ModelError(f"{where}: {attribute!r} is defined in module {defined_in!r}, which is not allowed here "
                         f"(models.allowed: {_listing(allowed)}); {ALLOW_HINT}")
    return target


def _arguments(function: Callable[..., Any], input_shape: tuple[int, ...], num_classes: int) -> dict[str, Any]:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins): call it bare
        return {}
    given = {"num_classes": num_classes, "input_shape": input_shape}
    by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {k: given[k] for k in BY_KEYWORD if k in parameters and parameters[k].kind in by_keyword}


def entry_point_spec(name: str, entry_point: str, input_shape: Sequence[int], num_classes: int,
                     mean: Sequence[float] = (), std: Sequence[float] = (), *, allowed: Allowed = (),
                     search_path: Sequence[str | PathLike[str]] = (), description: str = "") -> ModelSpec:
    """The spec of the model ``entry_point`` builds, imported (``search_path`` first) and checked now; only from
    a module ``allowed`` allows (by default none: the caller says whose code may run, :func:`check_allowed`).

    ModelError naming the entry point when it is not ``package.module:function``, its module is not allowed
    (refused before anything is imported), the module does
    not import, the function is missing or not callable, fails, returns something other than an
    ``nn.Module``, or its model's output for one zero sample is not ``(num_classes,)``. With
    ``mean``/``std`` the model is ``Sequential(input=Standardize(...), net=<the module>)``, or, when the
    module is itself an ``nn.Sequential``, ``Standardize`` followed by its children (names kept).
    """
    shape = check_io(name, input_shape, num_classes)
    first = standardize(name, shape, mean, std)
    function = _resolve(entry_point, search_path, allowed)
    kwargs = _arguments(function, shape, num_classes)
    paths = tuple(search_path)
    where = f"entry point {entry_point!r}"

    def build() -> nn.Module:
        try:
            with _import_path(paths):  # the function may import its own helpers when called
                module = function(**kwargs)
        except Exception as exc:  # whatever the user's function raises
            raise ModelError(f"{where}: calling it fails: {type(exc).__name__}: {exc}") from exc
        if not isinstance(module, nn.Module):
            raise ModelError(f"{where}: returns a {type(module).__name__}, not a torch.nn.Module")
        if first is None:
            return module
        if isinstance(module, nn.Sequential) and "input" not in dict(module.named_children()):
            # spliced, not nested: parameters keep the names they have in the user's module, and a
            # sequential model stays one that model parallelism can divide
            return nn.Sequential(OrderedDict([("input", first()), *module.named_children()]))
        return nn.Sequential(OrderedDict([("input", first()), ("net", module)]))

    model = build()
    try:
        out = output_shape(model, shape)
    except Exception as exc:  # whatever the user's forward raises
        raise ModelError(f"{where}: the model rejects a zero sample of shape {(1, *shape)}: {exc}") from exc
    if out != (num_classes,):
        got = "not a tensor" if out is None else f"{out}"
        raise ModelError(f"{where}: the model's output per sample is {got}, but it must be ({num_classes},) "
                         f"for {num_classes} classes")
    return ModelSpec(name=name, input_shape=shape, num_classes=num_classes, builder=build,
                     description=description or f"entry point {entry_point}")
