"""Every error miles-core raises on purpose, under one base class.

Each command catches :class:`MilesError` once and prints ``str(exc)`` as one line naming
the culprit and the rule (a traceback only with ``--debug`` or ``MILES_DEBUG=1``), then
exits with the error's :attr:`~MilesError.exit_code`: 2 for bad input or configuration
(:class:`InputError`: flags, YAML, prompt files, checkpoints, plugins, requests), 1 for a
failure while running, 3 for a run that ``--guard-stop-on-alarm`` stopped
(:class:`GuardStopError`). Every class keeps the built-in parent it had before this module
existed, so ``except ValueError`` (or ``RuntimeError``, ``ImportError``, ...) around a
miles-core call still catches what it caught.

This module imports nothing: any layer may raise these, and plugins import them from
:mod:`miles_core.api`.
"""

from __future__ import annotations

from collections.abc import Iterable


class MilesError(Exception):
    """Base of every deliberate miles-core error; ``str(exc)`` is the one-line message."""

    exit_code: int = 1
    """The command's exit status when this error ends it: 1, a failure while running."""


class InputError(MilesError):
    """Bad input or configuration, found before or while it is used (exit status 2)."""

    exit_code = 2


# -- configuration and plugins --------------------------------------------------------


class UsageError(InputError, ValueError):
    """A command's arguments that cannot be used together or as given."""


class ConfigError(InputError, ValueError):
    """One or more configuration violations; the CLI prints one line each."""

    def __init__(self, messages: str | Iterable[str]) -> None:
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))


class FamilyMatchError(InputError, ValueError):
    """A checkpoint that matches no installed model family, or several."""


class PluginLoadError(InputError, RuntimeError):
    """A plugin that could not be loaded, raised in strict mode (``MILES_STRICT_PLUGINS=1``)."""


class PluginContractError(InputError):
    """A plugin that breaks the hook contract (a hook's return value, a flag clash);
    reported as that plugin's load error."""


class RegistryError(InputError):
    """Base of the component registries' errors."""


class ComponentLoadError(RegistryError, ImportError):
    """A registered component whose implementation cannot be imported."""


class RegistrationConflict(RegistryError):
    """Two distributions registered the same name for the same kind."""


class UnknownComponentError(RegistryError, LookupError):
    """A name that no installed plugin registered."""


class RefError(InputError, ImportError):
    """A ``module:attribute`` reference that cannot be imported or resolved."""


class PathFlagError(InputError, ValueError):
    """A ``--*-path`` flag that does not resolve to the right kind of object."""


class PlacementError(InputError, ValueError):
    """Cluster flags that describe an impossible placement."""


class ApiKeyError(InputError, ValueError):
    """An API key that cannot be used: empty, holding whitespace, or in a key file that
    cannot be read."""


# -- data, requests and the wire ------------------------------------------------------


class PromptDataError(InputError, ValueError):
    """A prompt file or row that cannot be used."""


class RequestError(InputError, ValueError):
    """A request field that is missing, of the wrong type or out of range; ``field``
    names it."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


class PromptNotStoredError(RequestError):
    """A prompt whose encoding is not among those precomputed at start-up, asked for after
    the text encoders were freed (``--precompute-prompt-embeddings``)."""

    def __init__(self, prompt: str, negative_prompt: str | None, flag: str) -> None:
        self.prompt = prompt
        negative = "" if negative_prompt is None else f" with negative prompt {negative_prompt!r}"
        super().__init__(
            "prompt",
            f"{prompt!r}{negative} (with these sampling parameters) is not among the prompt embeddings computed at "
            f"start-up under {flag}, and the text encoders were freed",
        )


class IpcFormatError(RequestError):
    """A CUDA-IPC weight update (sglang-diffusion's ``/update_weights_from_tensor`` JSON)
    that is malformed or names a global its restricted unpickler does not allow."""

    def __init__(self, field_name: str, message: str) -> None:
        self.message = message
        super().__init__(field_name, message)


class RequestLimitError(RequestError):
    """A request over one of a server's limits. ``status`` is 400 for one field out of
    its allowed range, 413 for a body or a total of work too large; ``limit`` is the
    allowed maximum, ``value`` what the request asked for (None: not known, a body that
    was not read to its end) and ``flag`` the server flag that raises the limit."""

    def __init__(self, field_name: str, message: str, *, value: int | None, limit: int, flag: str, status: int = 400) -> None:
        self.value = value
        self.limit = limit
        self.flag = flag
        self.status = status
        super().__init__(field_name, message)


class GenerationCancelled(MilesError, RuntimeError):
    """A generation stopped between two denoising steps because its caller gave up (an
    HTTP client that went away); ``step`` steps of ``steps`` had run."""

    def __init__(self, request_id: str, step: int, steps: int) -> None:
        self.request_id = request_id
        self.step = step
        self.steps = steps
        super().__init__(f"request {request_id}: cancelled after {step} of {steps} denoising steps")


class TrainingStopped(MilesError, RuntimeError):
    """A rollout's training stopped after a micro-batch because the run was stopped while
    it trained on another thread (:attr:`Trainer.stop_requested`); ``done`` of ``total``
    micro-batches (or steps) had run, so its optimizer steps may be half applied."""

    def __init__(self, done: int, total: int) -> None:
        self.done = done
        self.total = total
        of = f" of {total}" if total else ""
        super().__init__(f"training stopped after {done}{of} micro-batch(es) or step(s): the run was stopped")


class WireError(InputError, ValueError):
    """A document that does not follow the wire format; the message names the path."""


class CheckpointError(InputError, RuntimeError):
    """A checkpoint that cannot be read: missing, partial or corrupt. The message is one
    line naming the path and what is wrong."""


class WeightUpdateError(InputError, ValueError):
    """A weight update that does not fit the module (unknown name, wrong shape or dtype)."""


class LoraAdapterError(WeightUpdateError):
    """A LoRA-only update the module's adapter cannot take."""


class LoraAdapterMismatch(LoraAdapterError):
    """The module already has a LoRA adapter other than the update's ``lora_config``."""


# -- running --------------------------------------------------------------------------


class RunError(MilesError, RuntimeError):
    """A run that cannot start as configured; the message names the flag, file or
    directory and the rule (exit status 2). :class:`RunFailedError` is the kind for a
    run that fails while running."""

    exit_code = 2


class RunFailedError(RunError):
    """A run that failed while running: an engine that died or refused, a ``--ci-test``
    metric check that did not pass (exit status 1)."""

    exit_code = 1


class HookError(RunError):
    """User code (a ``--*-path`` hook) that cannot be loaded or returned the wrong thing;
    one line naming the flag."""


class FilterError(HookError):
    """A rollout filter that cannot be loaded or returned the wrong thing; one line naming the flag."""


class DebugDataError(RunError):
    """A debug file that cannot be read or written; the message names the flag and path."""


class LoggerError(RunError):
    """A metrics logger that cannot start; the message names the flag."""


class GuardStopError(RunError):
    """``--guard-stop-on-alarm``: the reward-hacking guard raised an alarm at an
    evaluation; the run saved a checkpoint and stopped (exit status 3, so scripts can
    tell it from a failure)."""

    exit_code = 3


class ReportError(InputError, ValueError):
    """``miles-core report``: a directory that is not a run, or a report that cannot be
    written; the message names the path and the rule (exit status 2)."""


class RewardError(MilesError, RuntimeError):
    """A reward that cannot be used at all (not one sample's failure): an unknown name,
    a reward that cannot be built, or a return value of the wrong shape or type (exit
    status 2). :class:`RewardsFailedError` is the kind for a rollout in which every
    sample's reward failed."""

    exit_code = 2


class RewardsFailedError(RewardError):
    """Every sample's reward failed in one rollout or evaluation (exit status 1)."""

    exit_code = 1


class RewardWorkerDiedError(RewardError):
    """A reward worker of a ``--use-ray`` run (its ``serve-reward --run-worker`` server)
    died or answered what it should not; the message names the worker and its node (exit status 1; under ``--save`` the run keeps a checkpoint of its last trained rollout first)."""

    exit_code = 1


class NonFiniteLogProbError(MilesError, ArithmeticError):
    """A step's log-probability is not finite even when recomputed in float64."""

    def __init__(self, step_index: int | None, sample_indices: list[int], detail: str = "") -> None:
        self.step_index = step_index
        self.sample_indices = sample_indices
        where = f"step {step_index}" if step_index is not None else "an unnamed step"
        message = f"non-finite log-prob at {where} for sample(s) {sample_indices} after the float64 recompute"
        super().__init__(f"{message}: {detail}" if detail else message)


class WeightSyncError(MilesError, RuntimeError):
    """An engine that does not hold the weights the trainer sent it."""


class WeightGroupError(WeightSyncError):
    """A weight-update group (``--weight-sync-path distributed``) that an engine could not
    join or use. Exit status 1 mid-run; 2 when it happens at start-up (``startup``: the
    run's first sync), before anything was trained."""

    def __init__(self, message: str, *, startup: bool = False) -> None:
        super().__init__(message)
        self.exit_code = 2 if startup else 1


class EngineRequestError(MilesError, RuntimeError):
    """A request an engine server refused or failed (``status`` None: no HTTP answer)."""

    def __init__(self, url: str, status: int | None, message: str) -> None:
        self.url = url
        self.status = status
        self.message = message
        where = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"{url}: {where}: {message}")


class EngineReleasedError(MilesError, RuntimeError):
    """An engine asked to generate, update or checksum its weights while its memory is
    released (``--offload-rollout``); it must be resumed first."""


class NoHealthyEngineError(MilesError, RuntimeError):
    """No engine became healthy in time (raised as the engine's request error)."""


class WeightsMismatchError(MilesError, RuntimeError):
    """Servers behind one engine report different weights for a module."""


class FleetError(MilesError, RuntimeError):
    """An engine server that did not start, or did not become healthy."""


class SglangEngineError(RunError):
    """The sglang-diffusion environment or servers could not be used (one line)."""


class ClusterError(RunError):
    """Ray is missing, unreachable, or cannot place the run: it cannot start as
    configured (exit status 2)."""
