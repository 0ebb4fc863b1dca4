"""Schema fuzzing of the frontend's whole HTTP API with schemathesis: requests that fit the OpenAPI
document (positive) and requests that break it (negative: wrong types, missing fields, out-of-range
values), sent to the real app in front of the mock backend. The pass condition: no 5xx, ever, and every
error is the OpenAI error object.

`make test` runs a few hundred cases; `make fuzz` (KVYARD_FUZZ_EXAMPLES=150) runs thousands. The
strategies are driven by Hypothesis directly, one run per (operation, mode), so the test does not depend
on schemathesis's pytest plugin."""
from __future__ import annotations

import os
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from kvyard.tokenizer import TextTokenizer
from tests.support.mock_stack import MockBackendThread, mock_frontend, script

EXAMPLES = int(os.environ.get("KVYARD_FUZZ_EXAMPLES", "20"))  # per operation and generation mode


def test_no_request_gets_a_5xx(tokenizer: TextTokenizer) -> None:
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    with MockBackendThread(script(tokenizer, "Hello there!")) as backend, \
            mock_frontend(tokenizer, backend.address) as frontend:
        api = schemathesis.openapi.from_url(f"{frontend.url}/openapi.json")
        operations = [result.ok() for result in api.get_all_operations()]
        assert len(operations) >= 20

        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                @given(case=operation.as_strategy(generation_mode=mode))
                @settings(max_examples=EXAMPLES, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                def send(case: schemathesis.Case) -> None:
                    response = case.call(base_url=frontend.url, timeout=20)
                    statuses[response.status_code] += 1
                    where = f"{case.method} {case.path} {mode.value} body={str(case.body)[:300]}"
                    if response.status_code >= 500:
                        failures.append(f"{response.status_code} {where}: {response.text[:300]}")
                    elif response.status_code >= 400:
                        error = response.json().get("error") if response.text.startswith("{") else None
                        if not (isinstance(error, dict) and error.get("message")):
                            failures.append(f"{response.status_code} without an error object {where}: "
                                            f"{response.text[:300]}")
                try:
                    send()
                except Unsatisfiable:  # no way to break a schema with nothing in it (GET /health)
                    assert mode is GenerationMode.NEGATIVE
    total = sum(statuses.values())
    print(f"\nfuzzed {total} requests over {len(operations)} operations: "
          + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    assert not failures, "\n".join(failures[:20])
    assert total >= 5 * len(operations)  # it did fuzz (an operation without inputs has few cases)
