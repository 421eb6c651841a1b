"""The evaluation datasets of a run: ``--eval-config FILE`` or ``--eval-prompt-data``.

``--eval-config`` takes the reference's (slime's) OmegaConf file, YAML or JSON::

    eval:
      defaults:            # optional: what every dataset gets unless it sets its own
        n_samples_per_eval_prompt: 1
      datasets:            # required, non-empty
        - name: ocr        # required, unique: metrics are eval/<name>/...
          path: prompts/ocr_eval.jsonl   # required; relative: against the file's folder
          rm_type: ocr
          metadata_overrides: {split: test}

As in the reference, ``datasets`` may also be a mapping ``name -> {path: ...}`` and the
``eval:`` root may be left out.

A dataset's value wins over ``eval.defaults``, which wins over the command line's flag
(``--n-samples-per-eval-prompt``, ``--eval-input-key``/``--input-key``, ...). The file's
datasets replace ``--eval-prompt-data`` (the reference's rule). This module is the one
place that resolves those settings: :func:`eval_datasets` gives each set's
:class:`EvalDataset`, which the loading, the requests, the scoring and the prompt
embeddings read instead of the global flags.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_core.errors import ConfigError

DATASET_KEYS = (
    "name",
    "path",
    "n_samples_per_eval_prompt",
    "input_key",
    "image_key",
    "metadata_key",
    "rm_type",
    "metadata_overrides",
    "diffusion_eval_num_steps",
)
"""The keys a dataset (and, but for name and path, ``eval.defaults``) may set."""

_INTS = ("n_samples_per_eval_prompt", "diffusion_eval_num_steps")
_STRINGS = ("name", "path", "input_key", "image_key", "metadata_key", "rm_type")


@dataclass(frozen=True)
class EvalDataset:
    """One eval set with every setting resolved (dataset > ``eval.defaults`` > flag)."""

    name: str
    path: str
    """The prompt file; a relative path in an ``--eval-config`` file is resolved against its folder."""
    input_key: str
    metadata_key: str
    image_key: str | None
    """None: ``--image-key`` (read only by a family that takes an image)."""
    n_samples_per_eval_prompt: int
    num_steps: int
    """Denoising steps: ``diffusion_eval_num_steps``, else ``--diffusion-eval-num-steps``, else ``--diffusion-num-steps``."""
    rm_type: str | None = None
    """The registered reward that scores this set's rows (as their ``metadata.rm_type``)."""
    metadata_overrides: Mapping[str, Any] = field(default_factory=dict)
    source: str | None = None
    """The ``--eval-config`` file that names this set; None: ``--eval-prompt-data`` (or the flags)."""

    @property
    def where(self) -> str:
        """How an error names this set: ``--eval-config FILE: dataset 'NAME'`` or ``--eval-prompt-data NAME``."""
        return f"--eval-config {self.source}: dataset {self.name!r}" if self.source else f"--eval-prompt-data {self.name}"

    @property
    def size_flag(self) -> str:
        """What sets this set's samples per prompt, as a check on a hook's samples names it."""
        return f"{self.where} n_samples_per_eval_prompt" if self.source else "--n-samples-per-eval-prompt"

    def reward(self) -> tuple[str, Any] | None:
        """``(key, name)`` of the reward this set's rows carry as ``metadata.rm_type``, or
        None: ``metadata_overrides.rm_type`` wins over ``rm_type``, as in the reference,
        which sets ``rm_type`` first and then applies the overrides."""
        if "rm_type" in self.metadata_overrides:
            return "metadata_overrides.rm_type", self.metadata_overrides["rm_type"]
        return ("rm_type", self.rm_type) if self.rm_type is not None else None

    def row_metadata(self, metadata: Mapping[str, Any]) -> dict[str, Any]:
        """A row's metadata with the set's ``rm_type``, then its overrides, merged in."""
        merged = dict(metadata)
        if self.rm_type is not None:
            merged["rm_type"] = self.rm_type
        merged.update(self.metadata_overrides)
        return merged


def _check_value(where: str, key: str, value: Any) -> None:
    if key in _INTS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: {key} must be an integer >= 1, got {value!r}")
    elif key in _STRINGS:
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{where}: {key} must be a non-empty string, got {value!r}")
    elif key == "metadata_overrides" and not isinstance(value, Mapping):
        raise ConfigError(f"{where}: metadata_overrides must be a mapping, got {value!r}")


def _check_keys(where: str, entry: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    for key in entry:
        if key not in allowed:
            raise ConfigError(f"{where}: unknown key {key!r}; allowed: {', '.join(allowed)}")
        _check_value(where, str(key), entry[key])


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


_CACHE: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
"""read_eval_config's datasets by (absolute path, mtime_ns, size): a run reads its file once."""


def read_eval_config(path: str | Path) -> list[dict[str, Any]]:
    """The datasets of an ``--eval-config`` file, each merged over ``eval.defaults`` and
    checked (keys, types, ranges, unique names), paths resolved against the file's folder;
    a bad file is a one-line :class:`~miles_core.errors.ConfigError` naming it and the rule.
    Read once per process while the file stays as it is (same mtime and size)."""
    file = Path(path)
    where = f"--eval-config {path}"
    if not file.is_file():
        raise ConfigError(f"{where}: no such file")
    stat = file.stat()
    key = (str(file.absolute()), stat.st_mtime_ns, stat.st_size)
    if key not in _CACHE:
        _CACHE[key] = _read(file, where)
    return [{**entry, "metadata_overrides": dict(entry["metadata_overrides"])} for entry in _CACHE[key]]


def _load(file: Path, where: str) -> Any:
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue, OmegaConfBaseException
    from yaml import YAMLError

    try:
        loaded = OmegaConf.load(file)
    except (OSError, UnicodeDecodeError, YAMLError, OmegaConfBaseException) as exc:
        raise ConfigError(f"{where}: cannot be read as YAML/JSON: {_one_line(exc)}") from None
    if not isinstance(loaded, DictConfig):
        return None
    try:
        return OmegaConf.to_container(loaded, resolve=True, throw_on_missing=True)
    except (MissingMandatoryValue, InterpolationResolutionError) as exc:
        # '???' or a ${...} that names nothing: the value, not the file's syntax, is wrong.
        key = getattr(exc, "full_key", None) or "?"
        reason = " ".join((str(exc).splitlines() or [type(exc).__name__])[0].split())
        raise ConfigError(f"{where}: a value cannot be resolved: {key} ({reason})") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{where}: cannot be read as YAML/JSON: {_one_line(exc)}") from None


def _read(file: Path, where: str) -> list[dict[str, Any]]:
    data = _load(file, where)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping: 'eval' (or 'datasets' and 'defaults' directly)")
    if "eval" in data:  # the reference reads cfg.get("eval", cfg): the root may be omitted
        extra = [str(key) for key in data if key != "eval"]
        if extra:
            raise ConfigError(f"{where}: unknown top-level key {extra[0]!r}; the file holds 'eval' only")
        section = data["eval"]
    else:
        section = data
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: 'eval' must be a mapping with 'datasets' (and optional 'defaults')")
    _check_keys(f"{where}: eval", section, ("defaults", "datasets"))
    defaults = section.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{where}: eval.defaults must be a mapping, got {defaults!r}")
    _check_keys(f"{where}: eval.defaults", defaults, tuple(k for k in DATASET_KEYS if k not in ("name", "path")))
    datasets = section.get("datasets")
    if isinstance(datasets, dict):  # the reference's other shape: name -> {path: ...}
        datasets = [_named(where, name, dataset) for name, dataset in datasets.items()]
    if not isinstance(datasets, list) or not datasets:
        raise ConfigError(f"{where}: eval.datasets must be a non-empty list (or name -> dataset mapping) of datasets")
    entries: list[dict[str, Any]] = []
    for i, dataset in enumerate(datasets):
        label = f"{where}: dataset {i}"
        if not isinstance(dataset, dict):
            raise ConfigError(f"{label}: must be a mapping with name and path, got {dataset!r}")
        if isinstance(dataset.get("name"), str) and dataset["name"].strip():
            label = f"{where}: dataset {dataset['name']!r}"
        _check_keys(label, dataset, DATASET_KEYS)
        for key in ("name", "path"):
            if key not in dataset:
                raise ConfigError(f"{label}: {key} is required")
        if any(entry["name"] == dataset["name"] for entry in entries):
            raise ConfigError(f"{label}: duplicate name (eval set names must be unique)")
        overrides = {**defaults.get("metadata_overrides", {}), **dataset.get("metadata_overrides", {})}
        entry = {**defaults, **dataset, "metadata_overrides": overrides, "source": str(file)}
        prompts = Path(dataset["path"]).expanduser()
        entry["path"] = str(prompts if prompts.is_absolute() else file.parent / prompts)
        entries.append(entry)
    return entries


def _named(where: str, name: Any, dataset: Any) -> Any:
    """A dataset of the mapping shape, its key as its name (a ``name`` inside must agree)."""
    if not isinstance(dataset, dict):
        raise ConfigError(f"{where}: dataset {str(name)!r}: must be a mapping with path, got {dataset!r}")
    if "name" in dataset and dataset["name"] != str(name):
        raise ConfigError(f"{where}: dataset {str(name)!r}: name {dataset['name']!r} disagrees with its key {str(name)!r}")
    return {"name": str(name), **dataset}


def _flag_values(config: Any) -> dict[str, Any]:
    """The flags' settings of an eval set (what a dataset and ``eval.defaults`` override)."""
    get = lambda dest: getattr(config, dest, None)  # noqa: E731
    return {
        "n_samples_per_eval_prompt": get("n_samples_per_eval_prompt") or 1,
        "input_key": get("eval_input_key") or get("input_key") or "prompt",
        "metadata_key": get("metadata_key") or "metadata",
        "image_key": None,
        "diffusion_eval_num_steps": get("diffusion_eval_num_steps") or get("diffusion_num_steps"),
        "rm_type": None,
        "metadata_overrides": {},
        "source": None,
    }


def _dataset(config: Any, entry: Mapping[str, Any]) -> EvalDataset:
    values = {**_flag_values(config), **entry}
    steps = values.pop("diffusion_eval_num_steps")
    return EvalDataset(num_steps=int(steps) if steps is not None else 0, **values)


def flag_dataset(config: Any, name: str = "", path: str = "") -> EvalDataset:
    """An eval set with the flags' settings only (an ``--eval-prompt-data`` set's)."""
    return _dataset(config, {"name": name, "path": path})


def eval_datasets(config: Any) -> list[EvalDataset]:
    """The run's eval sets, in order: ``--eval-config``'s datasets when it is set, else
    ``--eval-prompt-data``'s NAME PATH pairs, every setting resolved."""
    if getattr(config, "eval_config", None):
        entries = read_eval_config(config.eval_config)
    else:
        pairs = list(getattr(config, "eval_prompt_data", None) or [])
        entries = [{"name": pairs[i], "path": pairs[i + 1]} for i in range(0, len(pairs) - 1, 2)]
    return [_dataset(config, entry) for entry in entries]


def eval_config_problems(config: Any, rewards: Any) -> list[str]:
    """What is wrong with ``--eval-config`` for this run (the resolver's check): the file
    itself, a dataset reward (:meth:`EvalDataset.reward`) that names no registered reward
    in ``rewards``, or one set while ``--eval-rm-type`` / ``--eval-reward-weights`` (else
    ``--custom-rm-path``) scores every evaluation sample whatever a row's ``rm_type``."""
    try:
        datasets = eval_datasets(config)
    except ConfigError as exc:
        return list(exc.messages)
    problems = []
    every = [
        flag
        for flag, dest in (("--eval-rm-type", "eval_rm_type"), ("--eval-reward-weights", "eval_reward_weights"))
        if getattr(config, dest, None)
    ]
    if not every and getattr(config, "custom_rm_path", None):  # the evaluation scores with it then
        every = ["--custom-rm-path"]
    for dataset in datasets:
        reward = dataset.reward()
        if reward is None:
            continue
        key, name = reward
        if every:
            problems.append(
                f"{dataset.where}: {key} {name} conflicts with {every[0]}, which scores every evaluation sample; drop one of them"
            )
        elif not isinstance(name, str) or name not in rewards:
            problems.append(f"{dataset.where}: {rewards.unknown_message(str(name), flag=key)}")
    return problems


def eval_config_rewards(config: Any) -> list[str]:
    """The rewards an ``--eval-config`` file's datasets name (none when it cannot be read)."""
    try:
        datasets = eval_datasets(config) if getattr(config, "eval_config", None) else []
    except ConfigError:
        return []
    rewards = [dataset.reward() for dataset in datasets]
    return [reward[1] for reward in rewards if reward is not None and isinstance(reward[1], str)]


__all__ = [
    "DATASET_KEYS",
    "EvalDataset",
    "eval_config_problems",
    "eval_config_rewards",
    "eval_datasets",
    "flag_dataset",
    "read_eval_config",
]
