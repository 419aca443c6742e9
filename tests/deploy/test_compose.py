"""Every compose file, alone or with its override, through `docker-compose config`: the files
parse, merge and interpolate as a real compose implementation does it, and the merged model
has the services, the dependencies and the JOBPLANE_REDIS_URL each variant promises, the
one-off that registers the templates, the worker built from a directory of one's own, no
server of its own when the servers are yours, and an OpenTelemetry Collector that every
jobplane service sends its spans to, with a configuration that takes them in and passes them on."""

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.deploy.conftest import COMPOSE_MISSING

ROOT = Path(__file__).parents[2]
BASE = "compose/docker-compose.yml"
WORKER_IMAGE = "compose/worker-image.yml"
EXTERNAL = "compose/external-servers.yml"
OTEL = "compose/otel-collector.yml"
# Not a compose file: the collector's own, which OTEL mounts into it.
COLLECTOR_CONFIG = "compose/otel-collector-config.yaml"
COLLECTOR = "otel-collector"
COLLECTOR_URL = f"http://{COLLECTOR}:4318"
JOBPLANE = ("api", "worker", "scheduler", "notifier")
SENTINEL_URL = "redis+sentinel://sentinel-1:26379,sentinel-2:26379,sentinel-3:26379/mymaster/0"
CLUSTER_URL = "redis+cluster://redis-1:6379,redis-2:6379,redis-3:6379"
# A replica set and a Redis of one's own, as the external-servers file requires them.
OWN = {
    "JOBPLANE_MONGODB_URL": "mongodb://db1,db2,db3/?replicaSet=prod",
    "JOBPLANE_REDIS_URL": "rediss://cache.internal:6380/2",
}


@dataclass(frozen=True)
class Variant:
    services: set[str]
    redis_url: str
    # what the jobplane services wait for of `mongo` and of `redis`
    mongo_condition: str
    redis_condition: str
    # the variables it requires besides JOBPLANE_ADMIN_KEY and JOBPLANE_WORKER_BUILD
    variables: dict[str, str] = field(default_factory=dict)


# Every variant runs these besides its Redis servers: the one-off `templates` too.
SERVICES = {"mongo", "redis", *JOBPLANE, "templates"}
HEALTHY, DONE = "service_healthy", "service_completed_successfully"
ONE = Variant(SERVICES, "redis://redis:6379/0", HEALTHY, HEALTHY)
SENTINEL = Variant(
    SERVICES | {"redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"},
    SENTINEL_URL,
    HEALTHY,
    HEALTHY,
)
CLUSTER = Variant(SERVICES | {"redis-1", "redis-2", "redis-3"}, CLUSTER_URL, HEALTHY, DONE)
# `mongo` and `redis` stay, as one-offs that run no server (the file's header says why).
OWN_SERVERS = Variant(SERVICES, OWN["JOBPLANE_REDIS_URL"], DONE, DONE, OWN)


def traced(variant: Variant) -> Variant:
    """`variant` with OTEL added: the same, and the collector."""
    return replace(variant, services=variant.services | {COLLECTOR})


# files given with -f, in order -> what they promise
VARIANTS: dict[tuple[str, ...], Variant] = {
    (BASE,): ONE,
    (BASE, "compose/redis-sentinel.yml"): SENTINEL,
    (BASE, "compose/redis-cluster.yml"): CLUSTER,
    (BASE, WORKER_IMAGE): ONE,
    (BASE, "compose/redis-cluster.yml", WORKER_IMAGE): CLUSTER,
    (BASE, EXTERNAL): OWN_SERVERS,
    (BASE, EXTERNAL, WORKER_IMAGE): OWN_SERVERS,
    (BASE, OTEL): traced(ONE),
    (BASE, "compose/redis-sentinel.yml", OTEL): traced(SENTINEL),
    (BASE, EXTERNAL, WORKER_IMAGE, OTEL): traced(OWN_SERVERS),
}

needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None, reason=COMPOSE_MISSING)


def compose(files: tuple[str, ...], **variables: str) -> subprocess.CompletedProcess[str]:
    """`docker-compose config` of `files` with only `variables` set (JOBPLANE_ADMIN_KEY...):
    nothing from the caller's environment steers compose (COMPOSE_FILE, a set admin key...)."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "JOBPLANE_", "DOCKER"))
    }
    env.update(variables)
    args = ["docker-compose", *(a for f in files for a in ("-f", f)), "config"]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def required(tmp_path: Path) -> dict[str, str]:
    """The variables the files require, set; the worker's build directory must exist."""
    return {"JOBPLANE_ADMIN_KEY": "a-key-of-the-test", "JOBPLANE_WORKER_BUILD": str(tmp_path)}


def merged(files: tuple[str, ...], variables: dict[str, str]) -> dict[str, Any]:
    done = compose(files, **variables)
    assert done.returncode == 0, done.stderr
    model: dict[str, Any] = yaml.safe_load(done.stdout)
    return model


def test_every_compose_file_is_checked() -> None:
    shipped = {f"compose/{p.name}" for p in (ROOT / "compose").glob("*.y*ml")}
    assert shipped == {f for files in VARIANTS for f in files} | {COLLECTOR_CONFIG}


@needs_compose
@pytest.mark.parametrize("files", list(VARIANTS), ids=lambda f: "+".join(Path(p).stem for p in f))
def test_variant_merges_into_the_promised_services(
    files: tuple[str, ...], required: dict[str, str]
) -> None:
    variant = VARIANTS[files]
    services = merged(files, required | variant.variables)["services"]
    assert set(services) == variant.services
    for name in JOBPLANE:
        service = services[name]
        assert service["environment"]["JOBPLANE_REDIS_URL"] == variant.redis_url
        assert service["environment"]["JOBPLANE_ADMIN_KEY"] == "a-key-of-the-test"
        assert service["depends_on"]["mongo"] == {"condition": variant.mongo_condition}
        assert service["depends_on"]["redis"] == {"condition": variant.redis_condition}
        assert service["command"] == [name]
        own = name == "worker" and WORKER_IMAGE in files
        context = Path(required["JOBPLANE_WORKER_BUILD"]) if own else ROOT
        assert Path(service["build"]["context"]) == context
        # Tracing is off unless OTEL is given: then every process exports to the collector.
        otel = {k: v for k, v in service["environment"].items() if k.startswith("OTEL_")}
        assert otel == ({"OTEL_EXPORTER_OTLP_ENDPOINT": COLLECTOR_URL} if OTEL in files else {})
        if OTEL in files:
            assert service["depends_on"][COLLECTOR] == {"condition": "service_started"}
    for name, service in services.items():
        for needed in service.get("depends_on", {}):
            assert needed in services, f"{name} depends on {needed}, which is not a service"


@needs_compose
def test_the_urls_of_your_own_servers_come_from_the_environment(required: dict[str, str]) -> None:
    for variables, mongo_url, redis_url in (
        ({}, "mongodb://mongo:27017/?replicaSet=rs0", "redis://redis:6379/0"),
        (OWN, OWN["JOBPLANE_MONGODB_URL"], OWN["JOBPLANE_REDIS_URL"]),
    ):
        services = merged((BASE,), required | variables)["services"]
        for name in JOBPLANE:
            environment = services[name]["environment"]
            assert environment["JOBPLANE_MONGODB_URL"] == mongo_url
            assert environment["JOBPLANE_REDIS_URL"] == redis_url


@needs_compose
@pytest.mark.parametrize("files", list(VARIANTS), ids=lambda f: "+".join(Path(p).stem for p in f))
def test_variant_refuses_to_start_without_an_admin_key(
    files: tuple[str, ...], required: dict[str, str]
) -> None:
    done = compose(files, **{**required, **VARIANTS[files].variables, "JOBPLANE_ADMIN_KEY": ""})
    assert done.returncode != 0
    assert "set JOBPLANE_ADMIN_KEY" in done.stderr


@needs_compose
@pytest.mark.parametrize("files", list(VARIANTS), ids=lambda f: "+".join(Path(p).stem for p in f))
def test_templates_are_registered_once_the_api_is_ready(
    files: tuple[str, ...], required: dict[str, str]
) -> None:
    services = merged(files, required | VARIANTS[files].variables)["services"]
    api, once = services["api"], services["templates"]
    assert "/readyz" in " ".join(api["healthcheck"]["test"])
    assert once["depends_on"] == {"api": {"condition": "service_healthy"}}
    assert once["restart"] == "no"
    assert once["environment"] == {
        "JOBPLANE_URL": "http://api:8000",
        "JOBPLANE_API_KEY": required["JOBPLANE_ADMIN_KEY"],
    }
    assert once["volumes"] == [f"{ROOT / 'templates'}:/templates:ro"]
    assert once["command"] == ["templates", "apply", "/templates"]
    # the port the API listens on in the image, the one the one-off calls
    assert api["ports"] == [{"published": 8000, "target": 8000}]


@needs_compose
def test_the_templates_directory_can_be_another(required: dict[str, str], tmp_path: Path) -> None:
    mine = tmp_path / "my-templates"
    services = merged((BASE,), {**required, "JOBPLANE_TEMPLATES_DIR": str(mine)})["services"]
    assert services["templates"]["volumes"] == [f"{mine}:/templates:ro"]


@needs_compose
def test_worker_image_needs_the_directory_of_its_dockerfile(required: dict[str, str]) -> None:
    done = compose((BASE, WORKER_IMAGE), JOBPLANE_ADMIN_KEY=required["JOBPLANE_ADMIN_KEY"])
    assert done.returncode != 0
    assert "set JOBPLANE_WORKER_BUILD" in done.stderr


@needs_compose
def test_external_servers_replace_the_bundled_ones(required: dict[str, str]) -> None:
    services = merged((BASE, EXTERNAL), required | OWN)["services"]
    for name in JOBPLANE:
        environment = services[name]["environment"]
        assert environment["JOBPLANE_MONGODB_URL"] == OWN["JOBPLANE_MONGODB_URL"]
        assert environment["JOBPLANE_REDIS_URL"] == OWN["JOBPLANE_REDIS_URL"]
    # No server runs: `mongo` and `redis` exit at once, and no service runs a server's image.
    for name in ("mongo", "redis"):
        assert services[name]["command"] == ["true"]
        assert services[name]["restart"] == "no"
        assert "ports" not in services[name]
    images = {service.get("image", "").partition(":")[0] for service in services.values()}
    assert not images & {"mongo", "redis"}


@needs_compose
@pytest.mark.parametrize("variable", list(OWN))
def test_external_servers_need_both_urls(required: dict[str, str], variable: str) -> None:
    done = compose((BASE, EXTERNAL), **{**required, **OWN, variable: ""})
    assert done.returncode != 0
    assert f"set {variable}" in done.stderr


def hosts(url: str) -> list[tuple[str, int]]:
    netloc = urlsplit(url).netloc.rpartition("@")[2]
    return [(h, int(p)) for h, _, p in (node.rpartition(":") for node in netloc.split(","))]


@needs_compose
def test_sentinel_url_names_the_sentinels_and_their_master(required: dict[str, str]) -> None:
    services = merged((BASE, "compose/redis-sentinel.yml"), required)["services"]
    master = urlsplit(SENTINEL_URL).path.split("/")[1]
    for host, port in hosts(SENTINEL_URL):
        script = services[host]["command"][-1]
        assert services[host]["environment"]["SENTINEL_NAME"] == host
        assert f"port {port}" in script
        # `sentinel monitor <name> <host> <port> <quorum>`: the master is the `redis` service.
        assert re.search(rf"sentinel monitor {master} redis 6379 2\b", script)
        assert "--sentinel" in script
    replica = services["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1 :][:2] == ["redis", "6379"]
    # Each server announces its service name to its master (what the sentinels then hand out).
    for name in ("redis", "redis-replica"):
        command = services[name]["command"]
        assert command[command.index("--replica-announce-ip") + 1] == name


@needs_compose
def test_cluster_url_names_the_nodes_that_announce_themselves(required: dict[str, str]) -> None:
    services = merged((BASE, "compose/redis-cluster.yml"), required)["services"]
    nodes = hosts(CLUSTER_URL)
    for host, port in nodes:
        command = services[host]["command"]
        assert command[0] == "redis-server"
        assert command[command.index("--cluster-enabled") + 1] == "yes"
        assert command[command.index("--cluster-announce-hostname") + 1] == host
        assert command[command.index("--cluster-preferred-endpoint-type") + 1] == "hostname"
        assert port == 6379
    # The one-off forms the cluster of exactly those nodes, after each is up.
    form = services["redis"]
    assert set(form["depends_on"]) == {host for host, _ in nodes}
    create = " ".join(f"{host}:{port}" for host, port in nodes)
    assert f"redis-cli --cluster create {create} --cluster-yes" in form["command"][-1]
    assert form["restart"] == "no"


def collector_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((ROOT / COLLECTOR_CONFIG).read_text())
    return config


@needs_compose
def test_the_collector_listens_where_the_services_send(required: dict[str, str]) -> None:
    collector = merged((BASE, OTEL), required)["services"][COLLECTOR]
    # A version of its own, not whatever `latest` is on the day of a pull.
    assert re.fullmatch(r"otel/opentelemetry-collector-contrib:\d+\.\d+\.\d+", collector["image"])
    (flag,) = collector["command"]
    inside = flag.removeprefix("--config=")
    assert collector["volumes"] == [f"{ROOT / COLLECTOR_CONFIG}:{inside}:ro"]
    protocols = collector_config()["receivers"]["otlp"]["protocols"]
    # On every interface (the collector's default is localhost), at the port the services use.
    assert protocols["http"]["endpoint"] == f"0.0.0.0:{urlsplit(COLLECTOR_URL).port}"
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
    published = [{"published": port, "target": port} for port in (4317, 4318)]
    assert collector["ports"] == published


def test_the_collector_passes_traces_from_otlp_to_its_exporters() -> None:
    config = collector_config()
    pipelines = config["service"]["pipelines"]
    assert set(pipelines) == {"traces"}
    assert pipelines["traces"]["receivers"] == ["otlp"]
    # Out of the box it only prints; a backend is the commented example's to add.
    assert pipelines["traces"]["exporters"] == ["debug"]
    # The collector refuses a pipeline naming a component it lacks; one defined and in no
    # pipeline would be silently off (say, a backend's exporter added but not wired).
    for kind in ("receivers", "processors", "exporters"):
        used = {name for pipeline in pipelines.values() for name in pipeline.get(kind, [])}
        assert used == set(config.get(kind) or {}), kind
