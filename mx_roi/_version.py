"""The version of mx_roi, in one place: ``mx_roi.__version__`` imports it and setup.py
reads this file as text (so building the package never imports MXNet)."""
__version__ = "0.1.0"
