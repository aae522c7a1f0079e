"""A user's function named on the command line as `path/to/file.py:function` or `package.module:function`.

Used by every flag that takes user code (--custom-rm-path, --custom-generate-function-path): the run setup loads
the function once, so that a missing file or function stops the run before any work with an error naming the
flag; worker processes load it again by path or module name (spawned processes share no imports).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable


def resolve(spec: str, flag: str) -> str:
    """`spec` with a file path made absolute (workers resolve it alike wherever they run); checks its form."""
    location, _, name = spec.rpartition(":")
    if not location or not name:
        raise ValueError(f"{flag} {spec!r}: expected path/to/file.py:function or package.module:function")
    return f"{os.path.abspath(location)}:{name}" if _is_file(location) else spec


def _is_file(location: str) -> bool:
    return location.endswith(".py") or os.sep in location


@functools.cache
def load(spec: str, flag: str) -> Callable:
    """The function `spec` names (loaded once per process). Errors name `flag`."""
    location, _, name = spec.rpartition(":")
    where = f"{flag} {spec!r}"
    if _is_file(location):
        if not os.path.isfile(location):
            raise ValueError(f"{where}: no such file {location!r}")
        module_name = "user_plugin_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(location))[0])
        module_spec = importlib.util.spec_from_file_location(module_name, location)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"{where}: {location!r} cannot be loaded as Python")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look a module up by its name
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise ValueError(f"{where}: loading {location!r} failed ({type(e).__name__}: {e})") from e
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as e:
            raise ValueError(f"{where}: cannot import module {location!r} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{where}: {location!r} has no function {name!r}")
    return fn
