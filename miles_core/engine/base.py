"""The engine interface the trainer-side rollout talks to.

Every engine speaks the ``/rollout/generate`` contract, in process or over HTTP, so the
rollout code is the same for all of them.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

from miles_core.request import RolloutOutput, RolloutRequest


class RolloutEngine(abc.ABC):
    """A rollout engine: generation, health, weight updates, checksums, and (where
    :attr:`releases_memory`) releasing its memory while the trainer trains."""

    releases_memory: ClassVar[bool] = False
    """Whether :meth:`release_memory` and :meth:`resume_memory` work (``--offload-rollout``)."""

    caps_per_server: ClassVar[bool] = False
    """Whether the engine keeps at most ``--sglang-server-concurrency`` requests in flight on
    each of its servers itself (the ``http`` engines). For the others the rollout keeps at
    most that many of its requests in flight in all."""

    @classmethod
    @abc.abstractmethod
    def from_config(cls, config: Any) -> RolloutEngine:
        """Build the engine a resolved configuration asks for (``--rollout-engine``)."""

    @abc.abstractmethod
    async def generate(self, request: RolloutRequest) -> list[RolloutOutput]:
        """Run one request (one prompt, ``num_outputs_per_prompt`` outputs) off the
        caller's event loop; return one record per output."""

    @abc.abstractmethod
    async def weights_checksum(self, module_names: Sequence[str]) -> dict[str, str]:
        """One SHA-256 per named module (see :func:`miles_core.weights.module_checksum`)."""

    async def release_memory(self) -> None:
        """Release the memory the engine's weights hold (``--offload-rollout``), until
        :meth:`resume_memory`; generating in between is an error. Releasing twice does
        nothing."""
        raise NotImplementedError(f"the {type(self).__name__} engine cannot release its memory")

    async def resume_memory(self) -> None:
        """Bring back what :meth:`release_memory` released (nothing when it is resident)."""
        raise NotImplementedError(f"the {type(self).__name__} engine cannot release its memory")

    async def close(self) -> None:  # noqa: B027 - engines without resources need not override it
        """Release the engine's resources."""
