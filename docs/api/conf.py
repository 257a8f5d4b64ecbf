"""Sphinx configuration of mx_roi's API reference (``make docs``: sphinx-build -W)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                                   # opdocs, the op-table directive
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # mx_roi from this checkout

import mx_roi  # noqa: E402

project = "mx_roi"
release = version = mx_roi.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "opdocs"]
napoleon_numpy_docstring = True
napoleon_google_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"            # the structs' annotations are strings (PEP 563)
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = []
