"""The repository's Python scripts (scripts/*.py) as modules, for their tests. They run as
`python scripts/NAME.py` on a machine where llmserve may not be installed yet, so they
belong to no distribution and import nothing of ours."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py, imported once as the module `scripts_<name>`."""
    module_name = f"scripts_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # Before it runs: its dataclasses look their module up.
        spec.loader.exec_module(module)
    return sys.modules[module_name]
