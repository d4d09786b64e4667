"""A model built by the user's own Python function, named ``package.module:function``.

The function takes no arguments, or ``num_classes`` and/or ``input_shape`` by keyword when its
signature names them, and returns a ``torch.nn.Module`` whose output for one sample of
``input_shape`` is one score per class. The module is imported and the model built and checked
when the spec is made; the spec's builder calls the function again for every model it builds.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from os import PathLike, fspath
from typing import Any

from torch import nn

from edgemesh.common.errors import ModelError
from edgemesh.common.models.probe import output_shape
from edgemesh.common.models.specs import ModelSpec, check_io, standardize

BY_KEYWORD = ("num_classes", "input_shape")
"""Arguments the function is given when its signature names them."""


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


def _resolve(entry_point: str, search_path: Sequence[str | PathLike[str]]) -> Callable[..., Any]:
    where = f"entry point {entry_point!r}"
    module_name, colon, attribute = entry_point.partition(":") if isinstance(entry_point, str) else ("", "", "")
    if not colon or not _is_dotted_name(module_name) or not _is_dotted_name(attribute):
        raise ModelError(f"{where}: expected 'package.module:function'")
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
    if not callable(target):
        raise ModelError(f"{where}: {attribute!r} is a {type(target).__name__}, not callable")
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
                     mean: Sequence[float] = (), std: Sequence[float] = (),
                     search_path: Sequence[str | PathLike[str]] = (), description: str = "") -> ModelSpec:
    """The spec of the model ``entry_point`` builds, imported (``search_path`` first) and checked now.

    ModelError naming the entry point when it is not ``package.module:function``, the module does
    not import, the function is missing or not callable, fails, returns something other than an
    ``nn.Module``, or its model's output for one zero sample is not ``(num_classes,)``. With
    ``mean``/``std`` the model is ``Sequential(input=Standardize(...), net=<the module>)``, or, when the
    module is itself an ``nn.Sequential``, ``Standardize`` followed by its children (names kept).
    """
    shape = check_io(name, input_shape, num_classes)
    first = standardize(name, shape, mean, std)
    function = _resolve(entry_point, search_path)
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
