"""``radixrt.lang``: prompt programs with prefix sharing (see ``program`` and ``backend``)."""

from radixrt.lang.backend import Backend, EngineBackend, RuntimeEndpoint
from radixrt.lang.program import (
    ForkGroup,
    Program,
    ProgramState,
    assistant,
    function,
    gen,
    get_default_backend,
    select,
    set_default_backend,
    system,
    user,
)

__all__ = [
    "Backend",
    "EngineBackend",
    "RuntimeEndpoint",
    "ForkGroup",
    "Program",
    "ProgramState",
    "assistant",
    "function",
    "gen",
    "get_default_backend",
    "select",
    "set_default_backend",
    "system",
    "user",
]
