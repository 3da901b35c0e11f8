"""Continuous batching engine: scheduler, model runner, offline and streaming APIs."""

from worker.engine.async_engine import AsyncLLMEngine
from worker.engine.config import EngineConfig
from worker.engine.health import AllocatorFault, EngineDeadError
from worker.engine.llm_engine import LLMEngine, RequestError
from worker.engine.output_processor import RequestOutput
from worker.engine.sampling import SamplingError, SamplingParams

__all__ = [
    "AllocatorFault",
    "AsyncLLMEngine",
    "EngineConfig",
    "EngineDeadError",
    "LLMEngine",
    "RequestError",
    "RequestOutput",
    "SamplingError",
    "SamplingParams",
]
