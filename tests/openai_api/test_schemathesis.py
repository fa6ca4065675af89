"""Schemathesis against `spececd api`'s own OpenAPI document (``/openapi.json``), in
process (ASGI): whatever it generates, valid or not, gets no server error, a status the
document lists for that operation, a body that conforms to the document, and every error
in OpenAI's shape. The default run is bounded to a few seconds; a slow-marked run sends
many more.

Valid bodies that name the served model generate: their ``n`` and ``max_tokens`` are cut
to a few tokens before they are sent, so that the run measures the API, not the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("torch")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.config import SchemathesisConfig  # noqa: E402

from spececd.generator import Generator  # noqa: E402
from spececd.openai_api.server import Api, create_app  # noqa: E402

MODEL = "spececd"
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance,
          content_type_conformance]
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
FUZZING_ONLY = SchemathesisConfig.from_dict({"phases": {"coverage": {"enabled": False}}})


@pytest.fixture(scope="module")
def api_app(tiny_models: dict[str, Path]) -> Iterator[Any]:
    gen = Generator.load(str(tiny_models["draft"]), str(tiny_models["llama"]), device="cpu",
                         dtype="float32")
    api = Api(gen, MODEL, max_concurrency=4)
    yield create_app(api)
    api.executor.shutdown(wait=True, cancel_futures=True)
    gen.close()


@pytest.fixture(scope="module")
def api_schema(api_app: Any) -> Any:
    """Fuzzing only: the coverage phase's boundary cases take longer than the default
    run's budget."""
    return schemathesis.openapi.from_asgi("/openapi.json", api_app, config=FUZZING_ONLY)


@pytest.fixture(scope="module")
def api_schema_in_full(api_app: Any) -> Any:
    return schemathesis.openapi.from_asgi("/openapi.json", api_app)


schema = schemathesis.pytest.from_fixture("api_schema")
schema_in_full = schemathesis.pytest.from_fixture("api_schema_in_full")


def cheap(case: Any) -> None:
    """Valid generation requests kept to a few tokens (see the module docstring)."""
    body = case.body
    if isinstance(body, dict) and body.get("model") == MODEL:
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(field), int) and body[field] > 4:
                body[field] = 4
        if isinstance(body.get("n"), int) and body["n"] > 2:
            body["n"] = 2


def check_openai_error(response: Any) -> None:
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]
        assert "the `None` parameter" not in error["message"], error["message"]


def run(case: Any) -> None:
    cheap(case)
    response = case.call_and_validate(checks=CHECKS)
    check_openai_error(response)


@schema.parametrize()
@settings(max_examples=10, **SETTINGS)  # type: ignore[arg-type]
def test_the_api_answers_as_its_document_says(case: Any) -> None:
    run(case)


@pytest.mark.slow
@schema_in_full.parametrize()
@settings(max_examples=10_000, **SETTINGS)  # type: ignore[arg-type]
def test_the_api_answers_as_its_document_says_at_length(case: Any) -> None:
    run(case)


def test_the_document_lists_every_error_status_in_openais_shape(api_app: Any) -> None:
    document = api_app.openapi()
    for path, method in (("/v1/completions", "post"), ("/v1/chat/completions", "post")):
        responses = document["paths"][path][method]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "408", "413", "502", "503"}
        for status, answer in responses.items():
            if status != "200":
                ref = answer["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/ErrorResponse"), (path, status)
    assert "HTTPValidationError" not in document["components"]["schemas"]


@pytest.mark.parametrize("body,content_type", [
    (None, None), (b"", "application/json"), (b"prompt=hi", "text/plain"),
    (b"[1, 2]", "application/json"), (b"{not json", "application/json")])
def test_a_missing_or_non_json_body_is_a_400_that_says_what_to_send(
        api_app: Any, body: bytes | None, content_type: str | None) -> None:
    from starlette.testclient import TestClient

    headers = {"content-type": content_type} if content_type else {}
    with TestClient(api_app) as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = client.post(path, content=body, headers=headers)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert "the `None` parameter" not in error["message"]
            assert "JSON" in error["message"], error["message"]
