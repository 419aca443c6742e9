"""JOBPLANE_TRACE_URL: where the dashboard links a run's trace, checked as a process starts."""

import pytest
from pydantic import ValidationError

from jobplane.cli import main
from jobplane.settings import Settings, refusal


@pytest.mark.parametrize(
    "url",
    [
        "https://jaeger.example/trace/{traceId}",
        "http://127.0.0.1:16686/trace/{traceId}",
        "HTTPS://Tempo.example/explore?traceId={traceId}&orgId=1",
    ],
)
def test_an_http_url_holding_the_trace_id_is_kept_as_written(url: str) -> None:
    assert Settings(trace_url=url).trace_url == url


def test_unset_or_empty_is_no_link() -> None:
    assert Settings().trace_url is None
    assert Settings(trace_url="").trace_url is None


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("jaeger.example/trace/{traceId}", "must be an http:// or https:// URL with a host"),
        ("javascript:alert(1)//{traceId}", "must be an http:// or https:// URL with a host"),
        ("ftp://jaeger.example/{traceId}", "must be an http:// or https:// URL with a host"),
        ("https:///trace/{traceId}", "must be an http:// or https:// URL with a host"),
        ("https://jaeger.example:99999/{traceId}", "must be an http:// or https:// URL"),
        ("https://[::1/trace/{traceId}", "must be an http:// or https:// URL with a host"),
        ("https://jaeger.example/trace/", "must hold {traceId}"),
        ("https://jaeger.example/trace/{traceid}", "must hold {traceId}"),
        ("https://ops:hunter2@jaeger.example/{traceId}", "may not hold a user name or password"),
    ],
)
def test_anything_else_is_refused_naming_the_variable(url: str, says: str) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(trace_url=url)
    said = refusal(refused.value)
    assert said.startswith("JOBPLANE_TRACE_URL ") and says in said, said
    assert "hunter2" not in said


def test_a_process_refuses_a_bad_trace_url_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("JOBPLANE_TRACE_URL", "https://ops:hunter2@jaeger.example/trace")
    with pytest.raises(SystemExit) as exited:
        main(["api"])
    assert exited.value.code == 1
    said = capsys.readouterr().err
    assert said.startswith("error: InvalidSettings: JOBPLANE_TRACE_URL "), said
    assert said.count("\n") == 1, said
    assert "hunter2" not in said
