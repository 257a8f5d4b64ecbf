"""Entry point of a parameter-server *scheduler* or *server* process.

MXNet runs the role named by ``DMLC_ROLE`` while it is being imported (and exits when the job
is over), so this module only has to import ``mx_roi`` -- which imports MXNet -- so that the
server runs with the mx_roi custom operators registered.
"""
import os
import sys

if os.environ.get("DMLC_ROLE") not in ("scheduler", "server"):
    sys.exit("example_rcnn.ps_node: set DMLC_ROLE=scheduler or server")

try:
    import mx_roi  # noqa: F401,E402  (imports mxnet, which runs the role)
except ImportError:  # pragma: no cover - mx_roi not importable: run the role anyway
    pass
import mxnet  # noqa: F401,E402
