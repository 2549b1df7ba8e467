"""Code run in a fresh interpreter where some packages cannot be imported (no torch here: the rules' tests import
this where torch is blocked)."""
from __future__ import annotations

import os
import subprocess
import sys


def python_without(blocked: tuple, code: str, root, **env_extra):
    """``code`` run in a fresh interpreter (from ``root``, on its path) where importing any of the top-level
    packages ``blocked`` raises ImportError, as on a machine without them (none may be imported at start-up).
    -> the CompletedProcess, output captured."""
    prelude = f"""
import sys

BLOCKED = {blocked!r}


class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{{name}}: not installed here")
        return None


assert not [m for m in sys.modules if m.partition(".")[0] in BLOCKED], "imported at start-up"
sys.meta_path.insert(0, _NotInstalled())
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
               **env_extra)
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
