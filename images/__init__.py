"""gpupool's images as package data: each image's lock files (`NAME/requirements.lock`, and `models.lock` where
an image carries model packages) for `gpupool images build`, the servers' environment's start-up files
(`base/`), and the fine-tuning templates (`templates/NAME/`) for `gpupool templates`.

The Dockerfiles and short requirements files stay in the repository (images/NAME/); `make locks` regenerates
the lock files from them.
"""

from pathlib import Path

#: The folder of the images' lock files and the templates, wherever gpupool is installed.
IMAGES_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = IMAGES_DIR / "templates"
#: The image whose environment, in the embedded mode, is the servers' environment itself (`make install`).
BASE_IMAGE = "base"


def image_names() -> list[str]:
    """The images gpupool knows: each folder here with a lock file."""
    return sorted(p.parent.name for p in IMAGES_DIR.glob("*/requirements.lock"))
