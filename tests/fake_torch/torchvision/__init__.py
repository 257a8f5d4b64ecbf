"""A small stand-in for ``torchvision`` (tests only; see ``tests/fake_torch/torch``)."""
__version__ = "0.0-fake"
