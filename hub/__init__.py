"""The hub side of gpupool: JupyterHub configuration, the `gpupool` command, hub services and pages."""

# The repository's folders are the `gpupool.*` packages (setup.cfg's package_dir). Imported under their
# folder's name (`import hub` with the repository root on sys.path) they would be a second copy of every
# module in them, with its own state: refused.
if __name__ != "gpupool.hub":
    raise ImportError(
        f"{__name__!r} is gpupool's hub/ folder imported by its folder name: import gpupool.hub "
        "instead (the folder is installed as gpupool.hub: `make install`, or `pip install -e .`)"
    )

__version__ = "0.1.0"
