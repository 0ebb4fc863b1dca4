"""Backend fixtures on the real embedded model: config, float32 weights loaded once, Engine factory.

The weights (~6 s to dequantize) are shared by every engine a test builds; each engine gets its own
KVCache and Scheduler, which are cheap. The session `tokenizer` fixture comes from tests/conftest.py.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from backend.attention import KVCache
from backend.engine import Engine, GenerationRequest
from backend.engine_loop import EngineLoop
from backend.model import LlamaModel
from backend.model_runner import DirectChunk, DirectSeq, ModelRunner
from backend.scheduler import Scheduler, SchedulerConfig
from backend.weights import load_weights
from kvyard.model_config import ModelConfig, load_model_config
from kvyard.model_path import embedded_model_path
from kvyard.tokenizer import TextTokenizer

CPU = torch.device("cpu")


def _block_layouts() -> list[str]:
    """The layouts GGUF blocks are served in wherever the kernels run: "rows" (float32 activations) and
    "n16" (int16 activations: AVX-512 VNNI, or AVX2 with the same bits)."""
    from backend import kernels
    return [] if kernels.load() is None else ["rows", "n16"]


BLOCK_LAYOUTS = _block_layouts()

# The SmolLM2 ChatML template rendered by hand for one user turn (the template's default system prompt).
CHAT_TEMPLATE = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n{question}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread() -> Iterator[None]:
    """One intra-op thread while backend tests run. On this 2-core box the servers other tests start
    (and anything else running) share the cores; a 2-thread OpenMP team then stalls on its barriers
    and a 60 ms decode step can take 600 ms, while one thread stays steady. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return embedded_model_path()


@pytest.fixture(scope="session")
def model_config(model_path: Path) -> ModelConfig:
    return load_model_config(model_path)


@pytest.fixture(scope="session")
def weights_f32(model_path: Path, model_config: ModelConfig) -> dict[str, torch.Tensor]:
    return load_weights(model_path, model_config, torch.float32, CPU)


@pytest.fixture(scope="session")
def model_f32(model_config: ModelConfig, weights_f32: dict[str, torch.Tensor]) -> LlamaModel:
    """Stateless apart from its weights and RoPE tables: safe to share between engines."""
    return LlamaModel(model_config, weights_f32)


@pytest.fixture(scope="session")
def chat_ids(tokenizer: TextTokenizer) -> Callable[[str], list[int]]:
    """chat_ids(question) → the token ids of the chat prompt asking it, ready for the assistant's answer."""
    def encode(question: str) -> list[int]:
        return tokenizer.encode(CHAT_TEMPLATE.format(question=question), parse_special=True)
    return encode


@pytest.fixture(scope="session")
def france_prompt_ids(chat_ids: Callable[[str], list[int]]) -> list[int]:
    """Greedy answer: "The capital of France is Paris." then eos."""
    return chat_ids("What is the capital of France?")


@pytest.fixture(scope="session")
def eos_id(tokenizer: TextTokenizer) -> int:
    assert tokenizer.eos_token_id is not None
    return tokenizer.eos_token_id


EngineFactory = Callable[..., Engine]


def build_engine(model: LlamaModel, config: ModelConfig, *, num_blocks: int = 256, block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 long_prefill_token_threshold: int = 0, max_model_len: int | None = None,
                 kv_dtype: torch.dtype | None = None) -> Engine:
    cache = KVCache(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                    kv_dtype or model.dtype, model.device)
    scheduler = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size,
                                          max_num_seqs=max_num_seqs,
                                          max_num_batched_tokens=max_num_batched_tokens,
                                          long_prefill_token_threshold=long_prefill_token_threshold))
    return Engine(ModelRunner(model, cache), scheduler, config.vocab_size,
                  max_model_len or config.max_position_embeddings)


@pytest.fixture(scope="session")
def engine_builder() -> Callable[..., Engine]:
    """engine_builder(model, config, **make_engine's options) → an Engine around any model
    (e.g. bfloat16 on CUDA); the KV cache takes the model's dtype and device."""
    return build_engine


@pytest.fixture(scope="session")
def make_engine(model_f32: LlamaModel, model_config: ModelConfig) -> EngineFactory:
    """make_engine(num_blocks=256, block_size=16, max_num_seqs=64, max_num_batched_tokens=2048,
    long_prefill_token_threshold=0, max_model_len=None) → a fresh float32 CPU Engine."""
    def make(**kwargs: int | None) -> Engine:
        return build_engine(model_f32, model_config, **kwargs)  # type: ignore[arg-type]
    return make



def full_logits(model: LlamaModel, config: ModelConfig, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [len(token_ids), V] (float32) of every position: one cold causal prefill on a private cache."""
    block_size = 16
    num_blocks = -(-len(token_ids) // block_size)
    cache = KVCache(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                    model.dtype, model.device)
    n = len(token_ids)
    chunk = DirectChunk(DirectSeq(list(token_ids), list(range(num_blocks))), 0, n)
    return ModelRunner(model, cache).run([chunk], [list(range(n))])


class LogitsRecorder:
    """Wraps engine.runner.run and keeps, per request id, the logits of every sampling row in step order
    (the row the sampler picked each token from)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.by_request: dict[str, list[torch.Tensor]] = {}
        self._run = engine.runner.run

        def run(chunks: Sequence[Any], logit_rows: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
            logits = self._run(chunks, logit_rows)
            rows = logit_rows if logit_rows is not None else \
                [[c.num_new_tokens - 1] if c.samples else [] for c in chunks]
            i = 0
            for chunk, chunk_rows in zip(chunks, rows):
                if chunk.samples:
                    assert chunk_rows and chunk_rows[-1] == chunk.num_new_tokens - 1
                    self.by_request.setdefault(chunk.seq.request_id, []).append(
                        logits[i + len(chunk_rows) - 1].clone())
                i += len(chunk_rows)
            assert i == logits.shape[0]
            return logits

        engine.runner.run = run  # type: ignore[method-assign]

    def close(self) -> None:
        self.engine.runner.run = self._run  # type: ignore[method-assign]


@pytest.fixture(scope="session")
def record_logits() -> Callable[[Engine], LogitsRecorder]:
    """record_logits(engine) → a LogitsRecorder installed on that engine's runner."""
    return LogitsRecorder


@pytest.fixture(scope="session")
def reference_logits(model_f32: LlamaModel, model_config: ModelConfig) -> Callable[[Sequence[int]], torch.Tensor]:
    """reference_logits(ids) → our model's logits [len(ids), V] for every position, computed cold."""
    def run(token_ids: Sequence[int]) -> torch.Tensor:
        return full_logits(model_f32, model_config, token_ids)
    return run


@pytest.fixture(scope="session")
def long_text_ids(tokenizer: TextTokenizer) -> list[int]:
    """About 1,000 tokens of varied English prose (no model call): material to cut prompts from."""
    text = " ".join([
        "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg",
        "combined movable metal type, oil-based ink and a wooden screw press into one working system.",
        "Before that, books were copied by hand in monasteries, a slow process that kept them rare.",
        "Rivers shape the land around them: they carve valleys, deposit silt on their floodplains and",
        "carry nutrients to the sea, where deltas form at their mouths over thousands of years.",
        "A good recipe for bread needs only flour, water, salt and yeast, yet bakers argue endlessly",
        "about hydration, fermentation time and the temperature of the oven.",
        "In astronomy, a light year measures distance rather than time: it is how far light travels",
        "in one year, roughly nine and a half trillion kilometres.",
        "Chess openings have colourful names such as the Sicilian Defence, the Queen's Gambit and the",
        "Ruy Lopez, each leading to very different kinds of positions in the middle game.",
        "Honeybees communicate the direction of flowers with a waggle dance, whose angle relative to",
        "the vertical matches the angle between the food source and the sun.",
        "Mountaineers who climb above eight thousand metres enter the so-called death zone, where the",
        "air holds too little oxygen for the human body to recover.",
        "The first computers filled entire rooms, used vacuum tubes and consumed enormous amounts of",
        "electricity, while a modern phone is millions of times faster.",
        "Volcanoes release gases and molten rock from deep inside the earth; some erupt explosively,",
        "others let lava flow slowly down their sides for months.",
        "Learning a new language is easier when you read stories you enjoy, listen to native speakers",
        "and practise speaking without fear of making mistakes.",
        "The octopus has three hearts, blue blood and can change the colour and texture of its skin",
        "in a fraction of a second to hide from predators.",
        "Trains changed how people thought about time, because railway timetables required every",
        "town along the line to agree on the same clock.",
        "Gardeners rotate crops each season so that the soil does not lose the same nutrients every",
        "year and pests do not build up in one place.",
    ] * 3)
    ids = tokenizer.encode(text)
    assert len(ids) >= 900
    return ids


T = TypeVar("T")


def run_on_loop(loop: EngineLoop, scenario: Callable[[], Awaitable[T]]) -> T:
    """Start the engine thread, run the asyncio scenario against it, and stop the thread whatever happens."""
    loop.start()
    try:
        return asyncio.run(scenario())  # type: ignore[arg-type]
    finally:
        loop.stop()


def greedy_run(engine: Engine, req: GenerationRequest) -> tuple[list[int], list[torch.Tensor], int]:
    """A request through the Engine to its end: its tokens, the logits each was sampled from, and the
    prompt tokens the prefix cache served."""
    recorder = LogitsRecorder(engine)
    engine.add(req)
    tokens, reuse = [], 0
    while engine.has_work:
        for out in engine.step():
            tokens.append(out.token_id)
            reuse = out.aux.reuse_len
    recorder.close()
    return tokens, recorder.by_request[req.request_id], reuse
