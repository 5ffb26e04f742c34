"""Every public name of every shardkit package has a docstring."""

import importlib
import inspect
import pkgutil

import shardkit

MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(shardkit.__path__, "shardkit.")
    if not any(part.startswith("_") for part in name.split(".")[1:])
)


def test_every_public_name_has_a_docstring():
    missing = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        if not (module.__doc__ or "").strip():
            missing.append(module_name)
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not (
                inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj)
            ):
                continue
            if not (inspect.getdoc(obj) or "").strip():
                missing.append(f"{module_name}.{name}")
    assert missing == []


def _public_members(cls):
    """Public methods and properties ``cls`` itself defines (``forward`` and
    ``extra_repr`` of modules are torch's protocol, documented there)."""
    for attr, value in vars(cls).items():
        if attr.startswith("_") or attr in ("forward", "extra_repr"):
            continue
        if isinstance(value, property):
            yield attr, value
        elif isinstance(value, (classmethod, staticmethod)) or inspect.isfunction(value):
            yield attr, getattr(cls, attr)


def test_every_public_method_of_a_public_class_has_a_docstring():
    """Planners and storage readers are extension points the docs tell users to
    override: each method says what it must do (found missing by a docs audit)."""
    missing = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            if not inspect.isclass(obj) or not obj.__module__.startswith("shardkit"):
                continue
            for attr, member in _public_members(obj):
                if not (inspect.getdoc(member) or "").strip():
                    missing.append(f"{module_name}.{name}.{attr}")
    assert sorted(set(missing)) == []
