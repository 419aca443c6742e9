"""The layers of `docs/architecture.md`'s map: what each part of jobplane may import."""

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2] / "platform"

# A module may import nothing under these prefixes.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # Leaves.
    "jobplane.model": ("jobplane.",),
    "jobplane.clock": ("jobplane.",),
    "jobplane.errors": ("jobplane.",),
    "jobplane.groupcommit": ("jobplane.",),
    "jobplane.process": ("jobplane.",),
    "jobplane.tracing": ("jobplane.",),
    "jobplane.exporting": ("jobplane.",),
    "jobplane.queue.connect": ("jobplane.",),
    "jobplane.queue.keys": ("jobplane.",),
    "jobplane.schedules.cron": ("jobplane.",),
    # Engines: MongoDB's and Redis's parts know nothing of what uses them, nor of each other.
    "jobplane.store": ("jobplane.queue", "jobplane.runs", "jobplane.worker", "jobplane.api"),
    "jobplane.queue.redis": ("jobplane.store", "jobplane.runs", "jobplane.worker"),
    # Services, below the processes that run them.
    "jobplane.runs": ("jobplane.worker", "jobplane.scheduler", "jobplane.api", "jobplane.cli"),
    "jobplane.schedules": ("jobplane.worker", "jobplane.scheduler", "jobplane.api"),
    # Processes: none reaches into another. The API checks a webhook's URL as the notifier
    # will (`webhooks.guard`), and nothing else of the notifier's.
    "jobplane.worker": ("jobplane.api", "jobplane.scheduler", "jobplane.cli", "jobplane.webhooks"),
    "jobplane.scheduler": ("jobplane.api", "jobplane.worker", "jobplane.cli", "jobplane.webhooks"),
    "jobplane.webhooks": ("jobplane.api", "jobplane.worker", "jobplane.scheduler", "jobplane.cli"),
    "jobplane.api": (
        "jobplane.worker",
        "jobplane.scheduler",
        "jobplane.cli",
        "jobplane.webhooks.fanout",
        "jobplane.webhooks.sender",
        "jobplane.webhooks.notifier",
    ),
    # The public client is the run service's, not the API's: over HTTP it never loads FastAPI.
    "jobplane.client": ("jobplane.api", "jobplane.worker", "jobplane.cli", "fastapi"),
}
# But for these: direct mode serves the API's routes in its own process, so that both modes
# answer every call alike (`docs/architecture.md`, "The client's two modes").
# And a process's exporter, which tracing loads only when asked for (it needs the otel extra).
ALLOWED: dict[str, tuple[str, ...]] = {
    "jobplane.client.direct": ("jobplane.api",),
    "jobplane.tracing": ("jobplane.exporting",),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_each_layer_imports_only_what_the_map_allows() -> None:
    broken: list[str] = []
    for path in sorted((ROOT / "jobplane").rglob("*.py")):
        me = module_name(path)
        for layer, forbidden in FORBIDDEN.items():
            if me != layer and not me.startswith(f"{layer}."):
                continue
            for name in imported(path):
                own = name == layer or name.startswith(f"{layer}.")
                if (
                    not own
                    and name.startswith(forbidden)
                    and not name.startswith(ALLOWED.get(me, ()))
                ):
                    broken.append(f"{me} imports {name}")
    assert broken == []
