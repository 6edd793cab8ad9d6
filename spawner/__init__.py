"""Spawners and the GPU share translation they share: profiles → Kubernetes resources or local devices."""

# The repository's folders are the `gpupool.*` packages (setup.cfg's package_dir). Imported under their
# folder's name (`import spawner` with the repository root on sys.path) they would be a second copy of every
# module in them, with its own state: refused.
if __name__ != "gpupool.spawner":
    raise ImportError(
        f"{__name__!r} is gpupool's spawner/ folder imported by its folder name: import gpupool.spawner "
        "instead (the folder is installed as gpupool.spawner: `make install`, or `pip install -e .`)"
    )
