"""Import-only stand-ins for packages this CPU environment has no working build of (see README.md here).

A stand-in module answers every attribute with a placeholder, and every submodule import with another
stand-in module, so SGLang's (and transformers') module-level imports succeed. Using a placeholder
(calling it, or reading an attribute of it) raises and names what was missing, so a code path that needs
the real package fails loudly instead of computing something wrong.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class Missing:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is not available in the SGLang CPU test environment "
                           "(tools/sglang_cpu/shims); this code path needs a real build")


def module_getattr(module_name: str):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{module_name}.{name}")

    return __getattr__


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `import <package>.<anything>` give a stand-in module, for the packages registered here."""

    packages: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.packages and "." in fullname:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


def stand_in_package(name: str, module) -> None:
    """Turn the package module `name` (being imported) into a stand-in with stand-in submodules."""
    module.__getattr__ = module_getattr(name)
    _StandInFinder.packages.add(name)
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.append(_StandInFinder())
