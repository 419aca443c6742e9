"""Template definitions: parsing YAML/JSON files and checking them before registration."""

from jobplane.templates.loader import load_file, load_path, parse_template

__all__ = ["load_file", "load_path", "parse_template"]
