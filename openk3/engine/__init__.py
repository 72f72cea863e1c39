"""openk3 inference engine: continuous batching, paged MLA latent cache, KDA slots and a KDA-aware
prefix cache (token ids, plus image features for image requests; the contract is the
:class:`~openk3.engine.engine.Engine` docstring and its methods)."""

from openk3.engine.async_engine import AsyncEngine
from openk3.engine.engine import Engine, EngineConfig, EngineOverloaded, RequestOutput, Usage
from openk3.engine.mm import ImageInput
from openk3.engine.sampling import SamplingParams, TokenLogprob

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineOverloaded",
    "ImageInput",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "Usage",
]
