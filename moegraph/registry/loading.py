"""Loading the registries: shipped YAML files, user YAML files and calibrated profiles.

    load_model("mixtral-8x7b")   # an entry of models.yaml (shipped in this package)
    load_model("my/model.yaml")  # or a user YAML file holding ONE mapping of the same fields

Every mistake raises RegistryError with one line naming the file, entry, field and what is
valid. Unknown fields are errors, so a typo never falls back to a default.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import yaml

from moegraph.registry.configs import Hardware, ModelConfig
from moegraph.registry.fields import RegistryError

__all__ = ["load_model", "load_hardware", "model_names", "hardware_names"]

_REGISTRY_DIR = Path(__file__).parent
_PROFILES_DIR = _REGISTRY_DIR / "profiles"     # calibrated profiles shipped with the package


# --- loading -------------------------------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one). A merge key
    (``<<: *entry``) is allowed: the entry's own keys override the merged mapping's."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path, shown: str) -> Any:
    try:
        text = path.read_text()
    except OSError as err:
        raise RegistryError(f"{shown}: cannot read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise RegistryError(f"{shown}: not a text file ({err.reason} at byte {err.start})") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise RegistryError(f"{shown}: invalid YAML: {err.problem or err.context}{where}") from None
    except yaml.YAMLError as err:
        raise RegistryError(f"{shown}: invalid YAML: {' '.join(str(err).split())}") from None


def _build(cls: type, data: Any, source: str, entry: str | None, name: str) -> Any:
    """Construct cls from one YAML mapping; errors are prefixed 'source: entry.field: ...'."""
    where = f"{source}: {entry}" if entry else source
    if not isinstance(data, dict):
        raise RegistryError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = sorted(str(k) for k in data if k not in fields)
    if extra:
        raise RegistryError(f"{where}: unknown field {extra[0]!r}; valid: {', '.join(sorted(fields))}")
    missing = [n for n, f in fields.items()
               if n != "name" and f.default is dataclasses.MISSING and n not in data]
    if missing:
        plural = "s" if len(missing) > 1 else ""
        raise RegistryError(f"{where}: missing field{plural} {', '.join(map(repr, missing))}")
    if entry and data.get("name", entry) != entry:
        raise RegistryError(f"{where}.name: {data['name']!r} differs from its key {entry!r}")
    try:
        return cls(**{"name": name, **data})
    except RegistryError as err:
        sep = "." if entry and err.field else ": "
        raise RegistryError(f"{where}{sep}{err}", field=err.field) from None


@functools.lru_cache(maxsize=None)
def _registry(filename: str, kind: str, registry_dir: Path) -> dict[str, Any]:
    cls = ModelConfig if kind == "model" else Hardware
    data = _read_yaml(registry_dir / filename, filename)
    if not isinstance(data, dict):
        raise RegistryError(f"{filename}: expected a mapping of name -> entry, got {type(data).__name__}")
    return {str(k): _build(cls, v, filename, str(k), str(k)) for k, v in data.items()}


def _is_path(arg: str | os.PathLike) -> bool:
    if isinstance(arg, os.PathLike):
        return True
    return "/" in arg or os.sep in arg or arg.endswith((".yaml", ".yml", ".json"))


def _load(arg: str | os.PathLike, kind: str, filename: str) -> Any:
    if not isinstance(arg, (str, os.PathLike)):
        raise RegistryError(f"expected a {kind} name or a YAML path, got {arg!r}")
    if _is_path(arg):
        path = Path(arg)
        if path.is_dir():
            raise RegistryError(f"{kind} file '{arg}' is a directory; give a {kind} YAML file or a registry name")
        if not path.is_file():
            raise RegistryError(f"{kind} file '{arg}' does not exist")
        if kind == "model" and path.suffix == ".json":                 # a Hugging Face config.json
            from moegraph.registry.hf import load_hf_config
            return load_hf_config(path, str(arg), path.stem)
        cls = ModelConfig if kind == "model" else Hardware
        return _build(cls, _read_yaml(path, str(arg)), str(arg), None, path.stem)
    entries = _registry(filename, kind, _REGISTRY_DIR)
    if arg in entries:
        return entries[arg]
    if kind == "model" and arg in _hf_names():                       # a shipped published config.json
        return _hf_entry(arg)
    profile = _PROFILES_DIR / f"{arg}.yaml"
    if kind == "hardware" and profile.is_file():                 # a shipped calibrated profile
        return _build(Hardware, _read_yaml(profile, profile.name), profile.name, None, arg)
    known = sorted(entries) + (list(_profile_names()) if kind == "hardware" else list(_hf_names()))
    raise RegistryError(f"unknown {kind} {arg!r}; known: {', '.join(known)}")


def _profile_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in _PROFILES_DIR.glob("*.yaml")))


def load_model(name_or_path: str | os.PathLike) -> ModelConfig:
    """A models.yaml entry by name, or a YAML file (path contains '/' or ends in .yaml/.yml)."""
    return _load(name_or_path, "model", "models.yaml")


def load_hardware(name_or_path: str | os.PathLike) -> Hardware:
    """A hardware.yaml entry by name, or a YAML file (path contains '/' or ends in .yaml/.yml)."""
    return _load(name_or_path, "hardware", "hardware.yaml")


def model_names() -> tuple[str, ...]:
    """models.yaml's entries and the shipped Hugging Face configs (registry/hf/NAME.json)."""
    return tuple(sorted(_registry("models.yaml", "model", _REGISTRY_DIR))) + _hf_names()


def _hf_names() -> tuple[str, ...]:
    from moegraph.registry.hf import hf_names
    return hf_names()


@functools.lru_cache(maxsize=None)
def _hf_entry(name: str) -> ModelConfig:
    from moegraph.registry.hf import HF_DIR, load_hf_config
    return load_hf_config(HF_DIR / f"{name}.json", f"{name}.json", name)


def hardware_names() -> tuple[str, ...]:
    """Registry entries and shipped calibrated profiles (registry/profiles/NAME.yaml)."""
    return tuple(sorted(_registry("hardware.yaml", "hardware", _REGISTRY_DIR))) + _profile_names()
