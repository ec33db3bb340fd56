"""The one definition of dist_ckpt's version.

``pyproject.toml`` reads it statically (``[tool.setuptools.dynamic]``, without importing the
package, so building needs no torch); ``dist_ckpt.__version__`` and the ``library_version``
recorded in every ``metadata.json`` import it from here.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
