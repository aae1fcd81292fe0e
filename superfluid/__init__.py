"""superfluid: an LLM inference engine and OpenAI-compatible server.

    from superfluid import LLM, SamplingParams
    llm = LLM()                     # the default model on the torch runtime
    out = llm.generate("Hello", SamplingParams(max_tokens=32))
    print(out[0].outputs[0].text)
"""

from .engine.config import EngineConfig, SchedulerConfig
from .entrypoints.llm import LLM
from .engine.outputs import CompletionOutput, Logprob, RequestOutput
from .engine.params import GrammarSpec, SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "GrammarSpec",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineConfig",
    "SchedulerConfig",
]
