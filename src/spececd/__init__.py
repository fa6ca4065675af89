"""SpecECD: lossless speculative decoding split between an edge drafter and a cloud verifier.

The Python API (see the README):

    from spececd import Generator
    gen = Generator.load(draft="models/draft", target="models/target")
    for chunk in gen.stream("def fib(n):", max_tokens=64):
        print(chunk.text, end="")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spececd.core.params import Constraint, SamplingParams
from spececd.errors import InputError, SpecECDError

__version__ = "0.1.0"

__all__ = ["AsyncGenerator", "Completion", "Constraint", "Generator", "InputError",
           "SamplingParams",
           "SpecECDError", "StreamChunk"]

if TYPE_CHECKING:
    from spececd.generator import AsyncGenerator, Completion, Generator, StreamChunk


def __getattr__(name: str) -> Any:
    # The API pulls in the backends; import it lazily so `import spececd` stays light.
    if name in ("AsyncGenerator", "Generator", "Completion", "StreamChunk"):
        from spececd import generator

        return getattr(generator, name)
    raise AttributeError(name)
