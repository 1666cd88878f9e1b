"""The package version: one place, read by the package face and by ``attnlab --version``."""

__version__ = "0.1.0"
