"""Fixtures shared by the frontend tests that run an in-process frontend against the mock backend.
A module may define its own `mock` fixture (the scripted backend; the default answers "Hello there, friend!");
these build on it."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from kvyard.tokenizer import TextTokenizer
from tests.frontend.role_stack import stack  # noqa: F401  (a FRONTEND process, shared by test_frontend_role*.py)
from tests.support.mock_stack import MockBackendThread, MockFrontend, mock_frontend, script


@pytest.fixture(scope="module")
def mock(tokenizer: TextTokenizer) -> Iterator[MockBackendThread]:
    with MockBackendThread(script(tokenizer, "Hello there, friend!")) as backend:
        yield backend


@pytest.fixture(scope="module")
def front(tokenizer: TextTokenizer, mock: MockBackendThread) -> Iterator[MockFrontend]:
    with mock_frontend(tokenizer, mock.address) as f:
        yield f


@pytest.fixture(scope="module")
def http(front: MockFrontend) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=front.url, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def client(front: MockFrontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0, timeout=10)
