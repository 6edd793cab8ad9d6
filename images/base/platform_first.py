"""Run at start-up of every interpreter of the servers' environment (from `gpupool-platform-first.pth`).

Users' own packages (`pip install --user`, `%pip install`) live in their home's user site, which Python puts
*before* the environment's site-packages; a user's copy of `jupyter_server` could then break their server. This
puts the platform's site-packages first and the user's after them, and drops the system interpreter's
dist-packages (the environment enables them only because pip and `site` need that switch for user installs).
It runs again just before `sitecustomize`, once every site folder has been added.
"""

import os
import site
import sys


def _ordered(path: list[str]) -> list[str]:
    user_base = os.path.realpath(site.getuserbase()) + os.sep
    system = {os.path.realpath(p) for p in site.getsitepackages([sys.base_prefix])}
    mine = [p for p in path if os.path.isabs(p) and (os.path.realpath(p) + os.sep).startswith(user_base)]
    return [p for p in path if p not in mine and os.path.realpath(p) not in system] + mine


def _platform_first(then=site.execsitecustomize):
    def execsitecustomize():
        sys.path[:] = _ordered(sys.path)
        then()

    return execsitecustomize


sys.path[:] = _ordered(sys.path)
site.execsitecustomize = _platform_first()
