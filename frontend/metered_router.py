"""Router with request metrics: every backend generation (chat, LMTP, /generate) is timed and counted here."""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from frontend.backend_client import PoolInput, PoolOutput, BackendOutput, ScoreOutput
from frontend.config import FrontendConfig
from frontend.images import LoadedImage
from frontend.routing import Router
from kvyard.errors import RequestError
from kvyard.metrics import FrontendMetrics
from kvyard.sampling_params import SamplingParams


class MeteredRouter(Router):
    """A Router whose generate() records TTFT, inter-token and end-to-end latency, token counts, the
    backend's prefix-cache reuse and the requests waiting for / streaming tokens."""

    def __init__(self, cfg: FrontendConfig, metrics: FrontendMetrics) -> None:
        super().__init__(cfg)
        self.metrics = metrics

    async def generate(self, request_id: str, input_ids: list[int], params: SamplingParams,
                       model: str | None = None, images: Sequence[LoadedImage] = ()
                       ) -> AsyncIterator[list[BackendOutput]]:
        m = self.metrics
        timer = m.timer()
        gen = super().generate(request_id, input_ids, params, model, images)
        gauge = m.waiting
        gauge.inc()
        first, failed = True, False
        unfinished = max(1, params.n)
        try:
            async for outs in gen:
                if first and outs:
                    first = False
                    m.prompt(outs[0].aux.input_len or len(input_ids), outs[0].aux.reuse_len)
                    gauge.dec()
                    gauge = m.running
                    gauge.inc()
                timer.step(sum(len(o.token_ids) for o in outs))
                unfinished -= sum(1 for o in outs if o.finish_reason is not None)
                if unfinished == 0:
                    timer.finish()  # now: callers may stop reading once they have every finish_reason
                yield outs
        except RequestError:
            failed = True  # no end-to-end latency to report
            raise
        finally:
            if not failed and timer.tokens:
                timer.finish()  # the caller stopped reading (a stop string, a closed socket): it ended here
            gauge.dec()
            await gen.aclose()

    async def pool(self, request_id: str, items: list[PoolInput], task: str, model: str,
                   direct: tuple[str, ...], timeout_s: float | None = None) -> PoolOutput:
        """Router.pool, its input tokens counted as prompt tokens."""
        out = await super().pool(request_id, items, task, model, direct, timeout_s)
        self.metrics.prompt(out.input_len, 0)
        return out

    async def score(self, request_id: str, prompt_ids: list[int], scored_ids: list[int],
                    model: str | None = None, top_logprobs: int = 0, adapter: str = "") -> ScoreOutput:
        """The chosen backend's ScoreCall (no retry: scoring is one short call); a LoRA adapter runs on its
        base model's backends, as a generation does."""
        route = await self.route(self.cfg.model_name if adapter else model or self.cfg.model_name,
                                 prompt_ids + scored_ids, adapter=adapter)
        timeout = self.cfg.request_timeout_s or None
        out = await self.client(route.address).score(request_id, prompt_ids, scored_ids, top_logprobs, timeout,
                                                      adapter)
        self.metrics.prompt(out.input_len or len(prompt_ids) + len(scored_ids), out.reuse_len)
        return out
