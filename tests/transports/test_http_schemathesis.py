"""Schemathesis against the HTTP transport's own OpenAPI document (``/openapi.json`` on
the listener `spececd serve --http-port` opens), over a real loopback server on the
torch-free toy target: whatever it generates gets no server error (a full server's
documented 503 ``server_busy`` aside: the sessions it opens count until they idle out), a
status the document lists, a body that conforms to it, and every error in the transport's
typed shape
(``{"error": {"code", "message"}}`` with a code of the protocol's error tree). The
default run is bounded to a few seconds; a slow-marked run sends many more.

``/v1/links/{link_id}/frames`` takes a binary body the document cannot describe beyond
"bytes": the frame fuzzer (tests/fuzz.py) is what exercises it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("torch")  # tests.transports.test_http's server helper

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.config import SchemathesisConfig  # noqa: E402

from spececd.cloud.runners import builtin_service  # noqa: E402
from spececd.cloud.service import ServicePolicy  # noqa: E402
from spececd.protocol.errors import _BY_CODE  # noqa: E402
from tests.support.servers import ThreadServer  # noqa: E402
from tests.toy import ToyBackend, ToyModel  # noqa: E402

CHECKS = [status_code_conformance, response_schema_conformance, content_type_conformance]
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
IDLE = 3.0  # seconds before a session the generated requests left open is evicted
FUZZING_ONLY = SchemathesisConfig.from_dict({"phases": {"coverage": {"enabled": False}}})


@pytest.fixture(scope="module")
def transport_server() -> Iterator[ThreadServer]:
    server = ThreadServer(builtin_service(ToyBackend(ToyModel(seed=0)),
                                 policy=ServicePolicy(idle_timeout=IDLE)))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def transport_schema(transport_server: ThreadServer) -> Any:
    """Fuzzing only: the coverage phase's boundary cases take longer than the default
    run's budget."""
    return schemathesis.openapi.from_url(f"{transport_server.url}/openapi.json",
                                         config=FUZZING_ONLY)


@pytest.fixture(scope="module")
def transport_schema_in_full(transport_server: ThreadServer) -> Any:
    return schemathesis.openapi.from_url(f"{transport_server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("transport_schema")
schema_in_full = schemathesis.pytest.from_fixture("transport_schema_in_full")


def run(case: Any) -> None:
    response = case.call_and_validate(checks=CHECKS, timeout=10)
    # No server error, except the documented 503 of a full server: every session the
    # generated requests open counts until it closes or idles out (IDLE seconds).
    if response.status_code >= 500:
        assert (response.status_code, response.json()["error"]["code"]) == \
            (503, "server_busy"), response.text
    if response.status_code >= 400 and response.headers.get(
            "content-type", [""])[0].startswith("application/json"):
        error = response.json()["error"]
        assert set(error) == {"code", "message"} and error["code"] in _BY_CODE, error


@schema.parametrize()
@settings(max_examples=5, **SETTINGS)  # type: ignore[arg-type]
def test_the_http_transport_answers_as_its_document_says(case: Any) -> None:
    run(case)


@pytest.mark.slow
@schema_in_full.parametrize()
@settings(max_examples=1000, **SETTINGS)  # type: ignore[arg-type]
def test_the_http_transport_answers_as_its_document_says_at_length(case: Any) -> None:
    run(case)
