"""The hub side of gpupool: JupyterHub configuration, the `gpupool` command, hub services and pages."""

__version__ = "0.1.0"
