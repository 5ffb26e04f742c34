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
