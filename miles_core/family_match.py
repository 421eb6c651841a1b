"""Which installed model family a ``--hf-checkpoint`` is.

A local directory is matched by what it is: the pipeline class in its diffusers
``model_index.json`` (``_class_name``) picks the families that list it in
:attr:`~miles_core.specs.ModelFamilySpec.pipeline_classes`, and each of those then looks
at the components: its trainable components must be there (a ``[library, class]`` entry
in ``model_index.json`` and a ``config.json`` in their folder), and its optional
:attr:`~miles_core.specs.ModelFamilySpec.checkpoint_check` must agree. One pipeline
class can serve several models (``WanPipeline`` runs Wan 2.1, Wan 2.2 A14B and TI2V-5B),
so a family claims a directory only after reading it. Exactly one claim selects the
family; several, or none among families that list the class, is an error. A pipeline
class no installed family lists, and every hub id, falls back to the families' name
patterns (case-insensitive substrings of the value, ``fnmatch`` wildcards allowed). When
several families' patterns match, a family whose matching pattern contains another's
matching pattern is the more specific and wins over it (``wan2.2-ti2v`` over ``wan2.2``:
``Wan-AI/Wan2.2-TI2V-5B-Diffusers`` is TI2V-5B, not A14B); several left is an error.
``--diffusion-model-family`` skips all of this.

Local path or hub id: a value that is an existing directory is local. Otherwise it is a
hub id when it has the hub's shape, ``name`` or ``org/name`` (letters, digits, ``-``,
``_`` and ``.``, neither starting nor ending with ``-`` or ``.``, no ``--`` or ``..``);
anything else (absolute, starting with ``.`` or ``~``, more than one ``/``, a trailing
``/``, another separator) is a local path, and one that does not exist is reported as
``no such directory``. A relative ``models/my-model`` that does not exist therefore reads
as a hub id; when no family's name matches it the message says so.

Stdlib only: configuration resolution and the plugins' checks run it without loading
any model code.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_core.errors import FamilyMatchError, MilesError

MODEL_INDEX = "model_index.json"

_HUB_PART = r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"^(?:{_HUB_PART}/)?{_HUB_PART}$")

OVERRIDE = "pass --diffusion-model-family to choose one"


def is_hub_id(value: str) -> bool:
    """Whether ``value`` has the shape of a hub id (``name`` or ``org/name``)."""
    return bool(_HUB_ID.match(value)) and "--" not in value and ".." not in value


def checkpoint_problem(value: str | os.PathLike[str]) -> str | None:
    """Why ``value`` is neither a local directory nor a hub id, as ``VALUE: what is
    wrong`` (the caller puts its flag in front), or None when it may be either."""
    text = os.fspath(value)
    path = Path(text)
    if path.is_dir():
        return None
    if path.exists():
        return f"{text}: not a directory (a diffusers pipeline is a directory with {MODEL_INDEX})"
    if is_hub_id(text):
        return None
    hint = ""
    if text.startswith("~") and Path(text).expanduser().is_dir():
        hint = f" ({Path(text).expanduser()} exists: ~ is expanded by the shell, not here)"
    return f"{text}: no such directory{hint}"


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json", ".pt", ".pth", ".ckpt")
"""File endings of a component's weights in a diffusers or transformers folder."""


def missing_weights(directory: str | os.PathLike[str]) -> str | None:
    """Why the local pipeline directory cannot be loaded for lack of weights (None when every
    model component listed in its ``model_index.json`` that has a ``config.json`` also has
    a weight file): a weightless configuration folder (the real configurations the memory
    planner reads) is refused in one line naming the first such component."""
    directory = Path(directory)
    try:
        index = read_model_index(directory)
    except FamilyMatchError:
        return None  # diffusers' own error says what is wrong with the folder
    for name, entry in index.items():
        folder = directory / name
        if name.startswith("_") or not isinstance(entry, (list, tuple)) or not (folder / "config.json").is_file():
            continue
        if not any(path.name.endswith(WEIGHT_SUFFIXES) for path in folder.iterdir()):
            return (
                f"{directory}: component {name} has a configuration but no weights (no {', '.join(WEIGHT_SUFFIXES[:2])} "
                f"file in {folder}); a configuration-only folder can be planned (miles-core plan), not loaded"
            )
    return None


def read_model_index(directory: Path) -> dict[str, Any]:
    """``directory``'s ``model_index.json``, which must name its pipeline class."""
    path = directory / MODEL_INDEX
    if not path.is_file():
        raise FamilyMatchError(
            f"--hf-checkpoint {directory}: no {MODEL_INDEX}, so it is not a diffusers pipeline directory "
            "and its model family cannot be read from it; point it at the pipeline's top folder or " + OVERRIDE
        )
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FamilyMatchError(f"--hf-checkpoint {directory}: cannot read {MODEL_INDEX}: {exc}") from None
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str) or not index["_class_name"]:
        raise FamilyMatchError(f"--hf-checkpoint {directory}: {MODEL_INDEX} names no pipeline class (_class_name); {OVERRIDE}")
    return index


def component_config(directory: Path, component: str) -> dict[str, Any] | None:
    """``directory/component/config.json`` as a dict, None when absent. For
    ``checkpoint_check`` functions; an unreadable file is a :class:`FamilyMatchError`."""
    path = Path(directory) / component / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FamilyMatchError(f"--hf-checkpoint {directory}: cannot read {component}/config.json: {exc}") from None
    if not isinstance(config, dict):
        raise FamilyMatchError(f"--hf-checkpoint {directory}: {component}/config.json is not a JSON object")
    return config


def has_component(model_index: Mapping[str, Any], component: str) -> bool:
    """Whether ``model_index.json`` lists ``component`` as a loaded ``[library, class]``
    (diffusers writes ``[null, null]`` for an optional component that is absent)."""
    entry = model_index.get(component)
    return isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) and x for x in entry)


def why_not(registration: Any, directory: Path, model_index: Mapping[str, Any]) -> str | None:
    """Why the family of ``registration`` does not claim ``directory`` (whose pipeline
    class it lists), or None when it does."""
    spec = registration.spec
    for component in spec.trainable_components:
        if not has_component(model_index, component):
            return f"{MODEL_INDEX} lists no {component}, which it trains"
        if not (directory / component / "config.json").is_file():
            return f"no {component}/config.json"
    if spec.checkpoint_check is None:
        return None
    from miles_core.refs import load_ref

    where = f"the {spec.name} family's checkpoint_check {spec.checkpoint_check} ({registration.plugin})"
    try:
        check = load_ref(spec.checkpoint_check)
        reason = check(directory, model_index)
    except MilesError:
        raise
    except Exception as exc:  # a plugin's check may fail with anything; name it
        raise FamilyMatchError(f"--hf-checkpoint {directory}: {where} failed: {type(exc).__name__}: {exc}") from exc
    if reason is not None and not (isinstance(reason, str) and reason):
        raise FamilyMatchError(
            f"--hf-checkpoint {directory}: {where} returned {reason!r}; expected None (the directory is the family's) or a non-empty reason"
        )
    return reason


def match_by_content(directory: Path, registry: Any, model_index: Mapping[str, Any] | None = None) -> Any | None:
    """The registration of the one family that claims ``directory`` (see the module
    docstring), or None when no installed family lists its pipeline class."""
    index = read_model_index(directory) if model_index is None else model_index
    pipeline = index["_class_name"]
    candidates = sorted((reg for reg in registry if pipeline in reg.spec.pipeline_classes), key=lambda r: r.name)
    if not candidates:
        return None
    verdicts = {reg.name: why_not(reg, directory, index) for reg in candidates}
    claims = [reg for reg in candidates if verdicts[reg.name] is None]
    if len(claims) == 1:
        return claims[0]
    if claims:
        raise FamilyMatchError(
            f"--hf-checkpoint {directory}: its {pipeline} ({MODEL_INDEX}) is claimed by several model families "
            f"({', '.join(reg.name for reg in claims)}); {OVERRIDE}"
        )
    considered = "; ".join(f"{name}: {reason}" for name, reason in verdicts.items())
    raise FamilyMatchError(
        f"--hf-checkpoint {directory}: its {pipeline} ({MODEL_INDEX}) is claimed by no installed model family "
        f"(considered {considered}{_failed(registry)}); {OVERRIDE}"
    )


def names_matching(checkpoint: str, registry: Any) -> list[Any]:
    """The registrations whose name patterns match ``checkpoint``."""
    haystack = checkpoint.lower()
    return [reg for reg in registry if any(fnmatch.fnmatch(haystack, f"*{pattern.lower()}*") for pattern in reg.spec.checkpoint_patterns)]


def most_specific(checkpoint: str, matches: list[Any]) -> list[Any]:
    """Of ``matches`` (registrations whose name patterns match ``checkpoint``), those that
    no other one refines: a family refines another when one of its patterns that matches
    contains, as a longer string, one of the other's patterns that matches."""
    haystack = checkpoint.lower()
    matched = {
        reg.name: [p.lower() for p in reg.spec.checkpoint_patterns if fnmatch.fnmatch(haystack, f"*{p.lower()}*")] for reg in matches
    }

    def refined(reg: Any) -> bool:
        return any(
            len(wider) > len(narrow) and narrow in wider
            for other in matches
            if other.name != reg.name
            for wider in matched[other.name]
            for narrow in matched[reg.name]
        )

    return [reg for reg in matches if not refined(reg)]


def _failed(registry: Any) -> str:
    """The plugins that failed to load (one of them may have been the family), if any."""
    return f"; plugins that failed to load: {'; '.join(registry.unavailable)}" if registry.unavailable else ""


def _installed(registry: Any, *, with_classes: bool) -> str:
    listed = [
        f"{reg.name} ({', '.join(reg.spec.pipeline_classes)})" if with_classes and reg.spec.pipeline_classes else reg.name
        for reg in sorted(registry, key=lambda r: r.name)
    ]
    return f"installed: {', '.join(listed) or 'none'}{_failed(registry)}"


def match_family(checkpoint: str | os.PathLike[str], registry: Any) -> Any:
    """The ``model_family`` registration for ``checkpoint``: by content for a local
    directory, then by name patterns (see the module docstring). Raises
    :class:`FamilyMatchError` with a one-line message when none or several match."""
    value = os.fspath(checkpoint)
    problem = checkpoint_problem(value)
    if problem is not None:
        raise FamilyMatchError(f"--hf-checkpoint {problem}")
    directory = Path(value) if Path(value).is_dir() else None
    pipeline = None
    if directory is not None:
        index = read_model_index(directory)
        found = match_by_content(directory, registry, index)
        if found is not None:
            return found
        pipeline = index["_class_name"]
    matches = most_specific(value, names_matching(value, registry))
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise FamilyMatchError(
            f"--hf-checkpoint {value}: matches the name patterns of several families ({', '.join(m.name for m in matches)}); {OVERRIDE}"
        )
    if pipeline is not None:
        what = f"no installed model family serves its {pipeline} ({MODEL_INDEX}) or matches its name"
    else:
        what = "no local directory of that name, and as a hub id no installed model family matches its name"
    raise FamilyMatchError(f"--hf-checkpoint {value}: {what} ({_installed(registry, with_classes=pipeline is not None)}); {OVERRIDE}")


def _local_index(checkpoint: str | Path) -> dict[str, Any] | None:
    """``checkpoint``'s ``model_index.json`` when it is a readable local pipeline directory."""
    directory = Path(checkpoint)
    if not str(checkpoint) or not (directory / MODEL_INDEX).is_file():  # "": no checkpoint, not "."
        return None
    try:
        return read_model_index(directory)
    except FamilyMatchError:
        return None  # the match reports an unreadable index; the family default stands


def default_lora_targets(spec: Any, checkpoint: str | Path) -> tuple[str, ...]:
    """The default ``--lora-target-modules`` of ``spec``'s family for ``checkpoint``: for a
    local pipeline directory, those its ``lora_target_modules_for`` function computes from
    the configuration, else those listed for the pipeline class its ``model_index.json``
    names (``lora_target_modules_by_pipeline``), else the family's ``lora_target_modules``."""
    index = _local_index(checkpoint)
    if index is None:
        return spec.lora_target_modules
    if spec.lora_target_modules_for is not None:
        from miles_core.refs import load_ref

        where = f"the {spec.name} family's lora_target_modules_for {spec.lora_target_modules_for}"
        try:
            targets = load_ref(spec.lora_target_modules_for)(Path(checkpoint), index)
        except MilesError:
            raise
        except Exception as exc:  # a plugin's function may fail with anything; name it
            raise FamilyMatchError(f"--hf-checkpoint {checkpoint}: {where} failed: {type(exc).__name__}: {exc}") from exc
        if targets is not None:
            if not (isinstance(targets, tuple) and targets and all(isinstance(t, str) and t for t in targets)):
                raise FamilyMatchError(f"--hf-checkpoint {checkpoint}: {where} returned {targets!r}; expected None or a tuple of names")
            return targets
    return dict(spec.lora_target_modules_by_pipeline).get(index["_class_name"], spec.lora_target_modules)


def default_guidance_scale(spec: Any, checkpoint: str | Path) -> float | None:
    """The family's default ``--diffusion-guidance-scale`` for ``checkpoint``: the one listed
    for the pipeline class a local directory's ``model_index.json`` names
    (``default_guidance_scale_by_pipeline``), else ``default_guidance_scale``."""
    index = _local_index(checkpoint)
    by_pipeline = dict(spec.default_guidance_scale_by_pipeline)
    if index is not None and index["_class_name"] in by_pipeline:
        return float(by_pipeline[index["_class_name"]])
    return spec.default_guidance_scale
