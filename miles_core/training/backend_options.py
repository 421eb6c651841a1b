"""Training-backend options applied to the trained components: ``--gradient-checkpointing``
and ``--fsdp-attention-backend``, both through diffusers' ``ModelMixin`` API.

With the embedded engine the trainer and the engine share these modules. Gradient
checkpointing acts only while gradients are recorded (the engine samples under
``no_grad``); the attention backend applies to both, and diffusers also makes it the
process-wide active backend.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

CHECKPOINTING_FLAG = "--gradient-checkpointing"
ATTENTION_FLAG = "--fsdp-attention-backend"

DEFAULT_ATTENTION_BACKEND = "native"
"""torch's scaled_dot_product_attention: what processors that do not dispatch through
diffusers' attention backends (SD3's ``JointAttnProcessor2_0``) compute anyway."""


def enable_gradient_checkpointing(modules: Mapping[str, torch.nn.Module]) -> None:
    """Turn on diffusers' gradient checkpointing (activations recomputed in the backward)
    for every module; a module that does not support it is a one-line error naming it."""
    for name, module in modules.items():
        if not getattr(module, "_supports_gradient_checkpointing", False) or not hasattr(module, "enable_gradient_checkpointing"):
            raise ValueError(
                f"{CHECKPOINTING_FLAG}: component {name} ({type(module).__name__}) does not support gradient checkpointing "
                "(not a diffusers model with _supports_gradient_checkpointing)"
            )
        module.enable_gradient_checkpointing()


def attention_backends() -> list[str]:
    """The backend names diffusers accepts (``AttentionBackendName``), sorted."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return sorted(member.value for member in AttentionBackendName)


def _dispatching_processors(module: torch.nn.Module) -> int:
    # Processors that route through diffusers' dispatcher carry an _attention_backend slot;
    # the others call torch's SDPA directly and ignore any backend.
    return sum(1 for sub in module.modules() if hasattr(getattr(sub, "processor", None), "_attention_backend"))


def set_attention_backend(modules: Mapping[str, torch.nn.Module], backend: str) -> None:
    """``module.set_attention_backend(backend)`` on every module, after checking the name
    (one-line errors naming the flag and listing the valid names). A backend other than
    ``native`` on a module none of whose attention processors dispatch through diffusers'
    backends is refused: it would have no effect."""
    valid = attention_backends()
    name = backend.lower()  # diffusers lowercases the name too
    if name not in valid:
        raise ValueError(f"{ATTENTION_FLAG} {backend}: unknown attention backend; diffusers offers {', '.join(valid)}")
    for component, module in modules.items():
        if not hasattr(module, "set_attention_backend"):
            raise ValueError(f"{ATTENTION_FLAG} {backend}: component {component} ({type(module).__name__}) is not a diffusers model")
        if name != DEFAULT_ATTENTION_BACKEND and not _dispatching_processors(module):
            raise ValueError(
                f"{ATTENTION_FLAG} {backend}: no attention processor of component {component} ({type(module).__name__}) "
                f"dispatches through diffusers' attention backends, so it would have no effect; leave the flag unset "
                f"(or {DEFAULT_ATTENTION_BACKEND})"
            )
        try:
            module.set_attention_backend(name)
        except (RuntimeError, ValueError, ImportError) as exc:  # a backend whose package is missing
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"{ATTENTION_FLAG} {backend}: {message}") from None


__all__ = [
    "ATTENTION_FLAG",
    "CHECKPOINTING_FLAG",
    "attention_backends",
    "enable_gradient_checkpointing",
    "set_attention_backend",
]
