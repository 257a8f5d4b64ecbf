"""A small stand-in for ``torch``, enough for ``mx_roi.bench.torchvision_ops`` (tests only:
tests/test_bench.py puts ``tests/fake_torch`` on PYTHONPATH of a bench child process).

Tensors wrap NumPy arrays; ``backward`` runs the closure the producing op left behind.
"""
import numpy as np

__version__ = "0.0-fake"
_threads = [1]
moved_to = []  # the devices tensors were sent to (Tensor.to)
synced = []  # one entry per cuda.synchronize()


def set_num_threads(n):
    _threads[0] = int(n)


def get_num_threads():
    return _threads[0]


class Tensor:
    def __init__(self, array, backward_fn=None):
        self._array = array
        self._backward_fn = backward_fn
        self.requires_grad = False
        self.grad = None

    def numpy(self):
        return self._array

    def to(self, device):  # one "device": the host (the GPU column's tests), recorded
        moved_to.append(device)
        return self

    def cpu(self):
        return self

    def detach(self):
        return Tensor(self._array)

    def requires_grad_(self, flag=True):
        self.requires_grad = bool(flag)
        return self

    def backward(self, gradient):
        self._backward_fn(gradient.numpy())


def from_numpy(array):
    return Tensor(np.asarray(array))


def device(kind, index=0):
    return (kind, index)


class autograd:
    @staticmethod
    def grad(output, inputs, grad_outputs, retain_graph=False):
        output.backward(grad_outputs)
        return (inputs.grad,)


class cuda:
    """The GPU as the stand-in sees it: ``FAKE_TORCH_CUDA=0`` hides it."""

    @staticmethod
    def is_available():
        import os
        return os.environ.get("FAKE_TORCH_CUDA", "1") != "0"

    @staticmethod
    def synchronize():
        synced.append(1)
