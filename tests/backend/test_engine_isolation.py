"""One request must never hurt another: a row that cannot be sampled fails alone, a reused request id
is refused alone, and the poison-pill values are refused (or made harmless) before they reach a step."""
from __future__ import annotations

import asyncio
import math

import pytest

from backend.engine_loop import EngineLoop
from kvyard.sampling_params import SamplingParams
from kvyard.errors import ErrorCode, RequestError
from tests.backend.conftest import EngineFactory, run_on_loop
from tests.backend.test_engine_model import assert_pool_idle, request, run_alone


def test_poison_values_are_refused_or_harmless() -> None:
    for bad in (dict(temperature=math.nan), dict(top_p=math.inf), dict(repetition_penalty=1e-40),
                dict(repetition_penalty=1e9), dict(presence_penalty=5.0), dict(logit_bias={3: 1e30})):
        with pytest.raises(ValueError):
            SamplingParams(**bad).validate(100)  # type: ignore[arg-type]
    for tiny in (1e-38, 1e-45, 5e-6):
        params = SamplingParams(temperature=tiny)
        params.validate(100)
        assert params.greedy  # logits / 1e-38 would overflow: such a temperature samples greedily


def test_a_row_that_cannot_be_sampled_fails_alone(make_engine: EngineFactory,
                                                  france_prompt_ids: list[int]) -> None:
    """repetition_penalty=1e-40 slipped past validation (the sampler's own check is the last line):
    that request gets an error, the others in the same steps finish with their usual tokens."""
    want = run_alone(make_engine, france_prompt_ids, 8)
    engine = make_engine(num_blocks=64)
    engine.validate = lambda req: None  # type: ignore[method-assign]  # as if the edge had missed it
    loop = EngineLoop(engine)
    poison = SamplingParams(temperature=0.7, repetition_penalty=1e-40)

    async def scenario() -> tuple[list[int], list[int], BaseException | None]:
        async def collect(req) -> list[int]:  # type: ignore[no-untyped-def]
            return [o.token_id async for outs in loop.generate(req) for o in outs]
        results = await asyncio.gather(collect(request("a", france_prompt_ids, 8)),
                                       collect(request("bad", france_prompt_ids, 8, sampling=poison)),
                                       collect(request("b", france_prompt_ids, 8)), return_exceptions=True)
        a, bad, b = results
        return a, b, bad  # type: ignore[return-value]

    a, b, bad = run_on_loop(loop, scenario)
    assert isinstance(bad, RequestError) and bad.code is ErrorCode.INTERNAL
    assert a == want and b == want
    assert_pool_idle(engine)


def test_a_reused_request_id_is_refused_alone(make_engine: EngineFactory, france_prompt_ids: list[int]) -> None:
    want = run_alone(make_engine, france_prompt_ids, 24)
    engine = make_engine(num_blocks=64)
    loop = EngineLoop(engine)

    async def scenario() -> tuple[list[int], BaseException | None]:
        first = loop.generate(request("same", france_prompt_ids, 24))
        tokens = [o.token_id for o in (await first.__anext__())]
        duplicate = None
        try:
            async for _ in loop.generate(request("same", france_prompt_ids, 24)):
                pass
        except RequestError as exc:
            duplicate = exc
        tokens += [o.token_id async for outs in first for o in outs]
        return tokens, duplicate

    tokens, duplicate = run_on_loop(loop, scenario)
    assert isinstance(duplicate, RequestError) and "already running" in duplicate.message
    assert tokens == want  # the original ran to the end, untouched
    assert_pool_idle(engine)
