"""Where the embedded mode keeps the images' environments (`gpupool images build NAME`), and which one a
server or job of an image runs from.

An image NAME is materialised as a Python environment `IMAGES_DIR/NAME-<lock hash>` from the image's lock file,
and `IMAGES_DIR/NAME` is a symbolic link to the newest complete one: a rebuild never changes an environment a
running server uses, and a server starts from a whole environment or from none. The `base` image is the
servers' environment itself (`make install` builds it from the same lock).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpupool.images import BASE_IMAGE

#: The root install's images, beside its servers' environment (/opt/gpupool/env).
ROOT_IMAGES_DIR = Path("/opt/gpupool/images")
IMAGES_DIR_ENV = "GPUPOOL_IMAGES_DIR"
#: Written last into a complete environment: what it was built from.
STAMP = ".gpupool-image.json"


def default_images_dir() -> str:
    """`$GPUPOOL_IMAGES_DIR`, else /opt/gpupool/images as root, else ~/.local/share/gpupool/images."""
    configured = os.environ.get(IMAGES_DIR_ENV)
    if configured:
        return configured
    if os.getuid() == 0:
        return str(ROOT_IMAGES_DIR)
    return str(Path.home() / ".local" / "share" / "gpupool" / "images")


def image_stamp(prefix: str | os.PathLike) -> dict | None:
    """What a complete environment was built from (None: not there, or not complete)."""
    try:
        return json.loads((Path(prefix) / STAMP).read_text())
    except (OSError, ValueError):
        return None


def image_prefix(images_dir: str | os.PathLike, name: str, server_env: str) -> str | None:
    """The environment servers and jobs of image `name` run from; None when it has not been built."""
    if name == BASE_IMAGE:
        return server_env
    link = Path(images_dir) / name
    if image_stamp(link) is None:
        return None
    return os.path.realpath(link)
