"""Model and hardware registries: frozen, validated dataclasses loaded from YAML.

    load_model("mixtral-8x7b")   # an entry of models.yaml (shipped in this package)
    load_model("my/model.yaml")  # or a user YAML file holding ONE mapping of the same fields

Three modules, in import order:
    fields.py   the check each field runs (finite numbers, bounded sizes, curves, ...)
    configs.py  ModelConfig and Hardware, the frozen records
    loading.py  YAML reading, registry names, shipped calibrated profiles

Every user-facing mistake raises RegistryError with one line naming the file, entry, field
and what is valid. Unknown fields are errors, so a typo never falls back to a default.
Units: bytes, bytes/s, FLOP/s, microseconds; GB means 1e9 bytes (datasheet convention).
"""

from moegraph.registry.fields import CURVE_NAMES, IN_STEP_CLASSES, Curve, RegistryError
from moegraph.registry.configs import Hardware, ModelConfig
from moegraph.registry.loading import hardware_names, load_hardware, load_model, model_names

__all__ = ["ModelConfig", "Hardware", "RegistryError", "CURVE_NAMES", "IN_STEP_CLASSES", "Curve", "load_model",
           "load_hardware", "model_names", "hardware_names"]
