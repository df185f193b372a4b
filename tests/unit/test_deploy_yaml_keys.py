"""deploy/pdserve.yaml, the documented full config, lists every ServeConfig key.

ServeConfig.from_yaml already rejects a key the dataclasses do not know (checked in
test_deploy_manifests.py); this checks the other direction, so that a key added to a
section (cluster/config*.py) is also documented in the file.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import yaml

from cluster.config.serve import SECTIONS

PDSERVE_YAML = Path(__file__).resolve().parents[2] / "deploy" / "pdserve.yaml"


def config_keys() -> set[str]:
    """Every `section.key` of ServeConfig."""
    return {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in fields(cls)}


def missing_keys(raw: dict) -> set[str]:
    """The ServeConfig keys that the parsed YAML `raw` does not set."""
    return {dotted for dotted in config_keys()
            if dotted.partition(".")[2] not in (raw.get(dotted.partition(".")[0]) or {})}


def load() -> dict:
    return yaml.safe_load(PDSERVE_YAML.read_text())


def test_pdserve_yaml_lists_every_serve_config_key():
    missing = missing_keys(load())
    assert not missing, f"deploy/pdserve.yaml lacks {sorted(missing)}"


def test_the_check_names_each_key_the_file_lacks():
    for dotted in sorted(config_keys()):
        raw = load()
        section, _, key = dotted.partition(".")
        del raw[section][key]
        assert missing_keys(raw) == {dotted}


def test_the_check_names_every_key_of_a_missing_section():
    raw = load()
    del raw["transfer"]
    assert missing_keys(raw) == {k for k in config_keys() if k.startswith("transfer.")}
