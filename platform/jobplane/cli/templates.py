"""`jobplane templates`: register template files or templates defined in code, check, export,
list, show, enable and disable them."""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jobplane.cli.client import APIClient, CLIError, located, segment
from jobplane.cli.render import template_line
from jobplane.errors import ValidationFailed
from jobplane.model import Template

if TYPE_CHECKING:
    from jobplane.templates import code


def apply(args: argparse.Namespace, client: APIClient) -> None:
    """Register each template of a file, a directory's files, or `module:attribute`."""
    for name, body, kind in _sources(args.source):
        try:
            t = client.call("POST", "/v1/templates", content=body, headers={"content-type": kind})
        except CLIError as exc:  # of many, say which was refused
            raise CLIError(exc.code, f"{name}: {exc.message}") from exc
        unchanged = "" if t.get("created", True) else " (unchanged)"
        print(f"{name}: {t['type']} v{t['version']}{unchanged}")
        for warning in t.get("warnings", []):
            print(f"warning: {name}: {warning}", file=sys.stderr)


def export(args: argparse.Namespace) -> None:
    """Print the templates `module:attribute` defines as YAML, one document each."""
    print("---\n".join(t.yaml() for t in _in_code(args.ref)), end="")


def validate(args: argparse.Namespace) -> None:
    """Check a template file as registration would, here: its steps' layers, or each problem."""
    from jobplane.model.graph import Graph
    from jobplane.templates import load_file

    path = Path(args.file)
    try:
        spec = load_file(path)
    except OSError as exc:
        raise CLIError("InvalidArgument", f"{path}: {exc.strerror}") from exc
    except ValidationFailed as exc:
        for problem in exc.details["errors"]:
            print(f"{path}: {located(problem)}", file=sys.stderr)
        raise CLIError("ValidationFailed", f"{path}: {exc.message}") from exc
    layers = Graph.of([(s.id, s.needs) for s in spec.steps]).layers
    print(f"{path}: {spec.type}, {len(spec.steps)} steps in {len(layers)} layers")
    # A map step says which template its children run.
    fans = {s.id: f" (map → {s.map.template})" for s in spec.steps if s.map is not None}
    for depth, layer in enumerate(layers, 1):
        print(f"  {depth}. {', '.join(step + fans.get(step, '') for step in layer)}")


def list_latest(args: argparse.Namespace, client: APIClient) -> None:
    for template in client.call("GET", "/v1/templates"):
        print(template_line(Template.model_validate(template)))


def show(args: argparse.Namespace, client: APIClient) -> None:
    path = f"/v1/templates/{segment(args.type)}"
    if args.version is not None:
        path += f"/versions/{args.version}"
    print(json.dumps(client.call("GET", path), indent=2))


def toggle(args: argparse.Namespace, client: APIClient) -> None:
    path = f"/v1/templates/{segment(args.type)}/{args.action}"
    print(template_line(Template.model_validate(client.call("POST", path))))


def _sources(source: str) -> list[tuple[str, bytes, str]]:
    """What `apply` sends, as (name shown, body, content type): each template file, or each
    template `module:attribute` defines (a path that exists is a path)."""
    from jobplane.templates.code import CODE_REF
    from jobplane.templates.loader import SUFFIXES

    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES)
        if not files:
            raise CLIError("InvalidArgument", f"{path}: no {', '.join(sorted(SUFFIXES))} files")
    elif path.is_file():
        files = [path]
    elif CODE_REF.fullmatch(source):
        return [
            (source, json.dumps(t.body()).encode(), "application/json") for t in _in_code(source)
        ]
    else:
        raise CLIError("InvalidArgument", f"{path}: no such file, directory or module:attribute")
    try:
        return [
            (
                f.name,
                f.read_bytes(),
                "application/json" if f.suffix == ".json" else "application/yaml",
            )
            for f in files
        ]
    except OSError as exc:
        raise CLIError("InvalidArgument", f"{exc.filename}: {exc.strerror}") from exc


def _in_code(ref: str) -> list["code.Template"]:
    """The templates `module:attribute` names, imported as `python -m` would (the current
    directory first on the path); a template it refuses is `ValidationFailed`."""
    from jobplane.templates.code import load_code

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return load_code(ref)
    except LookupError as exc:
        raise CLIError("InvalidArgument", str(exc.args[0])) from exc
    except ValidationFailed as exc:
        for problem in exc.details["errors"]:
            print(f"{ref}: {located(problem)}", file=sys.stderr)
        raise CLIError("ValidationFailed", f"{ref}: {exc.message}") from exc
    except Exception as exc:  # the module's own failure to import, in one line
        raise CLIError("InvalidArgument", f"{ref}: {type(exc).__name__}: {exc}") from exc
