"""specrl rollout sidecar: gRPC service, engines and the client library.

`__version__` is the installed specrl's version, read from its package metadata: the one value
that engines (`EngineInfo.engine_version`) and sidecars (`GetInfo`'s `specrl_version`) report.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _installed_version

try:
    __version__ = _installed_version("specrl")
except PackageNotFoundError:  # a source tree imported without `pip install -e .`
    __version__ = "unknown"
