"""``--compile``: regional ``torch.compile`` of a diffusion transformer's repeated blocks.

Compiling the whole transformer costs one long compile per input shape; compiling each
repeated block instead (``block.compile``) costs one compile per distinct block and
shape, and blocks of one class share the compiled code when their structure matches, so
compile time stays bounded by the block types rather than the depth.

Which blocks: the classes a diffusers model names in ``_repeated_blocks`` when it
declares any (Wan, LTX-2, Qwen-Image, Cosmos 3); else (SD3, whose list is empty) every
``nn.ModuleList`` whose children all share one class defined outside ``torch.nn`` (the
outermost such lists: ``transformer_blocks``).

Why it stays right under training (docs/guide.md, "Compiled transformer"):

- compilation is lazy: the graphs are traced at the first call, after the trainer has
  added its LoRA adapters, so the adapters' layers are part of them; adding or toggling
  adapters later changes the block's structure, which dynamo's guards catch (one more
  graph, never a stale one);
- parameters are inputs of the compiled graphs (dynamo inlines ``nn.Module`` calls), so
  weight updates that copy in place are seen by the next call without a recompile;
- ``dynamic=False``: one graph per shape, never a shape-generic graph that would round
  differently from the one compiled first; graphs are kept per grad mode (the engine's
  ``no_grad`` sampling and the trainer's forward are separate graphs).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: the configuration checks import this module
    import torch

COMPILE_FLAG = "--compile"

RECOMPILE_LIMIT = 64
"""Graphs dynamo keeps per block ``forward`` before falling back to eager. Every distinct
block structure (SD3's last block differs from the others), input shape, grad mode and
adapter state is one graph; torch's default of 8 is reached by an ordinary run (engine
and trainer shapes, the LoRA-disabled reference), after which calls would silently run
eager."""


def compile_unavailable(*, cuda: bool) -> str | None:
    """Why torch.compile's inductor backend cannot run here, in one line, or None: it
    needs triton on a GPU and a working C++ compiler on a CPU (``$CXX``, else ``g++``;
    ``clang++`` on macOS), as inductor looks for it."""
    spec = importlib.util.find_spec("torch")  # without importing torch (configuration time)
    if spec is None or spec.origin is None or not (Path(spec.origin).parent / "_inductor").is_dir():
        return "this torch has no inductor backend (torch._inductor)"
    if cuda:
        if importlib.util.find_spec("triton") is None:
            return "inductor compiles GPU kernels with triton, which is not installed (pip install triton)"
        return None
    compiler = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    try:
        subprocess.run([compiler, "--version"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return f"inductor compiles CPU kernels with a C++ compiler and {compiler} does not run (install g++ or set CXX)"
    return None


def _outside_torch(cls: type) -> bool:
    return not cls.__module__.startswith("torch.")


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformer (see the module docstring), outermost only,
    in module order; empty when it has none."""
    import torch

    declared = set(getattr(module, "_repeated_blocks", None) or ())
    found: list[torch.nn.Module] = []
    inside: list[str] = []
    for name, sub in module.named_modules():
        if sub is module or any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if declared:
            if type(sub).__name__ in declared:
                found.append(sub)
                inside.append(name)
        elif isinstance(sub, torch.nn.ModuleList) and len(sub) > 0:
            classes = {type(child) for child in sub}
            if len(classes) == 1 and _outside_torch(next(iter(classes))):
                found.extend(sub)
                inside.append(name)
    return found


def is_compiled(block: torch.nn.Module) -> bool:
    return getattr(block, "_compiled_call_impl", None) is not None


def compile_blocks(module: torch.nn.Module, *, component: str = "transformer") -> int:
    """Compile ``module``'s repeated blocks in place (``block.compile(dynamic=False)``);
    return how many. Already compiled blocks are left alone (the engine and the trainer
    share one family). A module without repeated blocks raises ``ValueError``."""
    blocks = repeated_blocks(module)
    if not blocks:
        raise ValueError(
            f"{COMPILE_FLAG}: component {component} ({type(module).__name__}) has no repeated blocks to compile "
            "(no _repeated_blocks and no ModuleList of one block class)"
        )
    _raise_recompile_limit()
    for block in blocks:
        if not is_compiled(block):
            block.compile(dynamic=False)
    return len(blocks)


def compile_components(components: Mapping[str, torch.nn.Module]) -> dict[str, int]:
    """:func:`compile_blocks` on every component (a family's trainable components: the
    transformer, Wan 2.2's two experts); return each one's block count."""
    return {name: compile_blocks(module, component=name) for name, module in components.items()}


def compiled_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The compiled repeated blocks of ``module``."""
    return [block for block in repeated_blocks(module) if is_compiled(block)]


def _raise_recompile_limit() -> None:
    import torch._dynamo

    config: Any = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(int(getattr(config, name)), RECOMPILE_LIMIT))


def eager() -> Any:
    """A context in which compiled blocks run eagerly (``torch.compiler.set_stance
    ("force_eager")``): the eager reference of the test and the bench, same modules."""
    import torch

    return torch.compiler.set_stance("force_eager")


def graph_count() -> int:
    """Graphs dynamo has compiled in this process (``unique_graphs``): a test's and the
    bench's measure of recompiles."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


__all__ = [
    "COMPILE_FLAG",
    "RECOMPILE_LIMIT",
    "compile_blocks",
    "compile_components",
    "compile_unavailable",
    "compiled_blocks",
    "eager",
    "graph_count",
    "is_compiled",
    "repeated_blocks",
]
