"""The two Lightning namespaces: ``pytorch_lightning`` and ``lightning.pytorch`` (``import lightning as L``).

They are two copies of the same code with separate class hierarchies: ``L.Trainer`` accepts only
``lightning.pytorch`` strategies, modules and callbacks, ``pytorch_lightning.Trainer`` only its
own. The package defines each Lightning-derived class once, as *logic* (a class without a
Lightning base) plus the Lightning base it extends in ``pytorch_lightning``:

    class GPipeStrategy(_GPipeStrategyLogic, pytorch_lightning.strategies.ParallelStrategy): ...

:func:`specialize` builds the same class over the other namespace's base
(``lightning.pytorch.strategies.ParallelStrategy``), once, from the same logic: no copied code.
Every Lightning call the class makes (``super()``, Lightning's own ``isinstance`` checks on
modules, optimizers, callbacks and precision plugins) then runs in the Trainer's namespace.

A strategy instance is built before it meets a Trainer. Each namespace's class is registered as a
virtual subclass of the other's (:func:`register_twins`), so either Trainer accepts it; when the
Trainer's connector hands it its accelerator (the first thing it sets), the instance adopts the
class of the Trainer's namespace (:func:`adopt`).
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from typing import Any

PYTORCH_LIGHTNING = "pytorch_lightning"
LIGHTNING = "lightning"

# namespace -> (Trainer package, Fabric package)
_PACKAGES = {
    PYTORCH_LIGHTNING: ("pytorch_lightning", "lightning_fabric"),
    LIGHTNING: ("lightning.pytorch", "lightning.fabric"),
}


def register_names(cls: Any, strategy_registry: Any) -> None:
    """Register ``cls`` in Lightning's strategy registry as ``"gpipe"`` and ``"gpipe_notebook"`` (ranks
    forked: Jupyter, ``python -i``), unless the names are taken."""
    if "gpipe" not in strategy_registry:
        description = "GPipe pipeline parallelism (lightning_gpipe)"
        strategy_registry.register("gpipe", cls, description=description)
    if "gpipe_notebook" not in strategy_registry:
        description = "GPipe pipeline parallelism, ranks forked (Jupyter, python -i)"
        strategy_registry.register("gpipe_notebook", cls, description=description, start_method="fork")


def installed() -> list[str]:
    """The namespaces importable here, ``"pytorch_lightning"`` first (the package's dependency)."""
    return [PYTORCH_LIGHTNING] + ([LIGHTNING] if importlib.util.find_spec("lightning") is not None else [])


def namespace_of(obj: Any) -> str | None:
    """The namespace of a Lightning object (Trainer, accelerator, module, callback), or ``None``."""
    for klass in type(obj).__mro__:
        module = klass.__module__
        if module.startswith(("lightning.pytorch", "lightning.fabric")):
            return LIGHTNING
        if module.startswith(("pytorch_lightning", "lightning_fabric")):
            return PYTORCH_LIGHTNING
    return None


def translate(module: str, namespace: str) -> str:
    """A module path of ``pytorch_lightning``/``lightning_fabric`` in ``namespace``."""
    for src, dst in zip(_PACKAGES[PYTORCH_LIGHTNING], _PACKAGES[namespace]):
        if module == src or module.startswith(src + "."):
            return dst + module[len(src) :]
    return module


def lightning_class(klass: type, namespace: str) -> type:
    """The class ``klass`` (of ``pytorch_lightning``/``lightning_fabric``) in ``namespace``."""
    module = importlib.import_module(translate(klass.__module__, namespace))
    found = module
    for part in klass.__qualname__.split("."):
        found = getattr(found, part)
    assert isinstance(found, type)
    return found


@cache
def specialize(cls: type, namespace: str) -> type:
    """``cls`` (``class C(Logic, LightningBase)``, defined over ``pytorch_lightning``) over
    ``namespace``'s base.

    Returns ``cls`` itself for ``"pytorch_lightning"``; otherwise a class of the same name and
    logic whose Lightning base is the namespace's copy of ``LightningBase``, with ``namespace``
    set. Built once per namespace.

    Raises:
        TypeError: ``cls`` is not built as ``(Logic, LightningBase)`` (e.g. a user subclass).
    """
    if len(cls.__bases__) != 2 or cls.__dict__.get("namespace") is None:
        raise TypeError(
            f"{cls.__qualname__} cannot be moved to the {namespace!r} namespace (it is not a "
            "lightning_gpipe class "
            f"built from logic and a Lightning base); subclass lightning_gpipe.strategy_class({namespace!r}) "
            "to customise the strategy for that namespace"
        )
    cls = _pytorch_lightning_class(cls)
    if namespace == PYTORCH_LIGHTNING:
        return cls
    logic, base = cls.__bases__
    attrs = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "namespace": namespace,
    }
    return type(cls.__name__, (logic, lightning_class(base, namespace)), attrs)


def register_twins(cls: type) -> None:
    """Let every installed namespace's Trainer accept an instance of ``cls`` or of its copies.

    ``cls`` (the ``pytorch_lightning`` class) becomes a virtual subclass of each other
    namespace's Lightning base, and each copy a virtual subclass of ``cls``, so
    ``isinstance(strategy, GPipeStrategy)`` holds whichever namespace the instance has adopted.
    """
    cls = _pytorch_lightning_class(cls)
    _, base = cls.__bases__
    for namespace in installed():
        if namespace != PYTORCH_LIGHTNING:
            copy = specialize(cls, namespace)
            lightning_class(base, namespace).register(cls)  # type: ignore[attr-defined]
            cls.register(copy)  # type: ignore[attr-defined]


def adopt(obj: Any, namespace: str | None) -> None:
    """Give ``obj`` (an instance of a class built by :func:`specialize`) the class of ``namespace``.

    Both classes have the same logic and attribute layout; only the Lightning base differs.
    """
    if namespace is None or getattr(obj, "namespace", namespace) == namespace:
        return
    cls = type(obj)
    root = next((c for c in cls.__mro__ if "namespace" in c.__dict__), cls)
    if root is not cls:
        raise TypeError(
            f"{cls.__qualname__} subclasses the {getattr(root, 'namespace', '?')!r} namespace's "
            f"{root.__qualname__} and cannot run "
            f"under a {namespace!r} Trainer; subclass lightning_gpipe.strategy_class({namespace!r}) instead"
        )
    obj.__class__ = specialize(_pytorch_lightning_class(cls), namespace)


def _pytorch_lightning_class(cls: type) -> type:
    """The ``pytorch_lightning`` class a specialized class was built from (the definition)."""
    if cls.__dict__.get("namespace") == PYTORCH_LIGHTNING:
        return cls
    logic = cls.__bases__[0]
    candidate: type
    for candidate in logic.__subclasses__():
        if candidate.__dict__.get("namespace") == PYTORCH_LIGHTNING:
            return candidate
    raise TypeError(f"no pytorch_lightning definition of {cls.__qualname__}")


@cache
def module(namespace: str, which: str = "trainer") -> Any:
    """The namespace's Trainer package (``which="trainer"``) or Fabric package (``"fabric"``)."""
    trainer_pkg, fabric_pkg = _PACKAGES[namespace]
    return importlib.import_module(trainer_pkg if which == "trainer" else fabric_pkg)
