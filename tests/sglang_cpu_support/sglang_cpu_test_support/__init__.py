"""TEST SUPPORT ONLY: what SGLang 0.5.23's PyPI wheels need to run on a CPU-only machine.

Installed into ``.venv-sglang`` alone (``tools/sglang-env`` writes a ``.pth`` file that calls
`activate` at interpreter start-up, so SGLang's spawned scheduler and detokenizer processes get
it too). Never imported by specrl's product code, never installed by ``pip install specrl``, and
inert on a machine with a CUDA driver: there SGLang runs with its own kernels and nothing here
changes anything. Pinned to SGLang 0.5.23: `activate` refuses other versions rather than
patching code it was not written against.

Why it exists. SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``, ``device="cpu"``) is built
for a CPU build of ``sgl-kernel`` compiled from source with AVX-512/AMX; the PyPI wheel that
``pip install sglang==0.5.23`` brings is the CUDA build. Each accommodation below answers one
error that wheel set raises on a CPU-only machine (found by running it; see issue 17):

1. ``sgl_kernel`` cannot be imported: its CUDA op library needs the driver —
   ``ImportError: libcuda.so.1: cannot open shared object file`` → "Could not load any
   common_ops library" (first reached through SGLang's CPU KV-cache import). We load the
   package without that library (`_load_without_cuda_ops`); its Python wrappers stay.
2. The CPU ops SGLang calls on this path are missing from the wheel (``torch.ops.sgl_kernel.*``
   ``decode_attention_cpu``, ``extend_attention_cpu``, the speculative tree / cache-location
   helpers): ``AttributeError: '_OpNamespace' 'sgl_kernel' object has no attribute ...``.
   `reference_ops` registers plain-PyTorch reference implementations under those exact names
   and schemas. They are scaffolding, written from the ops' semantics (SGLang's C++ CPU
   kernels and their Triton/CUDA twins), slow, and never used where the real kernels exist.
3. ``Qwen3MoeForCausalLMMTP.set_embed_and_head`` calls ``torch.cuda.synchronize()`` and
   ``torch.cuda.empty_cache()`` unconditionally: ``RuntimeError: Found no NVIDIA driver``.
   Both are no-ops while that method runs on a machine without CUDA (`_cpu_safe_embed_and_head`).
4. Speculative decoding needs the ``intel_amx`` attention backend (``torch_native`` refuses
   it: ``ValueError: EAGLE is not supported in decode attention backend torch_native``), and
   SGLang silently swaps ``intel_amx`` for ``torch_native`` when it finds no AMX kernels
   ("The current platform does not support Intel AMX, will fallback to torch_native backend").
   With the reference attention ops of 2. the backend works, so the swap is skipped when
   speculating (`_keep_intel_amx_attention`); without speculation SGLang's own ``torch_native``
   backend runs, as SGLang chooses. Linear layers, norms and activations still take SGLang's
   own native-PyTorch CPU fallbacks (no AMX weight packing is claimed).
5. ``torch.compile``: SGLang compiles a speculative helper on first use (~100 s on a 2-core
   machine, and it needs a C++ compiler). ``TORCHDYNAMO_DISABLE=1`` is set unless the
   environment says otherwise.

Switch it off with ``SPECRL_SGLANG_CPU_SUPPORT=0``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

SGLANG_VERSION = "0.5.23"
log = logging.getLogger("sglang_cpu_test_support")

_active = False


def cuda_driver_present() -> bool:
    """Whether the CUDA driver library loads (then SGLang's own kernels are used: do nothing)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def activate() -> bool:
    """Install the accommodations (idempotent); False where they do not apply."""
    global _active
    if _active:
        return True
    if os.environ.get("SPECRL_SGLANG_CPU_SUPPORT", "1") == "0" or cuda_driver_present():
        return False
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        return False
    version = _installed_version("sglang")
    if version != SGLANG_VERSION:
        raise RuntimeError(
            f"sglang_cpu_test_support is written for SGLang {SGLANG_VERSION}, found {version}; "
            "re-run tools/sglang-env or set SPECRL_SGLANG_CPU_SUPPORT=0"
        )
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # accommodation 5
    sys.meta_path.insert(
        0,
        _PatchAfterImport(
            {
                "sgl_kernel.load_utils": _load_without_cuda_ops,  # 1
                "sgl_kernel": _register_reference_ops,  # 2
                "sglang.srt.models.qwen3_moe_mtp": _cpu_safe_embed_and_head,  # 3
                "sglang.srt.arg_groups.overrides": _keep_intel_amx_attention,  # 4
            }
        ),
    )
    _active = True
    return True


def _installed_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# ---- the accommodations ------------------------------------------------------------------


def _load_without_cuda_ops(load_utils: types.ModuleType) -> None:
    """1: ``sgl_kernel`` imports with an empty stand-in for its CUDA ``common_ops`` library."""
    real = load_utils._load_architecture_specific_ops

    def load_architecture_specific_ops() -> Any:
        try:
            return real()
        except ImportError as e:  # libcuda.so.1 missing: the CUDA ops cannot exist here
            log.info("sgl_kernel loaded without its CUDA op library (%s)", str(e).splitlines()[0])
            return types.ModuleType("common_ops")

    load_utils._load_architecture_specific_ops = load_architecture_specific_ops


def _register_reference_ops(sgl_kernel: types.ModuleType) -> None:
    """2: plain-PyTorch stand-ins for the CPU ops this path calls (see `reference_ops`)."""
    from sglang_cpu_test_support import reference_ops

    reference_ops.register()


def _cpu_safe_embed_and_head(module: types.ModuleType) -> None:
    """3: ``set_embed_and_head`` without its unconditional CUDA synchronisation."""
    cls = module.Qwen3MoeForCausalLMMTP
    real = cls.set_embed_and_head

    def set_embed_and_head(self: Any, embed: Any, head: Any) -> None:
        with _cuda_sync_is_noop():
            real(self, embed, head)

    cls.set_embed_and_head = set_embed_and_head


@contextlib.contextmanager
def _cuda_sync_is_noop() -> Iterator[None]:
    import torch

    saved = torch.cuda.synchronize, torch.cuda.empty_cache
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda *a, **k: None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.empty_cache = saved  # type: ignore[assignment]


def _keep_intel_amx_attention(overrides: types.ModuleType) -> None:
    """4: keep ``attention_backend="intel_amx"`` on CPU (its attention ops are the references)."""
    real = overrides._attention_backend_platform_fallbacks

    def attention_backend_platform_fallbacks(view: Any) -> dict[str, Any]:
        if view.attention_backend == "intel_amx" and view.device == "cpu" and view.speculative_algorithm:
            return {}  # speculative: keep intel_amx (reference attention); otherwise SGLang's torch_native
        out: dict[str, Any] = real(view)
        return out

    attention_backend_platform_fallbacks.__qualname__ = real.__qualname__
    overrides._attention_backend_platform_fallbacks = attention_backend_platform_fallbacks
    passes: list[Callable[..., dict[str, Any]]] = overrides.POST_PROCESS_PASSES
    passes[:] = [attention_backend_platform_fallbacks if p is real else p for p in passes]


# ---- running code right after a module is imported -----------------------------------------


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after each named module has executed, once."""

    def __init__(self, patches: dict[str, Callable[[types.ModuleType], None]]) -> None:
        self._patches = dict(patches)
        self._busy: set[str] = set()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self._patches.get(fullname)
        if patch is None or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        del self._patches[fullname]
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[types.ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package ... of the real loader
        return getattr(self._loader, name)
